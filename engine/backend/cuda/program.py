"""A Program on the CUDA backend: its plan's steps run as a captured CUDA graph or eagerly.

Owns: ``CudaProgram`` (``CudaBackend.compile(program)``; the interface of
engine/backend/IR.md section 6: ``forward``, ``sample``, ``greedy``, ``last_logits``, ``new_kv_cache``,
``kv_cache_bytes``), the kernels' launch arguments for every step of ``cuda_plan.plan``,
and per KV cache the activation buffers, RoPE tables and captured graphs (``_CacheState``).
Leaves the order of ops to the Program (the architecture's), the fusions to
``cuda_plan``, K and V to ``cuda_kv``, the device tables to ``cuda_tables``, the kernels to
``cuda_src`` and ``cuda_sampling``, the prefill GEMM to ``cuda_gemm``, the kernel sites and
their candidates to ``cuda_choice`` and ``cuda_tune``, the artifact to ``kernel_choice``.

Two paths, one Program:
* **graph**: a batch of at most ``b_max`` rows in all (decode steps of many slots, verify
  windows, a short prefill) with at most one segment per slot replays a CUDA graph
  captured once per (row bucket, logits-row bucket) and KV cache: rows 1, 2, 4, ...
  b_max. Every kernel reads each row's token, slot and position from the row table;
  padding rows point at the scratch slot. The steps are GEMVs over the quantized weights
  with the plan's fusions in their prologues and epilogues (for llama, per layer: QKV with
  RMSNorm, RoPE and the KV write; split-context attention; O + residual; gate/up with
  RMSNorm and SwiGLU; down + residual), then ``sample_rows``, which writes a publication
  record per logits row. No cuBLAS inside. Rows of one slot at consecutive positions are
  causal without a mask: a layer's K and V rows are all written before its attention reads.
  Each GEMV launch runs the variant (rows per block, warps per row pair, where the norm
  scale is computed) the kernel choice recorded for its (site, bucket).
* **eager**: anything larger (prefill chunks) and batches with image rows. Steps on batch
  rows run ``cuda_gemm.PrefillGemm`` (cuBLAS on tensor cores: float16 or TF32 inputs,
  float32 accumulation; the mode per weight is the kernel choice's; the weights' dense
  dequantized copies, kept when they fit a budget, else dequantized one tile at a time
  into one scratch buffer); attention of long segments through the flash-style kernel
  (``attn_prefill``: tensor cores, K and V read from the cache, no score matrix; head
  dimensions ``FLASH_HEAD_DIMS`` on sm_80+), else through cuBLAS (scores, masked softmax
  kernel, values), the split-context attention kernel for short segments; steps on the logits rows (after ``take_rows``) run the graph's GEMVs. With
  ``prefill="gemv"`` every eager step runs the graph's kernels instead (batch-invariant
  prefill, slow on large models; see below).

Mixtures of experts: a moe layer runs as a **host step** (``_MoeHost``: rows to the host, the
router, routing and CPU expert tier there, the layer's GPU experts (``_GpuExperts``) launched
meanwhile, the join, the result back), which keeps its tick on the eager path, or with
``CudaBackend(moe_graphs=True)`` as graphs captured between the host steps (``_Segments``);
or, when every expert of the layer is on the GPU tier, as a **device step** (router GEMV,
``moe_route``, ``moe_tiles``, ``moe_gather``, ``moe_gemv``, ``moe_join``: no host work), which
the graph captures like any other step.

Batch invariance: every GEMV variant reduces each output element in one canonical order
(``cuda_src``), so through the graph a row's numbers do not depend on the other rows, the
bucket or the variant, and the eager path's GEMVs (logits rows) agree with the graph's.
The eager path's cuBLAS GEMMs and attention round differently: a prefill chunk of more
rows than a graph takes gives logits within about 1e-3 (relative) of the same rows run
through the graph, not the same bits; ``prefill="gemv"`` gives the same bits at the cost
BENCHMARKS.md and tests/tools/GPU_NOTES.md show.

Not thread-safe: one engine thread drives a program and its caches.
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import cupy as cp
import numpy as np
from cupy_backends.cuda.libs import cublas

from aotx.engine.backend.cuda import choice as CC
from aotx.engine.backend.cuda import persistent as PS
from aotx.engine.backend.cuda import plan as P
from aotx.engine.backend.cuda import sampling as CS
from aotx.engine.backend.cuda import source as S
from aotx.engine.backend.cuda.gemm import PrefillGemm
from aotx.engine.backend.cuda.kv import CudaKVCache, check_kv_type
from aotx.engine.backend.cuda.matrix import q8_buffers
from aotx.engine.backend.cuda.tables import DeviceTables, rows_for
from aotx.engine.errors import ModelError

GEMV_WARPS = CC.GEMV_WARPS    # warps per GEMV block (cuda_src.py defines the same)
ATT_NSMAX = 16                 # most context splits per (row, head) in the attention kernel
ATT_MINCHUNK = 64              # fewest positions per split
ATT_ROWS = 256                 # prefill="gemv": attention kernel launches of at most this many rows
SHORT_SEGMENT = 16             # eager path: segments up to this long use the attention kernel, not cuBLAS
# eager path: a longer segment uses the attention kernel too while its rows x keys x heads x
# head dims stay within this (a 512-token prompt of a 135M-0.5B model): there the cuBLAS path's
# ten array operations per layer cost more host time than the kernel's device time
ATT_KERNEL_WORK = 1 << 28
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
# eager path: long segments' attention runs the flash-style kernel (attn_prefill: tensor cores,
# no score matrix) at these head dimensions on sm_80 and newer; the cuBLAS path otherwise.
# FLASH_ATTENTION = False forces the cuBLAS path (tests and tests/tools/cuda_attn_bench.py).
# On since it was measured on an H200: within 2.3-2.5e-4 of the cuBLAS path and float64, 6-15x
# faster at 512-8192 tokens (BENCHMARKS.md, "GPU, 2026-12-06").
FLASH_HEAD_DIMS = S.FLASH_HEAD_DIMS
FLASH_ATTENTION = True
FLASH_ROWS = 64                # query rows per attn_prefill block (FA_BM in cuda_src.py)
NT = 256                       # threads per block of the elementwise kernels
PREFILL_FORCED = ("f16", "tf32", "f32", "gemv")
MODE_NAME = {S.MODE_STORE: "store", S.MODE_ADD: "add", S.MODE_SWIGLU: "swiglu", S.MODE_GEGLU: "geglu",
             S.MODE_QKV: "qkv", S.MODE_QKV16: "qkv"}


def _u64(a) -> np.uint64:
    """A device pointer as a kernel argument (a cupy array, a raw address or None)."""
    if a is None:
        return np.uint64(0)
    if isinstance(a, (int, np.integer)):
        return np.uint64(a)
    return np.uint64(a.data.ptr)


_ONE_BITS = np.float32(1.0).view(np.int32)   # the sampler table's "no penalty" (1.0f) word


def _pow2(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


def _i(v) -> np.int32:
    return np.int32(v)


def _f(v) -> np.float32:
    return np.float32(v)


def _qname(qtype: int) -> str:
    from gguf import GGMLQuantizationType as T

    try:
        return T(int(qtype)).name
    except ValueError:
        return str(qtype)


_OOM = getattr(getattr(cp.cuda, "memory", None), "OutOfMemoryError", MemoryError)
Z64 = np.uint64(0)
Z32 = np.int32(0)
READY_SCALE, READY_Q8 = 1, 2     # what _Gemv.launch left for the next GEMV on the same x and norm


class _Ctx:
    """One run of the steps: buffer addresses and row counts, per-row tables (device
    addresses), the cache and its state. ``xs``: scratch for the rows' norm scales (at
    least as many floats as rows); ``qkv``: scratch rows for a QKV step with QK-norm."""

    __slots__ = ("bufs", "n", "r", "kv", "st", "tok_p", "slot_p", "pos_p", "out_p", "eager", "layout", "plan",
                 "part", "counters", "layout_info", "xs", "xq", "xd", "qkv", "rope")

    def ptr(self, vid: int) -> int:
        loc = self.plan.loc[vid]
        return self.bufs[loc.buf].data.ptr + 4 * loc.col

    def ld(self, vid: int) -> int:
        return int(self.bufs[self.plan.loc[vid].buf].shape[1])

    def arr(self, vid: int) -> cp.ndarray:
        """The value as a (rows, width) view of its buffer."""
        loc = self.plan.loc[vid]
        rows = self.n if self.plan_rows(vid) == P.ROWS_N else self.r
        return self.bufs[loc.buf][:rows, loc.col:loc.col + loc.width]

    def plan_rows(self, vid: int) -> str:
        return self.plan.buffers[self.plan.loc[vid].buf][0]

    def rows(self, vid: int) -> int:
        return self.n if self.plan_rows(vid) == P.ROWS_N else self.r


class _CacheState:
    """What the graphs of one KV cache use: device tables, activation buffers (b_max rows),
    attention scratch, RoPE tables, and the graphs themselves by (rows, logits rows)."""

    def __init__(self, prog: "CudaProgram", kv: CudaKVCache):
        b = rows_for(kv.n_slots)
        self.b_max = b
        self.tables = DeviceTables(b)
        self.bufs = [cp.zeros((b, w), cp.float32) for _, w in prog.plan.buffers]
        self.qkv = cp.zeros((b, prog.qkv_width), cp.float32) if prog.qkv_width else None
        self.xs = cp.zeros(b, cp.float32)
        self.xq, self.xd = q8_buffers(b, prog.q8_k)
        self.part = cp.zeros(b * prog.max_heads * ATT_NSMAX * (prog.max_hd + 2), cp.float32)
        self.counters = cp.zeros(b * prog.max_heads, cp.int32)
        self.rope = [tuple(cp.asarray(t) for t in spec.tables(kv.n_ctx)) for spec in prog.plan.rope_specs]
        self.graphs: dict[tuple[int, int], object] = {}
        self.bar = cp.zeros(2, cp.uint32)         # the persistent step's grid barrier (cuda_persistent)
        self.psteps: dict[tuple[int, int], tuple] = {}   # (rows, logits rows) -> its persistent launch
        # the zeros above are queued on the current stream; the graphs run on the cache's
        # non-blocking stream, which does not wait for it (the split attention's counters
        # must be zero before its first replay, else the first tick is flaky on an H200)
        cp.cuda.get_current_stream().synchronize()

    @property
    def nbytes(self) -> int:
        n = sum(int(a.nbytes) for a in self.bufs) + self.tables.nbytes + int(self.part.nbytes + self.counters.nbytes)
        n += int(self.xq.nbytes + self.xd.nbytes) + int(self.bar.nbytes)
        return n + int(self.xs.nbytes) + (int(self.qkv.nbytes) if self.qkv is not None else 0)


# ---- bound steps --------------------------------------------------------------------------------
# Each has graph(prog, ctx) (GEMV kernels; also the eager path's launches on logits rows)
# and eager(prog, ctx) (cuBLAS where the rows are many).

class _Gemv:
    """One GEMV launch: fixed weights, mode and epilogue; x, y, rows supplied per run.

    ``site``: its kernel-choice site (``cuda_choice.gemv_site``; all layers' GEMVs of one
    shape share it); the variant at each batch bucket comes from ``prog.gemv_variant``.
    ``qkv``: for the fused QKV epilogue, (first row of [q; k; v] this matrix holds, the
    _QKV step) so that ``launch`` can pass the cache, RoPE tables and row tables.
    ``q8``: the GEMV runs on int8 activations (``quant_rows``, then gemv's Q8 form): the
    program's ``int8_activations`` and both weight types with an integer form (None: so
    decided; False: the float form, as the GPU expert tier's reference launches)."""

    def __init__(self, prog, mode: int, wa, a_ptr_off: int, wb, b_ptr_off: int, n_pairs: int, a_stride: int,
                 b_off: int, norm, bias_a, bias_b, m_rows: int, qkv=None, q8: bool | None = None):
        self.mode = mode
        self.wa, self.wb = wa, wb
        self.a_off, self.b_off_bytes = a_ptr_off, b_ptr_off
        self.n_pairs, self.a_stride, self.b_off = n_pairs, a_stride, b_off
        self.nw = norm[0] if norm is not None else None
        self.eps = float(norm[1]) if norm is not None else 0.0
        self.bias_a, self.bias_b = bias_a, bias_b
        self.m_rows = m_rows
        self.k = int(wa.k)
        self.qkv = qkv
        if q8 is None:
            q8 = prog.int8_activations and int(wa.qtype) in S.Q8_TYPES and int(wb.qtype) in S.Q8_TYPES
        self.q8 = bool(q8)
        if self.q8:
            prog.q8_k = max(prog.q8_k, self.k)
        self.site = CC.gemv_site(MODE_NAME[mode], _qname(wa.qtype), _qname(wb.qtype), m_rows, self.k, norm is not None,
                                 self.q8)
        prog.gemvs.append(self)

    def name(self, v: CC.GemvVariant, mode: int | None = None) -> str:
        return CC.gemv_instance(int(self.wa.qtype), int(self.wb.qtype), self.mode if mode is None else mode, v,
                                self.q8)

    def modes(self) -> tuple[int, ...]:
        """Template modes this GEMV may launch (a QKV GEMV: one per KV type)."""
        return (S.MODE_QKV, S.MODE_QKV16) if self.mode in (S.MODE_QKV, S.MODE_QKV16) else (self.mode,)

    def launch(self, prog, c, x: int, ldx: int, B: int, y: int, ldy: int, variant: CC.GemvVariant | None = None,
               kernels: dict | None = None, scale_ready: int = 0, ptrs: tuple | None = None) -> int:
        """Launch over ``B`` rows; returns what the next GEMV on the same x and norm finds
        ready, for its ``scale_ready``: READY_SCALE when the rows' norm scale is in ``c.xs``,
        plus READY_Q8 when x is in ``c.xq``/``c.xd`` as int8 blocks (``quant_rows`` ran).
        ``ptrs``: (Wa, Wb, bias_a, bias_b) device addresses that replace this GEMV's own (the
        GPU expert tier: one GEMV per expert shape, each launch on one expert's rows)."""
        if B == 0:
            return 0            # no logits rows (a prefill chunk): nothing after take_rows runs
        v = variant if variant is not None else prog.gemv_variant(self.site, B)
        mode = self.mode
        if self.qkv is not None:
            mode = S.MODE_QKV16 if c.kv.kvt else S.MODE_QKV
        kk = kernels if kernels is not None else prog.k
        kern = kk[self.name(v, mode)]
        xs = Z64
        ready = scale_ready
        q8_tail: tuple = (Z64, Z32)
        if self.q8:
            ldq = int(c.xq.shape[1])
            if not scale_ready & READY_Q8:
                kk["quant_rows"]((B, (self.k + 127) // 128), (128,),
                                 (np.uint64(x), _i(ldx), _i(self.k), _u64(self.nw), _f(self.eps), c.xs, c.xq, _i(ldq),
                                  c.xd, _i(ldq // 32)))
                ready = READY_Q8 | (READY_SCALE if self.nw is not None else 0)
            if self.nw is not None:
                xs = np.uint64(c.xs.data.ptr)
            x, ldx = c.xq.data.ptr, ldq
            q8_tail = (np.uint64(c.xd.data.ptr), _i(ldq // 32))
        elif self.nw is not None and v.pre:
            if not scale_ready & READY_SCALE:
                kk["row_scale"]((B,), (128,), (np.uint64(x), _i(ldx), _i(self.k), _f(self.eps), c.xs))
                ready |= READY_SCALE
            xs = np.uint64(c.xs.data.ptr)
        if self.qkv is not None:
            r0, q = self.qkv
            kc, vc = c.kv.layer_ptrs(q.s.layer)
            cos, sin = c.rope[q.spec_i]
            extra = (_i(r0), _i(q.qd), _i(q.kd), _i(q.s.hd), _i(q.rope_half), _i(q.neox), _i(q.s.n_kv),
                     _i(c.kv.n_ctx), np.uint64(c.slot_p), np.uint64(c.pos_p), _u64(cos), _u64(sin), np.uint64(kc),
                     np.uint64(vc))
        else:
            extra = (Z32, Z32, Z32, Z32, Z32, Z32, Z32, Z32, Z64, Z64, Z64, Z64, Z64, Z64)
        ppb = v.pairs_per_block
        grid = ((self.n_pairs + ppb - 1) // ppb, (B + v.nb - 1) // v.nb)
        if ptrs is None:
            ptrs = (self.wa.data.data.ptr + self.a_off, self.wb.data.data.ptr + self.b_off_bytes, self.bias_a,
                    self.bias_b)
        kern(grid, (GEMV_WARPS * 32,),
             (np.uint64(ptrs[0]), np.uint64(ptrs[1]),
              np.int64(self.wa.row_bytes), np.int64(self.wb.row_bytes), _i(self.a_stride), _i(self.b_off),
              _i(self.n_pairs), _i(self.k), np.uint64(x), _i(ldx), _i(B), _u64(self.nw), _f(self.eps), xs,
              _u64(ptrs[2]), _u64(ptrs[3]), np.uint64(y), _i(ldy)) + extra + q8_tail)
        return ready

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one launch reads: two rows of Wa per pair (a_stride 2), or one
        row of Wa and one of Wb (a GLU's gate and up)."""
        if self.a_stride == 2:
            return int(2 * self.n_pairs * self.wa.row_bytes)
        return int(self.n_pairs * (self.wa.row_bytes + self.wb.row_bytes))


def _pad_bias(b, m: int):
    """A bias vector as a float32 device array of even length (the pad row reads it)."""
    if b is None:
        return None
    b = cp.asarray(b, cp.float32).reshape(-1)
    if b.shape[0] != m:
        raise ModelError(f"a bias of {b.shape[0]} values for a matrix of {m} rows")
    return cp.concatenate([b, cp.zeros(2, cp.float32)]) if m % 2 else cp.ascontiguousarray(b)


class _Embed:
    def __init__(self, prog, s: P.Embed):
        self.s = s
        self.name = f"embed<{s.table.qtype}>"
        prog.need.add(self.name)

    def graph(self, prog, c: _Ctx) -> None:
        t = self.s.table
        d = t.k
        nu = d // 8
        prog.k[self.name](((nu + 127) // 128, c.n), (128,),
                          (_u64(t.data), np.int64(t.row_bytes), np.uint64(c.tok_p), _i(d), np.uint64(c.ptr(self.s.out)),
                           _i(c.ld(self.s.out)), _f(self.s.scale)))

    eager = graph


class _Linear:
    def __init__(self, prog, s: P.Linear, rows: str):
        self.s, self.rows = s, rows
        w = s.w
        bias = _pad_bias(s.bias, w.m)
        mode = S.MODE_ADD if s.mode == "add" else S.MODE_STORE
        self.g = _Gemv(prog, mode, w, 0, w, 0, (w.m + 1) // 2, 2, 1, s.norm, bias, bias, w.m)
        self.bias = bias
        self.psite = prog.prefill_site(self, [w], w.m, s.norm, s.x) if rows == P.ROWS_N else None

    def graph(self, prog, c: _Ctx) -> None:
        s = self.s
        self.g.launch(prog, c, c.ptr(s.x), c.ld(s.x), c.rows(s.x), c.ptr(s.out), c.ld(s.out))

    def eager(self, prog, c: _Ctx) -> None:
        mode = prog.prefill_mode(self.psite)
        if self.rows != P.ROWS_N or mode == "gemv":
            return self.graph(prog, c)
        s = self.s
        N = c.n
        w = s.w
        xp = prog.gemm.prepare(mode, c.ptr(s.x), c.ld(s.x), w.k, N, s.norm)
        prog.gemm.gemm(xp, w, 0, w.m, N, c.ptr(s.out), c.ld(s.out), s.mode == "add")
        prog.keep(xp)
        if self.bias is not None:
            prog.bias_rows(c.ptr(s.out), c.ld(s.out), self.bias, N, w.m)


class _Glu:
    def __init__(self, prog, s: P.Glu, rows: str):
        self.s, self.rows = s, rows
        mode = S.MODE_GEGLU if s.act == "gelu_tanh" else S.MODE_SWIGLU
        ba = cp.ascontiguousarray(cp.asarray(s.bias_a[0], cp.float32)[s.bias_a[1]:s.bias_a[1] + s.f]) \
            if s.bias_a is not None else None
        bb = cp.ascontiguousarray(cp.asarray(s.bias_b[0], cp.float32)[s.bias_b[1]:s.bias_b[1] + s.f]) \
            if s.bias_b is not None else None
        self.g = _Gemv(prog, mode, s.wa, s.a0 * s.wa.row_bytes, s.wb, s.b0 * s.wb.row_bytes, s.f, 1, 0, s.norm, ba, bb,
                       s.f)
        self.bias = None
        if ba is not None or bb is not None:
            self.bias = cp.concatenate([ba if ba is not None else cp.zeros(s.f, cp.float32),
                                        bb if bb is not None else cp.zeros(s.f, cp.float32)])
        self.act = 1 if s.act == "gelu_tanh" else 0
        self.psite = prog.prefill_site(self, [s.wa, s.wb], 2 * s.f, s.norm, s.x) if rows == P.ROWS_N else None

    def graph(self, prog, c: _Ctx) -> None:
        s = self.s
        self.g.launch(prog, c, c.ptr(s.x), c.ld(s.x), c.rows(s.x), c.ptr(s.out), c.ld(s.out))

    def eager(self, prog, c: _Ctx) -> None:
        mode = prog.prefill_mode(self.psite)
        if self.rows != P.ROWS_N or mode == "gemv":
            return self.graph(prog, c)
        s = self.s
        N, f = c.n, s.f
        gu = cp.empty((N, 2 * f), cp.float32)
        xp = prog.gemm.prepare(mode, c.ptr(s.x), c.ld(s.x), s.wa.k, N, s.norm)
        prog.gemm.gemm(xp, s.wa, s.a0, f, N, gu.data.ptr, 2 * f, False)
        prog.gemm.gemm(xp, s.wb, s.b0, f, N, gu.data.ptr + 4 * f, 2 * f, False)
        prog.keep(xp, gu)
        if self.bias is not None:
            prog.bias_rows(gu.data.ptr, 2 * f, self.bias, N, 2 * f)
        n_el = N * f
        prog.k["glu_rows"](((n_el + NT - 1) // NT,), (NT,),
                           (gu, _i(2 * f), np.uint64(gu.data.ptr + 4 * f), _i(2 * f), _i(N), _i(f), _i(self.act),
                            np.uint64(c.ptr(s.out)), _i(c.ld(s.out))))


class _QKV:
    def __init__(self, prog, s: P.QKV):
        self.s = s
        H, KV, hd = s.n_heads, s.n_kv, s.hd
        self.qd, self.kd = H * hd, KV * hd
        width = self.qd + 2 * self.kd
        mats = list(s.mats)
        if len(mats) == 3 and all(prog.refs[id(m)] == 1 for m, _ in mats):
            # consecutive matrices of one type become one (q, k, v all Q4_K: one launch; Q4_K_M's
            # Q6_K v layers: q and k in one launch, v in another)
            runs: list[list] = []
            for m, r0 in mats:
                if runs and runs[-1][0][0].qtype == m.qtype:
                    runs[-1].append((m, r0))
                else:
                    runs.append([(m, r0)])
            names = {3: "attn_qkv", 2: "attn_qk"}
            mats = [(prog.backend.concat(f"blk.{s.layer}.{names[len(r)] if r[0][1] == 0 else 'attn_kv'}",
                                         [m for m, _ in r]), r[0][1]) if len(r) > 1 else r[0] for r in runs]
        self.mats = mats
        bias = None                 # [q; k; v] biases in one vector (zeros where a part has none)
        if any(b is not None for b, _ in s.biases):
            bias = cp.zeros(width + 2, cp.float32)
            for b, r0 in s.biases:
                if b is not None:
                    bb = cp.asarray(b, cp.float32).reshape(-1)
                    bias[r0:r0 + bb.shape[0]] = bb
        self.bias = bias
        self.head_norm = s.q_norm is not None or s.k_norm is not None
        self.rope_half = s.spec.dim // 2
        self.neox = 1 if s.spec.mode == "neox" else 0
        self.spec_i = prog.plan.rope_specs.index(s.spec)
        self.eps = float((s.q_norm or s.k_norm)[1]) if self.head_norm else 0.0
        self.qn = s.q_norm[0] if s.q_norm is not None else None
        self.kn = s.k_norm[0] if s.k_norm is not None else None
        # graph launches: one GEMV per matrix; its epilogue ropes q and writes k, v into the
        # cache (either KV type: the mode follows the cache at launch), unless QK-norm: then
        # the GEMVs store [q; k; v] rows and head_rope_kv does the rest
        self.g = []
        for m, r0 in mats:
            sub = None if bias is None else bias[r0:]
            if self.head_norm:
                g = _Gemv(prog, S.MODE_STORE, m, 0, m, 0, m.m // 2, 2, 1, s.norm, sub, sub, m.m)
            else:
                g = _Gemv(prog, S.MODE_QKV16, m, 0, m, 0, m.m // 2, 2, 1, s.norm, sub, sub, m.m, qkv=(r0, self))
            self.g.append((g, r0))
        prog.need.update({"head_rope_kv<0>", "head_rope_kv<1>"})
        prog.qkv_width = max(prog.qkv_width, P._pad4(width))
        self.width = width
        self.psites = [prog.prefill_site(self, [m], m.m, s.norm, s.x) for m, _ in mats]

    def _head_rope_kv(self, prog, c: _Ctx, src: int, ld: int, bias, nrows: int, q_out: int, ldq: int) -> None:
        s = self.s
        kc, vc = c.kv.layer_ptrs(s.layer)
        cos, sin = c.rope[self.spec_i]
        prog.k[f"head_rope_kv<{c.kv.kvt}>"](
            (s.n_heads + 2 * s.n_kv, nrows), (32,),
            (np.uint64(src), _i(ld), _u64(bias), _i(s.n_heads), _i(s.n_kv), _i(s.hd), _i(self.rope_half), _i(self.neox),
             _u64(self.qn), _u64(self.kn), _f(self.eps), np.uint64(c.slot_p), np.uint64(c.pos_p), _u64(cos), _u64(sin),
             np.uint64(q_out), _i(ldq), np.uint64(kc), np.uint64(vc), _i(c.kv.n_ctx)))

    def graph(self, prog, c: _Ctx) -> None:
        s = self.s
        x, ldx, B = c.ptr(s.x), c.ld(s.x), c.n
        if self.head_norm:
            ldq = c.qkv.shape[1]
            ready = False
            for g, r0 in self.g:
                ready = g.launch(prog, c, x, ldx, B, c.qkv.data.ptr + 4 * r0, ldq, scale_ready=ready)
            self._head_rope_kv(prog, c, c.qkv.data.ptr, ldq, None, B, c.ptr(s.q_out), c.ld(s.q_out))
            return
        ready = False                # the rows' norm scale is in c.xs (the same x and norm for every matrix)
        for g, _ in self.g:
            ready = g.launch(prog, c, x, ldx, B, c.ptr(s.q_out), c.ld(s.q_out), scale_ready=ready)

    def eager(self, prog, c: _Ctx) -> None:
        modes = [prog.prefill_mode(ps) for ps in self.psites]
        if "gemv" in modes:
            return self.graph(prog, c)
        s = self.s
        N = c.n
        qkv = cp.empty((N, self.width), cp.float32)
        prepared: dict = {}
        for (m, r0), mode in zip(self.mats, modes):
            if mode not in prepared:
                prepared[mode] = prog.gemm.prepare(mode, c.ptr(s.x), c.ld(s.x), m.k, N, s.norm)
            prog.gemm.gemm(prepared[mode], m, 0, m.m, N, qkv.data.ptr + 4 * r0, self.width, False)
        prog.keep(qkv, *prepared.values())
        self._head_rope_kv(prog, c, qkv.data.ptr, self.width, self.bias, N, c.ptr(s.q_out), c.ld(s.q_out))


def _sm80(backend) -> bool:
    """The backend's device runs mma.sync m16n8k16 on float16, cp.async and ldmatrix
    (compute capability 8.0 or newer; ``attn_prefill``)."""
    try:
        return int(getattr(getattr(backend, "device", None), "compute_capability", 0)) >= 80
    except (TypeError, ValueError):
        return False


class _Attend:
    def __init__(self, prog, s: P.Attend):
        self.s = s
        if s.hd not in HEAD_DIMS:
            raise ModelError(f"head dimension {s.hd}: the CUDA attention kernel supports {', '.join(map(str, HEAD_DIMS))}")
        if s.n_heads % s.n_kv:
            raise ModelError(f"{s.n_heads} heads are not a multiple of {s.n_kv} KV heads")
        self.sinks = None           # gpt-oss: (n_heads,) float32 sink logits on the device
        if s.sinks is not None:
            self.sinks = cp.ascontiguousarray(cp.asarray(s.sinks, cp.float32).reshape(-1))
            if self.sinks.shape[0] != s.n_heads:
                raise ModelError(f"attention sinks: {self.sinks.shape[0]} values for {s.n_heads} heads")
        self.names = {kvt: f"attn_decode<{s.hd},{kvt}>" for kvt in (0, 1)}
        prog.need.update(self.names.values())
        prog.need.add("causal_softmax")
        self.flash = None           # the flash-style kernel's instance per KV type, where it runs
        if s.hd in FLASH_HEAD_DIMS and _sm80(prog.backend):
            self.flash = {kvt: f"attn_prefill<{s.hd},{kvt}>" for kvt in (0, 1)}
            prog.need.update(self.flash.values())
        prog.max_heads = max(prog.max_heads, s.n_heads)
        prog.max_hd = max(prog.max_hd, s.hd)

    def _kernel(self, prog, c: _Ctx, q: int, ldq: int, B: int, slot_p: int, pos_p: int, out: int, ldo: int, part,
                counters) -> None:
        s = self.s
        kc, vc = c.kv.layer_ptrs(s.layer)
        prog.k[self.names[c.kv.kvt]](
            (ATT_NSMAX, s.n_heads, B), (128,),
            (np.uint64(q), _i(ldq), np.uint64(kc), np.uint64(vc), np.uint64(slot_p), np.uint64(pos_p), _i(s.n_heads),
             _i(s.n_kv), _i(c.kv.n_ctx), _f(s.scale), _i(s.window), _u64(self.sinks), _u64(part), _u64(counters),
             np.uint64(out), _i(ldo),
             _i(ATT_NSMAX), _i(ATT_MINCHUNK)))

    def graph(self, prog, c: _Ctx) -> None:
        s = self.s
        self._kernel(prog, c, c.ptr(s.q), c.ld(s.q), c.n, c.slot_p, c.pos_p, c.ptr(s.out), c.ld(s.out), c.part,
                     c.counters)

    def _rows(self, prog, c: _Ctx, q: int, ldq: int, n: int, slot_p: int, pos_p: int, out: int, ldo: int, part,
              counters) -> None:
        """The attention kernel over ``n`` rows, ATT_ROWS at a time (``part`` holds that many)."""
        for r0 in range(0, n, ATT_ROWS):
            nr = min(ATT_ROWS, n - r0)
            self._kernel(prog, c, q + 4 * r0 * ldq, ldq, nr, slot_p + 4 * r0, pos_p + 4 * r0, out + 4 * r0 * ldo, ldo,
                         part, counters)

    def eager(self, prog, c: _Ctx) -> None:
        s = self.s
        eb = c.layout_info
        if eb.all_short:
            return self._rows(prog, c, c.ptr(s.q), c.ld(s.q), c.n, c.slot_p, c.pos_p, c.ptr(s.out), c.ld(s.out),
                              eb.part, eb.counters)
        q_all, o_all = c.arr(s.q), c.arr(s.out)
        if eb.short_rows is not None:
            qs = cp.ascontiguousarray(q_all[eb.short_rows])
            os_ = cp.empty_like(qs)
            self._rows(prog, c, qs.data.ptr, qs.shape[1], qs.shape[0], eb.short_slot_p, eb.short_pos_p,
                       os_.data.ptr, os_.shape[1], eb.part, eb.counters)
            o_all[eb.short_rows] = os_
        if self.flash is not None and FLASH_ATTENTION:
            return self._flash(prog, c, eb.long_segs)
        H, KV, hd = s.n_heads, s.n_kv, s.hd
        G = H // KV
        qd = H * hd
        for row, slot, pos, n in eb.long_segs:
            T_ = pos + n
            c0 = max(0, pos + 1 - s.window) if s.window > 0 else 0
            kc = c.kv.k[s.layer, slot, :, c0:T_, :]
            vc = c.kv.v[s.layer, slot, :, c0:T_, :]
            if c.kv.kvt:
                kc, vc = kc.astype(cp.float32), vc.astype(cp.float32)
            qs = q_all[row:row + n].reshape(n, KV, G, hd).transpose(1, 2, 0, 3).reshape(KV, G * n, hd)
            sc = cp.matmul(qs, kc.transpose(0, 2, 1))
            Tw = T_ - c0
            prog.k["causal_softmax"]((KV * G * n,), (256,),
                                     (sc, _i(Tw), _i(n), _i(pos), _i(c0), _i(s.window), _f(s.scale),
                                      _u64(self.sinks)))
            o = cp.matmul(sc, vc)
            o_all[row:row + n] = o.reshape(KV, G, n, hd).transpose(2, 0, 1, 3).reshape(n, qd)

    def _flash(self, prog, c: _Ctx, segs) -> None:
        """Long segments (``(row, slot, pos, n)``) through ``attn_prefill``: one launch each,
        (ceil(n / FLASH_ROWS), heads) blocks of 128 threads, K and V read from the cache."""
        s = self.s
        kc, vc = c.kv.layer_ptrs(s.layer)
        name = self.flash[c.kv.kvt]
        q, ldq, out, ldo = c.ptr(s.q), c.ld(s.q), c.ptr(s.out), c.ld(s.out)
        for row, slot, pos, n in segs:
            prog.k[name](((n + FLASH_ROWS - 1) // FLASH_ROWS, s.n_heads), (128,),
                         (np.uint64(q + 4 * row * ldq), _i(ldq), np.uint64(kc), np.uint64(vc), _i(slot), _i(pos),
                          _i(n), _i(s.n_heads), _i(s.n_kv), _i(c.kv.n_ctx), _f(s.scale), _i(s.window),
                          _u64(self.sinks), np.uint64(out + 4 * row * ldo), _i(ldo)))


class _KVStore:
    def __init__(self, prog, s: P.KVStore):
        self.s = s
        prog.need.update({"kv_store<0>", "kv_store<1>"})

    def graph(self, prog, c: _Ctx) -> None:
        s = self.s
        kc, vc = c.kv.layer_ptrs(s.layer)
        n_el = c.n * s.n_kv * s.hd
        prog.k[f"kv_store<{c.kv.kvt}>"](((n_el + NT - 1) // NT,), (NT,),
                                        (np.uint64(c.ptr(s.k)), _i(c.ld(s.k)), np.uint64(c.ptr(s.v)), _i(c.ld(s.v)),
                                         _i(c.n), _i(s.n_kv), _i(s.hd), _i(c.kv.n_ctx), np.uint64(c.slot_p),
                                         np.uint64(c.pos_p), np.uint64(kc), np.uint64(vc)))

    eager = graph


class _TakeRows:
    def __init__(self, prog, s: P.TakeRows):
        self.s = s
        prog.need.add("gather_rows")

    def graph(self, prog, c: _Ctx) -> None:
        s = self.s
        if c.r == 0:
            return
        prog.k["gather_rows"]((c.r,), (128,), (np.uint64(c.ptr(s.x)), _i(c.ld(s.x)), np.uint64(c.out_p),
                                               np.uint64(c.ptr(s.out))))

    eager = graph


class _Norm:
    def __init__(self, prog, s: P.Norm):
        self.s = s
        prog.need.add("rms_norm")

    def graph(self, prog, c: _Ctx) -> None:
        s = self.s
        rows = c.rows(s.x)
        if rows == 0:
            return
        prog.k["rms_norm"]((rows,), (256,), (np.uint64(c.ptr(s.x)), _i(c.ld(s.x)), _u64(s.w), _f(s.eps),
                                            _i(P_width(c, s.x)), np.uint64(c.ptr(s.out)), _i(c.ld(s.out)),
                                            _i(1 if s.add else 0)))

    eager = graph


def P_width(c: _Ctx, vid: int) -> int:
    return c.plan.loc[vid].width


class _HeadOp:
    def __init__(self, prog, s: P.HeadOp):
        self.s = s
        if s.hd > 256:
            raise ModelError(f"head dimension {s.hd}: the CUDA head kernels support up to 256")
        self.spec_i = prog.plan.rope_specs.index(s.spec) if s.spec is not None else -1
        self.rope_half = s.spec.dim // 2 if s.spec is not None else 0
        self.neox = 1 if s.spec is not None and s.spec.mode == "neox" else 0
        prog.need.add("head_ops")

    def graph(self, prog, c: _Ctx) -> None:
        s = self.s
        rows = c.rows(s.x)
        if rows == 0:
            return
        cos, sin = c.rope[self.spec_i] if self.spec_i >= 0 else (None, None)
        prog.k["head_ops"]((P_width(c, s.x) // s.hd, rows), (32,),
                           (np.uint64(c.ptr(s.x)), _i(c.ld(s.x)), np.uint64(c.ptr(s.out)), _i(c.ld(s.out)), _i(s.hd),
                            _u64(s.w), _f(s.eps), _i(self.rope_half), _i(self.neox), np.uint64(c.pos_p), _u64(cos),
                            _u64(sin)))

    eager = graph


class _Elementwise:
    OPS = {"add": 0, "scale": 1, "softcap": 2}

    def __init__(self, prog, s: P.Elementwise):
        self.s = s
        prog.need.add("ew_rows")

    def graph(self, prog, c: _Ctx) -> None:
        s = self.s
        rows, n = c.rows(s.a), P_width(c, s.a)
        if rows == 0:
            return
        b = c.ptr(s.b) if s.b is not None else 0
        ldb = c.ld(s.b) if s.b is not None else 0
        n_el = rows * n
        prog.k["ew_rows"](((n_el + NT - 1) // NT,), (NT,),
                          (np.uint64(c.ptr(s.a)), _i(c.ld(s.a)), np.uint64(b), _i(ldb), np.uint64(c.ptr(s.out)),
                           _i(c.ld(s.out)), _i(rows), _i(n), _i(self.OPS[s.op]), _f(s.s)))

    eager = graph


class _GluRows:
    def __init__(self, prog, s: P.GluRows):
        self.s = s
        prog.need.add("glu_rows")

    def graph(self, prog, c: _Ctx) -> None:
        s = self.s
        rows, f = c.rows(s.gate), P_width(c, s.gate)
        if rows == 0:
            return
        n_el = rows * f
        prog.k["glu_rows"](((n_el + NT - 1) // NT,), (NT,),
                           (np.uint64(c.ptr(s.gate)), _i(c.ld(s.gate)), np.uint64(c.ptr(s.up)), _i(c.ld(s.up)),
                            _i(rows), _i(f), _i(1 if s.act == "gelu_tanh" else 0), np.uint64(c.ptr(s.out)),
                            _i(c.ld(s.out))))

    eager = graph


def _host_matrix(dm, int8: bool):
    """A DevMatrix's rows copied back into a CPU QuantMatrix (the host step's router and
    shared-expert weights: small; once, at load)."""
    from aotx.engine.backend.cpu.experts import host_matrix

    return host_matrix(dm.data[:dm.m].get(), dm.qtype, dm.m, dm.k, dm.name, int8=int8)


class _MoeScratch:
    """Buffers the GPU expert tiers of one program share, per expert shape (the moe steps
    run one after the other on one thread, each call waiting for its output before the
    next starts): the device table (row indices, tiles), gathered rows (k), hidden rows (fp;
    gpt-oss: gate and up rows too), output rows (d); the pinned host table and output.
    Grown to the next power of two; ``gen`` counts the growths (the tiers' cached launch
    arguments name these buffers)."""

    def __init__(self, k: int, fp: int, d: int, oai: bool):
        self.k, self.fp, self.d, self.oai = k, fp, d, oai
        self.cap = (0, 0)          # (pairs, tiles)
        self.gen = 0
        self.dev: list = []
        self.host: tuple = ()

    def reserve(self, n_pairs: int, n_tiles: int) -> None:
        if n_pairs <= self.cap[0] and n_tiles <= self.cap[1]:
            return
        cp_, ct = max(self.cap[0], _pow2(n_pairs)), max(self.cap[1], _pow2(n_tiles))
        self.dev = self.host = None         # free the old ones first
        nt = cp_ + 3 * ct
        dev = [cp.empty(nt, cp.int32), cp.empty((cp_, self.k), cp.float32), cp.empty((cp_, self.fp), cp.float32),
               cp.empty((cp_, self.d), cp.float32)]
        if self.oai:
            dev += [cp.empty((cp_, self.fp), cp.float32), cp.empty((cp_, self.fp), cp.float32)]
        mem_t, mem_y = cp.cuda.alloc_pinned_memory(4 * nt), cp.cuda.alloc_pinned_memory(4 * cp_ * self.d)
        self.host = (np.frombuffer(mem_t, np.int32, nt), np.frombuffer(mem_y, np.float32, cp_ * self.d), mem_t, mem_y)
        self.dev, self.cap = dev, (cp_, ct)
        self.gen += 1


class _MoeStage:
    """Pinned host rows the moe steps of one program share, per (input, output) width: x's
    rows down before the router, the result up after the join. ``staged``: an event after
    the last upload (the next writer waits on it; the upload is asynchronous)."""

    def __init__(self, wx: int, wy: int):
        self.wx, self.wy = wx, wy
        self.cap = 0
        self.xh = self.yh = self.mem = None
        self.staged = None

    def reserve(self, n: int) -> None:
        if n <= self.cap:
            return
        if self.staged is not None:
            self.staged.synchronize()
        cap = max(_pow2(n), self.cap)
        self.xh = self.yh = self.mem = None
        mx, my = cp.cuda.alloc_pinned_memory(4 * cap * self.wx), cp.cuda.alloc_pinned_memory(4 * cap * self.wy)
        self.xh = np.frombuffer(mx, np.float32, cap * self.wx).reshape(cap, self.wx)
        self.yh = np.frombuffer(my, np.float32, cap * self.wy).reshape(cap, self.wy)
        self.mem, self.cap = (mx, my), cap


class _GpuExperts:
    """The GPU expert tier of one moe step (engine/model/experts.py plans the tiers): the experts
    the plan puts on "gpu" live on the device, uploaded once by ``place`` (the gate, up and
    down stacks of just those experts, in the file's block layout, and their biases), and
    their routed rows run through the decode GEMV's reduction: gate and up (one SwiGLU GEMV
    for "silu"; two GEMVs and ``swiglu_oai_rows`` for gpt-oss) then down.

    A call (``launch``) is one launch per GEMV for all the experts here (``moe_gemv``: a tile
    table gives each block row its expert slot and rows, the expert's weights lie at a fixed
    stride in the stacks): the host builds one int32 table (the routed rows' indices, then
    the tiles) in pinned memory, copies it with one H2D copy, ``moe_gather`` gathers the rows
    on the device, the GEMVs run into preallocated buffers (``_MoeScratch``, shared by the
    program's moe steps, grown on demand), and the output comes back with one D2H copy into
    pinned memory; ``wait`` is the layer's one sync. The
    GEMV reduces each output element in the canonical order of the decode GEMV (cuda_src),
    so a row's expert outputs do not depend on the batch, the tiles or the variant and
    equal the bits of ``gemv`` launched on each expert alone (``grouped = False`` runs those
    per-expert launches: the reference of the bit-identity test and of the host-overhead
    timing, tests/tools/moe_gpu_overhead.py). The variant is the kernel choice's default
    for the bucket of the most rows any expert has (these sites are not tuned). ``on[e]``:
    expert e is here. ``ok`` is False (``why`` says why) when the shapes or types do not
    suit the kernels: then every expert stays on the CPU tiers. Not thread-safe; one call
    at a time (``launch`` then ``wait``): the buffers are reused by the next call."""

    MAX_TILES = 65535                    # grid.y of one moe_gemv launch

    def __init__(self, prog, attrs: dict):
        from gguf import GGML_QUANT_SIZES

        from aotx.engine.backend.cuda.matrix import DevMatrix

        self.prog = prog
        self.attrs = attrs
        gate, up, down = attrs["gate"], attrs["up"], attrs["down"]
        self.E, self.ff, self.d, self.k = int(attrs["n_expert"]), int(gate.m), int(down.m), int(gate.k)
        self.act = attrs["act"]
        self.on = np.zeros(self.E, bool)
        self.slot = np.full(self.E, -1, np.int64)
        self.slot_dev = None             # slot as a device int32 array (moe_tiles reads it)
        self.ids: list[int] = []
        self.nbytes = 0
        self.rows = 0                    # (row, expert) pairs computed here since load
        self.calls = 0
        self.w = None                    # (gate, up, down) device stacks of the experts here
        self.b = (None, None, None)      # their biases (n_here, width) or None
        self._x = self._c = None         # the step's device input and context, during its eager run
        self._variants: dict = {}        # (GEMV, bucket) -> its default variant
        self.grouped = True              # False: per-expert gemv launches (the reference)
        self._kern: dict = {}            # (GEMV name, bucket) -> (moe_gemv kernel, pairs per block, nb)
        self._scratch = None             # the program's _MoeScratch of this shape (first call)
        self._args: dict = {}            # GEMV name -> its launch arguments on those buffers
        self._args_gen = -1              # the scratch generation they name
        why = ""
        for st in (gate, up, down):
            if int(st.qtype) not in S.TYPES:
                why = f"{st.name}: tensor type {_qname(st.qtype)} has no CUDA kernel"
            elif st.m % 2 or st.k % max(GGML_QUANT_SIZES[st.qtype][0], 32):
                why = f"{st.name}: shape {st.m} x {st.k} does not suit the GEMV"
        if up.m != self.ff or down.k != self.ff or up.k != self.k:
            why = "gate, up and down shapes disagree"
        self.ok, self.why = not why, why
        self.rb = []
        mats = []
        for st in (gate, up, down):
            be, bb = GGML_QUANT_SIZES[st.qtype]
            rb = int(st.k) // be * bb
            self.rb.append(rb)
            mats.append(DevMatrix(st.name, int(st.qtype), int(st.m), int(st.k), rb, None))
        self.mats = mats
        if not self.ok:
            self.gemvs = {}
            return
        mg, mu, md = mats
        n0 = len(prog.gemvs)
        if self.act == "silu":
            gv = {"gu": _Gemv(prog, S.MODE_SWIGLU, mg, 0, mu, 0, self.ff, 1, 0, None, None, None, self.ff, q8=False)}
        else:
            gv = {"g": _Gemv(prog, S.MODE_STORE, mg, 0, mg, 0, self.ff // 2, 2, 1, None, None, None, self.ff, q8=False),
                  "u": _Gemv(prog, S.MODE_STORE, mu, 0, mu, 0, self.ff // 2, 2, 1, None, None, None, self.ff, q8=False)}
            prog.need.add("swiglu_oai_rows")
        gv["d"] = _Gemv(prog, S.MODE_STORE, md, 0, md, 0, self.d // 2, 2, 1, None, None, None, self.d, q8=False)
        del prog.gemvs[n0:]              # not kernel-choice sites: their variant is the default
        # (q8=False: float activations, as moe_gemv computes; the per-expert launches are its reference)
        self.gemvs = gv
        for g in gv.values():
            for b in CC.TUNE_BUCKETS:
                v = self._variant(g, b)
                prog.need.update((g.name(v), self._grouped_name(g, v)))
        prog.need.add("moe_gather")

    @staticmethod
    def _grouped_name(g: _Gemv, v: CC.GemvVariant) -> str:
        return f"moe_gemv<{int(g.wa.qtype)},{int(g.wb.qtype)},{v.nb},{g.mode},{v.wpp}>"

    def _variant(self, g: _Gemv, rows: int) -> CC.GemvVariant:
        if self.prog._forced_gemv is not None:
            return self.prog._forced_gemv
        b = CC.tune_bucket(rows)
        v = self._variants.get((id(g), b))
        if v is None:
            v = self._variants[(id(g), b)] = CC.GemvVariant.parse(CC.gemv_default(b, False, g.m_rows, g.k))
        return v

    def place(self, ids) -> int:
        """Hold exactly the experts ``ids`` on the device (those already here are uploaded
        again: placement happens at load). Returns the device bytes they take."""
        ids = sorted({int(e) for e in ids})
        drop = getattr(self.prog, "drop_graphs", None)
        if drop is not None:
            drop()                       # graphs of the device-resident moe step name the old stacks
        self.w, self.b = None, (None, None, None)
        self._args = {}
        self.on[:] = False
        self.slot[:] = -1
        self.slot_dev = None
        self.ids, self.nbytes = [], 0
        if not ids:
            return 0
        if not self.ok:
            raise ValueError(f"moe layer {self.attrs['moe_layer']}: no GPU expert tier ({self.why})")
        st = (self.attrs["gate"], self.attrs["up"], self.attrs["down"])
        self.w = tuple(cp.asarray(np.ascontiguousarray(np.concatenate([s.raw(e) for e in ids]))) for s in st)
        bs = []
        for key in ("gate_bias", "up_bias", "down_bias"):
            v = self.attrs.get(key)
            bs.append(cp.asarray(np.ascontiguousarray(v[ids], np.float32)) if v is not None else None)
        self.b = tuple(bs)
        self.slot[ids] = np.arange(len(ids))
        self.slot_dev = cp.asarray(self.slot.astype(np.int32))
        self.on[ids] = True
        self.ids = ids
        self.nbytes = sum(int(a.nbytes) for a in self.w) + sum(int(a.nbytes) for a in self.b if a is not None)
        return self.nbytes

    def swap(self, promoted: int, evicted: int, stage: np.ndarray, off: int) -> int:
        """The learned cache's move (``CudaProgram._learn_experts``, between ticks): expert
        ``promoted`` takes ``evicted``'s device slot. Its gate, up and down rows (the file's
        bytes) go through ``stage`` (pinned host memory, from byte ``off``) and are copied
        over the slot on the current stream, its biases too; ``on``, ``slot`` and ``ids``
        follow. The stream's later launches read the new weights (stream order); the caller
        makes sure no launch still reads the slot and ``stage`` is not in use. The pinned
        host copies the CPU pool holds are repacked for its kernels, not the file's layout,
        so the source is the memory-mapped file (page cache; a page not resident is read
        from disk here). Returns the offset past the bytes staged."""
        if not (self.on[evicted] and not self.on[promoted]):
            raise RuntimeError(f"moe layer {self.attrs['moe_layer']}: swap {promoted} in for {evicted}, but the tier "
                               f"holds {self.ids}")
        sl = int(self.slot[evicted])
        stream = cp.cuda.get_current_stream()
        rt = cp.cuda.runtime
        for i, key in enumerate(("gate", "up", "down")):
            raw = self.attrs[key].raw(promoted)
            nb = int(raw.nbytes)
            dst = stage[off:off + nb]
            np.copyto(dst.reshape(raw.shape), raw)
            rt.memcpyAsync(self.w[i].data.ptr + sl * self.mats[i].m * self.rb[i], dst.ctypes.data, nb,
                           rt.memcpyHostToDevice, stream.ptr)
            off += nb
        for i, key in enumerate(("gate_bias", "up_bias", "down_bias")):
            v = self.attrs.get(key)
            if v is not None and self.b[i] is not None:
                self.b[i][sl] = cp.asarray(np.ascontiguousarray(v[promoted], np.float32))
        self.on[evicted], self.on[promoted] = False, True
        self.slot[evicted], self.slot[promoted] = -1, sl
        self.slot_dev = cp.asarray(self.slot.astype(np.int32))
        self.ids = sorted(set(self.ids) - {int(evicted)} | {int(promoted)})
        return off

    def expert_nbytes(self, e: int) -> int:
        """Bytes of expert e's gate, up and down rows in the file's layout."""
        return sum(int(self.attrs[k].raw(e).nbytes) for k in ("gate", "up", "down"))

    def _ptrs(self, i: int, e: int, width: int) -> tuple:
        """(weights of expert slot e in stack i, its bias) device addresses."""
        m = self.mats[i].m
        w = self.w[i].data.ptr + e * m * self.rb[i]
        b = self.b[i].data.ptr + 4 * e * width if self.b[i] is not None else 0
        return w, b

    def launch(self, pairs, x=None, c=None):
        """Start the FFNs of ``pairs`` ((expert, rows, slots j) of experts held here, as
        ``cpu_moe.groups`` gives them) on the device rows ``x`` (default: the step's input set
        by ``_MoeHost``); returns the handle ``wait`` takes. Its output: (P, d) float32, pairs
        in order, rows in order within."""
        if not self.grouped:
            return self._launch_each(pairs, x, c)
        if not pairs:
            return 0
        counts = [int(r.shape[0]) for _, r, _ in pairs]
        return self.launch_routed(np.repeat(np.array([e for e, _, _ in pairs], np.int64), counts),
                                  np.concatenate([r for _, r, _ in pairs]), x)

    def launch_routed(self, experts: np.ndarray, rows: np.ndarray, x=None):
        """``launch`` for pairs given as two (P,) int64 arrays (``cpu_moe.moe_rows``): each
        pair's expert (held here; grouped by expert, in increasing id) and row of x."""
        P_ = int(rows.shape[0])
        if P_ == 0:
            return 0
        cut = np.flatnonzero(np.diff(experts)) + 1
        first = np.concatenate(([0], cut))                   # each expert's first pair
        if not self.grouped:
            return self._launch_each([(int(experts[f]), r, None) for f, r in zip(first, np.split(rows, cut))], x)
        x = self._x if x is None else x
        prog = self.prog
        n_e = int(first.shape[0])
        counts = np.diff(np.append(first, P_))
        bucket = CC.tune_bucket(int(counts.max()))
        kerns = [self._kernel(name, bucket) for name in self.gemvs]
        nb = min(kk[2] for kk in kerns)   # tiles of at most every kernel's NB (one NB per bucket today)
        # the table: the rows' indices into x (P), then the tiles (T, 3): slot, first row, rows
        ntile = (counts + nb - 1) // nb
        T = int(ntile.sum())
        sc = self._reserve(P_, T)
        tab = sc.host[0]
        tab[:P_] = rows
        tiles = tab[P_:P_ + 3 * T].reshape(T, 3)
        rep_first = np.repeat(first, ntile)
        tiles[:, 0] = np.repeat(self.slot[experts[first]], ntile)
        b0 = rep_first + nb * (np.arange(T) - np.repeat(np.cumsum(ntile) - ntile, ntile))
        tiles[:, 1] = b0
        tiles[:, 2] = np.minimum(nb, np.repeat(first + counts, ntile) - b0)
        stream = cp.cuda.get_current_stream()
        rt = cp.cuda.runtime
        dev = sc.dev
        dtab = dev[0]
        rt.memcpyAsync(dtab.data.ptr, tab.ctypes.data, 4 * (P_ + 3 * T), rt.memcpyHostToDevice, stream.ptr)
        xg = dev[1]
        prog.k["moe_gather"]((P_,), (128,), (np.uint64(x.data.ptr), _i(x.strides[0] // 4), dtab, _i(self.k), xg,
                                             _i(self.k)))
        self.run_gemvs(kerns, self._args, dtab.data.ptr + 4 * P_, T, P_, dev[2], (dev[4], dev[5]) if sc.oai else None)
        rt.memcpyAsync(sc.host[1].ctypes.data, dev[3].data.ptr, 4 * P_ * self.d, rt.memcpyDeviceToHost, stream.ptr)
        self.rows += P_
        self.calls += n_e
        return P_

    def _kernel(self, name: str, bucket: int) -> tuple:
        """(moe_gemv kernel, row pairs per block, NB) of GEMV ``name`` at ``bucket``."""
        got = self._kern.get((name, bucket))
        if got is None:
            g = self.gemvs[name]
            v = self._variant(g, bucket)
            got = self._kern[(name, bucket)] = (self.prog.k[self._grouped_name(g, v)], GEMV_WARPS // v.wpp, v.nb)
        return got

    def _reserve(self, P_: int, T: int) -> _MoeScratch:
        """The program's scratch for this shape, holding ``P_`` pairs and ``T`` tiles, and
        each GEMV's launch arguments on it but the tile table's address."""
        sc = self._scratch
        if sc is None:
            fp = P._pad4(self.ff)
            key = (self.k, fp, self.d, self.act != "silu")
            sc = self._scratch = self.prog.moe_scratch.setdefault(key, _MoeScratch(*key))
        sc.reserve(P_, T)
        if self._args and self._args_gen == sc.gen:
            return sc
        dev = sc.dev
        self._args = self.launch_args(dev[1], dev[2], dev[3], (dev[4], dev[5]) if sc.oai else None)
        self._args_gen = sc.gen
        return sc

    def launch_args(self, xg, h, y, gu=None) -> dict:
        """Each GEMV's ``moe_gemv`` arguments (head, tail: all but the tile table's address)
        on the buffers xg (P, k) gathered rows -> h (P, fp) hidden rows -> y (P, d) outputs;
        ``gu``: gpt-oss's (gate, up) rows (P, fp)."""
        fp, d = int(h.shape[1]), int(y.shape[1])
        io = {"gu": (xg, self.k, h, fp), "d": (h, fp, y, d)}
        if gu is not None:
            io.update({"g": (xg, self.k, gu[0], fp), "u": (xg, self.k, gu[1], fp)})
        stack = {"gu": (0, 1), "g": (0, 0), "u": (1, 1), "d": (2, 2)}
        args = {}
        for name, g in self.gemvs.items():
            ia, ib = stack[name]
            xin, ldx, out, ldy = io[name]
            wa, wb = self.w[ia], self.w[ib]
            head = (np.uint64(wa.data.ptr), np.uint64(wb.data.ptr), np.int64(self.mats[ia].m * self.rb[ia]),
                    np.int64(self.mats[ib].m * self.rb[ib]), np.int64(self.rb[ia]), np.int64(self.rb[ib]),
                    _i(g.a_stride), _i(g.b_off), _i(g.n_pairs), _i(g.k), np.uint64(xin.data.ptr), _i(ldx))
            tail = (_u64(self.b[ia]), _u64(self.b[ib]), _i(self.mats[ia].m), np.uint64(out.data.ptr), _i(ldy))
            args[name] = (head, tail)
        return args

    def run_gemvs(self, kerns: list, args: dict, tiles_ptr: int, T: int, P_: int, h, gu=None) -> None:
        """The GEMVs over ``T`` tiles of the table at ``tiles_ptr`` (device), with ``kerns``
        (``_kernel`` per GEMV) and ``args`` (``launch_args``); gpt-oss's clamped SwiGLU of
        ``gu`` into h between its gate/up and down GEMVs."""
        prog = self.prog
        for (kern, ppb, _), name in zip(kerns, self.gemvs):
            g = self.gemvs[name]
            if name == "d" and self.act != "silu":
                n_el = P_ * self.ff
                fp = int(h.shape[1])
                prog.k["swiglu_oai_rows"](((n_el + NT - 1) // NT,), (NT,),
                                          (gu[0], _i(fp), gu[1], _i(fp), _i(P_), _i(self.ff),
                                           _f(self.attrs["alpha"]), _f(self.attrs["limit"]), h, _i(fp)))
            head, tail = args[name]
            gx = (g.n_pairs + ppb - 1) // ppb
            for t0 in range(0, T, self.MAX_TILES):
                kern((gx, min(self.MAX_TILES, T - t0)), (GEMV_WARPS * 32,),
                     head + (np.uint64(tiles_ptr + 12 * t0),) + tail)

    def _launch_each(self, pairs, x=None, c=None):
        """The per-expert launches (``grouped = False``): the rows gathered by an index
        array, per expert a ``gemv`` launch per GEMV on its rows. The reference of the
        grouped path (bit-identical) and of its host-overhead timing."""
        x = self._x if x is None else x
        c = self._c if c is None else c
        prog = self.prog
        rows = np.concatenate([r for _, r, _ in pairs])
        P_ = int(rows.shape[0])
        xg = cp.ascontiguousarray(x[cp.asarray(rows.astype(np.int64))])
        fp, dp = P._pad4(self.ff), P._pad4(self.d)
        h = cp.empty((P_, fp), cp.float32)
        y = cp.empty((P_, dp), cp.float32)
        keep = [xg, h, y]
        k, xp = self.k, xg.data.ptr
        r0 = 0
        if self.act != "silu":
            gt, ut = cp.empty((P_, fp), cp.float32), cp.empty((P_, fp), cp.float32)
            keep += [gt, ut]
        for e, r, _ in pairs:
            n, sl = int(r.shape[0]), int(self.slot[e])
            xr = xp + 4 * r0 * k
            if self.act == "silu":
                g = self.gemvs["gu"]
                (wg, bg), (wu, bu) = self._ptrs(0, sl, self.ff), self._ptrs(1, sl, self.ff)
                g.launch(prog, c, xr, k, n, h.data.ptr + 4 * r0 * fp, fp, variant=self._variant(g, n),
                         ptrs=(wg, wu, bg, bu))
            else:
                for i, name, out in ((0, "g", gt), (1, "u", ut)):
                    g = self.gemvs[name]
                    w, b = self._ptrs(i, sl, self.ff)
                    g.launch(prog, c, xr, k, n, out.data.ptr + 4 * r0 * fp, fp, variant=self._variant(g, n),
                             ptrs=(w, w, b, b))
            r0 += n
        if self.act != "silu":
            n_el = P_ * self.ff
            prog.k["swiglu_oai_rows"](((n_el + NT - 1) // NT,), (NT,),
                                      (gt, _i(fp), ut, _i(fp), _i(P_), _i(self.ff), _f(self.attrs["alpha"]),
                                       _f(self.attrs["limit"]), h, _i(fp)))
        r0 = 0
        g = self.gemvs["d"]
        for e, r, _ in pairs:
            n, sl = int(r.shape[0]), int(self.slot[e])
            w, b = self._ptrs(2, sl, self.d)
            g.launch(prog, c, h.data.ptr + 4 * r0 * fp, fp, n, y.data.ptr + 4 * r0 * dp, dp,
                     variant=self._variant(g, n), ptrs=(w, w, b, b))
            r0 += n
        self.rows += P_
        self.calls += len(pairs)
        return y, keep

    def wait(self, handle) -> np.ndarray:
        """The (P, d) float32 outputs of ``launch``'s handle on the host: the call's one sync.
        Grouped: a view of the pinned buffer, valid until the next ``launch``."""
        if isinstance(handle, tuple):
            y, _ = handle
            return np.ascontiguousarray(y[:, :self.d].get())
        cp.cuda.get_current_stream().synchronize()
        if handle == 0:
            return np.empty((0, self.d), np.float32)
        return self._scratch.host[1][:handle * self.d].reshape(handle, self.d)

    def measure(self, rows: tuple[int, ...], n_used: int, reps: int = 5) -> dict:
        """Calibration timings of this tier's call (``launch`` then ``wait``, as a layer makes
        it: the table built and copied, the gather, the GEMVs, the copy down, the sync), the
        best of ``reps`` after a warm-up: "gpu_one", one expert (0) on rows[0] rows;
        "gpu_layer" {n: s}, n rows each routed to the same "gpu_k" = max(2, n_used) experts
        (0 .. gpu_k - 1, at most n_expert; a layer's experts have one shape and type), for n
        in ``rows`` (experts.gpu_split takes the call's fixed part and each expert's share
        from them; one expert's call alone, times n_used, counted the fixed part n_used
        times); "copy", seconds to copy one expert (gate, up and down) from pinned host
        memory to the device. The experts timed are uploaded for it when not here; the
        tier's counters are left as they were."""
        k = max(1, min(self.E, max(2, int(n_used))))
        held = list(self.ids)
        missing = [e for e in range(k) if not self.on[e]]
        if missing:
            self.place(held + missing)
        rng = np.random.default_rng(0)
        c = _Ctx()
        counters = (self.rows, self.calls)

        def best_of(n: int, n_exp: int) -> float:
            x = cp.asarray(rng.standard_normal((n, self.k)).astype(np.float32))
            pairs = [(e, np.arange(n, dtype=np.int64), np.full(n, e, np.int64)) for e in range(n_exp)]
            self.wait(self.launch(pairs, x, c))
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                self.wait(self.launch(pairs, x, c))
                best = min(best, time.perf_counter() - t0)
            return best

        try:
            one = best_of(int(rows[0]), 1)
            layer = {int(n): best_of(int(n), k) for n in rows}
            raw = [st.raw(0) for st in (self.attrs["gate"], self.attrs["up"], self.attrs["down"])]
            nb = sum(int(r.nbytes) for r in raw)
            mem = cp.cuda.alloc_pinned_memory(nb)
            host = np.frombuffer(mem, np.uint8, nb)
            host[:] = np.concatenate([r.reshape(-1) for r in raw])
            dev = cp.empty(nb, cp.uint8)
            stream = cp.cuda.get_current_stream()
            copy = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                cp.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, nb, cp.cuda.runtime.memcpyHostToDevice,
                                            stream.ptr)
                stream.synchronize()
                copy = min(copy, time.perf_counter() - t0)
        finally:
            self.rows, self.calls = counters
            if list(self.ids) != held:
                self.place(held)
        return {"gpu_one": one, "gpu_layer": layer, "gpu_k": k, "copy": copy}


class _MoeHost:
    """The moe op (``cuda_plan.MoeHost``): x's rows to the host, the router, routing, the
    CPU tier's experts (``cpu_moe.moe_rows``) and the shared expert there; the experts the
    plan put on the GPU tier (``_GpuExperts``) run on the device meanwhile, their outputs
    joined with the CPU's before the weighted sum; the result back. Both copies go through
    pinned buffers the program's moe steps share (``_MoeStage``: one D2H and its sync
    before the router, one asynchronous H2D after the join; no allocation per call). Eager only:
    ``CudaProgram._graph_ok`` keeps a program with one off the graph path.

    Except when every expert of the layer is on the GPU tier (``device_ready``): then the
    step runs on the device alone, in launches a CUDA graph captures (``_device``): the
    router's GEMV, ``moe_route`` (top-k by ``cpu_moe.route``'s rules), ``moe_tiles`` (the
    pairs by expert and the tile table, built on the device), ``moe_gather``, the tier's
    ``moe_gemv`` launches over a fixed grid of tiles, ``moe_join``. Each row's numbers
    depend on that row alone (batch-invariant); the router's logits are the device GEMV's,
    so they differ from the host step's in the last bits."""

    def __init__(self, prog, s: P.MoeHost):
        from aotx.engine.backend.cpu import experts as cpu_moe

        self.s = s
        self.prog = prog
        self.gpu = _GpuExperts(prog, s.attrs)
        self.worker = prog.moe_worker
        self.router_dev = s.attrs["router"]             # the device step's router (DevMatrix) and bias
        rb = s.attrs.get("router_bias")
        self.router_bias_dev = cp.ascontiguousarray(cp.asarray(rb, cp.float32).reshape(-1)) if rb is not None else None
        self.dev_why = self._device_check(prog, s.attrs)
        self.router_gemv = None
        if self.dev_why is None:
            r = self.router_dev
            n0 = len(prog.gemvs)
            self.router_gemv = _Gemv(prog, S.MODE_STORE, r, 0, r, 0, (r.m + 1) // 2, 2, 1, None, None, None, r.m,
                                     q8=False)
            del prog.gemvs[n0:]         # not a kernel-choice site: the default variant per bucket
            for b in CC.TUNE_BUCKETS:
                prog.need.add(self.router_gemv.name(self._router_variant(b)))
            prog.need.update(("moe_route", "moe_tiles", "moe_join"))
        self.dev_traffic = None         # (E,) uint64 on the device: pairs per expert the device step routed
        a = dict(s.attrs)
        int8 = bool(getattr(prog.backend, "expert_int8", True))
        a["router"] = _host_matrix(a["router"], int8)
        if a.get("router_bias") is not None:
            a["router_bias"] = a["router_bias"].get()
        if a.get("shared") is not None:
            a["shared"] = tuple(_host_matrix(w, int8) for w in a["shared"])
        if a.get("shared_gate") is not None:
            a["shared_gate"] = _host_matrix(a["shared_gate"], int8)
        self.attrs = a
        self.pool = cpu_moe.ExpertPool.shared()
        self.host_traffic = np.zeros(a["n_expert"], np.int64)
        self._moe_rows = cpu_moe.moe_rows
        self.stages = prog.moe_stages   # the program's _MoeStage per (input, output) width

    @property
    def traffic(self) -> np.ndarray:
        """(E,) int64: the (row, expert) pairs routed to each expert since load, by the host
        step and the device step (whose counters this reads back: a sync)."""
        if self.dev_traffic is None:
            return self.host_traffic
        return self.host_traffic + self.dev_traffic.get().astype(np.int64)

    def device_pairs(self) -> int:
        """(row, expert) pairs of real rows the device step computed since load (its graph
        replays included: the device counters, read back; the GPU tier's ``rows`` counts
        the host step's calls only)."""
        return int(self.dev_traffic.sum().get()) if self.dev_traffic is not None else 0

    @staticmethod
    def _device_check(prog, attrs: dict) -> str | None:
        """None when the layer can run as a device step once all its experts are on the
        GPU tier, else why not."""
        r = attrs["router"]
        if not getattr(prog.backend, "moe_device", True):
            return "turned off (CudaBackend(moe_device=False))"
        if attrs.get("shared") is not None:
            return "a shared expert (host step)"
        if int(attrs["n_used"]) > 32 or int(attrs["n_expert"]) > 1024:
            return f"{attrs['n_used']} of {attrs['n_expert']} experts per token (at most 32 of 1024)"
        if int(getattr(r, "qtype", -1)) not in S.TYPES or int(r.k) != int(attrs["gate"].k):
            return "the router's type or shape"
        return None

    def device_ready(self) -> bool:
        """True when this step runs on the device (every expert of the layer on the GPU tier)."""
        g = self.gpu
        return self.dev_why is None and g.ok and g.slot_dev is not None and len(g.ids) == g.E

    def _router_variant(self, rows: int) -> CC.GemvVariant:
        if self.prog._forced_gemv is not None:
            return self.prog._forced_gemv
        b = CC.tune_bucket(rows)
        return CC.GemvVariant.parse(CC.gemv_default(b, False, self.router_dev.m, self.router_dev.k))

    def _device_buffers(self, prog, c: _Ctx, n: int, P_: int, tmax: int) -> dict:
        """The device step's buffers for n rows, shared by the program's moe steps of one shape
        (they run one after the other on one stream): the graph path's by row count (fixed
        addresses: a graph names them); the eager path's one set per shape, grown to the next
        power of two when a forward needs more (views of it are returned; the old set goes
        back to CuPy's pool, reused on the same stream only)."""
        g = self.gpu
        E = g.E
        fp = P._pad4(g.ff)
        shape = (E, int(self.attrs["n_used"]), g.k, fp, g.d, g.act != "silu")
        if not c.eager:
            got = prog.moe_device_scratch.get((n,) + shape)
            if got is None:
                got = prog.moe_device_scratch[(n,) + shape] = self._new_buffers(n, P_, tmax, fp)
            return got
        have = prog.moe_eager_scratch.get(shape)
        if have is None or have["cap"][0] < n or have["cap"][1] < P_ or have["cap"][2] < tmax:
            cap = tuple(_pow2(max(a, b)) for a, b in zip((n, P_, tmax), have["cap"] if have else (1, 1, 1)))
            prog.moe_eager_scratch[shape] = None       # the old set back to the pool first
            have = prog.moe_eager_scratch[shape] = self._new_buffers(*cap, fp)
            have["cap"] = cap
        b = {"lg": have["lg"][:n], "tab": have["tab"][:P_ + 3 * tmax]}
        for key in ("sel", "w", "pos", "xg", "h", "y"):
            b[key] = have[key][:P_]
        b["gu"] = (have["gu"][0][:P_], have["gu"][1][:P_]) if have["gu"] is not None else None
        return b

    def _new_buffers(self, n: int, P_: int, tmax: int, fp: int) -> dict:
        g = self.gpu
        E = g.E
        b = {"lg": cp.empty((n, P._pad4(E + (E & 1))), cp.float32), "sel": cp.empty(P_, cp.int32),
             "w": cp.empty(P_, cp.float32), "tab": cp.empty(P_ + 3 * tmax, cp.int32), "pos": cp.empty(P_, cp.int32),
             "xg": cp.empty((P_, g.k), cp.float32), "h": cp.empty((P_, fp), cp.float32),
             "y": cp.empty((P_, g.d), cp.float32)}
        b["gu"] = (cp.empty((P_, fp), cp.float32), cp.empty((P_, fp), cp.float32)) if g.act != "silu" else None
        return b

    def _device(self, prog, c: _Ctx) -> None:
        """The step on the device (``device_ready``): no host work but the launches."""
        x = c.arr(self.s.x)
        n = int(x.shape[0])
        if n == 0:
            return
        out = c.arr(self.s.out)
        g, a = self.gpu, self.attrs
        E, k = g.E, int(a["n_used"])
        P_ = n * k
        bucket = CC.tune_bucket(n)
        kerns = [g._kernel(name, bucket) for name in g.gemvs]
        nb = min(kk[2] for kk in kerns)
        # tiles: sum over the experts with rows of ceil(c_e / nb) <= (P + (nb - 1) m) / nb, m = min(E, P) of them
        tmax = (P_ + (nb - 1) * min(E, P_)) // nb
        b = self._device_buffers(prog, c, n, P_, tmax)
        if self.dev_traffic is None:
            self.dev_traffic = cp.zeros(E, cp.uint64)
        lg = b["lg"]
        ldl = int(lg.shape[1])
        self.router_gemv.launch(prog, c, x.data.ptr, int(x.strides[0]) // 4, n, lg.data.ptr, ldl,
                                variant=self._router_variant(n))
        rw = 4                                       # MOE_ROUTE_WARPS
        prog.k["moe_route"](((n + rw - 1) // rw,), (32 * rw,),
                            (lg, _i(ldl), _u64(self.router_bias_dev), _i(n), _i(E), _i(k),
                             _i(a["gating"] == "softmax_weight"), _i(bool(a["norm_w"])), _f(a["w_scale"]),
                             b["sel"], b["w"]), shared_mem=4 * rw * E)
        # padding rows (the scratch slot) are not counted as traffic. Known gap: on logits rows (the last
        # layer's FFN after take_rows) in a graph bucket with fewer logits rows than tokens, a padding logits
        # row is checked against a real token row's slot and counted (statistics only; decode is exact)
        kv = getattr(c, "kv", None)
        prog.k["moe_tiles"]((1,), (1024,), (b["sel"], _i(P_), _i(k), _i(E), g.slot_dev, _i(nb), _i(tmax), b["tab"],
                                           b["pos"], self.dev_traffic, np.uint64(getattr(c, "slot_p", 0) or 0),
                                           _i(kv.scratch_slot if kv is not None else -1)))
        prog.k["moe_gather"]((P_,), (128,), (np.uint64(x.data.ptr), _i(int(x.strides[0]) // 4), b["tab"], _i(g.k),
                                             b["xg"], _i(g.k)))
        g.run_gemvs(kerns, g.launch_args(b["xg"], b["h"], b["y"], b["gu"]), b["tab"].data.ptr + 4 * P_, tmax, P_,
                    b["h"], b["gu"])
        prog.k["moe_join"]((n,), (NT,), (b["y"], _i(g.d), b["pos"], b["w"], _i(k), _i(g.d), np.uint64(out.data.ptr),
                                         _i(int(out.strides[0]) // 4)))

    def graph(self, prog, c: _Ctx) -> None:
        if not self.device_ready():
            raise RuntimeError("this moe step runs on the host (not every expert is on the GPU): no CUDA graph")
        self._device(prog, c)

    def eager(self, prog, c: _Ctx) -> None:
        """The host step (or the device step when ``device_ready``). Also run between the
        graphs of a tick cut at the host steps (``_Segments``): there on the layout's real
        rows only (the bucket's padding rows are left as they are)."""
        if self.device_ready():
            self._device(prog, c)
            return
        x = c.arr(self.s.x)
        out = c.arr(self.s.out)
        if not c.eager and c.layout is not None:     # a graph's bucket: its real rows (tokens, or logits rows)
            real = int(c.layout.n_rows) if c.plan_rows(self.s.x) == P.ROWS_N else int(len(c.layout.out_rows))
            x, out = x[:real], out[:real]
        n = int(x.shape[0])
        if n == 0:
            return
        wx, wy = int(x.shape[1]), int(out.shape[1])
        sg = self.stages.get((wx, wy))
        if sg is None:
            sg = self.stages[(wx, wy)] = _MoeStage(wx, wy)
        sg.reserve(n)
        # x's rows into pinned memory by one 2-D copy, then the stream's sync (the router and
        # the CPU tier read them; the steps before on this stream are done)
        stream = cp.cuda.get_current_stream()
        rt = cp.cuda.runtime
        xh = sg.xh[:n]
        rt.memcpy2DAsync(xh.ctypes.data, 4 * wx, x.data.ptr, int(x.strides[0]), 4 * wx, n, rt.memcpyDeviceToHost,
                         stream.ptr)
        stream.synchronize()
        small = None                # rows of long segments take the CPU's prefill path
        segs = c.layout.segments if c.layout is not None else ()
        if sum(seg.n for seg in segs) == xh.shape[0] and any(seg.n > SHORT_SEGMENT for seg in segs):
            small = np.zeros(xh.shape[0], bool)
            row = 0
            for seg in segs:
                if seg.n <= SHORT_SEGMENT:
                    small[row:row + seg.n] = True
                row += seg.n
        gpu = None
        if self.gpu.ids:
            gpu = self.gpu
            gpu._x, gpu._c = x, c
        try:
            y = self._moe_rows(self.attrs, xh, self.pool, self.host_traffic, small, gpu, self.worker)
        finally:
            self.gpu._x = self.gpu._c = None
        # the result back by one 2-D copy from pinned memory (asynchronous: the event keeps
        # the next call from overwriting the buffer before the copy has read it)
        if sg.staged is None:
            sg.staged = cp.cuda.Event()
        sg.staged.synchronize()
        yh = sg.yh[:n]
        np.copyto(yh, y)
        rt.memcpy2DAsync(out.data.ptr, int(out.strides[0]), yh.ctypes.data, 4 * wy, 4 * wy, n, rt.memcpyHostToDevice,
                         stream.ptr)
        sg.staged.record(stream)


class _EagerBatch:
    """Per-forward facts of the eager path: short and long segments (with ``all_short``
    every segment counts as short: the attention kernel for every row, as the graph; a
    segment within ATT_KERNEL_WORK counts as short too), the tables of the short rows,
    attention scratch for ATT_ROWS rows."""

    def __init__(self, layout, slot_np: np.ndarray, pos_np: np.ndarray, max_heads: int, max_hd: int,
                 all_short: bool = False):
        short: list[int] = []
        self.long_segs: list[tuple[int, int, int, int]] = []
        row = 0
        for seg in layout.segments:
            if seg.n <= SHORT_SEGMENT or all_short or seg.n * (seg.pos + seg.n) * max_heads * max_hd <= ATT_KERNEL_WORK:
                short.extend(range(row, row + seg.n))
            else:
                self.long_segs.append((row, seg.slot, seg.pos, seg.n))
            row += seg.n
        self.all_short = not self.long_segs
        n_short = len(short)
        self.short_rows = None
        if short and not self.all_short:
            idx = np.asarray(short, np.int64)
            self.short_rows = cp.asarray(idx)
            meta = cp.asarray(np.stack([slot_np[idx], pos_np[idx]]).astype(np.int32))
            self._meta = meta
            self.short_slot_p = meta.data.ptr
            self.short_pos_p = meta.data.ptr + 4 * n_short
        rows = max(1, min(n_short, ATT_ROWS))
        self.part = cp.empty(rows * max_heads * ATT_NSMAX * (max_hd + 2), cp.float32)
        self.counters = cp.zeros(rows * max_heads, cp.int32)


_BIND = {P.Embed: _Embed, P.QKV: _QKV, P.Attend: _Attend, P.KVStore: _KVStore, P.TakeRows: _TakeRows,
         P.Norm: _Norm, P.HeadOp: _HeadOp, P.Elementwise: _Elementwise, P.GluRows: _GluRows, P.MoeHost: _MoeHost}


class _Segments:
    """A tick's launches cut at the host moe steps (``CudaBackend(moe_graphs=True)``):
    ``graphs[i]`` (a captured CUDA graph, or None for no steps) runs the steps between host
    steps i - 1 and i, the last one the sampler too; each host step runs on the host in
    between, on the layout's real rows, on the cache's stream (its copies and its sync
    order it after the graph before it and before the graph after it)."""

    def __init__(self, graphs: list, hosts: list):
        self.graphs, self.hosts = graphs, hosts

    def launch(self, prog, kv: CudaKVCache, st: _CacheState, b: int, r: int, layout, s) -> None:
        with s:
            for i, g in enumerate(self.graphs):
                if g is not None:
                    g.launch(s)
                if i < len(self.hosts):
                    c = prog._ctx(kv, st, b, r)
                    c.layout = layout
                    self.hosts[i].eager(prog, c)


class CudaProgram:
    """A Program compiled for a CudaBackend. See the module docstring.

    ``prefill``: None (each eager weight's GEMM mode from the kernel choice) or one of
    ``PREFILL_FORCED`` for every weight ("gemv": the graph's kernels, batch-invariant);
    ``gemv``: None (the kernel choice's variant per site and bucket) or one variant name
    (``cuda_choice.GemvVariant``) for every GEMV. ``kernel_choice``: the
    ``kernel_choice.Resolution`` of this load (its ``summary()`` goes to the startup
    profile)."""

    device_sampling = True

    def __init__(self, program, backend, *, fuse: bool = True, prefill: str | None = None, gemv: str | None = None):
        self.backend = backend
        if prefill is not None and prefill not in PREFILL_FORCED:
            raise ValueError(f"prefill mode {prefill!r} is not one of {', '.join(PREFILL_FORCED)}")
        self._forced_prefill = prefill
        self._forced_gemv = CC.GemvVariant.parse(gemv) if gemv else None
        # int8 activations for every GEMV whose weight types have an integer form, on models
        # big enough that reading weights, not launching kernels, bounds a decode step
        self.int8_activations = bool(getattr(backend, "int8_activations", False)) and \
            int(getattr(backend, "weight_bytes", 0)) >= int(getattr(backend, "int8_min_bytes", 0))
        if hasattr(backend, "numerics"):
            backend.numerics = "cuda-int8" if self.int8_activations else "cuda-f32"
        self.q8_k = 0                  # the most inputs of such a GEMV (the size of the xq scratch rows)
        try:
            self.plan = P.plan(program, fuse=fuse)
        except P.PlanError as e:
            raise ModelError(f"the CUDA backend cannot run this model: {e}") from None
        kl = self.plan.kv_layers
        if not kl or len({(L.n_kv_heads, L.head_dim) for L in kl}) != 1:
            raise ModelError("the CUDA backend needs the same KV heads and head dimension in every layer")
        self.n_layers, self.n_kv, self.head_dim = len(kl), kl[0].n_kv_heads, kl[0].head_dim
        self.vocab = self.plan.vocab
        self.d_model = self.plan.d_model
        self.need: set[str] = {"rms_norm", "bias_rows", "glu_rows", "row_scale", "quant_rows"}
        self.qkv_width = 0
        self.max_heads = 1
        self.max_hd = 32
        self.gemvs: list[_Gemv] = []
        self.psites: dict[str, dict] = {}          # prefill site key -> its weights, shape, input
        self.refs: dict[int, int] = {}
        for s in self.plan.steps:
            for w in _weights(s):
                self.refs[id(w)] = self.refs.get(id(w), 0) + 1
        rows_of = {}
        self._producer: dict[int, object] = {}
        for s in self.plan.steps:
            for v in P.writes(s):
                rows_of[id(s)] = self.plan.buffers[self.plan.loc[v].buf][0]
                self._producer[v] = s
        # the CPU expert tier's thread: it computes the CPU's experts while this thread
        # launches the GPU tier's (a mixture of experts only; started on first use)
        self.moe_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aotx-cpu-experts") \
            if any(isinstance(s, P.MoeHost) for s in self.plan.steps) else None
        self.moe_scratch: dict = {}    # the GPU expert tiers' shared buffers (_MoeScratch) per shape
        self.moe_stages: dict = {}     # the moe steps' shared pinned rows (_MoeStage) per width
        self.moe_device_scratch: dict = {}   # the device moe steps' graph-path buffers per (rows, shape)
        self.moe_eager_scratch: dict = {}    # their eager-path buffers per shape (grown on demand)
        self.expert_cache = None       # the learned GPU expert cache (experts.LearnedCache) or None: static
        self._cache_stage: tuple = ()  # its pinned staging (memory, uint8 view, event of the last copies)
        self.expert_copy = {"bytes": 0, "seconds": 0.0}
        self.steps = []
        for s in self.plan.steps:
            rows = rows_of.get(id(s), P.ROWS_N)
            if isinstance(s, P.Linear):
                b = _Linear(self, s, rows)
            elif isinstance(s, P.Glu):
                b = _Glu(self, s, rows)
            else:
                b = _BIND[type(s)](self, s)
            self.steps.append(b)
        self.moe_steps = [b for b in self.steps if isinstance(b, _MoeHost)]
        out_loc = self.plan.loc[self.plan.output]
        self.out_buf = out_loc.buf
        self.v_ld = self.plan.buffers[out_loc.buf][1]
        self._blas = cp.cuda.device.get_cublas_handle()
        # kernel choice: a variant per (GEMV site, bucket), a GEMM mode per prefill site;
        # timing (policy auto/force) compiles the candidates itself (cuda_tune.kernels)
        from aotx.engine.backend.cuda import tune as cuda_tune

        t0 = time.perf_counter()
        self._gv: dict[tuple[str, int], CC.GemvVariant] = {}
        self._pm: dict[str, str] = {}
        self._tune_k: dict = {}
        self.kernel_choice = cuda_tune.resolve_choices(self)
        self.kernel_choice_s = round(time.perf_counter() - t0, 3)
        for g in self.gemvs:
            for v in self._variants_of(g.site):
                self.need.update(g.name(v, m) for m in g.modes())
        qtypes = {int(w.qtype) for d in self.psites.values() for w in d["weights"]}
        self.need.update(PrefillGemm.kernel_names(qtypes))
        missing = sorted(self.need - set(self._tune_k))
        self.k = {**self._tune_k, **(backend.module(missing) if missing else {})}
        self._tune_k = {}
        self.gemm = PrefillGemm(self.k, self._blas)
        self._plan_dense()
        self.ks = backend.sampler_kernel()
        self._last_logits: cp.ndarray | None = None
        self._eager_logits: cp.ndarray | None = None
        self._eager_out_meta = np.zeros((2, 0), np.int32)
        self._keep: list = []          # the eager path's scratch arrays, alive until its forward returns
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # the persistent decode step (cuda_persistent): None when on, else why not
        self._record_wpp: int | None = None        # set while a bucket's launches are recorded
        self.persistent_reason = self._persistent_check()

    # ---- load-time helpers -------------------------------------------------------------------

    def prefill_site(self, step, weights: list, m: int, norm, x: int) -> str:
        """Register the eager GEMM of ``weights`` (one op: a linear, the two halves of a
        GLU, one matrix of a QKV) and return its kernel-choice site key. Its input counts
        as bounded (float16 is a candidate) when it is RMS-normed here or comes from a
        non-residual norm or an attention step."""
        src = self._producer.get(x)
        bounded = norm is not None or isinstance(src, P.Attend) or (isinstance(src, P.Norm) and not src.add)
        names = sorted({_qname(w.qtype) for w in weights})
        key = CC.prefill_site("+".join(names), m, int(weights[0].k), bounded)
        d = self.psites.setdefault(key, {"weights": [], "m": m, "k": int(weights[0].k), "bounded": bounded,
                                         "norm": norm})
        d["weights"].extend(weights)
        return key

    def _plan_dense(self) -> None:
        """Dense prefill copies (``cuda_gemm``) when every eager GEMM's dequantized weight
        fits the budget (``CudaBackend(dense_prefill=False)``: always tiles)."""
        uses = []
        for key, d in self.psites.items():
            mode = self.prefill_mode(key)
            if mode in ("f16", "tf32", "f32"):
                uses.extend((w, mode) for w in d["weights"])
        if not getattr(self.backend, "dense_prefill", True):
            self.gemm.plan_dense(uses, -1)
            self.gemm.dense_reason = "tiles: dense prefill copies turned off"
            return
        try:
            free = int(cp.cuda.Device().mem_info[0])
        except Exception:  # noqa: BLE001 - a runtime without the query: the fixed cap alone
            free = None
        self.gemm.plan_dense(uses, PrefillGemm.dense_budget(free))

    def prefill_mode(self, site: str | None) -> str | None:
        """The eager GEMM mode of a prefill site (None for a step on logits rows)."""
        if site is None:
            return None
        if self._forced_prefill is not None:
            return self._forced_prefill
        return self._pm[site]

    def gemv_variant(self, site: str, rows: int) -> CC.GemvVariant:
        """The variant a GEMV of ``site`` launches over ``rows`` batch rows."""
        if self._record_wpp is not None:           # the persistent step's GEMV blocks (no row_scale launch)
            return CC.GemvVariant(min(CC.pow2(max(1, rows)), CC.NB_MAX), self._record_wpp, False)
        if self._forced_gemv is not None:
            return self._forced_gemv
        return self._gv[(site, CC.tune_bucket(rows))]

    def _variants_of(self, site: str) -> set:
        if self._forced_gemv is not None:
            return {self._forced_gemv}
        return {v for (s, _), v in self._gv.items() if s == site}

    def keep(self, *arrays) -> None:
        """Keep eager scratch arrays (or Prepared activations) alive until the forward returns."""
        self._keep.extend(arrays)

    def bias_rows(self, y: int, ldy: int, bias: cp.ndarray, N: int, m: int) -> None:
        n_el = N * m
        self.k["bias_rows"](((n_el + NT - 1) // NT,), (NT,), (np.uint64(y), _i(ldy), bias, _i(N), _i(m)))

    # ---- the interface of engine/backend/IR.md section 6 ---------------------------------------

    @property
    def weight_bytes(self) -> int:
        return self.backend.weight_bytes

    @property
    def prefill_weight_bytes(self) -> int:
        """Bytes the eager (prefill) path adds for weights: the dense dequantized copies
        when the model's fit the budget, else the one dequantized-tile scratch buffer of
        the prefill GEMM (0 when every eager step runs the graph's GEMVs)."""
        if not self.psites or self._forced_prefill == "gemv":
            return 0
        return self.gemm.weight_bytes

    def kv_cache_bytes(self, n_slots: int, n_ctx: int, kv_type: str = "f16") -> int:
        """Bytes ``new_kv_cache(n_slots, n_ctx, kv_type)`` allocates for K and V."""
        return CudaKVCache.nbytes(self.n_layers, self.n_kv, self.head_dim, n_slots, n_ctx, kv_type)

    def new_kv_cache(self, n_slots: int, n_ctx: int, kv_type: str = "f16") -> CudaKVCache:
        """A zeroed cache of ``n_slots`` slots of ``n_ctx`` tokens, with its graphs' state."""
        check_kv_type(kv_type)
        kv = CudaKVCache(self.n_layers, self.n_kv, self.head_dim, n_slots, n_ctx, kv_type)
        self._states[kv] = _CacheState(self, kv)
        return kv

    def _state(self, kv: CudaKVCache) -> _CacheState:
        st = self._states.get(kv)
        if st is None:
            raise ValueError("this KV cache was not made by this program's new_kv_cache")
        return st

    def last_logits(self) -> cp.ndarray | None:
        """Device float32 (rows, vocab) logits of the last forward, greedy or sample call."""
        lg = self._last_logits
        if isinstance(lg, tuple):             # a replay's output buffer and its logits rows
            buf, R = lg
            lg = self._last_logits = buf[:R, :self.vocab]
        return lg

    def forward(self, tokens: np.ndarray, layout, kv: CudaKVCache, embeds=None) -> np.ndarray:
        """Run one batch; host float32 (R, vocab) logits (engine/backend/IR.md section 6)."""
        if embeds is None and self._graph_ok(layout, kv):
            self._replay(tokens, layout, kv, None, 0, want_ids=False)
            return self.last_logits().get()
        lg = self._eager(tokens, layout, kv, embeds)
        return lg.get() if lg is not None else np.empty((0, self.vocab), np.float32)

    def greedy(self, tokens: np.ndarray, layout, kv: CudaKVCache) -> np.ndarray:
        """Like ``forward`` but returns only the argmax id of each logits row, int32 (R,),
        computed on the device (the logits stay in ``last_logits()``)."""
        return self.sample(tokens, layout, kv, None)

    def sample(self, tokens: np.ndarray, layout, kv: CudaKVCache, rows, tick: int = 0) -> np.ndarray:
        """Run one batch and pick each logits row's next token on the device.

        rows: one ``(SamplerConfig, SamplerState, extra_history)`` per logits row (each must
        pass ``cuda_sampling.device_ok``), or None for greedy without penalty everywhere.
        The states are not advanced here (the caller mirrors the draws). Returns int32
        (R,) ids; the penalized logits stay in ``last_logits()``. Raises RuntimeError when
        a publication record does not belong to this tick."""
        if self._graph_ok(layout, kv):
            return self._replay(tokens, layout, kv, rows, tick, want_ids=True)
        lg = self._eager(tokens, layout, kv)
        if lg is None:
            return np.empty(0, np.int32)
        R = lg.shape[0]
        prm = np.zeros((R, CS.P_WORDS), np.int32)
        hist = np.zeros((R, CS.H_MAX), np.int32)
        self._fill(prm, hist, rows, list(range(R)), tick)
        ids = cp.empty(R, cp.int32)
        rec = cp.empty((R, CS.REC_WORDS), cp.int32)
        meta = cp.asarray(self._eager_out_meta)
        self.ks((R,), (1024,), (self._eager_logits, _i(self._eager_logits.shape[1]), _i(self.vocab), cp.asarray(prm),
                                cp.asarray(hist), meta[0], meta[1], Z64, ids, rec))
        return ids.get()

    @staticmethod
    def _fill(prm: np.ndarray, hist: np.ndarray, rows, out, tick: int) -> bool:
        """Write the sampler table rows ``out`` (a list of rows, or a count R: rows 0 .. R-1;
        the other rows of ``prm`` must already be zero, i.e. skipped); True when a penalty
        history is used."""
        if rows is None:
            sel = slice(0, out) if isinstance(out, int) else out
            prm[sel, 0] = CS.MODE_GREEDY
            prm[sel, 3] = tick & 0x7FFFFFFF
            prm[sel, 4] = _ONE_BITS
            return False
        if isinstance(out, int):
            out = range(out)
        if len(rows) != len(out):
            raise ValueError(f"{len(rows)} sampler rows for {len(out)} logits rows")
        need = False
        for j, (cfg, st, extra) in zip(out, rows):
            need |= CS.fill_row(prm[j], hist[j], cfg, st, tick, extra)
        return need

    # ---- expert tiers (planned by engine/model/experts.py): "gpu" on the device, "host"/"mmap" on the CPU

    def measure_experts(self, layer: int, rows: tuple[int, ...]) -> dict:
        """Calibration of moe layer ``layer``: "cpu" {n: s}, seconds per expert on n rows on
        the CPU tier (``cpu_moe.measure``); the GPU tier's call of one expert ("gpu_one") and
        of a layer's n_used experts ("gpu_layer" {n: s}, "gpu_k" experts), and the copy of one
        expert to the GPU ("copy"; ``_GpuExperts.measure``; these absent when this layer's
        experts cannot run on the GPU tier)."""
        from aotx.engine.backend.cpu import experts as cpu_moe

        st = self.moe_steps[layer]
        out = cpu_moe.measure(st.attrs, rows, st.pool)
        if st.gpu.ok:
            out.update(st.gpu.measure(rows, int(st.attrs["n_used"])))
        return out

    def place_experts(self, plan) -> dict:
        """Apply an expert-tier plan: each layer's "gpu" experts uploaded to the device (the
        others' device copies freed), "host" ones materialized and their pages touched by
        the pinned CPU pool, "mmap" ones left in the file's map. A layer whose experts do
        not fit in the device's free memory keeps them on the CPU tier (its "gpu" experts
        become "host"), which the returned ``gpu_bytes`` reflects. Raises ValueError for a
        plan of the wrong shape, or "gpu" experts in a layer the GPU tier cannot run."""
        from aotx.engine.backend.cpu import experts as cpu_moe

        if not self.moe_steps:
            return {"gpu_bytes": 0, "host_bytes": 0, "recalibrate": False}
        if len(plan.tiers) != len(self.moe_steps):
            raise ValueError(f"an expert plan of {len(plan.tiers)} layers for {len(self.moe_steps)} moe layers")
        gpu_bytes = host_bytes = 0
        pool = self.moe_steps[0].pool
        self.expert_cache = None       # its residents were the old placement's (experts.setup attaches anew)
        for st, tiers in zip(self.moe_steps, plan.tiers):
            a = st.attrs
            if len(tiers) != a["n_expert"] or any(t not in ("gpu",) + cpu_moe.CPU_TIERS for t in tiers):
                raise ValueError(f"moe layer {a['moe_layer']}: tiers {sorted(set(tiers))} for {a['n_expert']} "
                                 f"experts (tiers: gpu, {', '.join(cpu_moe.CPU_TIERS)})")
            on_gpu = [e for e, t in enumerate(tiers) if t == "gpu"]
            host = [e for e, t in enumerate(tiers) if t == "host"]
            try:
                gpu_bytes += st.gpu.place(on_gpu)
            except _OOM:
                st.gpu.place([])
                host += on_gpu
            host_bytes += pool.warm([a["gate"], a["up"], a["down"]], sorted(host))
        return {"gpu_bytes": gpu_bytes, "host_bytes": host_bytes, "recalibrate": True}

    def attach_expert_cache(self, cache) -> None:
        """Run the learned GPU expert cache ``cache`` (``experts.LearnedCache``, whose
        residents must be the GPU tier's experts now) from the next tick on, or none
        (None: the placement stays as it is). The GPU tier's experts are materialized on
        the CPU pool too, so an expert evicted later costs no repacking inside a tick.
        Raises ValueError when the residents are not the tier's."""
        if cache is None:
            self.expert_cache = None
            return
        if len(cache.resident) != len(self.moe_steps):
            raise ValueError(f"an expert cache of {len(cache.resident)} layers for {len(self.moe_steps)} moe layers")
        for st, on in zip(self.moe_steps, cache.resident):
            if not np.array_equal(np.asarray(on, bool), st.gpu.on):
                raise ValueError(f"moe layer {st.attrs['moe_layer']}: the cache's residents are not the GPU tier's "
                                 f"experts {st.gpu.ids}")
        for st in self.moe_steps:
            if st.gpu.ids and len(st.gpu.ids) < st.gpu.E:   # a whole GPU layer never evicts (rebalance skips it)
                a = st.attrs
                st.pool.warm([a["gate"], a["up"], a["down"]], list(st.gpu.ids))
        cache.tick(self._cache_traffic())      # its baseline: the counters now
        self.expert_cache = cache

    def _cache_traffic(self) -> list:
        """The learned cache's counters per moe layer: the host step's (a device-step layer, every
        expert on the GPU, has nothing to move: its device counters are not read back each tick)."""
        return [b.host_traffic if b.device_ready() else b.traffic for b in self.moe_steps]

    def _learn_experts(self) -> None:
        """The learned cache's step, BETWEEN ticks: called first thing in a forward (``_eager``,
        or ``_replay`` on the cache's stream for a tick of graphs between host steps), before
        this tick launches anything. The
        tick before is over by then: each moe step waited for its GPU tier's output (a
        stream sync) before its layer's join, so no launch still reads a slot about to be
        overwritten, and moe_rows reads ``on`` on this thread, so every row of this tick sees
        one placement. The copies go on the current stream ahead of this tick's launches (its
        first moe_gemv reads the new weights by stream order); at most the policy's
        ``copies_per_tick`` experts, through one pinned staging buffer (grown on demand),
        whose previous copies are waited for (an event) before it is rewritten."""
        cache = self.expert_cache
        t0 = time.perf_counter()
        moves = cache.tick(self._cache_traffic())
        if not moves:
            return
        need = sum(self.moe_steps[li].gpu.expert_nbytes(e) for li, e, _ in moves)
        mem, stage, ev = self._cache_stage or (None, np.empty(0, np.uint8), None)
        if ev is not None:
            ev.synchronize()
        if stage.shape[0] < need:
            mem = cp.cuda.alloc_pinned_memory(_pow2(need))
            stage = np.frombuffer(mem, np.uint8, _pow2(need))
            ev = None
        off = 0
        for li, e, v in moves:
            off = self.moe_steps[li].gpu.swap(e, v, stage, off)
        if ev is None:
            ev = cp.cuda.Event()
        ev.record(cp.cuda.get_current_stream())
        self._cache_stage = (mem, stage, ev)
        self.expert_copy["bytes"] += off
        self.expert_copy["seconds"] += time.perf_counter() - t0

    def expert_stats(self) -> dict:
        """Rows routed to each expert of each moe layer since load; (row, expert) pairs the
        GPU tier computed per layer; the CPU pool's counters; with a learned cache, its
        counters and the bytes and host seconds of its copies ("cache")."""
        out = {"traffic": [b.traffic.tolist() for b in self.moe_steps],
               "gpu_rows": [b.gpu.rows + b.device_pairs() for b in self.moe_steps],
               "gpu_experts": [len(b.gpu.ids) for b in self.moe_steps],
               "pool": self.moe_steps[0].pool.stats() if self.moe_steps else {}}
        if self.expert_cache is not None:
            out["cache"] = {**self.expert_cache.stats(), "copied_bytes": self.expert_copy["bytes"],
                            "copy_s": round(self.expert_copy["seconds"], 4)}
        return out

    # ---- graph path ---------------------------------------------------------------------------

    @property
    def moe_device_layers(self) -> tuple[bool, ...]:
        """Per moe layer: it runs as the device step once every expert is on the GPU tier
        (the expert planner's ``device_layers``)."""
        return tuple(st.dev_why is None and st.gpu.ok for st in self.moe_steps)

    def drop_graphs(self) -> None:
        """Forget every captured graph (and the device moe steps' buffers they name): the
        GPU expert tier's stacks moved (placement)."""
        for st in list(self._states.values()):
            st.graphs.clear()
            st.psteps.clear()
        self.moe_device_scratch.clear()

    def _graph_ok(self, layout, kv: CudaKVCache) -> bool:
        if self.moe_steps and not all(m.device_ready() for m in self.moe_steps) \
                and not getattr(self.backend, "moe_graphs", False):
            return False                # a host moe step: the eager path (moe_graphs: graphs between them)
        n = int(layout.n_rows)
        if n == 0 or n > self._state(kv).b_max:
            return False
        gm = getattr(self.backend, "gemm_min_rows", None)    # opt-in: many rows on the eager path's GEMMs
        if gm is not None and n >= gm:
            return False
        segs = layout.segments
        if len(segs) == 1:
            return True
        slots = [s.slot for s in segs]
        return len(set(slots)) == len(slots)

    def _ctx(self, kv: CudaKVCache, st: _CacheState, n: int, r: int) -> _Ctx:
        c = _Ctx()
        c.plan, c.kv, c.st, c.bufs, c.n, c.r = self.plan, kv, st, st.bufs, n, r
        t = st.tables
        c.tok_p, c.slot_p, c.pos_p, c.out_p = t.tok_ptr, t.slot_ptr, t.pos_ptr, t.out_ptr
        c.part, c.counters = st.part, st.counters
        c.xs, c.xq, c.xd, c.qkv, c.rope = st.xs, st.xq, st.xd, st.qkv, st.rope
        c.eager, c.layout = False, None
        return c

    def _launches(self, kv: CudaKVCache, st: _CacheState, b: int, r: int, steps: list | None = None,
                  sampler: bool = True) -> None:
        """Every launch of one replay: ``b`` batch rows, ``r`` logits rows; ``steps``: only
        these (one segment of ``_Segments``), the sampler only with ``sampler``. A host moe
        step among them (the plain run before a segmented capture, on padding rows) is
        skipped: it is not captured, and its rows would count as traffic."""
        pe = self._persistent(kv, st, b, r) if steps is None else None
        if pe is not None:
            kern, table, n_steps, nblocks = pe
            kern((nblocks,), (PS.THREADS,), (table, _i(n_steps), st.bar, _i(nblocks)))
        else:
            c = self._ctx(kv, st, b, r)
            for s in (self.steps if steps is None else steps):
                if not (isinstance(s, _MoeHost) and not s.device_ready()):
                    s.graph(self, c)
        if not sampler:
            return
        t = st.tables
        self.ks((r,), (1024,), (st.bufs[self.out_buf], _i(self.v_ld), _i(self.vocab), t.prm, t.hist,
                                np.uint64(t.slot_ptr), np.uint64(t.pos_ptr), np.uint64(t.out_ptr), t.ids, t.rec))

    # ---- the persistent decode step (cuda_persistent) -----------------------------------------

    def _persistent_check(self) -> str | None:
        """None when buckets of up to ``PS.MAX_ROWS`` rows may run the persistent step
        (whether the steps are covered is found when a bucket is first recorded), else why not."""
        mode = getattr(self.backend, "persistent", "off")
        if mode == "off":
            return "off"
        if self.int8_activations:
            return "int8 activations (quant_rows launches)"
        if self.moe_steps:
            return "experts (host steps)"
        if self._forced_gemv is not None:
            return f"one GEMV variant forced ({self._forced_gemv.name})"
        wb = int(getattr(self.backend, "weight_bytes", 0))
        if mode == "auto" and wb >= PS.MAX_WEIGHT_BYTES:
            return f"{wb / (1 << 30):.1f} GiB of weights: reading them, not launching kernels, bounds a step"
        wpp = int(getattr(self.backend, "persistent_wpp", 1))
        if wpp not in CC.GEMV_GRID[1]:
            return f"persistent_wpp {wpp} is not one of {CC.GEMV_GRID[1]}"
        return None

    @property
    def persistent_note(self) -> str:
        """What the startup profile says of the persistent step."""
        if self.persistent_reason is None:
            return f"on for decode buckets of up to {PS.MAX_ROWS} rows"
        return f"off: {self.persistent_reason}"

    def _record(self, kv: CudaKVCache, st: _CacheState, b: int, r: int) -> list:
        """The launches (name, grid, block, args) the graph path makes for ``b`` rows and ``r``
        logits rows, with the persistent step's GEMV variants, recorded, not run."""
        rec, saved = PS.Recorder(), self.k
        self.k = rec
        self._record_wpp = int(getattr(self.backend, "persistent_wpp", 1))
        try:
            c = self._ctx(kv, st, b, r)
            for s in self.steps:
                s.graph(self, c)
        finally:
            self.k = saved
            self._record_wpp = None
        return rec.calls

    def _persistent(self, kv: CudaKVCache, st: _CacheState, b: int, r: int):
        """(kernel, step table, steps, blocks) of the persistent launch for this bucket, or
        None (the graph of kernels runs; ``persistent_reason`` says why when it is not
        only the bucket's size)."""
        if self.persistent_reason is not None or b > PS.MAX_ROWS:
            return None
        got = st.psteps.get((b, r))
        if got is not None:
            return got
        calls = self._record(kv, st, b, r)
        bad = sorted({n for n, *_ in calls if not PS.covered(n)})
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
        table = cp.asarray(PS.step_table(calls, kinds_l, sigs))
        got = st.psteps[(b, r)] = (kern, table, len(calls), nblocks)
        return got

    def _capture(self, kv: CudaKVCache, st: _CacheState, b: int, r: int):
        s = kv.stream
        t = st.tables
        with s:
            # a plain run first (loads every kernel), on padding rows only: the scratch slot
            t.tab[0].fill(0)
            t.tab[1].fill(kv.scratch_slot)
            t.tab[2].fill(0)
            t.tab[3].fill(0)
            t.prm.fill(0)
            self._keep = []
            self._launches(kv, st, b, r)
            s.synchronize()
            parts = self._segments()
            if len(parts) > 1:
                lists, graphs = parts[0::2], []
                for i, seg in enumerate(lists):
                    last = i == len(lists) - 1
                    if not seg and not last:
                        graphs.append(None)
                        continue
                    s.begin_capture()
                    self._launches(kv, st, b, r, steps=seg, sampler=last)
                    graphs.append(s.end_capture())
                for g in graphs:
                    if g is not None:
                        g.upload(s)
                return _Segments(graphs, parts[1::2])
            s.begin_capture()
            self._launches(kv, st, b, r)
            g = s.end_capture()
        g.upload(s)
        return g

    def _segments(self) -> list:
        """The steps cut at the host moe steps: [steps, host step, steps, ..., steps] (one
        list when every moe step runs on the device or there is none)."""
        out, cur = [], []
        for s in self.steps:
            if isinstance(s, _MoeHost) and not s.device_ready():
                out += [cur, s]
                cur = []
            else:
                cur.append(s)
        return out + [cur]

    def _replay(self, tokens: np.ndarray, layout, kv: CudaKVCache, rows, tick: int, want_ids: bool):
        st = self._state(kv)
        t = st.tables
        n = int(tokens.shape[0])
        b = _pow2(n)
        R = t.fill_rows(tokens, layout, b, kv.scratch_slot)
        r = _pow2(max(R, 1))
        prm = t.prm_np
        prm[:r] = 0
        need_hist = False
        if want_ids and R:
            need_hist = self._fill(prm, t.hist_np, rows, R, tick)
        if self.expert_cache is not None:
            with kv.stream:                # between ticks (a segmented tick: host steps among the graphs); its
                self._learn_experts()      # copies on the stream the graphs and host steps run on, ahead of them
        g = st.graphs.get((b, r))
        if g is None:
            g = st.graphs[(b, r)] = self._capture(kv, st, b, r)
        s = kv.stream
        t.upload(s, r, need_hist)
        if isinstance(g, _Segments):
            g.launch(self, kv, st, b, r, layout, s)
        else:
            g.launch(s)
        if want_ids:
            t.download_records(s, R)
        s.synchronize()  # before anything on another stream reads the graph's output
        self._last_logits = (st.bufs[self.out_buf], R)    # sliced when asked for (last_logits)
        if want_ids:
            rec = t.rec_np[:R]
            if R and (rec[:, 0] != (tick & 0x7FFFFFFF)).any():
                raise RuntimeError(f"publication records of tick {int(rec[0, 0])} where tick {tick} was expected")
            return rec[:, 3].copy()
        return None

    # ---- eager path (prefill, image rows) ----------------------------------------------------

    def _eager(self, tokens: np.ndarray, layout, kv: CudaKVCache, embeds=None) -> cp.ndarray | None:
        if self.expert_cache is not None:
            self._learn_experts()          # between ticks: before this tick's first launch
        st = self._state(kv)
        N = int(tokens.shape[0])
        out_rows = layout.out_rows.astype(np.int32)
        R = int(out_rows.shape[0])
        meta = np.empty((4, max(N, R, 1)), np.int32)
        meta[0, :N] = tokens
        if embeds is not None:
            meta[0, np.asarray(embeds[0], np.int64)] = 0   # placeholder ids lie past the vocabulary
        meta[1, :N] = layout.slots
        meta[2, :N] = layout.positions
        meta[3, :R] = out_rows
        m_dev = cp.asarray(meta)
        w = meta.shape[1]
        c = _Ctx()
        c.plan, c.kv, c.st, c.n, c.r = self.plan, kv, st, N, R
        c.bufs = [cp.empty((N if rk == P.ROWS_N else max(R, 1), wd), cp.float32) for rk, wd in self.plan.buffers]
        c.tok_p, c.slot_p, c.pos_p, c.out_p = (m_dev.data.ptr, m_dev.data.ptr + 4 * w, m_dev.data.ptr + 8 * w,
                                               m_dev.data.ptr + 12 * w)
        c.eager = True
        c.layout = layout
        gemv_only = self._forced_prefill == "gemv"
        c.layout_info = _EagerBatch(layout, meta[1, :N], meta[2, :N], self.max_heads, self.max_hd, all_short=gemv_only)
        c.part, c.counters = c.layout_info.part, c.layout_info.counters
        c.xs = cp.empty(max(N, R, 1), cp.float32)
        c.xq, c.xd = q8_buffers(max(N, R, 1) if self.q8_k else 1, self.q8_k)
        c.qkv = cp.empty((N, self.qkv_width), cp.float32) if gemv_only and self.qkv_width else None
        c.rope = st.rope
        self._keep = []
        cublas.setStream(self._blas, cp.cuda.get_current_stream().ptr)
        cublas.setPointerMode(self._blas, cublas.CUBLAS_POINTER_MODE_HOST)
        for s in self.steps:
            s.eager(self, c)
            if embeds is not None and isinstance(s, _Embed):
                x = c.arr(s.s.out)
                x[cp.asarray(np.asarray(embeds[0], np.int64))] = cp.asarray(embeds[1], dtype=cp.float32)
        self._keep = []
        self._eager_out_meta = np.ascontiguousarray(meta[1:3, out_rows]) if R else np.zeros((2, 0), np.int32)
        if R == 0:
            self._last_logits = None
            cp.cuda.get_current_stream().synchronize()  # the graph's stream does not wait on this one
            return None
        lg = c.bufs[self.out_buf][:R]
        self._eager_logits = lg
        self._last_logits = lg[:, :self.vocab]
        return self._last_logits


def _weights(s) -> list:
    if isinstance(s, P.QKV):
        return [m for m, _ in s.mats]
    if isinstance(s, P.Linear):
        return [s.w]
    if isinstance(s, P.Glu):
        return [s.wa, s.wb]
    if isinstance(s, P.Embed):
        return [s.table]
    return []
