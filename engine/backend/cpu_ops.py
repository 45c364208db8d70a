"""The CPU op set besides matmul: RMSNorm, RoPE, attention over the KV cache, SwiGLU.

Owns: numba kernels (compiled once, cached on disk) and the numpy paths where
BLAS does the heavy lifting (prefill attention). Leaves the quantized matmul to
``cpu_matmul.py`` and the order of ops to the architecture module.

KV cache layout, per layer: ``(n_slots, n_kv_heads, n_ctx, head_dim) float32``,
so one slot's one head is a contiguous ``(n_ctx, head_dim)`` block: decode scans
it linearly and prefill hands it to BLAS without a copy.
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


@nb.njit(cache=True, fastmath=True, parallel=True, error_model="numpy")
def attention_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, slots: np.ndarray,
                     lengths: np.ndarray, scale: float, out: np.ndarray) -> None:
    """One query row per slot attends to that slot's first ``lengths[b]`` cached positions.

    q: (B, n_heads, hd) float32; k_cache, v_cache: (n_slots, n_kv, n_ctx, hd) float32;
    slots, lengths: (B,) int32; out: (B, n_heads, hd) float32. Grouped-query attention:
    query head h reads KV head h // (n_heads // n_kv) (Ainslie et al. 2023). Softmax in
    float32 with max subtraction; work is split over (row, KV head) pairs.
    """
    B, H, hd = q.shape
    KV = k_cache.shape[1]
    G = H // KV
    for job in nb.prange(B * KV):
        b = job // KV
        g = job % KV
        s = slots[b]
        T = lengths[b]
        scores = np.empty((G, T), dtype=np.float32)
        for t in range(T):
            for gi in range(G):
                acc = np.float32(0.0)
                for d in range(hd):
                    acc += q[b, g * G + gi, d] * k_cache[s, g, t, d]
                scores[gi, t] = acc * scale
        for gi in range(G):
            m = scores[gi, 0]
            for t in range(1, T):
                if scores[gi, t] > m:
                    m = scores[gi, t]
            tot = np.float32(0.0)
            for t in range(T):
                e = np.exp(scores[gi, t] - m)
                scores[gi, t] = e
                tot += e
            inv = np.float32(1.0) / tot
            for t in range(T):
                scores[gi, t] *= inv
        for gi in range(G):
            h = g * G + gi
            for d in range(hd):
                out[b, h, d] = 0.0
            for t in range(T):
                p = scores[gi, t]
                for d in range(hd):
                    out[b, h, d] += p * v_cache[s, g, t, d]


def attention_prefill(q: np.ndarray, k_slot: np.ndarray, v_slot: np.ndarray, pos0: int, scale: float) -> np.ndarray:
    """Causal attention of n new query rows at positions pos0..pos0+n-1 over one slot.

    q: (n, n_heads, hd) float32; k_slot, v_slot: (n_kv, n_ctx, hd) float32 views of the
    slot's cache (already holding the new rows); returns (n, n_heads, hd) float32.
    Row i sees positions 0..pos0+i. Matrix products go through numpy's BLAS.
    """
    n, H, hd = q.shape
    KV = k_slot.shape[0]
    G = H // KV
    T = pos0 + n
    out = np.empty((n, H, hd), dtype=np.float32)
    # mask[i, t] is True where row i must not see position t
    mask = np.arange(T)[None, :] > (pos0 + np.arange(n))[:, None]
    for g in range(KV):
        qg = q[:, g * G:(g + 1) * G, :].transpose(1, 0, 2).reshape(G * n, hd)
        s = (qg @ k_slot[g, :T].T).reshape(G, n, T)
        s *= scale
        s[:, mask] = -np.inf
        s -= s.max(axis=2, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=2, keepdims=True)
        o = s.reshape(G * n, T) @ v_slot[g, :T]
        out[:, g * G:(g + 1) * G, :] = o.reshape(G, n, hd).transpose(1, 0, 2)
    return out
