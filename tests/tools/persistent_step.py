"""The persistent decode step: a graph replay's steps as ONE kernel launch. An experiment
the engine does not run: on the H200 it gave the graph's bits but took 1.05 ms a token
against the graph's 0.72 (SmolLM2-135M; BENCHMARKS.md), so it lives here with its tests.

Owns: which programs and batch buckets it covers, the kernel source it generates for a
program (the engine's kernels, whose ``gemv``, ``attn_decode``, ``embed`` and ``gather_rows``
are each a ``__global__`` wrapper over a block function, then ``persistent_step.cu``, which
calls those block functions over virtual blocks with a grid-wide barrier between steps), the
step table (one row per launch the graph path would make, holding that launch's grid and its
arguments, packed as the kernel's parameters), and the launch: ``PersistentProgram`` (a
``CudaProgram`` whose replay runs the step table instead of the steps' kernels) and
``PersistentBackend`` (its backend, with the step's options). Leaves the order of the steps
and every argument to ``CudaProgram`` (it records the launches the program would make for a
bucket and replays them from the table), the block functions to
``engine/backend/cuda/kernels/``.

Why: on a small model a batch-1 decode step is ~150 dependent kernels of a few
microseconds each (SmolLM2-135M: 0.71 ms of device time for 97 MB of weights, which the
H200 reads in ~25 us). A CUDA graph removes the host's launch cost but not the device's:
each kernel waits for the previous one to drain, then ramps up. Here one kernel of
``n_sm x blocks_per_sm`` blocks of 128 threads runs every step: a block takes the step's
virtual blocks ``blockIdx.x, blockIdx.x + gridDim.x, ...`` (each one block of the kernel
the graph would launch, with its (x, y, z) block index), then waits at a grid barrier (an
arrival counter and a generation word in device memory) before the next step. The
sampling kernel stays a second launch (1,024 threads).

Numbers: the same block functions with the same arguments, so each output element is
formed in the same order as by the graph's kernels (kernels/gemv.cu, "the canonical reduction
order"; the split attention's partitions depend on the row's span only): the same bits
as the graph at every bucket (tests/test_cuda_persistent.py).

Covered: programs whose graph launches are only ``gemv`` (float32 activations; no
``row_scale``: the variants it records compute the norm scale per block), ``attn_decode``,
``embed`` and ``gather_rows`` (llama, qwen2: the default model); anything else (QK-norm's
``head_rope_kv``, gemma3's norms and element-wise steps, int8 activations, experts) keeps
the graph of kernels, and ``PersistentProgram.persistent_reason`` says why.

Correctness of the barrier: every block of the launch must be resident at once (a block
waiting at the barrier holds its multiprocessor): the grid is at most ``n_sm`` times the
blocks per multiprocessor the compiled kernel's registers and shared memory allow. The
module's copy of the source drops ``__restrict__``: data written by one block during the
launch (activations, the KV rows of this step) must not be read through the
non-coherent read-only path by another; ``ld.acquire`` and ``__threadfence`` at the barrier
order the plain loads.

The source generation and the packing are pure Python, tested without a GPU
(tests/test_cuda_persistent_host.py); the program and backend import CuPy (``backend()``).
"""

from __future__ import annotations

import re
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: kernel (base name) -> (block function, grid dimensions it uses)
BLOCK_FUNCTIONS = {"gemv": ("gemv_block", 2), "attn_decode": ("attn_block", 3), "embed": ("embed_block", 2),
                   "gather_rows": ("gather_block", 1)}
THREADS = 128                   # every covered kernel's block size
ARG_BYTES = 256                 # a step's packed arguments
HEADER_WORDS = 12               # int32 words before them: kind, nvb, gx, gy, two prefetch ranges (u64 + int32 each)
MAX_ROWS = 8                    # buckets of at most this many rows run persistent
MAX_WEIGHT_BYTES = 1 << 30      # "auto": models of fewer bytes of weights (launch-bound decode steps)
KERNEL = "persistent_step"
CU_FILE = Path(__file__).with_name("persistent_step.cu")

_SIG = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(([^)]*)\)", re.S)


@dataclass(frozen=True)
class Param:
    ctype: str      # the C type without __restrict__ (e.g. "const u8*", "int")
    kind: str       # "ptr" | "i64" | "int" | "float"
    name: str


def signatures(src: str) -> dict[str, list[Param]]:
    """Kernel name -> its parameters, for the ``__global__`` functions of ``src``."""
    out: dict[str, list[Param]] = {}
    for m in _SIG.finditer(src):
        params = []
        for p in m.group(2).split(","):
            p = " ".join(p.replace("__restrict__", "").split())
            if not p:
                continue
            name = re.split(r"[\s*]+", p)[-1]
            ctype = p[: len(p) - len(name)].strip()
            bare = ctype.replace("const", "").strip()
            if "*" in ctype:
                kind = "ptr"
            elif bare == "long long":
                kind = "i64"
            elif bare == "int":
                kind = "int"
            elif bare == "float":
                kind = "float"
            else:
                raise ValueError(f"kernel {m.group(1)}: parameter type {ctype!r} cannot be packed")
            params.append(Param(ctype, kind, name))
        out[m.group(1)] = params
    return out


def layout(params: list[Param]) -> list[int]:
    """Byte offset of each parameter in a step's packed arguments (natural alignment)."""
    offs, o = [], 0
    for p in params:
        size = 8 if p.kind in ("ptr", "i64") else 4
        o = (o + size - 1) // size * size
        offs.append(o)
        o += size
    if o > ARG_BYTES:
        raise ValueError(f"{len(params)} parameters take {o} bytes, more than a step's {ARG_BYTES}")
    return offs


def _scalar(a) -> int | float:
    """A recorded launch argument as a Python number (device arrays: their address)."""
    if hasattr(a, "data") and hasattr(a.data, "ptr"):
        return int(a.data.ptr)
    if isinstance(a, (np.floating, float)):
        return float(a)
    return int(a)


def pack(params: list[Param], args: tuple) -> bytes:
    """The arguments of one launch in the layout ``layout(params)`` gives."""
    if len(args) != len(params):
        raise ValueError(f"{len(args)} arguments for {len(params)} parameters")
    buf = bytearray(ARG_BYTES)
    for p, off, a in zip(params, layout(params), args):
        v = _scalar(a)
        if p.kind == "ptr":
            struct.pack_into("<Q", buf, off, int(v) & 0xFFFFFFFFFFFFFFFF)
        elif p.kind == "i64":
            struct.pack_into("<q", buf, off, int(v))
        elif p.kind == "int":
            struct.pack_into("<i", buf, off, int(v))
        else:
            struct.pack_into("<f", buf, off, float(v))
    return bytes(buf)


def split_name(name: str) -> tuple[str, str]:
    """``"gemv<3,3,1,5,1>"`` -> ("gemv", "<3,3,1,5,1>")."""
    i = name.find("<")
    return (name, "") if i < 0 else (name[:i], name[i:])


def covered(name: str) -> bool:
    return split_name(name)[0] in BLOCK_FUNCTIONS


def source(base_src: str, kinds: list[str], prefetch: bool = True) -> str:
    """The module source: ``base_src`` (the engine's kernels module) without ``__restrict__``,
    then ``persistent_step.cu``, whose ``switch`` runs kind i (``kinds[i]``, a kernel instance
    name) as its block function. ``prefetch``: at the start of each step, every block asks L2
    for its share of the next step's weights (``cp.async.bulk.prefetch.L2``, sm_90), so that
    step's first loads wait on L2, not on HBM."""
    sigs = signatures(base_src)
    cases = []
    for i, name in enumerate(kinds):
        base, targs = split_name(name)
        if base not in BLOCK_FUNCTIONS:
            raise ValueError(f"kernel {name!r} has no block function")
        fn, dims = BLOCK_FUNCTIONS[base]
        params = sigs[base]
        offs = layout(params)
        idx = ", ".join(("bx", "by", "bz")[:dims])
        vals = ", ".join(f"*({p.ctype} const*)(a + {o})" for p, o in zip(params, offs))
        cases.append(f"case {i}: {fn}{targs}({idx}, {vals}); break;")
    # the cases on the one line they replace, so the file's line numbers hold in errors
    cu = "\n".join(" ".join(cases) if ln == "AOTX_PERSISTENT_CASES" else ln
                   for ln in CU_FILE.read_text().split("\n"))
    return (f"#define AOTX_PERSISTENT_PREFETCH {1 if prefetch else 0}\n"
            f"#define AOTX_PERSISTENT_ARG_WORDS {ARG_BYTES // 8}\n" + base_src.replace("__restrict__", "")
            + '#line 1 "tests/tools/persistent_step.cu"\n' + cu)


def _dims(grid) -> tuple[int, int, int]:
    g = tuple(int(v) for v in (grid if isinstance(grid, tuple) else (grid,)))
    g = g + (1,) * (3 - len(g))
    return g[0], g[1], g[2]


def weight_ranges(name: str, args: tuple) -> list[tuple[int, int]]:
    """The weight bytes a launch reads, as (address, bytes) ranges (at most two): a GEMV's
    rows of Wa (``n_pairs * a_stride`` rows, less the odd last one) and, when a pair's second row comes from Wb
    (``a_stride`` 1: a GLU's gate and up), its ``n_pairs`` rows of Wb; nothing for the others."""
    if split_name(name)[0] != "gemv":
        return []
    wa, wb, rba, rbb, a_stride, _b_off, n_pairs = (int(_scalar(v)) for v in args[:7])
    # a matrix of m rows has (m + 1) // 2 pairs: the last pair's second row may not exist
    out = [(wa, (n_pairs * a_stride - (a_stride - 1)) * rba)]
    if a_stride == 1:
        out.append((wb, n_pairs * rbb))
    return out


def step_table(calls: list[tuple], kinds: list[str], sigs: dict[str, list[Param]]) -> np.ndarray:
    """The recorded launches ``calls`` ((name, grid, block, args) each) as the kernel's step
    table: a (n, HEADER_WORDS + ARG_BYTES / 4) int32 array, one row per launch, in order:
    kind, virtual blocks, grid x, grid y, the weight ranges to prefetch, the arguments."""
    rows = np.zeros((len(calls), HEADER_WORDS + ARG_BYTES // 4), np.int32)
    for i, (name, grid, block, args) in enumerate(calls):
        gx, gy, gz = _dims(grid)
        if _dims(block) != (THREADS, 1, 1):
            raise ValueError(f"{name}: blocks of {block}, the persistent step runs {THREADS} threads")
        base, _ = split_name(name)
        rows[i, :4] = (kinds.index(name), gx * gy * gz, gx, gy)
        head = bytearray(32)
        for j, (ptr, n) in enumerate(weight_ranges(name, tuple(args))):
            struct.pack_into("<Q", head, 8 * j, ptr)
            struct.pack_into("<i", head, 16 + 4 * j, min(int(n), 0x7FFFFFFF))
        rows[i, 4:HEADER_WORDS] = np.frombuffer(bytes(head), np.int32)
        rows[i, HEADER_WORDS:] = np.frombuffer(pack(sigs[base], tuple(args)), np.int32)
    return rows


def blocks_per_sm(num_regs: int, shared_bytes: int, want: int) -> int:
    """How many 128-thread blocks of the kernel fit on one multiprocessor at once (Hopper:
    65,536 registers allocated per warp in units of 256, 227 KB of shared memory per block
    and 228 KB per multiprocessor with 1 KB reserved per block, 16 blocks of 128 threads),
    at most ``want``."""
    regs_warp = ((max(num_regs, 1) * 32 + 255) // 256) * 256
    by_regs = 65536 // (regs_warp * (THREADS // 32))
    by_smem = (228 * 1024) // (shared_bytes + 1024)
    return max(0, min(want, by_regs, by_smem, 2048 // THREADS, 32))


class Recorder:
    """Stands in for a program's kernel dictionary while its launches for one bucket are
    recorded: ``rec[name](grid, block, args)`` appends (name, grid, block, args)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __getitem__(self, name: str):
        def launch(grid, block, args, shared_mem=0):
            self.calls.append((name, grid, block, tuple(args)))
        return launch

    def __contains__(self, name) -> bool:
        return True


# ---- the program and backend that run it (the engine's, with the decode step swapped) ---------

def _program_classes():
    """``(PersistentBackend, PersistentProgram)``: defined on first use, since they import
    CuPy through the CUDA backend (the functions above are tested without it)."""
    import cupy as cp

    from aotx.engine.backend.cuda import choice as CC
    from aotx.engine.backend.cuda import source as S
    from aotx.engine.backend.cuda.backend import NVRTC_OPTIONS, CudaBackend
    from aotx.engine.backend.cuda.program import CudaProgram

    class PersistentProgram(CudaProgram):
        """``CudaProgram`` whose decode buckets of up to ``MAX_ROWS`` rows run the persistent
        step: the launches the graph path would make are recorded (``Recorder``), packed as a
        step table and run as one launch, inside the same captured graph."""

        def __init__(self, program, backend, **kw):
            self._record_wpp: int | None = None      # set while a bucket's launches are recorded
            super().__init__(program, backend, **kw)
            self._pstate: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
            self.persistent_reason = self._persistent_check()

        def gemv_variant(self, site: str, rows: int):
            if self._record_wpp is not None:         # the persistent step's GEMV blocks (no row_scale launch)
                return CC.GemvVariant(min(CC.pow2(max(1, rows)), CC.NB_MAX), self._record_wpp, False)
            return super().gemv_variant(site, rows)

        def drop_graphs(self) -> None:
            super().drop_graphs()
            self._pstate.clear()

        def _launch_steps(self, kv, st, b, r, steps) -> None:
            pe = self._persistent(kv, st, b, r) if steps is None else None
            if pe is None:
                super()._launch_steps(kv, st, b, r, steps)
                return
            kern, table, n_steps, nblocks, bar = pe
            kern((nblocks,), (THREADS,), (table, np.int32(n_steps), bar, np.int32(nblocks)))

        def _persistent_check(self) -> str | None:
            """None when buckets of up to ``MAX_ROWS`` rows may run the persistent step
            (whether the steps are covered is found when a bucket is first recorded), else why not."""
            mode = self.backend.persistent
            if mode == "off":
                return "off"
            if self.int8_activations:
                return "int8 activations (quant_rows launches)"
            if self.moe_steps:
                return "experts (host steps)"
            if self._forced_gemv is not None:
                return f"one GEMV variant forced ({self._forced_gemv.name})"
            wb = int(getattr(self.backend, "weight_bytes", 0))
            if mode == "auto" and wb >= MAX_WEIGHT_BYTES:
                return f"{wb / (1 << 30):.1f} GiB of weights: reading them, not launching kernels, bounds a step"
            wpp = self.backend.persistent_wpp
            if wpp not in CC.GEMV_GRID[1]:
                return f"persistent_wpp {wpp} is not one of {CC.GEMV_GRID[1]}"
            return None

        @property
        def persistent_note(self) -> str:
            """What the step says of itself: on, or off and why."""
            if self.persistent_reason is None:
                return f"on for decode buckets of up to {MAX_ROWS} rows"
            return f"off: {self.persistent_reason}"

        def _record(self, kv, st, b: int, r: int) -> list:
            """The launches (name, grid, block, args) the graph path makes for ``b`` rows and
            ``r`` logits rows, with the persistent step's GEMV variants, recorded, not run."""
            rec, saved = Recorder(), self.k
            self.k = rec
            self._record_wpp = self.backend.persistent_wpp
            try:
                c = self._ctx(kv, st, b, r)
                for s in self.steps:
                    s.graph(self, c)
            finally:
                self.k = saved
                self._record_wpp = None
            return rec.calls

        def _persistent(self, kv, st, b: int, r: int):
            """(kernel, step table, steps, blocks, barrier) of the persistent launch for this
            bucket, or None (the graph of kernels runs; ``persistent_reason`` says why when it
            is not only the bucket's size)."""
            if self.persistent_reason is not None or b > MAX_ROWS:
                return None
            ps = self._pstate.setdefault(st, {"bar": cp.zeros(2, cp.uint32), "steps": {}})
            got = ps["steps"].get((b, r))
            if got is not None:
                return got
            calls = self._record(kv, st, b, r)
            bad = sorted({n for n, *_ in calls if not covered(n)})
            if bad:
                self.persistent_reason = f"its steps launch {', '.join(bad)}"
                return None
            # one module for every bucket's kinds (NB 1 .. 8): recorded, not run, so any bucket
            kinds = set()
            for bb in (1, 2, 4, 8):
                kinds.update(n for n, *_ in self._record(kv, st, bb, bb))
            kinds.update(n for n, *_ in calls)
            try:
                kern, kinds_l, sigs, nblocks = self.backend.persistent_kernel(sorted(kinds))
            except Exception as e:  # noqa: BLE001 - a compile or residency failure: the graph of kernels runs
                self.persistent_reason = f"the persistent kernel did not build ({type(e).__name__}: {e})"
                return None
            table = cp.asarray(step_table(calls, kinds_l, sigs))
            got = ps["steps"][(b, r)] = (kern, table, len(calls), nblocks, ps["bar"])
            return got

    class PersistentBackend(CudaBackend):
        """``CudaBackend`` whose programs are ``PersistentProgram``s. ``persistent``: "on",
        "auto" (models under ``MAX_WEIGHT_BYTES`` of weights) or "off" (the graph of kernels);
        ``persistent_bps`` blocks per multiprocessor (at most what fits at once),
        ``persistent_wpp`` warps per GEMV row pair of its GEMV blocks (1, 2, 4),
        ``persistent_prefetch`` each step asks L2 for the next step's weights."""

        def __init__(self, *args, persistent: str = "on", persistent_bps: int = 2, persistent_wpp: int = 1,
                     persistent_prefetch: bool = True, **kw):
            if persistent not in ("auto", "on", "off"):
                raise ValueError(f"persistent {persistent!r} is not one of auto, on, off")
            super().__init__(*args, **kw)
            self.persistent = persistent
            self.persistent_bps = int(persistent_bps)
            self.persistent_wpp = int(persistent_wpp)
            self.persistent_prefetch = bool(persistent_prefetch)

        def compile(self, program, *, fuse: bool | None = None):
            return PersistentProgram(program, self, fuse=self.fuse if fuse is None else fuse,
                                     prefill=self.prefill, gemv=self.gemv)

        def persistent_kernel(self, kinds: list[str]) -> tuple:
            """(kernel, kinds in its switch's order, their parameters, blocks of its grid),
            compiled once per set of kinds. Raises RuntimeError when not one block fits a
            multiprocessor."""
            key = ("persistent", str(self.persistent_prefetch)) + tuple(kinds)
            got = self._modules.get(key)
            if got is None:
                src = source(S.KERNELS.text, list(kinds), self.persistent_prefetch)
                mod = cp.RawModule(code=src, options=NVRTC_OPTIONS)
                kern = mod.get_function(KERNEL)
                regs = int(getattr(kern, "num_regs", 0) or 0)
                smem = int(getattr(kern, "shared_size_bytes", 0) or 0)
                got = self._modules[key] = (kern, list(kinds), signatures(S.KERNELS.text), regs, smem)
            kern, kinds_l, sigs, regs, smem = got
            bps = blocks_per_sm(regs, smem, self.persistent_bps)
            if bps < 1:
                raise RuntimeError(f"no block of {regs} registers and {smem} bytes of shared memory fits")
            return kern, kinds_l, sigs, self.n_sm * bps

    return PersistentBackend, PersistentProgram


def backend(**kw):
    """A ``PersistentBackend`` (``CudaBackend``'s arguments, and ``persistent``,
    ``persistent_bps``, ``persistent_wpp``, ``persistent_prefetch``)."""
    return _program_classes()[0](**kw)
