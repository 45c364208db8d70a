"""The step executors of a CUDA program: each step of the plan (``plan.py``) bound to its
kernels, with the launch arguments of its two paths.

Owns: the launch helpers every step uses (``u64``, ``i32``, ``f32``, ``pow2``, block sizes), the
run context (``Ctx``: buffer addresses, row counts, per-row tables), the GEMV launch
(``Gemv``: weights, mode and epilogue fixed at load; the variant per bucket from the kernel
choice) and the executors of the dense steps: embedding, linear, GLU, QKV (norm, RoPE, KV
write), KV store, take rows, norms, head ops, element-wise ops. Each has ``graph(prog, ctx)``
(the GEMV kernels, or the MMQ (``mmq.py``) over many rows: the captured graph, and the eager
path's launches on logits rows) and
``eager(prog, ctx)`` (cuBLAS through ``gemm.PrefillGemm`` where the rows are many). Leaves
the attention step to ``attention.py``, the moe steps to ``moe.py`` and ``experts.py``, the
order of steps, buffers and graphs to ``program.py``, the kernels to ``kernels/``.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from aotx.engine.backend.cuda import choice as CC
from aotx.engine.backend.cuda import mmq as MQ
from aotx.engine.backend.cuda import plan as P
from aotx.engine.backend.cuda import source as S
from aotx.engine.errors import ModelError

GEMV_WARPS = CC.GEMV_WARPS    # warps per GEMV block (kernels/shared.cuh defines the same)
NT = 256                       # threads per block of the elementwise kernels
MODE_NAME = {S.MODE_STORE: "store", S.MODE_ADD: "add", S.MODE_SWIGLU: "swiglu", S.MODE_GEGLU: "geglu",
             S.MODE_QKV: "qkv", S.MODE_QKV16: "qkv"}


def u64(a) -> np.uint64:
    """A device pointer as a kernel argument (a cupy array, a raw address or None)."""
    if a is None:
        return np.uint64(0)
    if isinstance(a, (int, np.integer)):
        return np.uint64(a)
    return np.uint64(a.data.ptr)


def pow2(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


def i32(v) -> np.int32:
    return np.int32(v)


def f32(v) -> np.float32:
    return np.float32(v)


def qname(qtype: int) -> str:
    from gguf import GGMLQuantizationType as T

    try:
        return T(int(qtype)).name
    except ValueError:
        return str(qtype)
Z64 = np.uint64(0)
Z32 = np.int32(0)
READY_SCALE, READY_Q8 = 1, 2     # what Gemv.launch left for the next GEMV on the same x and norm


class Ctx:
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


# ---- bound steps --------------------------------------------------------------------------------
# Each has graph(prog, ctx) (GEMV kernels; also the eager path's launches on logits rows)
# and eager(prog, ctx) (cuBLAS where the rows are many).

class Gemv:
    """One GEMV launch: fixed weights, mode and epilogue; x, y, rows supplied per run.

    ``site``: its kernel-choice site (``choice.gemv_site``; all layers' GEMVs of one
    shape share it); the variant at each batch bucket comes from ``prog.gemv_variant``.
    ``qkv``: for the fused QKV epilogue, (first row of [q; k; v] this matrix holds, the
    QKVStep step) so that ``launch`` can pass the cache, RoPE tables and row tables.
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
        self.site = CC.gemv_site(MODE_NAME[mode], qname(wa.qtype), qname(wb.qtype), m_rows, self.k, norm is not None,
                                 self.q8)
        # the MMQ form (int8 tensor cores, the same bits) that launches over mmq_min_rows rows and more
        self.mmq, self.mmq_why = MQ.site_for(prog, self)
        prog.gemvs.append(self)

    def name(self, v: CC.GemvVariant, mode: int | None = None) -> str:
        return CC.gemv_instance(int(self.wa.qtype), int(self.wb.qtype), self.mode if mode is None else mode, v,
                                self.q8)

    def modes(self) -> tuple[int, ...]:
        """Template modes this GEMV may launch (a QKV GEMV: one per float KV type, and the
        store a quantized cache's path takes where the head size allows one)."""
        if self.mode in (S.MODE_QKV, S.MODE_QKV16):
            quant = self.qkv is not None and self.qkv[1].s.hd % 32 == 0
            return (S.MODE_QKV, S.MODE_QKV16) + ((S.MODE_STORE,) if quant else ())
        return (self.mode,)

    def launch(self, prog, c, x: int, ldx: int, B: int, y: int, ldy: int, variant: CC.GemvVariant | None = None,
               kernels: dict | None = None, scale_ready: int = 0, ptrs: tuple | None = None,
               store: bool = False) -> int:
        """Launch over ``B`` rows; returns what the next GEMV on the same x and norm finds
        ready, for its ``scale_ready``: READY_SCALE when the rows' norm scale is in ``c.xs``,
        plus READY_Q8 when x is in ``c.xq``/``c.xd`` as int8 blocks (``quant_rows`` ran).
        ``ptrs``: (Wa, Wb, bias_a, bias_b) device addresses that replace this GEMV's own (the
        GPU expert tier: one GEMV per expert shape, each launch on one expert's rows).
        With an MMQ form, no ``variant`` or ``ptrs`` and at least ``prog.mmq_min_rows`` rows, the
        launch is the MMQ (``mmq.py``: the GEMV's arguments and bits). ``store``: a QKV GEMV
        stores its rows (a quantized cache's path: head_rope_kv writes it)."""
        if B == 0:
            return 0            # no logits rows (a prefill chunk): nothing after take_rows runs
        mr = getattr(prog, "mmq_min_rows", None)
        use_mmq = self.mmq is not None and variant is None and ptrs is None and mr is not None and B >= mr
        v = None if use_mmq else (variant if variant is not None else prog.gemv_variant(self.site, B))
        mode = self.mode
        qkv = self.qkv if not store else None
        if store:
            mode = S.MODE_STORE
        elif qkv is not None:
            mode = S.MODE_QKV16 if c.kv.kvt else S.MODE_QKV
        kk = kernels if kernels is not None else prog.k
        xs = Z64
        ready = scale_ready
        q8_tail: tuple = (Z64, Z32)
        if self.q8:
            ldq = int(c.xq.shape[1])
            if not scale_ready & READY_Q8:
                kk["quant_rows"]((B, (self.k + 127) // 128), (128,),
                                 (np.uint64(x), i32(ldx), i32(self.k), u64(self.nw), f32(self.eps), c.xs, c.xq,
                                  i32(ldq),
                                  c.xd, i32(ldq // 32)))
                ready = READY_Q8 | (READY_SCALE if self.nw is not None else 0)
            if self.nw is not None:
                xs = np.uint64(c.xs.data.ptr)
            x, ldx = c.xq.data.ptr, ldq
            q8_tail = (np.uint64(c.xd.data.ptr), i32(ldq // 32))
        elif self.nw is not None and v.pre:
            if not scale_ready & READY_SCALE:
                kk["row_scale"]((B,), (128,), (np.uint64(x), i32(ldx), i32(self.k), f32(self.eps), c.xs))
                ready |= READY_SCALE
            xs = np.uint64(c.xs.data.ptr)
        if qkv is not None:
            r0, q = qkv
            kc, vc = c.kv.layer_ptrs(q.s.layer)
            cos, sin = c.rope[q.spec_i]
            extra = (i32(r0), i32(q.qd), i32(q.kd), i32(q.s.hd), i32(q.rope_half), i32(q.neox), i32(q.s.n_kv),
                     i32(c.kv.n_ctx), np.uint64(c.slot_p), np.uint64(c.pos_p), u64(cos), u64(sin), np.uint64(kc),
                     np.uint64(vc))
        else:
            extra = (Z32, Z32, Z32, Z32, Z32, Z32, Z32, Z32, Z64, Z64, Z64, Z64, Z64, Z64)
        if ptrs is None:
            ptrs = (self.wa.data.data.ptr + self.a_off, self.wb.data.data.ptr + self.b_off_bytes, self.bias_a,
                    self.bias_b)
        args = (np.uint64(ptrs[0]), np.uint64(ptrs[1]),
                np.int64(self.wa.row_bytes), np.int64(self.wb.row_bytes), i32(self.a_stride), i32(self.b_off),
                i32(self.n_pairs), i32(self.k), np.uint64(x), i32(ldx), i32(B), u64(self.nw), f32(self.eps), xs,
                u64(ptrs[2]), u64(ptrs[3]), np.uint64(y), i32(ldy)) + extra + q8_tail
        if use_mmq:
            self.mmq.launch(kk, mode, B, args)
            return ready
        ppb = v.pairs_per_block
        grid = ((self.n_pairs + ppb - 1) // ppb, (B + v.nb - 1) // v.nb)
        kk[self.name(v, mode)](grid, (GEMV_WARPS * 32,), args)
        return ready

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one launch reads: two rows of Wa per pair (a_stride 2), or one
        row of Wa and one of Wb (a GLU's gate and up)."""
        if self.a_stride == 2:
            return int(2 * self.n_pairs * self.wa.row_bytes)
        return int(self.n_pairs * (self.wa.row_bytes + self.wb.row_bytes))


def pad_bias(b, m: int):
    """A bias vector as a float32 device array of even length (the pad row reads it)."""
    if b is None:
        return None
    b = cp.asarray(b, cp.float32).reshape(-1)
    if b.shape[0] != m:
        raise ModelError(f"a bias of {b.shape[0]} values for a matrix of {m} rows")
    return cp.concatenate([b, cp.zeros(2, cp.float32)]) if m % 2 else cp.ascontiguousarray(b)


class EmbedStep:
    def __init__(self, prog, s: P.Embed):
        self.s = s
        self.name = f"embed<{s.table.qtype}>"
        prog.need.add(self.name)

    def graph(self, prog, c: Ctx) -> None:
        t = self.s.table
        d = t.k
        nu = d // 8
        prog.k[self.name](((nu + 127) // 128, c.n), (128,),
                          (u64(t.data), np.int64(t.row_bytes), np.uint64(c.tok_p), i32(d), np.uint64(c.ptr(self.s.out)),
                           i32(c.ld(self.s.out)), f32(self.s.scale)))

    eager = graph


class LinearStep:
    def __init__(self, prog, s: P.Linear, rows: str):
        self.s, self.rows = s, rows
        w = s.w
        bias = pad_bias(s.bias, w.m)
        mode = S.MODE_ADD if s.mode == "add" else S.MODE_STORE
        self.g = Gemv(prog, mode, w, 0, w, 0, (w.m + 1) // 2, 2, 1, s.norm, bias, bias, w.m)
        self.bias = bias
        self.psite = prog.prefill_site(self, [w], w.m, s.norm, s.x) if rows == P.ROWS_N else None

    def graph(self, prog, c: Ctx) -> None:
        s = self.s
        self.g.launch(prog, c, c.ptr(s.x), c.ld(s.x), c.rows(s.x), c.ptr(s.out), c.ld(s.out))

    def eager(self, prog, c: Ctx) -> None:
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


class GluStep:
    def __init__(self, prog, s: P.Glu, rows: str):
        self.s, self.rows = s, rows
        mode = S.MODE_GEGLU if s.act == "gelu_tanh" else S.MODE_SWIGLU
        ba = cp.ascontiguousarray(cp.asarray(s.bias_a[0], cp.float32)[s.bias_a[1]:s.bias_a[1] + s.f]) \
            if s.bias_a is not None else None
        bb = cp.ascontiguousarray(cp.asarray(s.bias_b[0], cp.float32)[s.bias_b[1]:s.bias_b[1] + s.f]) \
            if s.bias_b is not None else None
        self.g = Gemv(prog, mode, s.wa, s.a0 * s.wa.row_bytes, s.wb, s.b0 * s.wb.row_bytes, s.f, 1, 0, s.norm, ba, bb,
                       s.f)
        self.bias = None
        if ba is not None or bb is not None:
            self.bias = cp.concatenate([ba if ba is not None else cp.zeros(s.f, cp.float32),
                                        bb if bb is not None else cp.zeros(s.f, cp.float32)])
        self.act = 1 if s.act == "gelu_tanh" else 0
        self.psite = prog.prefill_site(self, [s.wa, s.wb], 2 * s.f, s.norm, s.x) if rows == P.ROWS_N else None

    def graph(self, prog, c: Ctx) -> None:
        s = self.s
        self.g.launch(prog, c, c.ptr(s.x), c.ld(s.x), c.rows(s.x), c.ptr(s.out), c.ld(s.out))

    def eager(self, prog, c: Ctx) -> None:
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
                           (gu, i32(2 * f), np.uint64(gu.data.ptr + 4 * f), i32(2 * f), i32(N), i32(f), i32(self.act),
                            np.uint64(c.ptr(s.out)), i32(c.ld(s.out))))


class QKVStep:
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
                g = Gemv(prog, S.MODE_STORE, m, 0, m, 0, m.m // 2, 2, 1, s.norm, sub, sub, m.m)
            else:
                g = Gemv(prog, S.MODE_QKV16, m, 0, m, 0, m.m // 2, 2, 1, s.norm, sub, sub, m.m, qkv=(r0, self))
            self.g.append((g, r0))
        prog.need.update({"head_rope_kv<0>", "head_rope_kv<1>"})
        if s.hd % 32 == 0:           # a quantized cache (q8_0, q4_0) takes this model's heads
            prog.need.update({"head_rope_kv<2>", "head_rope_kv<3>"})
        prog.qkv_width = max(prog.qkv_width, P._pad4(width))
        self.width = width
        self.psites = [prog.prefill_site(self, [m], m.m, s.norm, s.x) for m, _ in mats]

    def _head_rope_kv(self, prog, c: Ctx, src: int, ld: int, bias, nrows: int, q_out: int, ldq: int) -> None:
        s = self.s
        kc, vc = c.kv.layer_ptrs(s.layer)
        cos, sin = c.rope[self.spec_i]
        prog.k[f"head_rope_kv<{c.kv.kvt}>"](
            (s.n_heads + 2 * s.n_kv, nrows), (32,),
            (np.uint64(src), i32(ld), u64(bias), i32(s.n_heads), i32(s.n_kv), i32(s.hd), i32(self.rope_half),
             i32(self.neox),
             u64(self.qn), u64(self.kn), f32(self.eps), np.uint64(c.slot_p), np.uint64(c.pos_p), u64(cos), u64(sin),
             np.uint64(q_out), i32(ldq), np.uint64(kc), np.uint64(vc), i32(c.kv.n_ctx), i32(c.kv.rot[0]),
             f32(c.kv.rot[1]), i32(c.kv.rot[2]), f32(c.kv.rot[3])))

    def graph(self, prog, c: Ctx) -> None:
        s = self.s
        x, ldx, B = c.ptr(s.x), c.ld(s.x), c.n
        if self.head_norm or c.kv.quant:
            # the GEMVs store [q; k; v] rows, head_rope_kv does the rest (a quantized cache is
            # written a block at a time: no GEMV epilogue does that)
            ldq = c.qkv.shape[1]
            ready = False
            for g, r0 in self.g:
                ready = g.launch(prog, c, x, ldx, B, c.qkv.data.ptr + 4 * r0, ldq, scale_ready=ready, store=True)
            self._head_rope_kv(prog, c, c.qkv.data.ptr, ldq, None, B, c.ptr(s.q_out), c.ld(s.q_out))
            return
        ready = False                # the rows' norm scale is in c.xs (the same x and norm for every matrix)
        for g, _ in self.g:
            ready = g.launch(prog, c, x, ldx, B, c.ptr(s.q_out), c.ld(s.q_out), scale_ready=ready)

    def eager(self, prog, c: Ctx) -> None:
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


class KVStoreStep:
    def __init__(self, prog, s: P.KVStore):
        self.s = s
        prog.need.update({"kv_store<0>", "kv_store<1>"})
        if s.hd % 32 == 0:           # a quantized cache (q8_0, q4_0) takes this model's heads
            prog.need.update({"kvq_store<2>", "kvq_store<3>"})

    def graph(self, prog, c: Ctx) -> None:
        s = self.s
        kc, vc = c.kv.layer_ptrs(s.layer)
        if c.kv.quant:               # one warp per (row, K or V head): rotated, then a block at a time
            r = c.kv.rot
            prog.k[f"kvq_store<{c.kv.kvt}>"]((2 * s.n_kv, c.n), (32,),
                                             (np.uint64(c.ptr(s.k)), i32(c.ld(s.k)), np.uint64(c.ptr(s.v)),
                                              i32(c.ld(s.v)), i32(s.n_kv), i32(s.hd), i32(c.kv.n_ctx),
                                              np.uint64(c.slot_p), np.uint64(c.pos_p), np.uint64(kc), np.uint64(vc),
                                              i32(r[0]), f32(r[1]), i32(r[2]), f32(r[3])))
            return
        n_el = c.n * s.n_kv * s.hd
        prog.k[f"kv_store<{c.kv.kvt}>"](((n_el + NT - 1) // NT,), (NT,),
                                        (np.uint64(c.ptr(s.k)), i32(c.ld(s.k)), np.uint64(c.ptr(s.v)), i32(c.ld(s.v)),
                                         i32(c.n), i32(s.n_kv), i32(s.hd), i32(c.kv.n_ctx), np.uint64(c.slot_p),
                                         np.uint64(c.pos_p), np.uint64(kc), np.uint64(vc)))

    eager = graph


class TakeRowsStep:
    def __init__(self, prog, s: P.TakeRows):
        self.s = s
        prog.need.add("gather_rows")

    def graph(self, prog, c: Ctx) -> None:
        s = self.s
        if c.r == 0:
            return
        prog.k["gather_rows"]((c.r,), (128,), (np.uint64(c.ptr(s.x)), i32(c.ld(s.x)), np.uint64(c.out_p),
                                               np.uint64(c.ptr(s.out))))

    eager = graph


class NormStep:
    def __init__(self, prog, s: P.Norm):
        self.s = s
        prog.need.add("rms_norm")

    def graph(self, prog, c: Ctx) -> None:
        s = self.s
        rows = c.rows(s.x)
        if rows == 0:
            return
        prog.k["rms_norm"]((rows,), (256,), (np.uint64(c.ptr(s.x)), i32(c.ld(s.x)), u64(s.w), f32(s.eps),
                                            i32(width_of(c, s.x)), np.uint64(c.ptr(s.out)), i32(c.ld(s.out)),
                                            i32(1 if s.add else 0)))

    eager = graph


def width_of(c: Ctx, vid: int) -> int:
    return c.plan.loc[vid].width


class HeadOpStep:
    def __init__(self, prog, s: P.HeadOp):
        self.s = s
        if s.hd > 256:
            raise ModelError(f"head dimension {s.hd}: the CUDA head kernels support up to 256")
        self.spec_i = prog.plan.rope_specs.index(s.spec) if s.spec is not None else -1
        self.rope_half = s.spec.dim // 2 if s.spec is not None else 0
        self.neox = 1 if s.spec is not None and s.spec.mode == "neox" else 0
        prog.need.add("head_ops")

    def graph(self, prog, c: Ctx) -> None:
        s = self.s
        rows = c.rows(s.x)
        if rows == 0:
            return
        cos, sin = c.rope[self.spec_i] if self.spec_i >= 0 else (None, None)
        prog.k["head_ops"]((width_of(c, s.x) // s.hd, rows), (32,),
                           (np.uint64(c.ptr(s.x)), i32(c.ld(s.x)), np.uint64(c.ptr(s.out)), i32(c.ld(s.out)), i32(s.hd),
                            u64(s.w), f32(s.eps), i32(self.rope_half), i32(self.neox), np.uint64(c.pos_p), u64(cos),
                            u64(sin)))

    eager = graph


class ElementwiseStep:
    OPS = {"add": 0, "scale": 1, "softcap": 2}

    def __init__(self, prog, s: P.Elementwise):
        self.s = s
        prog.need.add("ew_rows")

    def graph(self, prog, c: Ctx) -> None:
        s = self.s
        rows, n = c.rows(s.a), width_of(c, s.a)
        if rows == 0:
            return
        b = c.ptr(s.b) if s.b is not None else 0
        ldb = c.ld(s.b) if s.b is not None else 0
        n_el = rows * n
        prog.k["ew_rows"](((n_el + NT - 1) // NT,), (NT,),
                          (np.uint64(c.ptr(s.a)), i32(c.ld(s.a)), np.uint64(b), i32(ldb), np.uint64(c.ptr(s.out)),
                           i32(c.ld(s.out)), i32(rows), i32(n), i32(self.OPS[s.op]), f32(s.s)))

    eager = graph


class GluRowsStep:
    def __init__(self, prog, s: P.GluRows):
        self.s = s
        prog.need.add("glu_rows")

    def graph(self, prog, c: Ctx) -> None:
        s = self.s
        rows, f = c.rows(s.gate), width_of(c, s.gate)
        if rows == 0:
            return
        n_el = rows * f
        prog.k["glu_rows"](((n_el + NT - 1) // NT,), (NT,),
                           (np.uint64(c.ptr(s.gate)), i32(c.ld(s.gate)), np.uint64(c.ptr(s.up)), i32(c.ld(s.up)),
                            i32(rows), i32(f), i32(1 if s.act == "gelu_tanh" else 0), np.uint64(c.ptr(s.out)),
                            i32(c.ld(s.out))))

    eager = graph


def weights_of(s) -> list:
    """The weight matrices a plan step reads (program.py counts their uses)."""
    if isinstance(s, P.QKV):
        return [m for m, _ in s.mats]
    if isinstance(s, P.Linear):
        return [s.w]
    if isinstance(s, P.Glu):
        return [s.wa, s.wb]
    if isinstance(s, P.Embed):
        return [s.table]
    return []
