"""GGUF tensor types on the CPU: block layouts and dequantization to float32.

Owns: which GGML tensor types the CPU backend reads (`SUPPORTED_TYPES`), their block
geometry (`block_layout`), and `dequantize_rows`, which turns selected rows of a tensor,
kept in its file layout, into float32. The kernels are numba-compiled (`cache=True`).

Leaves to others: the fast matmul kernels and the repacked weight layouts
(`cpu/matmul.py`), reading the file (`gguf.GGUFReader`, memmap) and choosing which tensors
to load (engine/model).

Sources for the block layouts: ggml-common.h (`block_q4_0`, `block_q4_1`, `block_q5_0`,
`block_q5_1`, `block_q8_0`, `block_q2_K` .. `block_q6_K`, `block_iq4_nl`, `block_iq4_xs`,
`block_mxfp4`; QK_K = 256), ggml-quants.c (`dequantize_row_*`), ggml-impl.h
(`ggml_e8m0_to_fp32_half`) and the gguf package's numpy reference `gguf/quants.py`, which
the tests compare against bit for bit. All multi-byte fields are little-endian; every
scale `d`/`dmin`/`m` is IEEE float16 unless said otherwise.

The three non-linear 4-bit types:
* IQ4_NL (32 / 18 bytes): d f16 | qs[16]; w = d * KVALUES_IQ4NL[nibble], low nibbles are
  elements 0..15, high nibbles 16..31 (as Q4_0, with a table instead of q - 8).
* IQ4_XS (256 / 136 bytes): d f16 | scales_h u16 | scales_l[4] | qs[128]; 8 sub-blocks of
  32, each with a 6-bit scale ls = (4 bits of scales_l[ib/2], low nibble for even ib) |
  (2 bits ib of scales_h) << 4; w = (d * (ls - 32)) * KVALUES_IQ4NL[nibble], the nibbles of
  each sub-block laid out as one IQ4_NL block's.
* MXFP4 (32 / 17 bytes, OCP microscaling): e u8 (E8M0 exponent) | qs[16]; w =
  E8M0_HALF[e] * KVALUES_MXFP4[nibble], KVALUES_MXFP4 being the FP4 (E2M1) values doubled
  and E8M0_HALF[e] = 2^(e - 128), so the product is the E2M1 value times 2^(e - 127).
  ggml decodes e = 0 and 1 as float32 subnormals and e = 255 as 2^127 (not NaN); so do we.

Not supported here: the other IQ* types, TQ* and NVFP4 (the loader refuses them with a
message naming the tensor and its type).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from numba import njit, prange

SUPPORTED_TYPES: frozenset[T] = frozenset({
    T.F32, T.F16, T.BF16,
    T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
    T.IQ4_NL, T.IQ4_XS, T.MXFP4,
})

#: float16 bit pattern -> float32 value, for all 65536 patterns (exact, incl. subnormals,
#: inf and NaN). 256 KiB; used by every kernel that reads a float16 field.
F16_LUT: np.ndarray = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

#: IQ4_NL's (and IQ4_XS's) 16 levels, ggml-common.h `kvalues_iq4nl`, as float32.
KVALUES_IQ4NL: np.ndarray = np.array([-127, -104, -83, -65, -49, -35, -22, -10,
                                      1, 13, 25, 38, 53, 69, 89, 113], np.float32)
#: MXFP4's 16 FP4 (E2M1: sign, 2 exponent bits, 1 mantissa bit) values doubled, ggml-common.h
#: `kvalues_mxfp4`: nibble 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6 times 2; 8..15 the negatives.
KVALUES_MXFP4: np.ndarray = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
#: E8M0 byte e -> 2^(e - 128) as float32, exactly ggml_e8m0_to_fp32_half: the bit pattern
#: (e - 1) << 23 for e >= 2, the subnormals 2^-128 and 2^-127 for e = 0 and 1.
_E = np.arange(256, dtype=np.uint32)
E8M0_HALF: np.ndarray = np.where(_E < 2, np.uint32(0x00200000) << np.minimum(_E, 1),
                                 (_E - np.uint32(1)) << np.uint32(23)).astype(np.uint32).view(np.float32)
del _E


class UnsupportedTensorType(ValueError):
    """A tensor type the CPU backend cannot read; the message names the type."""


def block_layout(qtype: T) -> tuple[int, int]:
    """(elements per block, bytes per block) of `qtype`, from gguf.GGML_QUANT_SIZES.

    F32 is (1, 4), F16 and BF16 are (1, 2), Q4_0 is (32, 18), Q4_K is (256, 144).
    Raises UnsupportedTensorType for a type outside SUPPORTED_TYPES.
    """
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedTensorType(
            f"tensor type {getattr(qtype, 'name', qtype)} is not supported by the CPU backend "
            f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})")
    return GGML_QUANT_SIZES[qtype]


def row_bytes(qtype: T, k: int) -> int:
    """Bytes one row of `k` elements takes in `qtype`; raises ValueError when `k` is not
    a whole number of blocks."""
    be, bb = block_layout(qtype)
    if k % be:
        raise ValueError(f"row length {k} is not a multiple of the {qtype.name} block size {be}")
    return k // be * bb


def as_byte_rows(raw: np.ndarray, qtype: T, k: int) -> np.ndarray:
    """View `raw` as uint8 (n_rows, row_bytes) without copying when it is C-contiguous.

    `raw` is what gguf.GGUFReader gives: uint8 (m, row_bytes) for block types, a typed
    (m, k) array (float32, float16, or uint16/int16/bfloat16-like for BF16) for the float
    types, or any 1-D/N-D array holding whole rows. Raises ValueError on a size mismatch.
    """
    rb = row_bytes(qtype, k)
    a = np.ascontiguousarray(raw)          # no copy for the reader's contiguous memmaps
    b = a.reshape(-1).view(np.uint8)
    if b.size % rb:
        raise ValueError(f"{qtype.name} tensor of {b.size} bytes is not a whole number of "
                         f"rows of {k} elements ({rb} bytes each)")
    return b.reshape(-1, rb)


# ----------------------------------------------------------------------------------------
# numba kernels: (raw uint8 (m, row_bytes), ids int64 (n,), out float32 (n, k), lut)
# Every kernel writes out[i, :] = dequantized row ids[i]. Parallel over requested rows.
# ----------------------------------------------------------------------------------------

@njit(cache=True, inline="always")
def _h(raw, r, o, lut):
    """float16 at byte offset o of row r, as float32."""
    return lut[np.int64(raw[r, o]) | (np.int64(raw[r, o + 1]) << 8)]


@njit(cache=True, parallel=True)
def _deq_f32(raw, ids, out, lut):
    n, k = out.shape
    for i in prange(n):
        v = raw[ids[i]].view(np.float32)
        for j in range(k):
            out[i, j] = v[j]


@njit(cache=True, parallel=True)
def _deq_f16(raw, ids, out, lut):
    n, k = out.shape
    for i in prange(n):
        r = ids[i]
        for j in range(k):
            out[i, j] = _h(raw, r, 2 * j, lut)


@njit(cache=True, parallel=True)
def _deq_bf16_bits(raw, ids, out_bits):
    n, k = out_bits.shape
    for i in prange(n):
        v = raw[ids[i]].view(np.uint16)
        for j in range(k):
            out_bits[i, j] = np.uint32(v[j]) << np.uint32(16)


@njit(cache=True, parallel=True)
def _deq_q4_0(raw, ids, out, lut):        # block_q4_0: d f16 | qs[16]; 18 bytes / 32
    n, k = out.shape
    for i in prange(n):
        r = ids[i]
        for b in range(k // 32):
            o = b * 18
            d = _h(raw, r, o, lut)
            for j in range(16):
                q = np.int64(raw[r, o + 2 + j])
                out[i, b * 32 + j] = d * np.float32((q & 15) - 8)
                out[i, b * 32 + 16 + j] = d * np.float32((q >> 4) - 8)


@njit(cache=True, parallel=True)
def _deq_q4_1(raw, ids, out, lut):        # block_q4_1: d f16 | m f16 | qs[16]; 20 / 32
    n, k = out.shape
    for i in prange(n):
        r = ids[i]
        for b in range(k // 32):
            o = b * 20
            d = _h(raw, r, o, lut)
            m = _h(raw, r, o + 2, lut)
            for j in range(16):
                q = np.int64(raw[r, o + 4 + j])
                out[i, b * 32 + j] = d * np.float32(q & 15) + m
                out[i, b * 32 + 16 + j] = d * np.float32(q >> 4) + m


@njit(cache=True, parallel=True)
def _deq_q5_0(raw, ids, out, lut):        # block_q5_0: d f16 | qh u32 | qs[16]; 22 / 32
    n, k = out.shape
    for i in prange(n):
        r = ids[i]
        for b in range(k // 32):
            o = b * 22
            d = _h(raw, r, o, lut)
            qh = (np.int64(raw[r, o + 2]) | (np.int64(raw[r, o + 3]) << 8)
                  | (np.int64(raw[r, o + 4]) << 16) | (np.int64(raw[r, o + 5]) << 24))
            for j in range(16):
                q = np.int64(raw[r, o + 6 + j])
                lo = (q & 15) | (((qh >> j) & 1) << 4)
                hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
                out[i, b * 32 + j] = d * np.float32(lo - 16)
                out[i, b * 32 + 16 + j] = d * np.float32(hi - 16)


@njit(cache=True, parallel=True)
def _deq_q5_1(raw, ids, out, lut):        # block_q5_1: d | m | qh u32 | qs[16]; 24 / 32
    n, k = out.shape
    for i in prange(n):
        r = ids[i]
        for b in range(k // 32):
            o = b * 24
            d = _h(raw, r, o, lut)
            m = _h(raw, r, o + 2, lut)
            qh = (np.int64(raw[r, o + 4]) | (np.int64(raw[r, o + 5]) << 8)
                  | (np.int64(raw[r, o + 6]) << 16) | (np.int64(raw[r, o + 7]) << 24))
            for j in range(16):
                q = np.int64(raw[r, o + 8 + j])
                lo = (q & 15) | (((qh >> j) & 1) << 4)
                hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
                out[i, b * 32 + j] = d * np.float32(lo) + m
                out[i, b * 32 + 16 + j] = d * np.float32(hi) + m


@njit(cache=True, parallel=True)
def _deq_q8_0(raw, ids, out, lut):        # block_q8_0: d f16 | qs int8[32]; 34 / 32
    n, k = out.shape
    for i in prange(n):
        r = ids[i]
        for b in range(k // 32):
            o = b * 34
            d = _h(raw, r, o, lut)
            for j in range(32):
                out[i, b * 32 + j] = d * np.float32(np.int8(raw[r, o + 2 + j]))


@njit(cache=True, parallel=True)
def _deq_q2_k(raw, ids, out, lut):
    # block_q2_K (84 bytes / 256): scales[16] (lo nibble: scale, hi: min) | qs[64] | d | dmin
    n, k = out.shape
    for i in prange(n):
        r = ids[i]
        for b in range(k // 256):
            o = b * 84
            d = _h(raw, r, o + 80, lut)
            dmin = _h(raw, r, o + 82, lut)
            for e in range(256):
                g = e // 128
                s = (e // 32) % 4
                q = (np.int64(raw[r, o + 16 + g * 32 + e % 32]) >> (2 * s)) & 3
                sc = np.int64(raw[r, o + e // 16])
                out[i, b * 256 + e] = (d * np.float32(sc & 15)) * np.float32(q) - dmin * np.float32(sc >> 4)


@njit(cache=True, parallel=True)
def _deq_q3_k(raw, ids, out, lut):
    # block_q3_K (110 / 256): hmask[32] | qs[64] | scales[12] (16 x 6-bit, packed) | d
    n, k = out.shape
    for i in prange(n):
        r = ids[i]
        for b in range(k // 256):
            o = b * 110
            d = _h(raw, r, o + 108, lut)
            for e in range(256):
                sb = e // 16
                lo = (np.int64(raw[r, o + 96 + sb % 8]) >> (4 * (sb // 8))) & 15
                hi = (np.int64(raw[r, o + 104 + sb % 4]) >> (2 * (sb // 4))) & 3
                sc = (lo | (hi << 4)) - 32
                g = e // 128
                s = (e // 32) % 4
                ql = (np.int64(raw[r, o + 32 + g * 32 + e % 32]) >> (2 * s)) & 3
                h = (np.int64(raw[r, o + e % 32]) >> (e // 32)) & 1
                out[i, b * 256 + e] = (d * np.float32(sc)) * np.float32(ql - 4 * (1 - h))


@njit(cache=True, inline="always")
def _scale_min_k4(raw, r, o, j):
    """6-bit (scale, min) of sub-block j (0..7) from the 12 packed bytes at offset o
    (ggml-quants.c get_scale_min_k4)."""
    if j < 4:
        sc = np.int64(raw[r, o + j]) & 63
        mn = np.int64(raw[r, o + j + 4]) & 63
    else:
        sc = (np.int64(raw[r, o + j + 4]) & 15) | ((np.int64(raw[r, o + j - 4]) >> 6) << 4)
        mn = (np.int64(raw[r, o + j + 4]) >> 4) | ((np.int64(raw[r, o + j]) >> 6) << 4)
    return sc, mn


@njit(cache=True, parallel=True)
def _deq_q4_k(raw, ids, out, lut):
    # block_q4_K (144 / 256): d | dmin | scales[12] | qs[128]; 8 sub-blocks of 32
    n, k = out.shape
    for i in prange(n):
        r = ids[i]
        for b in range(k // 256):
            o = b * 144
            d = _h(raw, r, o, lut)
            dmin = _h(raw, r, o + 2, lut)
            for sb in range(8):
                sc, mn = _scale_min_k4(raw, r, o + 4, sb)
                ds = d * np.float32(sc)
                ms = dmin * np.float32(mn)
                g = sb // 2
                sh = 4 * (sb % 2)
                for l in range(32):
                    q = (np.int64(raw[r, o + 16 + g * 32 + l]) >> sh) & 15
                    out[i, b * 256 + sb * 32 + l] = ds * np.float32(q) - ms


@njit(cache=True, parallel=True)
def _deq_q5_k(raw, ids, out, lut):
    # block_q5_K (176 / 256): d | dmin | scales[12] | qh[32] | qs[128]
    n, k = out.shape
    for i in prange(n):
        r = ids[i]
        for b in range(k // 256):
            o = b * 176
            d = _h(raw, r, o, lut)
            dmin = _h(raw, r, o + 2, lut)
            for sb in range(8):
                sc, mn = _scale_min_k4(raw, r, o + 4, sb)
                ds = d * np.float32(sc)
                ms = dmin * np.float32(mn)
                g = sb // 2
                sh = 4 * (sb % 2)
                for l in range(32):
                    q = (np.int64(raw[r, o + 48 + g * 32 + l]) >> sh) & 15
                    q |= ((np.int64(raw[r, o + 16 + l]) >> sb) & 1) << 4
                    out[i, b * 256 + sb * 32 + l] = ds * np.float32(q) - ms


@njit(cache=True, parallel=True)
def _deq_q6_k(raw, ids, out, lut):
    # block_q6_K (210 / 256): ql[128] | qh[64] | scales int8[16] | d
    n, k = out.shape
    for i in prange(n):
        r = ids[i]
        for b in range(k // 256):
            o = b * 210
            d = _h(raw, r, o + 208, lut)
            for e in range(256):
                g = e // 128
                w = e % 128
                lo = (np.int64(raw[r, o + g * 64 + w % 64]) >> (4 * (w // 64))) & 15
                hi = (np.int64(raw[r, o + 128 + g * 32 + w % 32]) >> (2 * (w // 32))) & 3
                sc = np.int64(np.int8(raw[r, o + 192 + e // 16]))
                out[i, b * 256 + e] = (d * np.float32(sc)) * np.float32((lo | (hi << 4)) - 32)


@njit(cache=True, parallel=True)
def _deq_iq4_nl(raw, ids, out, lut):      # block_iq4_nl: d f16 | qs[16]; 18 / 32
    kv = KVALUES_IQ4NL
    n, k = out.shape
    for i in prange(n):
        r = ids[i]
        for b in range(k // 32):
            o = b * 18
            d = _h(raw, r, o, lut)
            for j in range(16):
                q = np.int64(raw[r, o + 2 + j])
                out[i, b * 32 + j] = d * kv[q & 15]
                out[i, b * 32 + 16 + j] = d * kv[q >> 4]


@njit(cache=True, parallel=True)
def _deq_iq4_xs(raw, ids, out, lut):
    # block_iq4_xs (136 / 256): d f16 | scales_h u16 | scales_l[4] | qs[128]; 8 sub-blocks of 32
    kv = KVALUES_IQ4NL
    n, k = out.shape
    for i in prange(n):
        r = ids[i]
        for b in range(k // 256):
            o = b * 136
            d = _h(raw, r, o, lut)
            sh = np.int64(raw[r, o + 2]) | (np.int64(raw[r, o + 3]) << 8)
            for ib in range(8):
                ls = ((np.int64(raw[r, o + 4 + ib // 2]) >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4)
                dl = d * np.float32(ls - 32)
                for j in range(16):
                    q = np.int64(raw[r, o + 8 + 16 * ib + j])
                    out[i, b * 256 + 32 * ib + j] = dl * kv[q & 15]
                    out[i, b * 256 + 32 * ib + 16 + j] = dl * kv[q >> 4]


@njit(cache=True, parallel=True)
def _deq_mxfp4(raw, ids, out, lut):       # block_mxfp4: e u8 (E8M0) | qs[16]; 17 / 32
    kv = KVALUES_MXFP4
    e8 = E8M0_HALF
    n, k = out.shape
    for i in prange(n):
        r = ids[i]
        for b in range(k // 32):
            o = b * 17
            d = e8[np.int64(raw[r, o])]
            for j in range(16):
                q = np.int64(raw[r, o + 1 + j])
                out[i, b * 32 + j] = d * kv[q & 15]
                out[i, b * 32 + 16 + j] = d * kv[q >> 4]


_KERNELS = {
    T.F32: _deq_f32, T.F16: _deq_f16,
    T.Q4_0: _deq_q4_0, T.Q4_1: _deq_q4_1, T.Q5_0: _deq_q5_0, T.Q5_1: _deq_q5_1,
    T.Q8_0: _deq_q8_0, T.Q2_K: _deq_q2_k, T.Q3_K: _deq_q3_k, T.Q4_K: _deq_q4_k,
    T.Q5_K: _deq_q5_k, T.Q6_K: _deq_q6_k,
    T.IQ4_NL: _deq_iq4_nl, T.IQ4_XS: _deq_iq4_xs, T.MXFP4: _deq_mxfp4,
}


def row_ids(rows: np.ndarray | slice, n_rows: int) -> np.ndarray:
    """Normalise a row selection (slice, int array) to int64 ids, checking the bounds."""
    if isinstance(rows, slice):
        return np.arange(*rows.indices(n_rows), dtype=np.int64)
    ids = np.asarray(rows).astype(np.int64, copy=False).reshape(-1)
    if ids.size and (ids.min() < -n_rows or ids.max() >= n_rows):
        raise IndexError(f"row id out of range for a tensor of {n_rows} rows "
                         f"(got min {ids.min()}, max {ids.max()})")
    return np.where(ids < 0, ids + n_rows, ids)


def dequantize_byte_rows(b: np.ndarray, qtype: T, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Kernel entry without checks: `b` uint8 (m, row_bytes), `ids` int64 (n,), `out`
    float32 C-contiguous (n, k). Returns `out`."""
    if qtype == T.BF16:
        _deq_bf16_bits(b, ids, out.view(np.uint32))
    elif qtype == T.F32:  # a copy: numpy's, not a kernel to compile (a cold start paid seconds for it)
        np.copyto(out, b[ids].view(np.float32).reshape(out.shape))
    else:
        _KERNELS[qtype](b, ids, out, F16_LUT)
    return out


def dequantize_rows(raw: np.ndarray, qtype: T, rows: np.ndarray | slice, k: int) -> np.ndarray:
    """Dequantize the selected rows of a tensor kept in its GGUF layout.

    raw:   the tensor's rows as gguf.GGUFReader gives them: uint8 (m, row_bytes) for block
           types, typed (m, k) for F32/F16/BF16 (a uint8 view of the same bytes also works);
           a read-only memmap is fine, only the selected rows are read.
    qtype: a type in SUPPORTED_TYPES.
    rows:  int array of row ids (negative ids count from the end) or a slice.
    k:     elements per row (a multiple of the block size).
    Returns float32 (n_rows, k), C-contiguous.
    Raises UnsupportedTensorType, ValueError (size mismatch), IndexError (bad row id).
    """
    b = as_byte_rows(raw, qtype, k)
    ids = row_ids(rows, b.shape[0])
    out = np.empty((ids.size, k), np.float32)
    if ids.size:
        dequantize_byte_rows(b, qtype, ids, out)
    return out
