"""The CUDA kernels' source: the ``.cu`` / ``.cuh`` files of ``kernels/``, read and joined
into the modules NVRTC compiles, and NVRTC's errors told as file:line.

Owns: which files make each module and in what order (``KERNEL_FILES``: every kernel
the CUDA backend launches but the sampler, one kernel family per file; ``SAMPLING_FILES``),
reading them as package data (``importlib.resources``), the ``#line`` markers that make
NVRTC name the file and line of an error, the mapping of a module's own line numbers back
to file:line (``Module.explain``), and the tensor-type codes and epilogue modes the
templates take (GGML's enum values). Leaves to ``backend.py`` the compilation (``cupy.RawModule``
with exactly the template instances a model needs; CuPy caches the compiled module on disk,
keyed by source and options), to ``program.py`` and ``steps.py`` the order of launches, to
``sampling.py`` the sampler's host side.

The files, in the order the kernels module joins them (a file uses what the files before it
define):

* ``common.cuh``: integer types, half/bfloat16 conversion, the aligned loads, ``byte_f``;
* ``dequant.cuh``: GGUF blocks dequantized in registers (``deq8<T>``), and their integer
  form for int8 activations (``q8w<T>``, ``q8dot``);
* ``shared.cuh``: warp reductions, float16 stores, GELU, the KV cache store, the GEMV
  epilogue modes;
* ``kv_quant.cu``: quantized KV caches (q8_0, q4_0): their loads, the block store, the
  Hadamard rotation (``kvq_rotate``, ``kvq_store``, ``kvq_dequant``);
* ``gemv.cu``: the decode GEMV and its canonical reduction order (``row_scale``,
  ``quant_rows``, ``gemv``);
* ``embed_rope.cu``: the QKV heads' norm, RoPE and KV write (``head_rope_kv``), the
  embedding lookup (``embed``);
* ``dequant.cu``: whole weights dequantized for the prefill GEMMs (``dequant``,
  ``dequant_h``) and their float16 activations (``rows_half``);
* ``attn_decode.cu``: split attention over the KV cache (``attn_decode``);
* ``elementwise.cu``: the eager path's norms, softmax, gathers, activations, biases, head
  ops and KV stores;
* ``attn_prefill.cu``: flash-style prefill attention on tensor cores (``attn_prefill``);
* ``moe.cu``: the GPU expert tier's grouped GEMV and the device moe step's routing and join;
* ``mmq.cu``: the int8 GEMV's sums on tensor cores for many batch rows (``mmq``: the same
  bits as ``gemv<..., Q8 = 1>``, one weight read per tile of batch rows; sm_80+);
* ``recurrent.cu``: hybrid models' recurrent layers: the causal short convolution and its
  state (``short_conv``, ``conv_state``), the gated delta rule as a recurrence
  (``delta_rule``), ``l2_norm_rows``, ``sigmoid_gate_rows``, ``deinterleave_rows``;
* ``sampling.cu`` (its own module): the sampler chain (``sample_rows``).

Layout conventions (all row-major, float32 unless said):
* weights stay in GGUF block layout, one row of ``k`` inputs = ``row_bytes`` bytes;
  ``deq8<T>(row, u, w)`` dequantizes inputs ``8u .. 8u+7`` of a row into registers.
  Each uses only the loads its block's alignment allows: a row starts at a multiple of
  ``row_bytes`` from a 256-byte aligned buffer, so blocks of 18/22/110 bytes (Q4_0, IQ4_NL,
  Q5_0, Q3_K) are 2-byte aligned, 20/24/84 (Q4_1, Q5_1, Q2_K) 4-byte, 136/144/176 (IQ4_XS,
  Q4_K, Q5_K) at least 8-byte, and MXFP4's 17-byte blocks only byte aligned (byte loads).
  Every product in a deq8 is exact in float32 (a float16 scale times small integers), so
  the values equal gguf's ``dequantize`` bit for bit whether or not the compiler fuses
  the one add into an FMA.
* int8 activations (``CudaProgram`` with ``int8_activations``): ``quant_rows`` writes a
  GEMV's input rows as int8 blocks of 32 (``xq`` (B, ldq) and ``xd`` (B, ldq / 32) float2
  scale and float sum), ``q8w<T>`` reads a weight block as int8 levels and ``gemv<..., Q8 =
  1>`` multiplies them with ``__dp4a`` (the types of ``Q8_TYPES``).
* activations ``x`` are ``(B, ld)``; KV cache per layer ``(n_slots, n_kv, n_ctx, hd)``,
  float32 or float16 (template argument ``KVT``: 0 or 1), or ``(n_slots, n_kv, n_ctx,
  row_bytes)`` bytes of q8_0 / q4_0 blocks (KVT 2, 3).
* device tables for decode: ``tab_tok``, ``tab_slot``, ``tab_pos`` int32 ``(B,)``.
* RoPE reads cos/sin tables ``(n_ctx, rope_half)`` float32 made on the host (frequency
  factors and scaling folded in); "neox" rotates dims j and j + rope_half of a head, the
  llama ("norm") style adjacent dims 2j and 2j + 1.

No headers are included (NVRTC has none by default): half/bfloat16 conversion uses
PTX ``cvt`` and bit shifts. A ``.cuh`` file is a part of a module, never compiled alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

# GGML tensor-type codes (gguf.GGMLQuantizationType values)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4 = 10, 11, 20, 23, 39
#: every type with a ``deq8<T>`` specialization (and so ``embed``/``dequant``/``gemv`` instances)
TYPES = (F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, BF16, MXFP4)
#: the types with an integer form (``q8w<T>``): their GEMVs can run on int8 activations (gemv Q8 1)
Q8_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4)

# gemv epilogue modes: store, add (residual), SwiGLU and GEGLU of a gate/up pair, the QKV
# projection with RoPE and the KV write fused (float32 or float16 KV cache)
MODE_STORE, MODE_ADD, MODE_SWIGLU, MODE_QKV, MODE_GEGLU, MODE_QKV16 = 0, 1, 2, 3, 4, 5
KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 2, "q4_0": 3}   # KVT template argument of the attention and KV-write kernels
#: head dimensions of the flash-style prefill attention (``attn_prefill<HD, KVT>``, sm_80+)
FLASH_HEAD_DIMS = (32, 64, 96, 128)

#: the kernels module's files, in order (the module docstring says what each holds)
KERNEL_FILES = ("common.cuh", "dequant.cuh", "shared.cuh", "kv_quant.cu", "gemv.cu", "embed_rope.cu", "dequant.cu",
                "attn_decode.cu", "elementwise.cu", "attn_prefill.cu", "moe.cu", "mmq.cu", "recurrent.cu")
SAMPLING_FILES = ("sampling.cu",)
#: how a module's files are named in ``#line`` markers and errors (their path in the repository)
FILE_PREFIX = "engine/backend/cuda/kernels/"

# an NVRTC diagnostic's location: "<file>(<line>): error: ..." (EDG's format)
_WHERE = re.compile(r"(?m)^(?P<file>[^\s()][^()\n]*?)\((?P<line>\d+)\): ")


class KernelCompileError(RuntimeError):
    """NVRTC refused a module; the message names each error's file:line."""


@dataclass(frozen=True)
class Module:
    """One module's source as NVRTC gets it. ``text``: every file behind a ``#line 1 "<file>"``
    marker; ``parts``: (file path as the markers name it, the module line of its first line,
    its number of lines)."""

    name: str
    text: str
    parts: tuple[tuple[str, int, int], ...]

    def locate(self, line: int) -> tuple[str, int]:
        """(file, line in it) of line ``line`` (1-based) of ``text``; a marker line counts as
        the line of its file before the file's first."""
        for name, first, n in reversed(self.parts):
            if line >= first - 1:
                return name, max(1, line - first + 1)
        return self.name, line

    def explain(self, log: str) -> str:
        """NVRTC's ``log`` with every location as ``file:line``: those NVRTC took from the
        ``#line`` markers as they are, those counted in the module's own lines mapped back to
        their file."""
        def where(m: re.Match) -> str:
            f, n = m.group("file"), int(m.group("line"))
            if f not in {p[0] for p in self.parts}:
                f, n = self.locate(n)
            return f"{f}:{n}: "
        return _WHERE.sub(where, log)


def read(name: str, root: Path | None = None) -> str:
    """The text of kernel file ``name``: from ``root`` when given (tests), else the package's
    ``kernels/`` folder (package data, so an installed wheel has it too)."""
    if root is not None:
        return (Path(root) / name).read_text(encoding="utf-8")
    return resources.files(__package__).joinpath("kernels", name).read_text(encoding="utf-8")


def build(files: tuple[str, ...], name: str, root: Path | None = None, extra: tuple[tuple[str, str], ...] = ()) \
        -> Module:
    """The module of ``files`` (read by ``read``) and then ``extra`` ((path, text) pairs: tools
    that compile the kernels with a file of their own), each behind its ``#line`` marker."""
    chunks, parts, line = [], [], 1
    for f, body in [(FILE_PREFIX + f, read(f, root)) for f in files] + list(extra):
        if not body.endswith("\n"):
            body += "\n"
        chunks.append(f'#line 1 "{f}"\n')
        chunks.append(body)
        parts.append((f, line + 1, body.count("\n")))
        line += 1 + body.count("\n")
    return Module(name, "".join(chunks), tuple(parts))


def compile_error(module: Module, e: BaseException) -> KernelCompileError:
    """The error to raise for NVRTC's ``e`` (CuPy's CompileException: its message is the log)
    on ``module``: the log's locations as file:line."""
    log = str(getattr(e, "get_message", lambda: str(e))())
    first = [ln for ln in module.explain(log).splitlines() if ln.strip()]
    return KernelCompileError(f"NVRTC could not compile the {module.name} module:\n" + "\n".join(first[:40]))


KERNELS = build(KERNEL_FILES, "kernels")
SAMPLING = build(SAMPLING_FILES, "sampling")
#: the kernels module's text (what ``backend.py`` hands NVRTC)
SRC = KERNELS.text
