"""The CPU op set besides matmul and attention: RMSNorm, RoPE, SwiGLU, residual adds.

Owns: numba kernels (compiled once, cached on disk). Leaves the quantized matmul to
``cpu_matmul.py``, attention over the KV cache to ``cpu_attention.py`` and the order of
ops to the architecture module. Every kernel here computes a row from that row alone
(one compiled loop per row, whatever the number of rows): batch-invariant.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np


@nb.njit(cache=True, fastmath=True, error_model="numpy")
def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:
    """out[i] = x[i] / sqrt(mean(x[i]**2) + eps) * w.  x, out: (n, d) float32; w: (d,) float32.

    Source: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; llama.cpp's
    ggml_rms_norm accumulates the sum of squares in float (here float64 for safety).
    A zero row with ``eps == 0`` gives a zero row; error_model="numpy": NaN or 0 never raises."""
    n, d = x.shape
    for i in range(n):
        s = 0.0
        for j in range(d):
            v = np.float64(x[i, j])
            s += v * v
        ms = s / d + eps
        scale = np.float32(1.0 / math.sqrt(ms)) if ms > 0.0 else np.float32(0.0)
        for j in range(d):
            out[i, j] = x[i, j] * scale * w[j]


@nb.njit(cache=True, fastmath=True, error_model="numpy")
def rope_inplace(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """Rotate adjacent pairs (x[2j], x[2j+1]) of every head by angle pos * theta_j.

    x: (n, n_heads, head_dim) float32, modified in place; positions: (n,) int32;
    cos, sin: (n_ctx, rope_dim // 2) float32 tables from ``rope_tables``. Only the
    first rope_dim dimensions rotate. Source: Su et al. 2021 (RoFormer), in ggml's
    "normal" mode (GGML_ROPE_TYPE_NORM) that llama-architecture GGUFs use.
    """
    n, h, _ = x.shape
    half = cos.shape[1]
    for i in range(n):
        p = positions[i]
        for hh in range(h):
            for j in range(half):
                c = cos[p, j]
                s = sin[p, j]
                a = x[i, hh, 2 * j]
                b = x[i, hh, 2 * j + 1]
                x[i, hh, 2 * j] = a * c - b * s
                x[i, hh, 2 * j + 1] = a * s + b * c


def rope_tables(n_ctx: int, rope_dim: int, base: float, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables, each (n_ctx, rope_dim // 2) float32: angle = (pos / scale) * base**(-2j/rope_dim).

    Computed in float64 then rounded, as llama.cpp's ggml_rope computes theta in float."""
    j = np.arange(rope_dim // 2, dtype=np.float64)
    inv = base ** (-2.0 * j / rope_dim)
    ang = (np.arange(n_ctx, dtype=np.float64)[:, None] / scale) * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@nb.njit(cache=True, fastmath=True, error_model="numpy")
def silu_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """SwiGLU: out = silu(gate) * up, silu(g) = g / (1 + exp(-g)). All (n, f) float32.

    Source: Shazeer 2020, "GLU Variants Improve Transformer"."""
    n, f = gate.shape
    for i in range(n):
        for j in range(f):
            g = gate[i, j]
            out[i, j] = g / (np.float32(1.0) + np.exp(-g)) * up[i, j]


@nb.njit(cache=True, fastmath=True, error_model="numpy")
def add_inplace(x: np.ndarray, y: np.ndarray) -> None:
    """x += y for (n, d) float32 (the residual add, without a temporary)."""
    n, d = x.shape
    for i in range(n):
        for j in range(d):
            x[i, j] += y[i, j]
