"""The llama architecture: token embedding, N pre-norm blocks, output head.

Each block (Touvron et al. 2023, "LLaMA"):
    h = x + Wo . attention(rope(Wq . rmsnorm(x)), rope(Wk . rmsnorm(x)), Wv . rmsnorm(x))
    x' = h + Wdown . (silu(Wgate . rmsnorm(h)) * Wup . rmsnorm(h))
with grouped-query attention over each slot's KV cache. Tensor names and
shapes follow llama.cpp's GGUF convention (``blk.{i}.attn_q.weight`` ...,
ggml shape ``[in, out]``); Q and K weights arrive permuted for ggml's
adjacent-pair RoPE. ``output.weight`` is optional (tied to ``token_embd``).

This module owns the order of operations and the tensor checks; the ops
themselves come from the backend. It does not know about slots' owners,
sampling or scheduling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from aotx.engine.errors import ModelError
from aotx.engine.model.batch import SMALL_SEGMENT, Segment  # noqa: F401 (re-exported)
from aotx.engine.model.config import ModelConfig

@dataclass
class Layer:
    attn_norm: np.ndarray
    wq: object
    wk: object
    wv: object
    wo: object
    ffn_norm: np.ndarray
    w_gate: object
    w_up: object
    w_down: object


class KVCache:
    """Per layer K and V: ``(n_slots, n_kv_heads, n_ctx, head_dim) float32``.

    ``nbytes(cfg, n_slots, n_ctx)`` gives the size before allocating."""

    def __init__(self, cfg: ModelConfig, n_slots: int, n_ctx: int):
        shape = (n_slots, cfg.n_kv_heads, n_ctx, cfg.head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(cfg.n_layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(cfg.n_layers)]
        self.n_slots = n_slots
        self.n_ctx = n_ctx

    def clear(self, slot: int, start: int, stop: int) -> None:
        """Zero positions start..stop-1 of ``slot`` in every layer (rollback of
        rejected draft tokens: the live buffers never keep a rejected token)."""
        for layer in self.k:
            layer[slot, :, start:stop, :] = 0.0
        for layer in self.v:
            layer[slot, :, start:stop, :] = 0.0

    @property
    def slot_shape(self) -> tuple[int, int, int, int]:
        """One slot's KV layout: (n_layers, n_kv_heads, n_ctx, head_dim)."""
        return (len(self.k),) + tuple(self.k[0].shape[1:])

    def snapshot_slot(self, slot: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of ``slot``'s K and V for positions 0..n-1: two
        (n_layers, n_kv_heads, n, head_dim) float32 arrays (capsule snapshot)."""
        return (np.stack([layer[slot, :, :n, :] for layer in self.k]),
                np.stack([layer[slot, :, :n, :] for layer in self.v]))

    def restore_slot(self, slot: int, k: np.ndarray, v: np.ndarray, n: int) -> None:
        """Copy positions 0..n-1 of ``k``, ``v`` (as ``snapshot_slot`` returns them) into
        ``slot`` (capsule restore; byte-exact)."""
        for li in range(len(self.k)):
            self.k[li][slot, :, :n, :] = k[li, :, :n, :]
            self.v[li][slot, :, :n, :] = v[li, :, :n, :]

    @staticmethod
    def nbytes(cfg: ModelConfig, n_slots: int, n_ctx: int) -> int:
        return 2 * cfg.n_layers * n_slots * cfg.n_kv_heads * n_ctx * cfg.head_dim * 4


def _check(gf, name: str, shape: tuple[int, ...]):
    t = gf.tensors.get(name)
    if t is None:
        raise ModelError(f"{gf.path}: tensor {name!r} is missing")
    if tuple(t.shape) != tuple(shape):
        raise ModelError(f"{gf.path}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
    return t


def _load(gf, name: str, shape: tuple[int, ...], put):
    """Check tensor ``name`` and hand it to the backend (``put``: ``matrix`` or
    ``vector``). The backend's ValueErrors (an unsupported tensor type, rows that do
    not match) become ModelError naming the file and the tensor."""
    t = _check(gf, name, shape)
    try:
        return put(t)
    except ModelError:
        raise
    except ValueError as e:
        msg = str(e)
        raise ModelError(f"{gf.path}: {msg if name in msg else f'tensor {name!r}: {msg}'}") from None


class LlamaModel:
    """A loaded llama model on a backend. ``forward`` runs one batch of segments."""

    device_sampling = False  # no sample()/greedy(): the host samples from forward()'s logits (SEAMS.md)

    def __init__(self, cfg: ModelConfig, gf, backend):
        self.cfg = cfg
        self.backend = backend
        d, hd = cfg.d_model, cfg.head_dim
        q_out, kv_out = cfg.n_heads * hd, cfg.n_kv_heads * hd
        vocab = cfg.vocab_size

        def mat(name: str, shape: tuple[int, ...]):
            return _load(gf, name, shape, backend.matrix)

        def vec(name: str, shape: tuple[int, ...]):
            return _load(gf, name, shape, backend.vector)

        self.tok_embd = mat("token_embd.weight", (d, vocab))
        out_t = gf.tensors.get("output.weight")
        self.output = mat("output.weight", (d, vocab)) if out_t is not None else self.tok_embd
        self.output_norm = vec("output_norm.weight", (d,))
        self.layers: list[Layer] = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            self.layers.append(Layer(
                attn_norm=vec(p + "attn_norm.weight", (d,)),
                wq=mat(p + "attn_q.weight", (d, q_out)),
                wk=mat(p + "attn_k.weight", (d, kv_out)),
                wv=mat(p + "attn_v.weight", (d, kv_out)),
                wo=mat(p + "attn_output.weight", (q_out, d)),
                ffn_norm=vec(p + "ffn_norm.weight", (d,)),
                w_gate=mat(p + "ffn_gate.weight", (d, cfg.ffn_dim)),
                w_up=mat(p + "ffn_up.weight", (d, cfg.ffn_dim)),
                w_down=mat(p + "ffn_down.weight", (cfg.ffn_dim, d)),
            ))
        self.scale = 1.0 / math.sqrt(hd)
        self._rope_n = 0
        self.cos = self.sin = None

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights occupy in the backend's memory."""
        return self.backend.weight_bytes

    def kv_cache_bytes(self, n_slots: int, n_ctx: int) -> int:
        """Bytes ``new_kv_cache(n_slots, n_ctx)`` would allocate."""
        return KVCache.nbytes(self.cfg, n_slots, n_ctx)

    def new_kv_cache(self, n_slots: int, n_ctx: int) -> KVCache:
        """Allocate KV for ``n_slots`` slots of ``n_ctx`` tokens each (zeroed)."""
        from aotx.engine.backend.cpu_ops import rope_tables

        if n_ctx > self._rope_n:
            self.cos, self.sin = rope_tables(n_ctx, self.cfg.rope_dim, self.cfg.rope_base, self.cfg.rope_scale)
            self._rope_n = n_ctx
        return KVCache(self.cfg, n_slots, n_ctx)

    def forward(self, tokens: np.ndarray, segments: list[Segment], kv: KVCache,
                embeds: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """Run one batch: write each segment's K/V into its slot, return logits.

        tokens: (N,) int32, N = sum of segment lengths, in segment order. Returns
        (R, vocab) float32 where R counts one row per segment with ``logits`` (its
        last token) or every row of an ``all_logits`` segment, in order. Positions must lie inside
        the cache (the runtime checks context before scheduling).
        ``embeds``: ``(rows (k,) int64, values (k, d_model) float32)``: input embeddings
        that replace the token embeddings of those batch rows (image positions, whose
        ids are placeholders past the vocabulary; see runtime/media_prompt.py).
        """
        be = self.backend
        cfg = self.cfg
        N = int(tokens.shape[0])
        H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        positions = np.empty(N, np.int32)
        row = 0
        out_rows: list[int] = []
        for s in segments:
            positions[row:row + s.n] = np.arange(s.pos, s.pos + s.n, dtype=np.int32)
            if s.all_logits:
                out_rows.extend(range(row, row + s.n))
            elif s.logits:
                out_rows.append(row + s.n - 1)
            row += s.n
        # Rows of short segments (decode steps and speculative verify windows) go through
        # per-row kernels (GEMV matmuls, the decode attention kernel with a length per row),
        # so a row's numbers never depend on the rest of the batch: batched greedy equals
        # solo greedy, and a verify window equals the decode steps it replaces. Prefill
        # chunks go through BLAS.
        small_rows: list[int] = []
        small_slots: list[int] = []
        small_len: list[int] = []
        row = 0
        for s in segments:
            if s.n <= SMALL_SEGMENT:
                small_rows.extend(range(row, row + s.n))
                small_slots.extend([s.slot] * s.n)
                small_len.extend(range(s.pos + 1, s.pos + s.n + 1))
            row += s.n
        sr = np.asarray(small_rows, np.int64)
        if len(small_rows) == N:
            big = None
        else:
            mask = np.ones(N, bool)
            mask[sr] = False
            big = np.nonzero(mask)[0]
        s_slots = np.asarray(small_slots, np.int32)
        s_len = np.asarray(small_len, np.int32)
        # One-token segments (decode steps) store their K/V rows with one fancy-indexed
        # assignment per layer instead of one slice assignment per segment.
        one: list[tuple[int, int, int]] = []        # (row, slot, pos)
        multi: list[tuple[int, Segment]] = []
        row = 0
        for s in segments:
            if s.n == 1:
                one.append((row, s.slot, s.pos))
            else:
                multi.append((row, s))
            row += s.n
        one_rows, one_slots, one_pos = (np.asarray(c, np.int64) for c in zip(*one)) if one else ((),) * 3

        def mm(W, a: np.ndarray) -> np.ndarray:
            if big is None:
                return W.matmul(a, per_row=True)
            if not small_rows:
                return W.matmul(a)
            out = np.empty((a.shape[0], W.m), np.float32)
            out[sr] = W.matmul(a[sr], per_row=True)
            out[big] = W.matmul(a[big])
            return out

        if embeds is None:
            x = self.tok_embd.rows(tokens.astype(np.int64))
        else:
            ids = tokens.astype(np.int64)
            ids[embeds[0]] = 0
            x = self.tok_embd.rows(ids)
            x[embeds[0]] = embeds[1]
        h = np.empty_like(x)
        for li, L in enumerate(self.layers):
            be.rms_norm(x, L.attn_norm, cfg.norm_eps, h)
            q = mm(L.wq, h).reshape(N, H, hd)
            k = mm(L.wk, h).reshape(N, KV, hd)
            v = mm(L.wv, h).reshape(N, KV, hd)
            be.rope(q, positions, self.cos, self.sin)
            be.rope(k, positions, self.cos, self.sin)
            kc, vc = kv.k[li], kv.v[li]
            if len(one_rows):
                kc[one_slots, :, one_pos, :] = k[one_rows]
                vc[one_slots, :, one_pos, :] = v[one_rows]
            for row, s in multi:
                kc[s.slot, :, s.pos:s.pos + s.n, :] = k[row:row + s.n].transpose(1, 0, 2)
                vc[s.slot, :, s.pos:s.pos + s.n, :] = v[row:row + s.n].transpose(1, 0, 2)
            att = np.empty((N, H, hd), np.float32)
            if big is None:                          # every row is a decode / verify row, in order
                be.attention_decode(q, kc, vc, s_slots, s_len, self.scale, att)
            elif small_rows:
                od = np.empty((len(small_rows), H, hd), np.float32)
                be.attention_decode(np.ascontiguousarray(q[sr]), kc, vc, s_slots, s_len, self.scale, od)
                att[sr] = od
            row = 0
            for s in segments:
                if s.n > SMALL_SEGMENT:
                    att[row:row + s.n] = be.attention_prefill(q[row:row + s.n], kc[s.slot], vc[s.slot], s.pos,
                                                              self.scale)
                row += s.n
            o = mm(L.wo, att.reshape(N, H * hd))
            be.add(x, o)
            be.rms_norm(x, L.ffn_norm, cfg.norm_eps, h)
            g = mm(L.w_gate, h)
            u = mm(L.w_up, h)
            be.silu_mul(g, u, g)
            be.add(x, mm(L.w_down, g))
        if not out_rows:
            return np.empty((0, cfg.vocab_size), np.float32)
        xo = np.ascontiguousarray(x[out_rows])
        ho = np.empty_like(xo)
        be.rms_norm(xo, self.output_norm, cfg.norm_eps, ho)
        return self.output.matmul(ho, per_row=True)


def build(cfg: ModelConfig, gf, backend) -> LlamaModel:
    """Check the file's tensors against ``cfg`` and load them onto ``backend``.
    Raises ModelError naming a missing or mis-shaped tensor. On the CUDA backend the
    model is ``cuda_llama.CudaLlamaModel`` (same interface, kernels and graphs on the GPU)."""
    if getattr(backend, "name", "") == "cuda":
        from aotx.engine.backend.cuda_llama import CudaLlamaModel

        return CudaLlamaModel(cfg, gf, backend)
    return LlamaModel(cfg, gf, backend)
