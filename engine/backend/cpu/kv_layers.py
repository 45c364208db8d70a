"""KV caches whose layers differ in shape (Gemma 4: sliding layers of one head size, global
layers of another), as capsules see them.

Owns: the flat layout ``snapshot_slot`` / ``restore_slot`` use when a ``CpuKVCache``'s
layers are not all (n_kv_heads, head_dim) alike: per position, every layer's K (then V)
heads side by side, (1, 1, n, W) with W = sum over layers of n_kv_heads * head_dim, so a
capsule keeps its (layers, heads, positions, head_dim) rank, positions stay the third
axis (a prefix of a capsule is still its first n positions) and the bytes are the cache's
own (float16 bits or float32). Leaves the cache itself to cpu/program.py.
"""

from __future__ import annotations

import numpy as np


def widths(kv) -> list[int]:
    """n_kv_heads * head_dim of each layer."""
    return [int(layer.shape[1] * layer.shape[3]) for layer in kv.k]


def flat_shape(kv) -> tuple[int, int, int, int]:
    return (1, 1, kv.n_ctx, sum(widths(kv)))


def _flat(layers, slot: int, n: int) -> np.ndarray:
    parts = [layer[slot, :, :n, :].transpose(1, 0, 2).reshape(n, -1) for layer in layers]
    return np.concatenate(parts, axis=1)[None, None]


def snapshot(kv, slot: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Copies of positions 0..n-1 in the flat layout, float16 (an f16 cache) or float32."""
    k, v = _flat(kv.k, slot, n), _flat(kv.v, slot, n)
    if kv.kv_type == "f16":
        k, v = k.view(np.float16), v.view(np.float16)
    return k, v


def restore(kv, slot: int, k: np.ndarray, v: np.ndarray, n: int) -> None:
    """The byte-exact inverse of ``snapshot`` for positions 0..n-1. ValueError on another
    dtype or width (nothing written)."""
    if np.dtype(k.dtype) != kv.dtype or np.dtype(v.dtype) != kv.dtype:
        raise ValueError(f"KV of dtype {k.dtype} cannot restore into an {kv.kv_type} cache")
    w = widths(kv)
    if k.shape[-1] != sum(w) or v.shape[-1] != sum(w):
        raise ValueError(f"KV of width {k.shape[-1]} cannot restore into layers of widths {w}")
    if kv.kv_type == "f16":
        k, v = k.view(np.uint16), v.view(np.uint16)
    at = 0
    for lk, lv, wl in zip(kv.k, kv.v, w):
        H, hd = lk.shape[1], lk.shape[3]
        lk[slot, :, :n, :] = k[0, 0, :n, at:at + wl].reshape(n, H, hd).transpose(1, 0, 2)
        lv[slot, :, :n, :] = v[0, 0, :n, at:at + wl].reshape(n, H, hd).transpose(1, 0, 2)
        at += wl
