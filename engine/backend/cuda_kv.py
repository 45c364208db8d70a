"""The CUDA backend's KV cache and the device tables of the decode graph.

Owns: per layer ``(n_slots + 1, n_kv, n_ctx, hd) float32`` K and V (the extra slot is
the scratch slot that padding rows of a graph write into), all layers in one
allocation; the decode graph's row tables (token, slot, position), the sampler table
and penalty history (``cuda_sampling``), the publication records, each with its
pinned host mirror; the graph's activation buffers; the captured graphs themselves,
keyed by (row bucket, output-row bucket).
Leaves the launches to ``cuda_llama.py``.

Rows: ``b_max`` = the slot count rounded up to a power of two, at least
``GRAPH_MIN_ROWS``: a graph replay runs up to ``b_max`` rows, which may be the
decode steps of many slots, a speculative verify window, or a short prefill (the
next turn of a conversation), all through the same captured kernels.

Same interface as ``llama.KVCache`` for the runtime: ``clear`` (speculative
rollback), ``slot_shape``, ``snapshot_slot`` / ``restore_slot`` (capsules;
``snapshot_slot(device=True)`` keeps the copy on the GPU: the device home),
``copy_slot``. Not thread-safe: one engine thread drives it.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from aotx.engine.backend import cuda_sampling as CS
from aotx.engine.model.config import ModelConfig

ATT_NSMAX = 16                 # most context splits per (row, head) in decode attention
GRAPH_MIN_ROWS = 128           # a graph replay takes at least this many rows (verify windows, short prefills)


def _pinned(shape: tuple[int, ...], dtype) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    mem = cp.cuda.alloc_pinned_memory(n)
    return np.frombuffer(mem, dtype, int(np.prod(shape))).reshape(shape)


class CudaKVCache:
    """KV for ``n_slots`` slots of ``n_ctx`` tokens on the device, plus the decode
    buffers and graphs bound to it. ``k``, ``v``: (n_layers, n_slots + 1, n_kv, n_ctx, hd)."""

    def __init__(self, model, n_slots: int, n_ctx: int):
        cfg = model.cfg
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        shape = (cfg.n_layers, n_slots + 1, cfg.n_kv_heads, n_ctx, cfg.head_dim)
        self.k = cp.zeros(shape, cp.float32)
        self.v = cp.zeros(shape, cp.float32)
        self.layer_bytes = int(self.k[0].nbytes)
        b = 1
        while b < max(n_slots, GRAPH_MIN_ROWS):
            b *= 2
        self.b_max = b
        qd = cfg.n_heads * cfg.head_dim
        # device tables (graph path), each refreshed from its pinned mirror before a replay
        self.tab = cp.zeros((4, b), cp.int32)                 # token, slot, position per row; output rows
        self.tab_np = _pinned((4, b), np.int32)
        self.prm = cp.zeros((b, CS.P_WORDS), cp.int32)        # sampler table
        self.prm_np = _pinned((b, CS.P_WORDS), np.int32)
        self.hist = cp.zeros((b, CS.H_MAX), cp.int32)         # penalty history
        self.hist_np = _pinned((b, CS.H_MAX), np.int32)
        self.ids = cp.zeros(b, cp.int32)
        self.rec = cp.zeros((b, CS.REC_WORDS), cp.int32)      # publication records
        self.rec_np = _pinned((b, CS.REC_WORDS), np.int32)
        self.x = cp.zeros((b, cfg.d_model), cp.float32)
        self.xo = cp.zeros((b, cfg.d_model), cp.float32)     # the rows whose logits are wanted
        self.q = cp.zeros((b, qd), cp.float32)
        self.att = cp.zeros((b, qd), cp.float32)
        self.g = cp.zeros((b, cfg.ffn_dim), cp.float32)
        self.logits = cp.zeros((b, model.v_pad), cp.float32)
        self.part = cp.zeros(b * cfg.n_heads * ATT_NSMAX * (cfg.head_dim + 2), cp.float32)
        self.counters = cp.zeros(b * cfg.n_heads, cp.int32)
        self.graphs: dict[int, object] = {}
        self.stream = cp.cuda.Stream(non_blocking=True)

    @staticmethod
    def nbytes(cfg: ModelConfig, n_slots: int, n_ctx: int) -> int:
        """Bytes of K and V for ``n_slots`` slots (plus the scratch slot) of ``n_ctx`` tokens."""
        return 2 * cfg.n_layers * (n_slots + 1) * cfg.n_kv_heads * n_ctx * cfg.head_dim * 4

    # ---- what the runtime and the capsules use (same interface as llama.KVCache) ----
    # Every method runs on ``self.stream`` (the decode graph's) and waits for it: the
    # model's calls return with their work finished, so nothing else is in flight.

    @property
    def slot_shape(self) -> tuple[int, int, int, int]:
        """One slot's KV layout: (n_layers, n_kv_heads, n_ctx, head_dim)."""
        L, _, kvh, n_ctx, hd = self.k.shape
        return (L, kvh, n_ctx, hd)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} out of range (the cache has {self.n_slots} slots)")

    def clear(self, slot: int, start: int, stop: int) -> None:
        """Zero positions start..stop-1 of ``slot`` in every layer (rollback of rejected
        draft tokens, as ``llama.KVCache.clear``)."""
        self._check_slot(slot)
        with self.stream:
            self.k[:, slot, :, start:stop, :] = 0
            self.v[:, slot, :, start:stop, :] = 0
        self.stream.synchronize()

    def snapshot_slot(self, slot: int, n: int, *, device: bool = False):
        """Copies of ``slot``'s K and V for positions 0..n-1, (n_layers, n_kv_heads, n,
        head_dim) float32: host numpy arrays (capsule snapshot), or with ``device=True``
        CuPy arrays beside the live cache (a device home: no PCIe round trip)."""
        self._check_slot(slot)
        with self.stream:
            k = cp.ascontiguousarray(self.k[:, slot, :, :n, :])
            v = cp.ascontiguousarray(self.v[:, slot, :, :n, :])
            if not device:
                k, v = k.get(stream=self.stream), v.get(stream=self.stream)
        self.stream.synchronize()
        return k, v

    def restore_slot(self, slot: int, k, v, n: int) -> None:
        """Copy positions 0..n-1 of ``k``, ``v`` (numpy or CuPy, as ``snapshot_slot``
        returns them) into ``slot``; byte-exact."""
        self._check_slot(slot)
        with self.stream:
            self.k[:, slot, :, :n, :] = cp.asarray(k[:, :, :n, :], cp.float32)
            self.v[:, slot, :, :n, :] = cp.asarray(v[:, :, :n, :], cp.float32)
        self.stream.synchronize()

    def copy_slot(self, src: int, dst: int, n: int) -> None:
        """Positions 0..n-1 of slot ``src`` into slot ``dst``, on the device (a fork)."""
        self._check_slot(src)
        self._check_slot(dst)
        with self.stream:
            self.k[:, dst, :, :n, :] = self.k[:, src, :, :n, :]
            self.v[:, dst, :, :n, :] = self.v[:, src, :, :n, :]
        self.stream.synchronize()


