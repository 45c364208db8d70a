"""The persistent decode step: a graph replay's steps as ONE kernel launch (issue 19 item 4).

Owns: which programs and batch buckets it covers, the kernel source it generates for a
program (the block functions of ``cuda_src`` called over virtual blocks, a grid-wide
barrier between steps), the step table (one ``Step`` per launch the graph path would make,
holding that launch's grid and its arguments, packed as the kernel's parameters), and the
launch. Leaves the order of the steps and every argument to ``cuda_program`` (it records
the launches ``CudaProgram`` would make for a bucket and replays them from the table), the
block functions to ``cuda_src``, the decision to use it to ``CudaProgram``.

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
formed in the same order as by the graph's kernels (cuda_src, "the canonical reduction
order"; the split attention's partitions depend on the row's span only): the same bits
as the graph at every bucket (tests/test_cuda_invariance.py, tests/test_cuda_persistent.py).

Covered: programs whose graph launches are only ``gemv`` (float32 activations; no
``row_scale``: the variants it records compute the norm scale per block), ``attn_decode``,
``embed`` and ``gather_rows`` (llama, qwen2: the default model); anything else (QK-norm's
``head_rope_kv``, gemma3's norms and element-wise steps, int8 activations, experts) keeps
the graph of kernels, and ``CudaProgram.persistent_reason`` says why.

Correctness of the barrier: every block of the launch must be resident at once (a block
waiting at the barrier holds its multiprocessor): the grid is at most ``n_sm`` times the
blocks per multiprocessor the compiled kernel's registers and shared memory allow. The
module's copy of the source drops ``__restrict__``: data written by one block during the
launch (activations, the KV rows of this step) must not be read through the
non-coherent read-only path by another; ``ld.acquire`` and ``__threadfence`` at the barrier
order the plain loads.

Pure Python except ``build``'s caller: the source generation and the packing are tested
without a GPU (tests/test_cuda_persistent_host.py).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

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
    """The module source: ``base_src`` without ``__restrict__``, then the persistent kernel
    whose ``switch`` runs kind i (``kinds[i]``, a kernel instance name) as its block
    function. ``prefetch``: at the start of each step, every block asks L2 for its share of
    the next step's weights (``cp.async.bulk.prefetch.L2``, sm_90), so that step's first
    loads wait on L2, not on HBM."""
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
        cases.append(f"        case {i}: {fn}{targs}({idx}, {vals}); break;")
    body = "\n".join(cases)
    return (f"#define AOTX_PERSISTENT_PREFETCH {1 if prefetch else 0}\n" + base_src.replace("__restrict__", "") + r"""
// ---- the persistent decode step (cuda_persistent.py) -----------------------------------------
struct PStep { int kind, nvb, gx, gy; unsigned long long pf[2]; int pfn[2]; int pad[2];
               long long a[""" + str(ARG_BYTES // 8) + r"""]; };

// block j of m asks L2 for its 16-byte aligned share of bytes [p, p + n) (a hint: no effect
// on what any load returns)
__device__ __forceinline__ void l2_prefetch_share(unsigned long long p, int n, int j, int m) {
    if (n <= 0) return;
    const unsigned long long a = (p + 15ull) & ~15ull;
    const long long len = (long long)n - (long long)(a - p);
    if (len < 16) return;
    const long long chunk = ((len + m - 1) / m + 15) & ~15ll;
    const long long off = (long long)j * chunk;
    if (off >= len) return;
    long long sz = len - off < chunk ? len - off : chunk;
    sz &= ~15ll;
    if (sz <= 0) return;
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(a + off), "r"((unsigned)sz) : "memory");
#endif
}

__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// Every block of the grid arrives, then leaves when the last one has: bar[0] counts the
// arrivals, bar[1] is the generation the last arrival advances (read before arriving).
__device__ __forceinline__ void grid_barrier(unsigned* bar, unsigned nblocks) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned gen = ld_acquire_gpu(bar + 1);
        __threadfence();
        if (atomicAdd(bar, 1u) == nblocks - 1u) {
            atomicExch(bar, 0u);
            __threadfence();
            atomicAdd(bar + 1, 1u);
        } else {
            while (ld_acquire_gpu(bar + 1) == gen) { }
        }
        __threadfence();
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(128) persistent_step(const PStep* steps, int n_steps, unsigned* bar,
                                                                 int nblocks)
{
    for (int i = 0; i < n_steps; i++) {
        const PStep* st = steps + i;
        const int kind = st->kind, nvb = st->nvb, gx = st->gx, gy = st->gy;
        const unsigned char* a = (const unsigned char*)st->a;
#if AOTX_PERSISTENT_PREFETCH
        if (threadIdx.x == 0 && i + 1 < n_steps) {
            const PStep* nx = st + 1;
            l2_prefetch_share(nx->pf[0], nx->pfn[0], blockIdx.x, gridDim.x);
            l2_prefetch_share(nx->pf[1], nx->pfn[1], blockIdx.x, gridDim.x);
        }
#endif
        for (int vb = blockIdx.x; vb < nvb; vb += gridDim.x) {
            const int bx = vb % gx, by = (vb / gx) % gy, bz = vb / (gx * gy);
            switch (kind) {
""" + body + r"""
            default: break;
            }
            __syncthreads();      // the block's shared memory is reused by its next virtual block
        }
        if (i + 1 < n_steps) grid_barrier(bar, (unsigned)nblocks);
    }
}
""")


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
