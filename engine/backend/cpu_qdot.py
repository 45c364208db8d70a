"""Integer dot-product kernels: quantized weights times int8-quantized activations.

Owns: `quantize_x` (activations to int8 per 32-block, as llama.cpp's Q8_1 does) and the
GEMV/GEMM kernels over the row-tiled weights that `cpu_matmul.repack` builds. Leaves to
others: the weight layouts and choosing a kernel (`cpu_matmul.py`).

Arithmetic (the trade llama.cpp makes in ggml_vec_dot_q4_1_q8_1 / q8_0_q8_0):
* x row i, block b (32 inputs): dx = max|x| / 127, qx = round(x / dx) in [-127, 127],
  kept as int16 so the kernel broadcasts it without a conversion; sx = sum of the float x.
* Q4_0 / Q4_1 weights are stored as 4-bit q in 0..15 with w = d * q + mn (mn = m for
  Q4_1, -8 d for Q4_0), i.e. w = d * (q - 8) + (mn + 8 d). Per block and row
      sum_j w_j x_j ~= d * (dx * sum_j (q_j - 8) qx_j + 8 sx) + mn * sx,
  and |sum_j (q_j - 8) qx_j| <= 32 * 8 * 127 = 32512 fits int16, so the inner loop
  multiplies and adds in int16 lanes (16 rows per AVX2 register, no widening): it sums
  q_j qx_j, which may wrap, and subtracts 8 sum_j qx_j at the end of the block; int16
  arithmetic is exact modulo 2**16, so the result is exact.
* Q8_0 weights (int8) times qx: products need 15 bits, so the block sum is kept in int32.
The only error against float arithmetic is the rounding of x to int8 (relative error of a
dot product ~1e-3..1e-2, the same as llama.cpp's); the tests compare against an exact
emulation of these formulas and, more loosely, against float64.

Loops over the 32 rows of a tile are innermost so that LLVM vectorizes across rows; the
GEMM kernels take 4 activation rows per weight load to reuse the unpacked nibbles.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

QB = 32      # inputs per quantization block
I16 = np.int16
I32 = np.int32


@njit(cache=True, fastmath=True, error_model="numpy")
def quantize_x(x, xq, dx, sx, x8):
    """x (n, k) float32 -> xq (n, k) int16 in [-127, 127], dx (n, k/32) float32 block
    scales, sx (n, k/32) float32 block sums of x, x8 (n, k/32) int16 = 8 * sum of the
    block's xq (the Q4 kernels' nibble offset). Rounds half to even (np.rint)."""
    n, k = x.shape
    nb = k // QB
    for i in range(n):
        for b in range(nb):
            o = b * QB
            amax = np.float32(0.0)
            s = np.float32(0.0)
            for j in range(QB):
                v = x[i, o + j]
                s += v
                a = abs(v)
                if a > amax:
                    amax = a
            d = amax / np.float32(127.0)
            inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
            t = 0
            for j in range(QB):
                q = np.int16(np.rint(x[i, o + j] * inv))
                xq[i, o + j] = q
                t += q
            dx[i, b] = d
            x8[i, b] = np.int16(8 * t)
            sx[i, b] = s


@njit(cache=True, fastmath=True, error_model="numpy")
def _tile_q4_x4(W, d, mn, xq, dx, sx, x8, i, s, acc):
    """acc[0:4, :] = the 4 activation rows i..i+3 times one Q4 tile (see gemm_q4).
    W (nb, 16, R) uint8, d/mn (nb, R); s (4, R) int16 and acc (4, R) float32 scratch.
    Kept out of the prange body: LLVM vectorizes it into int16 lanes only here."""
    nb, _, RR = W.shape
    F = np.uint8(15)
    S = np.uint8(4)
    for ii in range(4):
        for r in range(RR):
            acc[ii, r] = 0.0
    for b in range(nb):
        Wb = W[b]
        for ii in range(4):
            for r in range(RR):
                s[ii, r] = 0
        o = b * QB
        for j in range(16):
            a0 = xq[i, o + j]; b0 = xq[i, o + 16 + j]
            a1 = xq[i + 1, o + j]; b1 = xq[i + 1, o + 16 + j]
            a2 = xq[i + 2, o + j]; b2 = xq[i + 2, o + 16 + j]
            a3 = xq[i + 3, o + j]; b3 = xq[i + 3, o + 16 + j]
            for r in range(RR):
                u = Wb[j, r]
                lo = I16(u & F)
                hi = I16(u >> S)
                s[0, r] = I16(I16(s[0, r] + I16(lo * a0)) + I16(hi * b0))
                s[1, r] = I16(I16(s[1, r] + I16(lo * a1)) + I16(hi * b1))
                s[2, r] = I16(I16(s[2, r] + I16(lo * a2)) + I16(hi * b2))
                s[3, r] = I16(I16(s[3, r] + I16(lo * a3)) + I16(hi * b3))
        db = d[b]
        mb = mn[b]
        for ii in range(4):
            f = dx[i + ii, b]
            g = sx[i + ii, b]
            e = x8[i + ii, b]
            for r in range(RR):
                acc[ii, r] += db[r] * (f * np.float32(I16(s[ii, r] - e)) + 8 * g) + mb[r] * g


@njit(cache=True, fastmath=True, error_model="numpy")
def _tile_q4_x1(W, d, mn, xq, dx, sx, x8, i, s, acc):
    """acc[0, :] = activation row i times one Q4 tile; as _tile_q4_x4 for one row, two
    input pairs per pass."""
    nb, _, RR = W.shape
    F = np.uint8(15)
    S = np.uint8(4)
    for r in range(RR):
        acc[0, r] = 0.0
    for b in range(nb):
        Wb = W[b]
        for r in range(RR):
            s[0, r] = 0
        o = b * QB
        for j in range(0, 16, 2):
            a0 = xq[i, o + j]; b0 = xq[i, o + 16 + j]
            a1 = xq[i, o + j + 1]; b1 = xq[i, o + 17 + j]
            for r in range(RR):
                u = Wb[j, r]
                v = Wb[j + 1, r]
                p = I16(I16(I16(u & F) * a0) + I16(I16(u >> S) * b0))
                q = I16(I16(I16(v & F) * a1) + I16(I16(v >> S) * b1))
                s[0, r] = I16(s[0, r] + I16(p + q))
        db = d[b]
        mb = mn[b]
        f = dx[i, b]
        g = sx[i, b]
        e = x8[i, b]
        for r in range(RR):
            acc[0, r] += db[r] * (f * np.float32(I16(s[0, r] - e)) + 8 * g) + mb[r] * g


@njit(cache=True, fastmath=True, parallel=True, error_model="numpy")
def gemm_q4(qs, d, mn, xq, dx, sx, x8, out, n_chunks):
    """Q4 tiles x int8 activations.

    qs (T, nb, 16, R) uint8 (low nibble: input b*32+j, high: b*32+16+j), d/mn (T, nb, R)
    float32, xq (n, k) int16, dx/sx (n, nb) float32, x8 (n, nb) int16 = 8 * block sum of
    xq, out (n, m) float32.
    out[i, t*R + r] = sum_b d * (dx[i, b] * (sum_j q * xq - x8[i, b]) + 8 sx[i, b]) + mn * sx[i, b].
    The int16 sum of q * xq may wrap; after subtracting x8 it is the true value (|.| <=
    32512), since int16 arithmetic is exact modulo 2**16. Every product and sum is cast
    to int16 explicitly: without the casts LLVM vectorizes in int64 lanes.
    """
    nt, nb, _, RR = qs.shape
    n, m = out.shape
    per = (nt + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        acc = np.empty((4, RR), np.float32)
        s = np.empty((4, RR), np.int16)
        for t in range(c * per, min(nt, (c + 1) * per)):
            r1 = min(RR, m - t * RR)
            i = 0
            while i < n:
                if n - i >= 4:
                    _tile_q4_x4(qs[t], d[t], mn[t], xq, dx, sx, x8, i, s, acc)
                    for ii in range(4):
                        for r in range(r1):
                            out[i + ii, t * RR + r] = acc[ii, r]
                    i += 4
                else:
                    _tile_q4_x1(qs[t], d[t], mn[t], xq, dx, sx, x8, i, s, acc)
                    for r in range(r1):
                        out[i, t * RR + r] = acc[0, r]
                    i += 1


@njit(cache=True, fastmath=True, error_model="numpy")
def _tile_q8_x1(W, d, xq, dx, i, s, acc):
    """acc[:] = activation row i times one Q8_0 tile: W (nb, 32, R) int8, d (nb, R)
    float32, s (R,) int32 and acc (R,) float32 scratch. Block sums in int32 lanes."""
    nb, _, RR = W.shape
    for r in range(RR):
        acc[r] = 0.0
    for b in range(nb):
        Wb = W[b]
        for r in range(RR):
            s[r] = 0
        o = b * QB
        for j in range(0, QB, 2):
            a0 = I32(xq[i, o + j])
            a1 = I32(xq[i, o + j + 1])
            for r in range(RR):
                s[r] = I32(s[r] + I32(I32(I32(Wb[j, r]) * a0) + I32(I32(Wb[j + 1, r]) * a1)))
        db = d[b]
        f = dx[i, b]
        for r in range(RR):
            acc[r] += db[r] * (f * np.float32(s[r]))


@njit(cache=True, fastmath=True, parallel=True, error_model="numpy")
def gemm_q8(qs, d, xq, dx, out, n_chunks):
    """Q8_0 tiles x int8 activations: qs (T, nb, 32, R) int8, d (T, nb, R) float32,
    xq (n, k) int16, dx (n, nb) float32, out (n, m) float32.
    out[i, t*R + r] = sum_b d * dx[i, b] * sum_j q * xq (block sums in int32)."""
    nt, nb, _, RR = qs.shape
    n, m = out.shape
    per = (nt + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        acc = np.empty(RR, np.float32)
        s = np.empty(RR, np.int32)
        for t in range(c * per, min(nt, (c + 1) * per)):
            r1 = min(RR, m - t * RR)
            for i in range(n):
                _tile_q8_x1(qs[t], d[t], xq, dx, i, s, acc)
                for r in range(r1):
                    out[i, t * RR + r] = acc[r]


@njit(cache=True, error_model="numpy")
def matmul_q4(qs, d, mn, x, xq, dx, sx, x8, out, n_chunks):
    """quantize_x then gemm_q4 in one call (one numba dispatch per GEMV, not two).
    x (n, k) float32; xq, dx, sx, x8 scratch as quantize_x fills them; out (n, m)."""
    quantize_x(x, xq, dx, sx, x8)
    gemm_q4(qs, d, mn, xq, dx, sx, x8, out, n_chunks)


@njit(cache=True, error_model="numpy")
def matmul_q8(qs, d, x, xq, dx, sx, x8, out, n_chunks):
    """quantize_x then gemm_q8 in one call."""
    quantize_x(x, xq, dx, sx, x8)
    gemm_q8(qs, d, xq, dx, out, n_chunks)
