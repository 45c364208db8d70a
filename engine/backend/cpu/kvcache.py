"""The CPU KV cache: per layer K and V of every slot, in one of four element types.

Owns ``CpuKVCache`` (allocation, clear, capsule snapshot and restore) and the KV types
(``KV_TYPES``: float16 bits, float32, and llama.cpp's q8_0 / q4_0 blocks, whose formats,
store and attention are ``kvquant.py``'s). Leaves the store and attention kernels to
``attention.py`` / ``kvquant.py`` and their calls to ``program.py``.
"""

from __future__ import annotations

import numpy as np

from aotx.engine.backend.cpu import kv_layers as cpu_kv_layers
from aotx.engine.backend.cpu import kvquant
from aotx.engine.backend.ops import Program

KV_TYPES = ("f16", "f32", "q8_0", "q4_0")
_KV_DTYPE = {"f16": np.uint16, "f32": np.float32, "q8_0": np.uint8, "q4_0": np.uint8}


def check_kv_type(kv_type: str) -> str:
    if kv_type not in KV_TYPES:
        raise ValueError(f"KV cache type {kv_type!r} is not supported (use {', '.join(KV_TYPES)})")
    return kv_type


def row_width(kv_type: str, head_dim: int) -> int:
    """Elements of one position's row of one head in a ``kv_type`` cache: head_dim, or for
    q8_0 / q4_0 its bytes of blocks (``kvquant.row_bytes``; ValueError when head_dim is
    not a multiple of 32)."""
    return kvquant.row_bytes(kv_type, head_dim) if kv_type in kvquant.QUANT_TYPES else head_dim


class CpuKVCache:
    """Per layer K and V: ``(n_slots, n_kv_heads, n_ctx, width)``: float32 values for kv_type
    "f32", uint16 float16 bits for "f16" (rounded to nearest even when stored), uint8
    blocks of llama.cpp's q8_0 / q4_0 for those (``kvquant.py``: ``width`` is the row's
    bytes). Also the RoPE tables of the program's specs for this cache's ``n_ctx``
    (``rope[i]`` = (cos, sin) of ``program.rope_specs()[i]``), since Phi-3's factors depend
    on the context size.

    The interface of engine/model/interface.py: ``clear``, ``slot_shape``, ``snapshot_slot``,
    ``restore_slot``; ``row_width``: the last axis of a snapshot (head_dim, or a quantized
    row's bytes)."""

    def __init__(self, program: Program, n_slots: int, n_ctx: int, kv_type: str = "f16"):
        self.kv_type = check_kv_type(kv_type)
        self.half = kv_type == "f16"
        self.quant = kv_type in kvquant.QUANT_TYPES
        dt = _KV_DTYPE[kv_type]
        self.head_dim = program.kv_layers[0].head_dim if program.kv_layers else 0
        self.row_width = row_width(kv_type, self.head_dim) if program.kv_layers else 0
        self.k = [np.zeros((n_slots, L.n_kv_heads, n_ctx, row_width(kv_type, L.head_dim)), dt)
                  for L in program.kv_layers]
        self.v = [np.zeros((n_slots, L.n_kv_heads, n_ctx, row_width(kv_type, L.head_dim)), dt)
                  for L in program.kv_layers]
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        self.rope = [spec.tables(n_ctx) for spec in program.rope_specs()]
        self.uniform = len({(L.n_kv_heads, L.head_dim) for L in program.kv_layers}) <= 1   # else kv_layers.py
        if not self.uniform:     # a snapshot's last axis: every layer's heads side by side (kv_layers.py)
            self.row_width = sum(cpu_kv_layers.widths(self))

    @staticmethod
    def nbytes(program: Program, n_slots: int, n_ctx: int, kv_type: str = "f16") -> int:
        item = np.dtype(_KV_DTYPE[check_kv_type(kv_type)]).itemsize
        return sum(2 * n_slots * L.n_kv_heads * n_ctx * row_width(kv_type, L.head_dim) * item
                   for L in program.kv_layers)

    def clear(self, slot: int, start: int, stop: int) -> None:
        """Zero positions start..stop-1 of ``slot`` in every layer (rollback of rejected
        draft tokens: the live buffers never keep a rejected token)."""
        for layer in self.k:
            layer[slot, :, start:stop, :] = 0
        for layer in self.v:
            layer[slot, :, start:stop, :] = 0

    @property
    def slot_shape(self) -> tuple[int, int, int, int]:
        """One slot's KV layout: (n_layers, n_kv_heads, n_ctx, head_dim)."""
        if not self.uniform: return cpu_kv_layers.flat_shape(self)  # noqa: E701
        return (len(self.k), self.k[0].shape[1], self.k[0].shape[2], self.head_dim)

    @property
    def dtype(self) -> np.dtype:
        """The dtype ``snapshot_slot`` returns: float16, float32, or uint8 (q8_0, q4_0 blocks)."""
        return np.dtype({"f16": np.float16, "f32": np.float32}.get(self.kv_type, np.uint8))

    def snapshot_slot(self, slot: int, n: int, device: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Copies of ``slot``'s K and V for positions 0..n-1: two (n_layers, n_kv_heads, n,
        row_width) arrays, float16 for an f16 cache, float32 for f32, the uint8 blocks of a
        q8_0 / q4_0 one (capsule snapshot; ``device`` is accepted for the interface and means
        nothing on the CPU)."""
        if not self.uniform: return cpu_kv_layers.snapshot(self, slot, n)  # noqa: E701
        k = np.stack([layer[slot, :, :n, :] for layer in self.k])
        v = np.stack([layer[slot, :, :n, :] for layer in self.v])
        if self.kv_type == "f16":
            k, v = k.view(np.float16), v.view(np.float16)
        return k, v

    def restore_slot(self, slot: int, k: np.ndarray, v: np.ndarray, n: int) -> None:
        """Copy positions 0..n-1 of ``k``, ``v`` (as ``snapshot_slot`` returns them, same
        dtype) into ``slot`` (capsule restore; byte-exact). Raises ValueError on a dtype
        that is not this cache's."""
        if not self.uniform: return cpu_kv_layers.restore(self, slot, k, v, n)  # noqa: E701
        if np.dtype(k.dtype) != self.dtype or np.dtype(v.dtype) != self.dtype or k.shape[-1] != self.row_width:
            raise ValueError(f"KV of dtype {k.dtype} and rows of {k.shape[-1]} cannot restore into a {self.kv_type} "
                             f"cache (rows of {self.row_width})")
        if self.kv_type == "f16":
            k, v = k.view(np.uint16), v.view(np.uint16)
        for li in range(len(self.k)):
            self.k[li][slot, :, :n, :] = k[li, :, :n, :]
            self.v[li][slot, :, :n, :] = v[li, :, :n, :]
