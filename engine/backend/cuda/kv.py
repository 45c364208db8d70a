"""The CUDA backend's KV cache: K and V of every layer for every slot, float16 or float32.

Owns: per layer ``(n_slots + 1, n_kv, n_ctx, hd)`` K and V (the extra slot is the scratch
slot that padding rows of a graph replay write into), all layers in one allocation per
tensor, in the cache's ``kv_type`` ("f16", the default, or "f32"); the stream the decode
graph replays on; and the interface the runtime and the capsules use: ``clear``
(speculative rollback), ``slot_shape``, ``snapshot_slot`` / ``restore_slot`` (capsules;
byte-exact, same dtype; ``snapshot_slot(device=True)`` keeps the copy on the GPU: the
device home) and ``copy_slot`` (a fork on the device).
Leaves the device tables (rows, sampler, penalty history, publication records) to
``tables.py`` and the activation buffers and graphs to ``program.py``.

Not thread-safe: one engine thread drives it. Every method runs on ``self.stream`` and
waits for it, so nothing else is in flight when it returns.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

KV_TYPES = ("f16", "f32")
KV_DTYPE = {"f16": np.float16, "f32": np.float32}


def check_kv_type(kv_type: str) -> str:
    """``kv_type`` itself, or ValueError naming the accepted types."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"KV cache type {kv_type!r} is not supported (use f16 or f32)")
    return kv_type


class CudaKVCache:
    """KV for ``n_slots`` slots of ``n_ctx`` tokens on the device. ``k``, ``v``: (n_layers,
    n_slots + 1, n_kv, n_ctx, hd) of float16 or float32; ``layer_bytes``: bytes of one
    layer of one of them (kernels address layer ``l`` at ``k.data.ptr + l * layer_bytes``)."""

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, n_slots: int, n_ctx: int, kv_type: str = "f16"):
        self.kv_type = check_kv_type(kv_type)
        self.kvt = 1 if self.kv_type == "f16" else 0     # the kernels' KVT template argument
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        self.scratch_slot = n_slots
        shape = (n_layers, n_slots + 1, n_kv, n_ctx, head_dim)
        dt = KV_DTYPE[self.kv_type]
        self.k = cp.zeros(shape, dt)
        self.v = cp.zeros(shape, dt)
        self.layer_bytes = int(self.k[0].nbytes)
        self.stream = cp.cuda.Stream(non_blocking=True)
        cp.cuda.get_current_stream().synchronize()   # the zeros are done before the stream's first use

    @staticmethod
    def nbytes(n_layers: int, n_kv: int, head_dim: int, n_slots: int, n_ctx: int, kv_type: str = "f16") -> int:
        """Bytes of K and V for ``n_slots`` slots (plus the scratch slot) of ``n_ctx`` tokens."""
        item = np.dtype(KV_DTYPE[check_kv_type(kv_type)]).itemsize
        return 2 * n_layers * (n_slots + 1) * n_kv * n_ctx * head_dim * item

    def layer_ptrs(self, layer: int) -> tuple[int, int]:
        """Device addresses of layer ``layer``'s K and V."""
        off = layer * self.layer_bytes
        return self.k.data.ptr + off, self.v.data.ptr + off

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the cache and of what ``snapshot_slot`` returns."""
        return np.dtype(KV_DTYPE[self.kv_type])

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
        draft tokens)."""
        self._check_slot(slot)
        with self.stream:
            self.k[:, slot, :, start:stop, :] = 0
            self.v[:, slot, :, start:stop, :] = 0
        self.stream.synchronize()

    def snapshot_slot(self, slot: int, n: int, device: bool = False):
        """Copies of ``slot``'s K and V for positions 0..n-1, (n_layers, n_kv_heads, n,
        head_dim) in the cache's dtype: host numpy arrays (capsule snapshot), or with
        ``device=True`` CuPy arrays beside the live cache (a device home)."""
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
        returns them, in this cache's dtype) into ``slot``; byte-exact. Raises ValueError
        for another dtype (a capsule of an f32 cache into an f16 one, say)."""
        self._check_slot(slot)
        if np.dtype(k.dtype) != self.dtype or np.dtype(v.dtype) != self.dtype:
            raise ValueError(f"KV of dtype {np.dtype(k.dtype).name} cannot restore into an {self.kv_type} cache")
        with self.stream:
            self.k[:, slot, :, :n, :] = cp.asarray(k[:, :, :n, :])
            self.v[:, slot, :, :n, :] = cp.asarray(v[:, :, :n, :])
        self.stream.synchronize()
