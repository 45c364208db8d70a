"""The formats of a quantized KV cache that every backend shares: llama.cpp's q8_0 and q4_0
blocks, and the rotation a quantized cache's K, V and queries take.

Owns: the block sizes (``BLOCK_BYTES``), a quantized row's bytes (``row_bytes``), the
orthonormal Walsh-Hadamard matrices (``hadamard``) and llama.cpp's rule for where K and V
are rotated (``rotations``). The CPU's store and attention are ``cpu/kvquant.py``, CUDA's
``cuda/kernels/kv_quant.cu``; both keep a slot's bytes in these formats, so a capsule's
K and V bytes mean the same on either.
"""

from __future__ import annotations

import numpy as np

QUANT_TYPES = ("q8_0", "q4_0")
BLOCK = 32
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}


def row_bytes(kv_type: str, head_dim: int) -> int:
    """Bytes of one head's row of ``head_dim`` values. Raises ValueError when the head
    size is not a multiple of the 32-value block."""
    if head_dim % BLOCK:
        raise ValueError(f"KV cache type {kv_type} stores blocks of {BLOCK} values: a head size of {head_dim} is not "
                         f"a multiple of {BLOCK} (use --kv-type f16)")
    return head_dim // BLOCK * BLOCK_BYTES[kv_type]


def hadamard(n: int) -> np.ndarray:
    """The (n, n) Walsh-Hadamard matrix (Sylvester's; n a power of two) times 1/sqrt(n):
    orthonormal, symmetric, its own inverse. float32. Entry (i, j) is
    (-1)^popcount(i & j) / sqrt(n)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def rotation_sizes(head_dim: int) -> tuple[int, int] | None:
    """(K's block, V's block) of the rotation of a quantized cache of this head size, as
    llama.cpp chooses them (``attn_rot_k``, ``attn_rot_v``, its PR 21038: a head size that is
    a multiple of 64; K by the largest power of two from 64 up dividing it, V by 64), or
    None (no rotation)."""
    if head_dim % 64:
        return None
    nk = 64
    while head_dim % (2 * nk) == 0:
        nk *= 2
    return nk, 64


def rotations(head_dim: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(K's rotation, V's) matrices (``rotation_sizes``), or None."""
    sizes = rotation_sizes(head_dim)
    return None if sizes is None else (hadamard(sizes[0]), hadamard(sizes[1]))
