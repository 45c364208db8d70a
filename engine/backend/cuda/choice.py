"""The CUDA backend's kernel sites and their candidates (pure Python: tested without a GPU).

Owns: the names of the decode GEMV variants (``GemvVariant``: batch rows per block NB,
warps per row pair WPP, and where the RMSNorm scale is computed) and of the prefill GEMM
modes; which variants are candidates at each batch bucket, and which one runs by default
(no artifact, or ``kernel_choice`` policy "off"/"reuse" without one); the site keys the
artifact records. Leaves the artifact to ``kernel_choice``, the launches and their timing
to ``program.py``, ``steps.py`` and ``gemm.py``, the kernels to ``kernels/``.

Every GEMV variant computes each output element in the same order (``kernels/gemv.cu``, "the
canonical reduction order"), so the choice between them changes speed, never a bit of
the logits. The prefill GEMM modes differ in arithmetic (float16 or TF32 tensor-core
inputs, or float32), so their candidates are checked against float32 within a tolerance.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CHOICE_VERSION = "4"      # the naming of sites and candidates; part of the artifact key

# (NB, WPP) pairs compiled as gemv<...,NB,MODE,WPP> instances: a thread holds 2 NB
# accumulators (S = 4 / WPP groups, one after the other when S * NB > 4), so every WPP is
# affordable at every NB.
GEMV_GRID: dict[int, tuple[int, ...]] = {1: (1, 2, 4), 2: (1, 2, 4), 4: (1, 2, 4), 8: (1, 2, 4), 16: (1, 2, 4)}
NB_MAX = 16
GEMV_WARPS = 4           # warps per GEMV block (GEMV_WARPS of kernels/shared.cuh)
# row pairs per warp (PPW > 1: one x load serves PPW pairs) compiled at each NB, with any WPP
PPW_GRID: dict[int, tuple[int, ...]] = {1: (1, 2, 4), 2: (1, 2, 4), 4: (1, 2), 8: (1,), 16: (1,)}
PAIRED_WPP = (2, 4)      # the WPPs whose two-pairs-per-warp form is a kernel-choice candidate
TUNE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)   # batch buckets timed; larger ones use the last one's choice
WIDE_ROWS = 16384        # default: matrices with this many output rows (the output head) run one warp per pair
WIDE_K = 2048            # default at NB 16: WPP 1 up to this many inputs, WPP 4 beyond
PRE_ROWS = 2048          # default: matrices with at least this many rows read a precomputed norm scale

PREFILL_MODES = ("f16", "tf32", "f32")
# "f16": weights dequantized per tile to float16, activations converted once per op, cuBLAS
#        GemmEx with float32 accumulation (tensor cores); only for inputs that stay well inside
#        float16's range (a linear whose input is RMS-normed or an attention output)
# "tf32": weights dequantized per tile to float32, GemmEx with TF32 tensor-core math
#        (float32's range, float16's precision); the default for the other linears
# "f32": weights dequantized per tile to float32, SGEMM (no tensor cores; the reference)
PREFILL_TOL = {"f16": 1e-2, "tf32": 1e-2, "f32": 1e-5}   # the check: ||Y - Y_f32|| / ||Y_f32|| at most this


@dataclass(frozen=True)
class GemvVariant:
    """``nb`` batch rows per block, ``wpp`` warps per row pair, ``pre``: the RMSNorm scale
    comes from a ``row_scale`` launch before the GEMV (True) or is computed per block
    (False; the only form for a GEMV without a norm, where it means nothing); ``ppw`` row
    pairs per warp (each x load serves that many pairs; named ``r{2 ppw}``, rows per warp,
    when above 1)."""

    nb: int
    wpp: int
    pre: bool
    ppw: int = 1

    @property
    def name(self) -> str:
        rows = f"r{2 * self.ppw}" if self.ppw > 1 else ""
        return f"nb{self.nb}w{self.wpp}{rows}{'p' if self.pre else 'i'}"

    @property
    def pairs_per_block(self) -> int:
        return GEMV_WARPS // self.wpp * self.ppw

    @staticmethod
    def parse(name: str) -> "GemvVariant":
        m = re.fullmatch(r"nb(\d+)w(\d+)(?:r(\d+))?([pi])", name)
        if not m or int(m.group(1)) not in GEMV_GRID or int(m.group(2)) not in GEMV_GRID[int(m.group(1))]:
            raise ValueError(f"not a GEMV variant: {name!r}")
        nb, wpp = int(m.group(1)), int(m.group(2))
        ppw = int(m.group(3)) // 2 if m.group(3) else 1
        if m.group(3) and (int(m.group(3)) % 2 or ppw < 2 or ppw not in PPW_GRID.get(nb, (1,))):
            raise ValueError(f"not a GEMV variant: {name!r}")
        return GemvVariant(nb, wpp, m.group(4) == "p", ppw)


def pow2(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


def tune_bucket(rows: int) -> int:
    """The bucket whose choice a launch over ``rows`` rows uses."""
    return min(pow2(max(1, rows)), TUNE_BUCKETS[-1])


def gemv_candidates(bucket: int, norm: bool, q8: bool = False) -> tuple[str, ...]:
    """Variant names worth timing at ``bucket`` rows: NB = the bucket (up to 16) or half of
    it, every WPP compiled for that NB, and with a norm both places for its scale (the
    per-block one only up to NB 4: beyond, every block would re-read NB rows of x; with
    ``q8``, int8 activations, only the precomputed one: ``quant_rows`` computes it); at
    NB <= 4 also two row pairs per warp at WPP 2 and 4 (``PAIRED_WPP``: on the H200 these
    won some 8B sites by 5-17%, tests/tools/cuda_gemv_bench.py)."""
    top = min(bucket, NB_MAX)
    nbs = [top] + ([top // 2] if top > 1 else [])
    out = []
    for nb in nbs:
        for wpp in GEMV_GRID[nb]:
            for ppw in (1, 2) if (nb <= 4 and wpp in PAIRED_WPP) else (1,):
                if norm:
                    out.append(GemvVariant(nb, wpp, True, ppw).name)
                    if nb <= 4 and not q8:
                        out.append(GemvVariant(nb, wpp, False, ppw).name)
                else:
                    out.append(GemvVariant(nb, wpp, False, ppw).name)
    return tuple(out)


def gemv_default(bucket: int, norm: bool, m_rows: int, k: int | None = None, q8: bool = False) -> str:
    """The variant that runs without a recorded choice: NB = the bucket (up to 16); WPP 4 on
    layer-sized matrices at NB <= 4 (more loads in flight per row), 1 on the output head
    (enough rows to fill the GPU), 2 at NB 8, 1 at NB 16 (four row pairs per block share
    the x rows; one warp per pair, as the pre-port kernels ran 16-row blocks) for inputs up
    to ``WIDE_K`` (k None: taken as small), 4 beyond (7B/8B: k 3584-18944, where one warp
    per pair walks too many units in a row and WPP 4 measured faster); the norm scale
    precomputed for large matrices or NB >= 8 or with ``q8`` (int8 activations), else per
    block."""
    nb = min(pow2(max(1, bucket)), NB_MAX)
    if nb <= 4:
        wpp = 1 if m_rows >= WIDE_ROWS else 4
    else:
        wpp = 2 if nb == 8 else (1 if k is None or k <= WIDE_K else 4)
    pre = norm and (m_rows >= PRE_ROWS or nb >= 8 or q8)
    return GemvVariant(nb, wpp, pre).name


def gemv_instance(ta: int, tb: int, mode: int, v: GemvVariant, q8: bool = False) -> str:
    """The template instance a variant launches (``q8``: its int8-activation form)."""
    if q8:
        return f"gemv<{ta},{tb},{v.nb},{mode},{v.wpp},{v.ppw},1>"
    if v.ppw > 1:
        return f"gemv<{ta},{tb},{v.nb},{mode},{v.wpp},{v.ppw}>"
    return f"gemv<{ta},{tb},{v.nb},{mode},{v.wpp}>"


def gemv_site(mode: str, ta: str, tb: str, m_rows: int, k: int, norm: bool, q8: bool = False) -> str:
    """Site key of a GEMV (without its bucket): mode, tensor types, output rows, inputs,
    and ``/q8`` for its int8-activation form."""
    return f"gemv/{mode}/{ta}x{tb}/m{m_rows}/k{k}/{'norm' if norm else 'plain'}{'/q8' if q8 else ''}"


def at_bucket(site: str, bucket: int) -> str:
    return f"{site}@b{bucket}"


def prefill_candidates(bounded_input: bool) -> tuple[str, ...]:
    """Prefill GEMM modes for a linear (float16 only where its input is bounded)."""
    return PREFILL_MODES if bounded_input else ("tf32", "f32")


def prefill_default(bounded_input: bool) -> str:
    return "f16" if bounded_input else "tf32"


def prefill_site(qtype: str, m: int, k: int, bounded_input: bool) -> str:
    return f"gemm/{qtype}/m{m}/k{k}/{'bounded' if bounded_input else 'open'}"
