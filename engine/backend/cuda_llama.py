"""The llama architecture on the CUDA backend: decode (and short batches) as a CUDA graph.

Same interface and math as ``architectures/llama.py`` (LlamaModel): ``forward(tokens,
segments, kv)`` returns host float32 logits; ``sample`` runs the sampler chain on the
device (``cuda_sampling``) and returns only token ids; ``greedy`` is ``sample`` with
every row greedy.

Two paths:
* **graph**: a batch of at most ``kv.b_max`` rows in all (decode steps of many slots,
  speculative verify windows, a short prefill such as a conversation's next turn)
  replays a CUDA graph captured once per row-count bucket (1, 2, 4, ... b_max) and per
  KV cache. The graph reads each row's token, slot and position from the device table
  ``tab`` (3, b_max) int32 and each output row's sampler settings from ``prm``
  (``cuda_sampling``), refreshed from pinned host mirrors by one copy each before the
  replay; rows past the batch point at a scratch slot. Per layer it runs 5 of our
  kernels: QKV GEMV (RMSNorm, RoPE and the KV write fused), split-context attention,
  O GEMV + residual, gate/up GEMV (RMSNorm and SwiGLU fused), down GEMV + residual;
  then the output GEMV (final RMSNorm fused) and ``sample_rows``, which writes one
  publication record (tick, slot, position, token) per output row; the records come
  back to pinned host memory with one copy. No cuBLAS inside. Rows of one slot at
  consecutive positions are causal without a mask: every row's K and V of a layer are
  written by the QKV kernel before the attention kernel of that layer reads them.
* **eager**: anything larger (prefill chunks): weights dequantized once to float32
  (kept when they fit ``DENSE_CACHE_BYTES``), cuBLAS SGEMM for projections, cuBLAS for
  prefill attention (scores, causal softmax kernel, values), the decode attention
  kernel for single-token rows, then ``sample_rows`` when ids are asked for.

Batch invariance: a row's numbers do not depend on the other rows while the batch
stays under 16 rows (GEMV blocks of 1 and 4 rows reduce in the same order); at 16
rows and more the GEMV uses a one-warp-per-row layout for throughput, whose float
sums round differently.

The KV cache and the device tables live in ``cuda_kv.py``.
"""
from __future__ import annotations

import math

import cupy as cp
import numpy as np
from cupy_backends.cuda.libs import cublas

from aotx.engine.backend import cuda_sampling as CS
from aotx.engine.backend import cuda_src as S
from aotx.engine.backend.cuda import NVRTC_OPTIONS, CudaBackend, DevMatrix, _u64
from aotx.engine.backend.cuda_kv import ATT_NSMAX, CudaKVCache
from aotx.engine.errors import ModelError
from aotx.engine.model.batch import BatchLayout
from aotx.engine.model.config import ModelConfig

DENSE_CACHE_BYTES = 4 << 30   # float32 copies of the weights for prefill are kept up to this size
NB_CHOICES = (1, 4, 16)        # batch rows per GEMV block (template instances)
ATT_MINCHUNK = 64              # fewest positions per split (one round of the kernel for head_dim 64)
GEMV_WARPS = 4


def _nb(b: int) -> int:
    """Batch rows per GEMV block for a batch of ``b`` rows."""
    best = 1
    for n in NB_CHOICES:
        if n <= b:
            best = n
    return best


def rope_tables(n_ctx: int, rope_dim: int, base: float, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (n_ctx, rope_dim // 2) float32, as ``cpu_ops.rope_tables`` computes them
    (float64, then rounded), so both backends rotate by the same numbers."""
    j = np.arange(rope_dim // 2, dtype=np.float64)
    inv = base ** (-2.0 * j / rope_dim)
    ang = (np.arange(n_ctx, dtype=np.float64)[:, None] / scale) * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


class CudaLayer:
    def __init__(self, attn_norm, qkv: list[DevMatrix], wo, ffn_norm, w_gate, w_up, w_down):
        self.attn_norm = attn_norm
        self.qkv = qkv              # one concatenated matrix, or [wq, wk, wv] when their types differ
        self.wo = wo
        self.ffn_norm = ffn_norm
        self.w_gate = w_gate
        self.w_up = w_up
        self.w_down = w_down
        self.d_qkv = self.d_gu = None  # dense float32 copies for the eager path


class CudaLlamaModel:
    """A llama model on a CudaBackend. See the module docstring for the two paths."""

    device_sampling = True  # sample() and greedy() pick ids on the device (SEAMS.md)

    def __init__(self, cfg: ModelConfig, gf, backend: CudaBackend):
        from aotx.engine.model.architectures.llama import _check

        self.cfg = cfg
        self.backend = backend
        d, hd = cfg.d_model, cfg.head_dim
        if hd not in (64, 128):
            raise ModelError(f"{gf.path}: head dimension {hd}: the CUDA attention kernel supports 64 and 128")
        if cfg.n_heads % cfg.n_kv_heads:
            raise ModelError(f"{gf.path}: {cfg.n_heads} heads are not a multiple of {cfg.n_kv_heads} KV heads")
        self.qd, self.kd = cfg.n_heads * hd, cfg.n_kv_heads * hd
        vocab = cfg.vocab_size
        mat = lambda name, shape: backend.matrix(_check(gf, name, shape))  # noqa: E731
        vec = lambda name, shape: backend.vector(_check(gf, name, shape))  # noqa: E731
        self.tok_embd = mat("token_embd.weight", (d, vocab))
        self.output = mat("output.weight", (d, vocab)) if "output.weight" in gf.tensors else self.tok_embd
        self.output_norm = vec("output_norm.weight", (d,))
        self.v_pad = vocab + (vocab & 1)
        self.layers: list[CudaLayer] = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            wq = mat(p + "attn_q.weight", (d, self.qd))
            wk = mat(p + "attn_k.weight", (d, self.kd))
            wv = mat(p + "attn_v.weight", (d, self.kd))
            qkv = [backend.concat(p + "attn_qkv", [wq, wk, wv])] if wq.qtype == wk.qtype == wv.qtype else [wq, wk, wv]
            self.layers.append(CudaLayer(
                vec(p + "attn_norm.weight", (d,)), qkv, mat(p + "attn_output.weight", (self.qd, d)),
                vec(p + "ffn_norm.weight", (d,)), mat(p + "ffn_gate.weight", (d, cfg.ffn_dim)),
                mat(p + "ffn_up.weight", (d, cfg.ffn_dim)), mat(p + "ffn_down.weight", (cfg.ffn_dim, d))))
        self.scale = 1.0 / math.sqrt(hd)
        self._compile()
        self._rope_n = 0
        self.rcos = self.rsin = None
        self._dense_ok = self._dense_size() <= DENSE_CACHE_BYTES
        self._last_logits: cp.ndarray | None = None
        self._blas = cp.cuda.device.get_cublas_handle()
        self._one = np.ones(1, np.float32)
        self._zero = np.zeros(1, np.float32)
        self._one_p, self._zero_p = self._one.ctypes.data, self._zero.ctypes.data

    # ---- load-time helpers -----------------------------------------------------

    @staticmethod
    def _wpp(nb: int, output: bool) -> int:
        """Warps per row pair: 4 for the layer matrices at small batches (latency: more
        loads in flight per row), 1 for the output matrix (wide enough to fill the GPU)
        and for 16-row batch blocks (throughput: no idle lanes for k = 576)."""
        return 1 if output or nb >= 16 else 4

    def _gemv_name(self, ta: int, tb: int, nb: int, mode: int, output: bool = False) -> str:
        return f"gemv<{ta},{tb},{nb},{mode},{self._wpp(nb, output)}>"

    def _compile(self) -> None:
        names = {"argmax_rows", "gather_rows", "rms_norm", "rope_rows", "kv_write", "causal_softmax", "silu_mul",
                 f"attn_decode<{self.cfg.head_dim}>", f"embed<{self.tok_embd.qtype}>"}
        mats = [self.output, self.tok_embd]
        for L in self.layers:
            mats += L.qkv + [L.wo, L.w_gate, L.w_up, L.w_down]
            for nb in NB_CHOICES:
                for w in L.qkv:
                    names.add(self._gemv_name(w.qtype, w.qtype, nb, S.MODE_QKV))
                names.add(self._gemv_name(L.wo.qtype, L.wo.qtype, nb, S.MODE_ADD))
                names.add(self._gemv_name(L.w_down.qtype, L.w_down.qtype, nb, S.MODE_ADD))
                names.add(self._gemv_name(L.w_gate.qtype, L.w_up.qtype, nb, S.MODE_SWIGLU))
        for nb in NB_CHOICES:
            names.add(self._gemv_name(self.output.qtype, self.output.qtype, nb, S.MODE_STORE, True))
        for w in mats:
            names.add(f"dequant<{w.qtype}>")
        self.k = self.backend.module(sorted(names))
        self.ks = cp.RawModule(code=CS.SRC, options=NVRTC_OPTIONS).get_function("sample_rows")

    def _dense_size(self) -> int:
        return sum(4 * w.m * w.k for L in self.layers for w in L.qkv + [L.wo, L.w_gate, L.w_up, L.w_down])

    def _dense(self, w: DevMatrix) -> cp.ndarray:
        if w.dense is not None:
            return w.dense
        out = self.backend.dequantize(self.k[f"dequant<{w.qtype}>"], w)
        if self._dense_ok:
            w.dense = out
            self.backend.dense_bytes += int(out.nbytes)
        return out

    def _layer_dense(self, L: CudaLayer) -> tuple[cp.ndarray, cp.ndarray]:
        if L.d_qkv is not None:
            return L.d_qkv, L.d_gu
        qkv = cp.concatenate([self.backend.dequantize(self.k[f"dequant<{w.qtype}>"], w) for w in L.qkv])
        gu = cp.concatenate([self.backend.dequantize(self.k[f"dequant<{w.qtype}>"], w) for w in (L.w_gate, L.w_up)])
        if self._dense_ok:
            L.d_qkv, L.d_gu = qkv, gu
            self.backend.dense_bytes += int(qkv.nbytes + gu.nbytes)
        return qkv, gu

    # ---- public interface ------------------------------------------------------

    @property
    def weight_bytes(self) -> int:
        """Bytes of the quantized weights on the device (dense prefill copies not counted)."""
        return self.backend.weight_bytes

    @property
    def prefill_weight_bytes(self) -> int:
        """Bytes of the float32 weight copies the eager (prefill) path keeps on the device."""
        return self._dense_size() if self._dense_ok else 0

    def kv_cache_bytes(self, n_slots: int, n_ctx: int) -> int:
        """Bytes ``new_kv_cache(n_slots, n_ctx)`` allocates for K and V."""
        return CudaKVCache.nbytes(self.cfg, n_slots, n_ctx)

    def new_kv_cache(self, n_slots: int, n_ctx: int) -> CudaKVCache:
        """Allocate (zeroed) KV for ``n_slots`` slots of ``n_ctx`` tokens, and the RoPE tables."""
        if n_ctx > self._rope_n:
            c, s = rope_tables(n_ctx, self.cfg.rope_dim, self.cfg.rope_base, self.cfg.rope_scale)
            self.rcos, self.rsin = cp.asarray(c), cp.asarray(s)
            self._rope_n = n_ctx
        return CudaKVCache(self, n_slots, n_ctx)

    def last_logits(self) -> cp.ndarray | None:
        """Device float32 (rows, vocab) logits of the last forward or greedy call."""
        return self._last_logits

    def forward(self, tokens: np.ndarray, segments: list, kv: CudaKVCache,
                embeds: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """Run one batch (see LlamaModel.forward, ``embeds`` included: image rows go
        through the eager path); returns host float32 (R, vocab)."""
        if embeds is None and self._graph_ok(tokens, segments, kv):
            self._replay(tokens, segments, kv, None, 0, want_ids=False)
            return self._last_logits.get()
        lg = self._eager(tokens, segments, kv, embeds)
        return lg.get() if lg is not None else np.empty((0, self.cfg.vocab_size), np.float32)

    def greedy(self, tokens: np.ndarray, segments: list, kv: CudaKVCache) -> np.ndarray:
        """Like ``forward`` but returns only the argmax token id of each logits row,
        int32 (R,), computed on the device (the logits stay in ``last_logits()``)."""
        return self.sample(tokens, segments, kv, None)

    def sample(self, tokens: np.ndarray, segments: list, kv: CudaKVCache, rows: list | None,
               tick: int = 0) -> np.ndarray:
        """Run one batch and pick each logits row's next token on the device.

        rows: one ``(SamplerConfig, SamplerState, extra_history)`` per logits row (in
        ``forward``'s order; each must pass ``cuda_sampling.device_ok``), or None for
        greedy without penalty everywhere. ``extra_history``: tokens accepted before
        this row within the same batch (a greedy verify window). The states are not
        advanced here: the caller mirrors the draws (``step`` += 1 per sampled row) and
        the history. Returns int32 (R,) ids; the penalized logits stay in
        ``last_logits()``. Raises RuntimeError when a publication record does not
        belong to this tick (the device tables are inconsistent)."""
        if self._graph_ok(tokens, segments, kv):
            return self._replay(tokens, segments, kv, rows, tick, want_ids=True)
        lg = self._eager(tokens, segments, kv)
        if lg is None:
            return np.empty(0, np.int32)
        R = lg.shape[0]
        prm = np.zeros((R, CS.P_WORDS), np.int32)
        hist = np.zeros((R, CS.H_MAX), np.int32)
        self._fill(prm, hist, rows, list(range(R)), tick)
        ids = cp.empty(R, cp.int32)
        rec = cp.empty((R, CS.REC_WORDS), cp.int32)
        meta = cp.asarray(self._eager_out_meta)
        self.ks((R,), (1024,), (lg, np.int32(self.v_pad), np.int32(self.cfg.vocab_size), cp.asarray(prm),
                                cp.asarray(hist), meta[0], meta[1], _u64(0), ids, rec))
        return ids.get()

    @staticmethod
    def _fill(prm: np.ndarray, hist: np.ndarray, rows: list | None, out: list[int], tick: int) -> bool:
        """Write the sampler table rows ``out`` (one per logits row; the other rows of
        ``prm`` must already be zero, i.e. skipped); True when a penalty history is used."""
        if rows is None:
            prm[out, 0] = CS.MODE_GREEDY
            prm[out, 3] = tick & 0x7FFFFFFF
            prm[out, 4] = np.float32(1.0).view(np.int32)
            return False
        if len(rows) != len(out):
            raise ValueError(f"{len(rows)} sampler rows for {len(out)} logits rows")
        need = False
        for j, (cfg, st, extra) in zip(out, rows):
            need |= CS.fill_row(prm[j], hist[j], cfg, st, tick, extra)
        return need

    # ---- graph path ------------------------------------------------------------

    @staticmethod
    def _graph_ok(tokens: np.ndarray, segments: list, kv: CudaKVCache) -> bool:
        if not segments or int(tokens.shape[0]) > kv.b_max:
            return False
        seen = set()
        for s in segments:
            if s.slot in seen:
                return False
            seen.add(s.slot)
        return True

    def _replay(self, tokens: np.ndarray, segments: list, kv: CudaKVCache, rows: list | None, tick: int,
                want_ids: bool):
        """Replay the graph of the smallest bucket holding the batch. rows, tick: as
        ``sample``; without ``want_ids`` (``forward``) only the logits are wanted."""
        n = int(tokens.shape[0])
        b = 1
        while b < n:
            b *= 2
        t = kv.tab_np
        t[0, :n] = tokens[:n]
        out = BatchLayout.of(segments).write_rows(t[1], t[2])
        t[0, n:b] = 0
        t[1, n:b] = kv.n_slots
        t[2, n:b] = 0
        R = len(out)
        r = 1
        while r < R:
            r *= 2
        t[3, :R] = out
        t[3, R:] = 0
        prm = kv.prm_np
        prm[:r] = 0
        need_hist = False
        if want_ids and R:
            need_hist = self._fill(prm, kv.hist_np, rows, list(range(R)), tick)
        g = kv.graphs.get((b, r))
        if g is None:
            g = kv.graphs[(b, r)] = self._capture(kv, b, r)
        st = kv.stream
        H2D, D2H = cp.cuda.runtime.memcpyHostToDevice, cp.cuda.runtime.memcpyDeviceToHost
        cp.cuda.runtime.memcpyAsync(kv.tab.data.ptr, t.ctypes.data, t.nbytes, H2D, st.ptr)
        cp.cuda.runtime.memcpyAsync(kv.prm.data.ptr, prm.ctypes.data, 4 * CS.P_WORDS * r, H2D, st.ptr)
        if need_hist:
            cp.cuda.runtime.memcpyAsync(kv.hist.data.ptr, kv.hist_np.ctypes.data, 4 * CS.H_MAX * r, H2D, st.ptr)
        g.launch(st)
        if want_ids:
            cp.cuda.runtime.memcpyAsync(kv.rec_np.ctypes.data, kv.rec.data.ptr, 4 * CS.REC_WORDS * R, D2H, st.ptr)
        st.synchronize()  # before anything on another stream reads the graph's output
        self._last_logits = kv.logits[:R, :self.cfg.vocab_size]
        if want_ids:
            rec = kv.rec_np[:R]
            if R and (rec[:, 0] != (tick & 0x7FFFFFFF)).any():
                raise RuntimeError(f"publication records of tick {int(rec[0, 0])} where tick {tick} was expected")
            return rec[:, 3].copy()
        return None

    def _capture(self, kv: CudaKVCache, b: int, r: int):
        """Capture the graph of ``b`` batch rows with ``r`` logits rows."""
        st = kv.stream
        with st:
            # a plain run first (loads every kernel), on padding rows only: the scratch slot
            kv.tab[0].fill(0)
            kv.tab[1].fill(kv.n_slots)
            kv.tab[2].fill(0)
            kv.tab[3].fill(0)
            kv.prm.fill(0)
            self._decode_launches(kv, b, r)
            st.synchronize()
            st.begin_capture()
            self._decode_launches(kv, b, r)
            g = st.end_capture()
        g.upload(st)
        return g

    def _gemv(self, mode: int, wa: DevMatrix, wb: DevMatrix | None, x, ldx: int, B: int, nw, y, ldy: int,
              kv: CudaKVCache | None = None, layer: int = 0, row_base: int = 0, tab=None) -> None:
        """Launch gemv<Ta,Tb,NB,mode>. tab: (slot_ptr, pos_ptr) for MODE_QKV."""
        cfg = self.cfg
        nb = _nb(B)
        if mode == S.MODE_SWIGLU:
            n_pairs, a_stride, b_off = wa.m, 1, 0
        else:
            wb, n_pairs, a_stride, b_off = wa, (wa.m + 1) // 2, 2, 1
        out = wa is self.output
        wpp = self._wpp(nb, out)
        kern = self.k[self._gemv_name(wa.qtype, wb.qtype, nb, mode, out)]
        if mode == S.MODE_QKV:
            kc = kv.k.data.ptr + layer * kv.layer_bytes
            vc = kv.v.data.ptr + layer * kv.layer_bytes
            slot_p, pos_p = tab
            extra = (np.int32(row_base), np.int32(self.qd), np.int32(self.kd), np.int32(cfg.head_dim),
                     np.int32(cfg.rope_dim // 2), np.int32(cfg.n_kv_heads), np.int32(kv.n_ctx),
                     _u64(slot_p), _u64(pos_p), _u64(self.rcos), _u64(self.rsin), _u64(kc), _u64(vc))
        else:
            z = np.int32(0)
            extra = (z, z, z, z, z, z, z, _u64(0), _u64(0), _u64(0), _u64(0), _u64(0), _u64(0))
        ppb = GEMV_WARPS // wpp
        grid = ((n_pairs + ppb - 1) // ppb, (B + nb - 1) // nb)
        kern(grid, (GEMV_WARPS * 32,),
             (_u64(wa.data), _u64(wb.data), np.int64(wa.row_bytes), np.int64(wb.row_bytes), np.int32(a_stride),
              np.int32(b_off), np.int32(n_pairs), np.int32(wa.k), _u64(x), np.int32(ldx), np.int32(B), _u64(nw),
              np.float32(cfg.norm_eps), _u64(y), np.int32(ldy)) + extra)

    def _attn_decode(self, kv: CudaKVCache, layer: int, q, ldq: int, B: int, slot_p: int, pos_p: int, out,
                     ldo: int) -> None:
        cfg = self.cfg
        self.k[f"attn_decode<{cfg.head_dim}>"](
            (ATT_NSMAX, cfg.n_heads, B), (128,),
            (_u64(q), np.int32(ldq), _u64(kv.k.data.ptr + layer * kv.layer_bytes),
             _u64(kv.v.data.ptr + layer * kv.layer_bytes), _u64(slot_p), _u64(pos_p), np.int32(cfg.n_heads),
             np.int32(cfg.n_kv_heads), np.int32(kv.n_ctx), np.float32(self.scale), _u64(kv.part),
             _u64(kv.counters), _u64(out), np.int32(ldo), np.int32(ATT_NSMAX), np.int32(ATT_MINCHUNK)))

    def _qkv(self, L: CudaLayer, kv, li: int, x, ldx: int, B: int, q, tab) -> None:
        base = 0
        for w in L.qkv:
            self._gemv(S.MODE_QKV, w, None, x, ldx, B, L.attn_norm, q, self.qd, kv, li, base, tab)
            base += w.m

    def _decode_launches(self, kv: CudaKVCache, B: int, R: int | None = None) -> None:
        """The launches of one graph replay: ``B`` batch rows, ``R`` (default B) logits rows
        gathered by the table's output-row indices."""
        R = B if R is None else R
        cfg = self.cfg
        d, f = cfg.d_model, cfg.ffn_dim
        tok_p = kv.tab.data.ptr
        slot_p, pos_p = tok_p + 4 * kv.b_max, tok_p + 8 * kv.b_max
        nu = d // 8
        self.k[f"embed<{self.tok_embd.qtype}>"](((nu + 127) // 128, B), (128,),
                                                 (_u64(self.tok_embd.data), np.int64(self.tok_embd.row_bytes),
                                                  _u64(tok_p), np.int32(d), _u64(kv.x), np.int32(d)))
        for li, L in enumerate(self.layers):
            self._qkv(L, kv, li, kv.x, d, B, kv.q, (slot_p, pos_p))
            self._attn_decode(kv, li, kv.q, self.qd, B, slot_p, pos_p, kv.att, self.qd)
            self._gemv(S.MODE_ADD, L.wo, None, kv.att, self.qd, B, None, kv.x, d)
            self._gemv(S.MODE_SWIGLU, L.w_gate, L.w_up, kv.x, d, B, L.ffn_norm, kv.g, f)
            self._gemv(S.MODE_ADD, L.w_down, None, kv.g, f, B, None, kv.x, d)
        out_p = tok_p + 12 * kv.b_max
        self.k["gather_rows"]((R,), (128,), (_u64(kv.x), np.int32(d), _u64(out_p), _u64(kv.xo)))
        self._gemv(S.MODE_STORE, self.output, None, kv.xo, d, R, self.output_norm, kv.logits, self.v_pad)
        self.ks((R,), (1024,), (_u64(kv.logits), np.int32(self.v_pad), np.int32(cfg.vocab_size), _u64(kv.prm),
                                _u64(kv.hist), _u64(slot_p), _u64(pos_p), _u64(out_p), _u64(kv.ids), _u64(kv.rec)))

    # ---- eager path (prefill, mixed batches) -----------------------------------

    def _sgemm(self, X, k: int, W, Y, m: int, N: int, beta: float) -> None:
        """Y (N, m) = X (N, k) @ W (m, k).T + beta * Y, row-major float32, through cuBLAS
        (column-major: Y.T = W.T.T @ X.T)."""
        cublas.sgemm(self._blas, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, m, N, k, self._one_p,
                     W.data.ptr, k, X.data.ptr, k, self._one_p if beta else self._zero_p, Y.data.ptr, m)

    def _eager(self, tokens: np.ndarray, segments: list, kv: CudaKVCache,
               embeds: tuple[np.ndarray, np.ndarray] | None = None) -> cp.ndarray | None:
        cfg = self.cfg
        k = self.k
        N = int(tokens.shape[0])
        d, f, hd = cfg.d_model, cfg.ffn_dim, cfg.head_dim
        H, KV = cfg.n_heads, cfg.n_kv_heads
        G = H // KV
        qd, kd = self.qd, self.kd
        meta = np.empty((3, N), np.int32)
        meta[0] = tokens
        if embeds is not None:
            meta[0, embeds[0]] = 0  # placeholder ids lie past the vocabulary; their rows are replaced below
        out_rows = BatchLayout.of(segments).write_rows(meta[1], meta[2])
        dec_rows: list[int] = []
        row = 0
        for s in segments:
            if s.n == 1:
                dec_rows.append(row)
            row += s.n
        m_dev = cp.asarray(meta)
        tok_p, slot_p, pos_p = m_dev.data.ptr, m_dev.data.ptr + 4 * N, m_dev.data.ptr + 8 * N
        x = cp.empty((N, d), cp.float32)
        h = cp.empty((N, d), cp.float32)
        nu = d // 8
        k[f"embed<{self.tok_embd.qtype}>"](((nu + 127) // 128, N), (128,),
                                            (_u64(self.tok_embd.data), np.int64(self.tok_embd.row_bytes),
                                             _u64(tok_p), np.int32(d), _u64(x), np.int32(d)))
        if embeds is not None:
            x[cp.asarray(embeds[0])] = cp.asarray(embeds[1], dtype=cp.float32)
        w_qkv = qd + 2 * kd
        qkv = cp.empty((N, w_qkv), cp.float32)
        att = cp.empty((N, qd), cp.float32)
        g = cp.empty((N, f), cp.float32)
        gu = cp.empty((N, 2 * f), cp.float32)
        cublas.setStream(self._blas, cp.cuda.get_current_stream().ptr)
        cublas.setPointerMode(self._blas, cublas.CUBLAS_POINTER_MODE_HOST)
        if dec_rows:
            assert len(dec_rows) <= kv.b_max, "more single-token rows than the cache has slots"
            dr = cp.asarray(np.asarray(dec_rows, np.int32))
            dmeta = cp.asarray(meta[1:, dec_rows].copy())
            d_slot, d_pos = dmeta.data.ptr, dmeta.data.ptr + 4 * len(dec_rows)
            qdec = cp.empty((len(dec_rows), qd), cp.float32)
            odec = cp.empty((len(dec_rows), qd), cp.float32)
        nt = 256
        for li, L in enumerate(self.layers):
            d_qkv, d_gu = self._layer_dense(L)
            k["rms_norm"]((N,), (256,), (x, L.attn_norm, np.float32(cfg.norm_eps), np.int32(d), h))
            self._sgemm(h, d, d_qkv, qkv, w_qkv, N, 0.0)
            half = cfg.rope_dim // 2
            n_el = N * (H + KV) * half          # q heads then k heads: contiguous columns
            k["rope_rows"](((n_el + nt - 1) // nt,), (nt,),
                           (qkv, np.int32(w_qkv), np.int32(0), np.int32(N), np.int32(H + KV), np.int32(hd),
                            np.int32(half), _u64(pos_p), self.rcos, self.rsin))
            kc = kv.k[li]
            vc = kv.v[li]
            n_el = N * kd
            k["kv_write"](((n_el + nt - 1) // nt,), (nt,),
                          (qkv, np.int32(w_qkv), np.int32(qd), np.int32(qd + kd), np.int32(N), np.int32(KV),
                           np.int32(hd), np.int32(kv.n_ctx), _u64(slot_p), _u64(pos_p), kc, vc))
            if dec_rows:
                cp.take(qkv[:, :qd], dr, axis=0, out=qdec)
                self._attn_decode(kv, li, qdec, qd, len(dec_rows), d_slot, d_pos, odec, qd)
                att[dr] = odec
            row = 0
            for s in segments:
                n = s.n
                if n > 1:
                    T_ = s.pos + n
                    qs = qkv[row:row + n, :qd].reshape(n, KV, G, hd).transpose(1, 2, 0, 3).reshape(KV, G * n, hd)
                    sc = cp.matmul(qs, kc[s.slot, :, :T_, :].transpose(0, 2, 1))
                    k["causal_softmax"]((KV * G * n,), (256,),
                                        (sc, np.int32(T_), np.int32(n), np.int32(s.pos), np.float32(self.scale)))
                    o = cp.matmul(sc, vc[s.slot, :, :T_, :])
                    att[row:row + n] = o.reshape(KV, G, n, hd).transpose(2, 0, 1, 3).reshape(n, qd)
                row += n
            self._sgemm(att, qd, self._dense(L.wo), x, d, N, 1.0)     # x += att @ Wo.T
            k["rms_norm"]((N,), (256,), (x, L.ffn_norm, np.float32(cfg.norm_eps), np.int32(d), h))
            self._sgemm(h, d, d_gu, gu, 2 * f, N, 0.0)
            n_el = N * f
            k["silu_mul"](((n_el + nt - 1) // nt,), (nt,), (gu, np.int32(N), np.int32(f), g))
            self._sgemm(g, f, self._dense(L.w_down), x, d, N, 1.0)     # x += g @ Wdown.T
        self._eager_out_meta = np.ascontiguousarray(meta[1:, out_rows])
        if not out_rows:
            self._last_logits = None
            cp.cuda.get_current_stream().synchronize()  # the decode graph's stream does not wait on this one
            return None
        R = len(out_rows)
        xo = x[cp.asarray(np.asarray(out_rows, np.int64))] if R != N else x
        xo = cp.ascontiguousarray(xo)
        logits = cp.empty((R, self.v_pad), cp.float32)
        self._gemv(S.MODE_STORE, self.output, None, xo, d, R, self.output_norm, logits, self.v_pad)
        self._last_logits = logits[:, :cfg.vocab_size]
        return self._last_logits


def build(cfg: ModelConfig, gf, backend: CudaBackend) -> CudaLlamaModel:
    """Load a llama model onto the CUDA backend. Raises ModelError naming a missing,
    mis-shaped or unsupported tensor."""
    return CudaLlamaModel(cfg, gf, backend)
