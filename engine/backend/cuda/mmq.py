"""The MMQ on the host: which int8 GEMVs run as ``mmq`` (kernels/mmq.cu), at what tile shape,
with how much shared memory, and its launch.

Owns: ``site_for(prog, gemv)`` (an ``MmqSite`` for a GEMV the MMQ can run, or None and the
reason), the tile shape (``WN`` warp columns of 8 row pairs, ``WM`` warp rows of 16 batch
rows: ``wm_for``; ``S`` warp sets sharing each group's leaves on small matrices:
``choose_split``), the shared memory a launch needs (``smem_bytes``, the layout mmq.cu
describes), the template instances a program compiles (``MmqSite.names``), raising each
instance's dynamic shared memory limit once at load (``prepare``) and the launch itself
(``MmqSite.launch``). Leaves the arguments (the GEMV's own: the same signature) and the
choice between GEMV and MMQ per launch (rows at or above ``CudaProgram.mmq_min_rows``) to
``steps.Gemv.launch``, the kernel to ``kernels/mmq.cu``.

The MMQ gives every output the int8 GEMV's bits (kernels/mmq.cu: the same integers, float
tail and reduction order), so switching between them by row count keeps batch invariance:
a row's logits are the same at 1 row (GEMV) and 64 (MMQ). What it changes is how often the
weights are read: once per tile of up to 64 batch rows, where the GEMV reads them once per
16-row block, on tensor cores (int8 ``mma.sync``) instead of ``dp4a``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from aotx.engine.backend.cuda import source as S

#: the types with a block expander (``q8w<T>`` and ``MmqBlk<T>`` in mmq.cu): every int8-GEMV type
MMQ_TYPES = S.Q8_TYPES
REC = 48                         # bytes of a stage record (mmq.cu's MMQ_REC)
SMEM_DEFAULT = 48 * 1024         # dynamic shared memory a kernel may use without raising its limit
STATIC_SMEM = 1024               # mmq.cu's static shared memory (s_row: 16 WN row pointers, <= 512 bytes), rounded up
SMEM_MAX = 227 * 1024 - STATIC_SMEM   # the most dynamic shared memory one block may ask for (sm_90's opt-in
                                 # 227 KiB less the static part; sm_80: 163 KiB, checked at load)
SMEM_TWO = 110 * 1024            # at most this, two blocks fit one multiprocessor: the wider tile is taken
WN_CHOICES = (2, 1)              # warp columns of 8 row pairs, widest first
MIN_CC = 80                      # mma.sync s8 and cp.async


def min_rows_from_env(value: str | None) -> int | None:
    """``AOTX_MMQ_MIN_ROWS``: unset, empty or "off" leaves the MMQ off; a whole number of at
    least 1 runs it for GEMV launches over that many rows and more. Anything else is a
    ValueError naming the variable."""
    if value is None or value.strip().lower() in ("", "off"):
        return None
    try:
        rows = int(value)
    except ValueError:
        rows = 0
    if rows < 1:
        raise ValueError(f"AOTX_MMQ_MIN_ROWS={value!r}: a whole number of rows, at least 1 (16 is the design's "
                         "threshold), or off")
    return rows


# CudaBackend(mmq_min_rows)'s default: off until the kernel has run on a GPU. Its bits are
# proven against the CPU model (tests/test_cuda_mmq_model.py) and fake CuPy, and every
# instance compiles for sm_90, but the first H100 run failed to launch it (BENCHMARKS.md,
# 2026-12-07). The engine reads AOTX_MMQ_MIN_ROWS (``min_rows_from_env``, in
# ``model/loader.make_backend``): 16 turns it on for decode ticks of 16 rows and more.
DEFAULT_MIN_ROWS = None
MAX_THREADS = 512                # a block's threads (WN x WM x S warps): 2 blocks fit at 64 registers, 1 at 128
TARGET_BLOCKS = 2                # row-pair tiles x warp sets per multiprocessor the split aims for
N_SM = 132                       # multiprocessors when the backend does not say (an H100)


def chunk_bytes(qtype: int) -> tuple[int, int]:
    """(bytes of 1024 inputs of a row, bytes of its shared-memory record): mmq.cu's MmqBlk ch, chs."""
    be, bb = GGML_QUANT_SIZES[GGMLQuantizationType(int(qtype))]
    ch = 1024 // be * bb
    return ch, (ch + 47) // 16 * 16


def smem_bytes(ta: int, tb: int, k: int, wn: int, wm: int, split: int = 1) -> int:
    """Dynamic shared memory of one block: the slab (16 wn rows x rmax records), two weight
    stages and three input stages of ``split`` leaves each, and the subtree sums of the warp
    sets when there are several (rmax = ceil(k / 4096) rounds)."""
    rows, mt = 16 * wn, 16 * wm
    rmax = (k // 32 + 127) // 128
    chs = max(chunk_bytes(ta)[1], chunk_bytes(tb)[1])
    comb = split * wn * wm * 8 * 32 * 4 if split > 1 else 0
    return rows * rmax * chs + split * rmax * (2 * rows + 3 * mt) * REC + comb


def wm_for(rows: int) -> int:
    """Warp rows (16 batch rows each) of a launch over ``rows`` rows: 1, 2 or 4 (64 rows a block;
    more rows: more blocks along the batch)."""
    return 1 if rows <= 16 else (2 if rows <= 32 else 4)


def choose_split(n_pairs: int, wn: int, wm: int, ta: int, tb: int, k: int, n_sm: int, cap: int = SMEM_MAX) -> int:
    """Warp sets sharing each group's leaves (mmq.cu's S: 1, 2 or 4): the fewest that give at
    least ``TARGET_BLOCKS`` row-pair tiles x sets per multiprocessor, within ``MAX_THREADS``
    threads and the shared memory a block may have (more sets: more warps on a small matrix,
    a quarter of the chain of leaves at S 4; the sum's order is the same)."""
    tiles = (n_pairs + 8 * wn - 1) // (8 * wn)
    best = 1
    for sp in (1, 2, 4):
        if 32 * wn * wm * sp > MAX_THREADS or smem_bytes(ta, tb, k, wn, wm, sp) > cap:
            break
        best = sp
        if tiles * sp >= TARGET_BLOCKS * n_sm:
            break
    return best


@dataclass(frozen=True)
class MmqSite:
    """One GEMV's MMQ form: weight types, inputs, row pairs, the tile's warp columns ``wn`` and
    the warp sets ``splits`` for 1, 2 and 4 warp rows."""

    ta: int
    tb: int
    k: int
    n_pairs: int
    wn: int
    splits: tuple[int, int, int] = (1, 1, 1)

    def split(self, wm: int) -> int:
        return self.splits[{1: 0, 2: 1, 4: 2}[wm]]

    def name(self, mode: int, wm: int) -> str:
        return f"mmq<{self.ta},{self.tb},{mode},{self.wn},{wm},{self.split(wm)}>"

    def names(self, modes) -> list[str]:
        """Every instance a program may launch for this GEMV (each tile height, each mode)."""
        return [self.name(m, wm) for m in modes for wm in (1, 2, 4)]

    def smem(self, wm: int) -> int:
        return smem_bytes(self.ta, self.tb, self.k, self.wn, wm, self.split(wm))

    def geometry(self, rows: int) -> tuple[tuple[int, int], tuple[int], int, int]:
        """(grid, block, dynamic shared memory, wm) of a launch over ``rows`` batch rows: batch
        tiles along x (blocks sharing a weight tile run together), row-pair tiles along y."""
        wm = wm_for(rows)
        grid = ((rows + 16 * wm - 1) // (16 * wm), (self.n_pairs + 8 * self.wn - 1) // (8 * self.wn))
        return grid, (32 * self.wn * wm * self.split(wm),), self.smem(wm), wm

    def launch(self, kernels: dict, mode: int, rows: int, args: tuple) -> None:
        """One launch over ``rows`` rows with the GEMV's argument tuple ``args``."""
        grid, block, smem, wm = self.geometry(rows)
        kernels[self.name(mode, wm)](grid, block, args, shared_mem=smem)


def make_site(ta: int, tb: int, k: int, n_pairs: int, n_sm: int, cap: int = SMEM_MAX) -> MmqSite | None:
    """The MMQ site of a matrix (None: even the narrowest tile needs more shared memory than
    ``cap``): its warp columns (``choose_wn``; the narrow tile where the wide one leaves fewer
    than ``TARGET_BLOCKS`` tiles x sets per multiprocessor) and its splits."""
    wn = choose_wn(ta, tb, k, cap)
    if wn is None:
        return None
    if wn > 1 and smem_bytes(ta, tb, k, 1, 4) <= cap:
        wide = (n_pairs + 8 * wn - 1) // (8 * wn) * choose_split(n_pairs, wn, 1, ta, tb, k, n_sm, cap)
        if wide < TARGET_BLOCKS * n_sm:
            wn = 1
    splits = tuple(choose_split(n_pairs, wn, wm, ta, tb, k, n_sm, cap) for wm in (1, 2, 4))
    return MmqSite(ta, tb, k, n_pairs, wn, splits)


def site_for(prog, g) -> tuple[MmqSite | None, str]:
    """The MMQ form of GEMV ``g`` (``steps.Gemv``) in program ``prog``, or None and why not:
    the program runs no MMQ (``mmq_min_rows`` None, float activations, a GPU before sm_80),
    the GEMV is not on int8 activations, a weight type has no block expander, or even the
    narrow tile needs more shared memory than a block may have. (Rows need no alignment: the
    slab copies 16-byte pieces from the boundary at or below each chunk, reading at most 15
    bytes before and after it: inside the previous row, or inside the allocation, whose size
    CuPy rounds up to 512 bytes.)"""
    if getattr(prog, "mmq_min_rows", None) is None:
        return None, "the program runs no MMQ"
    if not g.q8:
        return None, "float activations"
    ta, tb = int(g.wa.qtype), int(g.wb.qtype)
    if ta not in MMQ_TYPES or tb not in MMQ_TYPES:
        return None, "a weight type without an integer form"
    cap = int(getattr(prog, "mmq_smem_max", SMEM_MAX))
    n_sm = int(getattr(getattr(prog, "backend", None), "n_sm", 0) or N_SM)
    site = make_site(ta, tb, g.k, g.n_pairs, n_sm, cap)
    if site is None:
        return None, f"{smem_bytes(ta, tb, g.k, WN_CHOICES[-1], 4)} bytes of shared memory per block (at most {cap})"
    return site, ""


def choose_wn(ta: int, tb: int, k: int, cap: int = SMEM_MAX) -> int | None:
    """The tile's warp columns for rows of ``k`` inputs: the widest whose 64-row tile lets two
    blocks share a multiprocessor, else the narrowest if it fits at all (None: it does not)."""
    for wn in WN_CHOICES:
        need = smem_bytes(ta, tb, k, wn, 4)
        if need <= SMEM_TWO or (wn == WN_CHOICES[-1] and need <= cap):
            return wn
    return None


def program_min_rows(backend, int8: bool) -> int | None:
    """The row count from which a program's int8 GEMVs run as the MMQ: the backend's
    ``mmq_min_rows`` where the device has int8 ``mma.sync`` (sm_80+) and the program runs int8
    activations, else None."""
    mr = getattr(backend, "mmq_min_rows", None)
    if mr is None or not int8:
        return None
    try:
        cc = int(getattr(getattr(backend, "device", None), "compute_capability", 0) or 0)
    except (TypeError, ValueError):
        cc = 0
    return int(mr) if cc >= MIN_CC else None


def smem_limit(backend) -> int:
    """The most dynamic shared memory one block may ask for on this device: the opt-in size
    less the kernel's static shared memory. (The first H100 run asked for the whole opt-in
    size: CUDA_ERROR_INVALID_VALUE on every launch needing it; this fix has not run on a card.)"""
    try:
        import cupy as cp

        attr = cp.cuda.runtime.deviceGetAttribute(97, backend.device.id)   # cudaDevAttrMaxSharedMemoryPerBlockOptin
        return int(attr) - STATIC_SMEM
    except Exception:  # noqa: BLE001 - a runtime without the query (the fake): sm_90's
        return SMEM_MAX


def prepare(kernels: dict, gemvs) -> None:
    """Raise each MMQ instance's dynamic shared memory limit to what its launches need (above
    48 KiB a kernel must opt in; done once at load, before any graph is captured)."""
    need: dict[str, int] = {}
    for g in gemvs:
        site = getattr(g, "mmq", None)
        if site is None:
            continue
        for m in g.modes():
            for wm in (1, 2, 4):
                n = site.name(m, wm)
                need[n] = max(need.get(n, 0), site.smem(wm))
    for n, b in need.items():
        if b > SMEM_DEFAULT and n in kernels:
            static = int(getattr(kernels[n], "shared_size_bytes", 0) or 0)
            if static > STATIC_SMEM:
                raise RuntimeError(f"MMQ {n}: {static} bytes of static shared memory, more than the {STATIC_SMEM} "
                                   "mmq.STATIC_SMEM leaves for it")
            kernels[n].max_dynamic_shared_size_bytes = int(b)


def weight_reads(site: MmqSite, rows: int, row_bytes_a: int, row_bytes_b: int) -> int:
    """Bytes of weights a launch over ``rows`` rows reads from memory: every tile row's bytes
    once per batch tile (tools: GB/s of the bench)."""
    tiles = site.geometry(rows)[0][0]
    return int(tiles * site.n_pairs * (row_bytes_a + row_bytes_b))

