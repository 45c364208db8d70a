"""The attention step of a CUDA program, and the eager batch's layout it reads.

Owns: ``AttendStep``: decode and short segments through the split-context kernel
(``attn_decode``: up to ``ATT_NSMAX`` splits per (row, head), each at least
``ATT_MINCHUNK`` positions; the same partitions for a row whatever the batch), long prefill
segments through the flash-style kernel (``attn_prefill``: tensor cores, K and V read from
the cache; head dimensions ``FLASH_HEAD_DIMS`` on sm_80+, ``FLASH_ATTENTION`` off: the
cuBLAS path) or cuBLAS (scores, masked softmax kernel, values); over a quantized cache
(q8_0, q4_0: ``kernels/kv_quant.cu``) the same kernels dequantize as they load, the cuBLAS
path reads the segment's keys dequantized (``kvq_dequant``), and where the cache is rotated
(``kv.rot``) the queries are rotated before and the output back after (``kvq_rotate``, in
place); and ``EagerBatch``, which sorts an eager batch's segments into short and long ones
and sizes their scratch. Leaves
the K and V writes to the QKV step (``steps.py``), the cache to ``kv.py``, the kernels to
``kernels/attn_decode.cu`` and ``kernels/attn_prefill.cu``.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from aotx.engine.backend.cuda import plan as P
from aotx.engine.backend.cuda import source as S
from aotx.engine.backend.cuda.steps import Ctx, f32, i32, u64
from aotx.engine.errors import ModelError

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
# On since an H200 run: within 2.3-2.5e-4 of the cuBLAS path and float64, 6-15x
# faster at 512-8192 tokens (BENCHMARKS.md, "GPU, 2026-12-06").
FLASH_HEAD_DIMS = S.FLASH_HEAD_DIMS
FLASH_ATTENTION = True
FLASH_ROWS = 64                # query rows per attn_prefill block (FA_BM in kernels/attn_prefill.cu)


def sm80(backend) -> bool:
    """The backend's device runs mma.sync m16n8k16 on float16, cp.async and ldmatrix
    (compute capability 8.0 or newer; ``attn_prefill``)."""
    try:
        return int(getattr(getattr(backend, "device", None), "compute_capability", 0)) >= 80
    except (TypeError, ValueError):
        return False


class AttendStep:
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
        kvts = (0, 1, 2, 3) if s.hd % 32 == 0 else (0, 1)   # q8_0 / q4_0 caches: blocks of 32 per head
        self.names = {kvt: f"attn_decode<{s.hd},{kvt}>" for kvt in kvts}
        prog.need.update(self.names.values())
        prog.need.add("causal_softmax")
        if s.hd % 32 == 0:
            prog.need.update({"kvq_rotate", "kvq_dequant<2>", "kvq_dequant<3>"})
        self.flash = None           # the flash-style kernel's instance per KV type, where it runs
        if s.hd in FLASH_HEAD_DIMS and sm80(prog.backend):
            self.flash = {kvt: f"attn_prefill<{s.hd},{kvt}>" for kvt in kvts}
            prog.need.update(self.flash.values())
        prog.max_heads = max(prog.max_heads, s.n_heads)
        prog.max_hd = max(prog.max_hd, s.hd)

    def _kernel(self, prog, c: Ctx, q: int, ldq: int, B: int, slot_p: int, pos_p: int, out: int, ldo: int, part,
                counters) -> None:
        s = self.s
        kc, vc = c.kv.layer_ptrs(s.layer)
        prog.k[self.names[c.kv.kvt]](
            (ATT_NSMAX, s.n_heads, B), (128,),
            (np.uint64(q), i32(ldq), np.uint64(kc), np.uint64(vc), np.uint64(slot_p), np.uint64(pos_p), i32(s.n_heads),
             i32(s.n_kv), i32(c.kv.n_ctx), f32(s.scale), i32(s.window), u64(self.sinks), u64(part), u64(counters),
             np.uint64(out), i32(ldo),
             i32(ATT_NSMAX), i32(ATT_MINCHUNK)))

    def _rotate(self, prog, c: Ctx, x: int, ld: int, n: int, block: int, inv) -> None:
        """Each head of rows x (n, ld) times the block-size Walsh-Hadamard matrix, in place."""
        prog.k["kvq_rotate"]((self.s.n_heads, n), (32,), (np.uint64(x), i32(ld), i32(self.s.hd), i32(block), f32(inv)))

    def graph(self, prog, c: Ctx) -> None:
        s = self.s
        if c.kv.rot[0]:              # a rotated cache: the queries as its keys were
            self._rotate(prog, c, c.ptr(s.q), c.ld(s.q), c.n, c.kv.rot[0], c.kv.rot[1])
        self._kernel(prog, c, c.ptr(s.q), c.ld(s.q), c.n, c.slot_p, c.pos_p, c.ptr(s.out), c.ld(s.out), c.part,
                     c.counters)
        if c.kv.rot[0]:              # and the output back, as its values were rotated
            self._rotate(prog, c, c.ptr(s.out), c.ld(s.out), c.n, c.kv.rot[2], c.kv.rot[3])

    def _rows(self, prog, c: Ctx, q: int, ldq: int, n: int, slot_p: int, pos_p: int, out: int, ldo: int, part,
              counters) -> None:
        """The attention kernel over ``n`` rows, ATT_ROWS at a time (``part`` holds that many)."""
        for r0 in range(0, n, ATT_ROWS):
            nr = min(ATT_ROWS, n - r0)
            self._kernel(prog, c, q + 4 * r0 * ldq, ldq, nr, slot_p + 4 * r0, pos_p + 4 * r0, out + 4 * r0 * ldo, ldo,
                         part, counters)

    def eager(self, prog, c: Ctx) -> None:
        s = self.s
        if c.kv.rot[0]:              # a rotated cache: the queries as its keys were, the output back after
            self._rotate(prog, c, c.ptr(s.q), c.ld(s.q), c.n, c.kv.rot[0], c.kv.rot[1])
            self._eager(prog, c)
            self._rotate(prog, c, c.ptr(s.out), c.ld(s.out), c.n, c.kv.rot[2], c.kv.rot[3])
            return
        self._eager(prog, c)

    def _eager(self, prog, c: Ctx) -> None:
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
            if c.kv.quant:           # the segment's keys and values dequantized (kvq_dequant)
                kc, vc = self._dequant(prog, c, slot, c0, T_ - c0)
            else:
                kc = c.kv.k[s.layer, slot, :, c0:T_, :]
                vc = c.kv.v[s.layer, slot, :, c0:T_, :]
                if c.kv.kvt:
                    kc, vc = kc.astype(cp.float32), vc.astype(cp.float32)
            qs = q_all[row:row + n].reshape(n, KV, G, hd).transpose(1, 2, 0, 3).reshape(KV, G * n, hd)
            sc = cp.matmul(qs, kc.transpose(0, 2, 1))
            Tw = T_ - c0
            prog.k["causal_softmax"]((KV * G * n,), (256,),
                                     (sc, i32(Tw), i32(n), i32(pos), i32(c0), i32(s.window), f32(s.scale),
                                      u64(self.sinks)))
            o = cp.matmul(sc, vc)
            o_all[row:row + n] = o.reshape(KV, G, n, hd).transpose(2, 0, 1, 3).reshape(n, qd)

    def _dequant(self, prog, c: Ctx, slot: int, c0: int, n: int):
        """Positions c0 .. c0 + n - 1 of ``slot``'s keys and values as (n_kv, n, hd) float32."""
        s = self.s
        kp, vp = c.kv.layer_ptrs(s.layer)
        out = []
        for p in (kp, vp):
            a = cp.empty((s.n_kv, n, s.hd), cp.float32)
            prog.k[f"kvq_dequant<{c.kv.kvt}>"]((n, s.n_kv), (32,),
                                              (np.uint64(p), i32(slot), i32(c0), i32(n), i32(s.n_kv), i32(s.hd),
                                               i32(c.kv.n_ctx), a))
            out.append(a)
        return out

    def _flash(self, prog, c: Ctx, segs) -> None:
        """Long segments (``(row, slot, pos, n)``) through ``attn_prefill``: one launch each,
        (ceil(n / FLASH_ROWS), heads) blocks of 128 threads, K and V read from the cache."""
        s = self.s
        kc, vc = c.kv.layer_ptrs(s.layer)
        name = self.flash[c.kv.kvt]
        q, ldq, out, ldo = c.ptr(s.q), c.ld(s.q), c.ptr(s.out), c.ld(s.out)
        for row, slot, pos, n in segs:
            prog.k[name](((n + FLASH_ROWS - 1) // FLASH_ROWS, s.n_heads), (128,),
                         (np.uint64(q + 4 * row * ldq), i32(ldq), np.uint64(kc), np.uint64(vc), i32(slot), i32(pos),
                          i32(n), i32(s.n_heads), i32(s.n_kv), i32(c.kv.n_ctx), f32(s.scale), i32(s.window),
                          u64(self.sinks), np.uint64(out + 4 * row * ldo), i32(ldo)))


class EagerBatch:
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
