"""The CPU op set besides matmul: norms, RoPE (both modes), activations, attention over the KV cache.

Owns: numba kernels (compiled once, cached on disk) and the numpy paths where BLAS does
the heavy lifting (prefill attention). Leaves the quantized matmul to ``cpu_matmul.py``,
the order of ops to the architecture module and the program executor (``cpu_program.py``).

KV cache layout, per layer: ``(n_slots, n_kv_heads, n_ctx, head_dim)``, float32 or, for an
f16 cache, uint16 holding IEEE float16 bits (numba has no float16 type; values are read
back exactly through ``F16_LUT``). One slot's one head is a contiguous ``(n_ctx, head_dim)``
block: decode scans it linearly and prefill hands it to BLAS without a copy (float32) or
after one conversion of the positions it reads (f16).

The attention kernels here (``attention_rows`` for short segments, ``attention_prefill``
for long ones) are the interim ones of issue 14; helper ``invariance`` replaces them with
one kernel for every row (``cpu_attention.py``, same ``attention_rows`` signature).
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np
from numba.extending import overload

#: float16 bit pattern -> float32 value, all 65536 patterns (exact: subnormals, inf, NaN).
F16_LUT: np.ndarray = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


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
def head_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> None:
    """In place: every head vector x[i, h] (length hd) becomes x / sqrt(mean(x**2) + eps) * w.

    x: (n, n_heads, hd) float32, may be a strided view (a column block of a fused QKV
    output); w: (hd,) float32, shared by the heads (QK-norm: Qwen3, Gemma 3)."""
    n, H, hd = x.shape
    for i in range(n):
        for h in range(H):
            s = 0.0
            for j in range(hd):
                v = np.float64(x[i, h, j])
                s += v * v
            ms = s / hd + eps
            scale = np.float32(1.0 / math.sqrt(ms)) if ms > 0.0 else np.float32(0.0)
            for j in range(hd):
                x[i, h, j] = x[i, h, j] * scale * w[j]


@nb.njit(cache=True, fastmath=True, error_model="numpy")
def rope_inplace(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """Rotate adjacent pairs (x[2j], x[2j+1]) of every head by the table angle of row i's position.

    x: (n, n_heads, head_dim) float32, modified in place (may be a strided view);
    positions: (n,) int32; cos, sin: (n_ctx, rope_dim // 2) float32 from
    ``ops.RopeSpec.tables``. Only the first rope_dim dimensions rotate. Source: Su et al.
    2021 (RoFormer), in ggml's "normal" mode (GGML_ROPE_TYPE_NORM) that llama GGUFs use.
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


@nb.njit(cache=True, fastmath=True, error_model="numpy")
def rope_neox_inplace(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """Rotate the pairs (x[j], x[j + rope_dim/2]) of every head (GGML_ROPE_TYPE_NEOX: the
    GPT-NeoX layout that Qwen, Gemma and Phi-3 GGUFs use). Same arguments as rope_inplace."""
    n, h, _ = x.shape
    half = cos.shape[1]
    for i in range(n):
        p = positions[i]
        for hh in range(h):
            for j in range(half):
                c = cos[p, j]
                s = sin[p, j]
                a = x[i, hh, j]
                b = x[i, hh, j + half]
                x[i, hh, j] = a * c - b * s
                x[i, hh, j + half] = a * s + b * c


@nb.njit(cache=True, fastmath=True, error_model="numpy")
def silu_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """SwiGLU: out = silu(gate) * up, silu(g) = g / (1 + exp(-g)). All (n, f) float32
    (gate and up may be strided views; out may be gate).

    Source: Shazeer 2020, "GLU Variants Improve Transformer"."""
    n, f = gate.shape
    for i in range(n):
        for j in range(f):
            g = gate[i, j]
            out[i, j] = g / (np.float32(1.0) + np.exp(-g)) * up[i, j]


@nb.njit(cache=True, fastmath=True, error_model="numpy")
def gelu_tanh_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """GeGLU with the tanh approximation of GELU: out = 0.5 g (1 + tanh(sqrt(2/pi) (g +
    0.044715 g^3))) * up. All (n, f) float32 (out may be gate).

    Source: Hendrycks & Gimpel 2016 (GELU, tanh form), Shazeer 2020 (GeGLU); ggml's
    ggml_gelu_f32 uses the same constants (its CPU path reads a float16 table instead)."""
    n, f = gate.shape
    c = np.float32(0.7978845608028654)
    a3 = np.float32(0.044715)
    for i in range(n):
        for j in range(f):
            g = gate[i, j]
            out[i, j] = np.float32(0.5) * g * (np.float32(1.0) + np.tanh(c * (g + a3 * g * g * g))) * up[i, j]


@nb.njit(cache=True, fastmath=True, error_model="numpy")
def add_inplace(x: np.ndarray, y: np.ndarray) -> None:
    """x += y for (n, d) float32 (the residual add, without a temporary)."""
    n, d = x.shape
    for i in range(n):
        for j in range(d):
            x[i, j] += y[i, j]


# ---------------------------------------------------------------------------- attention

def _kv_row(a, s, g, t, bits, row):  # pragma: no cover - replaced by the overload inside numba
    raise NotImplementedError


@overload(_kv_row, inline="always")
def _kv_row_impl(a, s, g, t, bits, row):
    """K or V at position t of (slot s, KV head g) as hd float32 values: a float32 cache's
    own row; a uint16 (f16 bits) cache's row converted exactly into ``row`` (float32 view
    of the uint32 scratch ``bits``): the f16 sign and exponent/mantissa shifted into
    float32 place and scaled by 2^112, exact for every finite f16 (normals and
    subnormals); the all-ones exponent lands at >= 65536 and becomes +-inf (an f16 NaN
    reads as inf). Integer ops and one multiply per value, so it vectorizes."""
    if a.dtype == nb.types.uint16:
        def conv(a, s, g, t, bits, row):
            src = a[s, g, t]
            for d in range(src.shape[0]):
                h = np.uint32(src[d])
                bits[d] = ((h & np.uint32(0x8000)) << np.uint32(16)) | ((h & np.uint32(0x7FFF)) << np.uint32(13))
            for d in range(src.shape[0]):
                f = row[d] * np.float32(5.192296858534828e33)          # 2^112
                row[d] = f * np.float32(np.inf) if abs(f) >= np.float32(65536.0) else f
            return row
        return conv
    return lambda a, s, g, t, bits, row: a[s, g, t]


# fastmath without "nnan"/"ninf": an f16 cache's inf must stay inf (see _kv_row)
@nb.njit(cache=True, fastmath={"nsz", "arcp", "contract", "afn", "reassoc"}, parallel=True, error_model="numpy")
def _attention_rows(q, k_cache, v_cache, slots, lengths, scale, window, out, sinks, has_sinks):
    B, H, hd = q.shape
    KV = k_cache.shape[1]
    G = H // KV
    for job in nb.prange(B * KV):
        b = job // KV
        g = job % KV
        s = slots[b]
        T = lengths[b]
        t0 = T - window if window > 0 and T > window else 0
        n = T - t0
        scores = np.empty((G, n), dtype=np.float32)
        bits = np.empty(hd, dtype=np.uint32)
        row = bits.view(np.float32)
        for t in range(n):
            kr = _kv_row(k_cache, s, g, t0 + t, bits, row)
            for gi in range(G):
                acc = np.float32(0.0)
                for d in range(hd):
                    acc += q[b, g * G + gi, d] * kr[d]
                scores[gi, t] = acc * scale
        for gi in range(G):
            m = scores[gi, 0]
            for t in range(1, n):
                if scores[gi, t] > m:
                    m = scores[gi, t]
            if has_sinks and sinks[g * G + gi] > m:
                m = sinks[g * G + gi]
            tot = np.float32(0.0)
            for t in range(n):
                e = np.exp(scores[gi, t] - m)
                scores[gi, t] = e
                tot += e
            if has_sinks:
                tot += np.exp(sinks[g * G + gi] - m)
            inv = np.float32(1.0) / tot
            for t in range(n):
                scores[gi, t] *= inv
        for gi in range(G):
            h = g * G + gi
            for d in range(hd):
                out[b, h, d] = 0.0
        for t in range(n):
            vr = _kv_row(v_cache, s, g, t0 + t, bits, row)
            for gi in range(G):
                h = g * G + gi
                p = scores[gi, t]
                for d in range(hd):
                    out[b, h, d] += p * vr[d]


_NO_SINKS = np.zeros(1, np.float32)


def attention_rows(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, slots: np.ndarray,
                   lengths: np.ndarray, scale: float, window: int, out: np.ndarray,
                   sinks: np.ndarray | None = None) -> None:
    """Every query row attends to its slot's cached positions [lo, length), lo =
    max(0, length - window) if window > 0 else 0 (the rows' K/V are already stored).

    q: (N, n_heads, hd) float32 (may be a strided view); k_cache, v_cache: (n_slots, n_kv,
    n_ctx, hd) float32 or uint16 (f16 bits); slots, lengths: (N,) int32; out: (N, n_heads,
    hd) float32. Grouped-query attention: query head h reads KV head h // (n_heads / n_kv)
    (Ainslie et al. 2023). Softmax in float32 with max subtraction; work is split over
    (row, KV head) pairs, and a row's result does not depend on the other rows.
    ``sinks``: None, or (n_heads,) float32 attention-sink logits (gpt-oss): head h's
    softmax denominator also holds exp(sinks[h] - m), m the max over the scores and the
    sink; the sink adds no value. (SEAMS.md's signature, plus sinks; the interim kernel
    for decode and verify rows.)"""
    has = sinks is not None
    _attention_rows(q, k_cache, v_cache, slots, lengths, np.float32(scale), int(window), out,
                    np.ascontiguousarray(sinks, np.float32) if has else _NO_SINKS, has)


def kv_as_f32(a: np.ndarray) -> np.ndarray:
    """A K or V block as float32: itself when float32, else its f16 bits converted."""
    return a if a.dtype == np.float32 else F16_LUT[a]


def attention_prefill(q: np.ndarray, k_slot: np.ndarray, v_slot: np.ndarray, pos0: int, scale: float,
                      window: int = 0, sinks: np.ndarray | None = None) -> np.ndarray:
    """Causal attention of n new query rows at positions pos0..pos0+n-1 over one slot.

    q: (n, n_heads, hd) float32; k_slot, v_slot: (n_kv, n_ctx, hd) float32 or uint16 (f16
    bits) views of the slot's cache (already holding the new rows); returns (n, n_heads,
    hd) float32. Row i sees positions [lo_i, pos0 + i] with lo_i = max(0, pos0 + i + 1 -
    window) when window > 0, else 0. Matrix products go through numpy's BLAS. ``sinks``:
    (n_heads,) attention-sink logits or None (as ``attention_rows``).
    """
    n, H, hd = q.shape
    KV = k_slot.shape[0]
    G = H // KV
    T = pos0 + n
    t0 = max(0, pos0 + 1 - window) if window > 0 else 0
    out = np.empty((n, H, hd), dtype=np.float32)
    # mask[i, t] is True where row i must not see position t0 + t
    tt = np.arange(t0, T)[None, :]
    pi = (pos0 + np.arange(n))[:, None]
    mask = tt > pi
    if window > 0:
        mask |= tt <= pi - window
    for g in range(KV):
        kg = kv_as_f32(k_slot[g, t0:T])
        vg = kv_as_f32(v_slot[g, t0:T])
        qg = q[:, g * G:(g + 1) * G, :].transpose(1, 0, 2).reshape(G * n, hd)
        s = (qg @ kg.T).reshape(G, n, T - t0)
        s *= scale
        s[:, mask] = -np.inf
        mx = s.max(axis=2, keepdims=True)
        if sinks is not None:
            sk = np.asarray(sinks[g * G:(g + 1) * G], np.float32)[:, None, None]
            mx = np.maximum(mx, sk)
        s -= mx
        np.exp(s, out=s)
        tot = s.sum(axis=2, keepdims=True)
        if sinks is not None:
            tot += np.exp(sk - mx)
        s /= tot
        o = s.reshape(G * n, T - t0) @ vg
        out[:, g * G:(g + 1) * G, :] = o.reshape(G, n, hd).transpose(1, 0, 2)
    return out
