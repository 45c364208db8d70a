"""The CUDA backend's KV cache: K and V of every layer for every slot, float16, float32 or
llama.cpp's q8_0 / q4_0 blocks.

Owns: per layer ``(n_slots + 1, n_kv, n_ctx, width)`` K and V (the extra slot is the scratch
slot that padding rows of a graph replay write into), all layers in one allocation per
tensor, in the cache's ``kv_type`` ("f16", the default, "f32", or "q8_0" / "q4_0": rows of
blocks, ``width`` their bytes, in ``engine/backend/kvformat.py``'s layout, rotated as it
says: the kernels of ``kernels/kv_quant.cu``); the stream the decode
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
from aotx.engine.backend import kvformat

KV_TYPES = ("f16", "f32", "q8_0", "q4_0")
KV_DTYPE = {"f16": np.float16, "f32": np.float32, "q8_0": np.uint8, "q4_0": np.uint8}
KVT = {"f32": 0, "f16": 1, "q8_0": 2, "q4_0": 3}   # the kernels' KVT template argument


def check_kv_type(kv_type: str) -> str:
    """``kv_type`` itself, or ValueError naming the accepted types."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"KV cache type {kv_type!r} is not supported (use {', '.join(KV_TYPES)})")
    return kv_type


def row_width(kv_type: str, head_dim: int) -> int:
    """The last axis of a ``kv_type`` cache: head_dim values, or a quantized row's bytes
    (ValueError when head_dim is not a multiple of 32)."""
    return kvformat.row_bytes(kv_type, head_dim) if kv_type in kvformat.QUANT_TYPES else head_dim


class CudaKVCache:
    """KV for ``n_slots`` slots of ``n_ctx`` tokens on the device. ``k``, ``v``: (n_layers,
    n_slots + 1, n_kv, n_ctx, hd) of float16 or float32; ``layer_bytes``: bytes of one
    layer of one of them (kernels address layer ``l`` at ``k.data.ptr + l * layer_bytes``).
    ``state``: a hybrid program's recurrent state (``recurrent.CudaRecurrentState``), else None."""

    state = None

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, n_slots: int, n_ctx: int, kv_type: str = "f16"):
        self.kv_type = check_kv_type(kv_type)
        self.kvt = KVT[self.kv_type]                     # the kernels' KVT template argument
        self.quant = self.kv_type in kvformat.QUANT_TYPES
        self.head_dim = head_dim
        self.row_width = row_width(self.kv_type, head_dim)
        # a quantized cache's rotation (kvformat.rotation_sizes): (K's block, 1/sqrt, V's
        # block, 1/sqrt) as the kernels take them; zeros: none
        sizes = kvformat.rotation_sizes(head_dim) if self.quant else None
        self.rot = (0, np.float32(0), 0, np.float32(0)) if sizes is None else (
            sizes[0], np.float32(1 / np.sqrt(sizes[0])), sizes[1], np.float32(1 / np.sqrt(sizes[1])))
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        self.scratch_slot = n_slots
        shape = (n_layers, n_slots + 1, n_kv, n_ctx, self.row_width)
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
        return 2 * n_layers * (n_slots + 1) * n_kv * n_ctx * row_width(kv_type, head_dim) * item

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
        L, _, kvh, n_ctx, _ = self.k.shape
        return (L, kvh, n_ctx, self.head_dim)

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
        row_width) in the cache's dtype: host numpy arrays (capsule snapshot), or with
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
        if np.dtype(k.dtype) != self.dtype or np.dtype(v.dtype) != self.dtype or k.shape[-1] != self.row_width:
            raise ValueError(f"KV of dtype {np.dtype(k.dtype).name} and rows of {k.shape[-1]} cannot restore into a "
                             f"{self.kv_type} cache (rows of {self.row_width})")
        with self.stream:
            self.k[:, slot, :, :n, :] = cp.asarray(k[:, :, :n, :])
            self.v[:, slot, :, :n, :] = cp.asarray(v[:, :, :n, :])
        self.stream.synchronize()
