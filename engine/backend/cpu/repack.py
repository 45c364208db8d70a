"""The weights' layouts for the CPU's integer kernels: GGUF blocks decomposed and repacked at load.

Owns: ``decompose`` (a GGUF tensor type's blocks as int8 quants and float32 scales,
``combine`` their inverse), ``repack`` (those as the tiles the integer kernels read) and
``repack_compact`` (Q4_K / Q6_K with the file's small scale integers), ``tile_shapes``
(the arrays a stack of tiles needs), the file-row helpers ``_byte_rows`` and
``_dequantize`` for the types only this package reads, and the tables of which GGUF type
takes which kind (``KIND_OF``, ``COMPACT_OF``, ``F16_SCALES``). Leaves to others: the
matrices and their matmul (``matmul.py``), the kernels (``qdot.py``, ``lanes.py``), the
markers and tile facts (``markers.py``), plain dequantization of the file layouts
(``quants.py``).

How it computes
* Integer path (the default, ``int8=True``): x is rounded to int8 per 32-block as
  llama.cpp does (Q8_1-style activations) and multiplied with integer weights
  (`qdot.gemm`: vpdpbusd, or vpmaddubsw / vpmaddwd, or portable LLVM vector code),
  with a relative error ~5e-3 against float64, llama.cpp's fidelity. Every type whose
  values are small integers times a per-16 or per-32 scale is repacked once at load
  (`decompose` then `repack`) into tiles of R = 8 output rows (markers.R); for tile t, block b
  (32 inputs), byte group g, row r and byte c:
      kind Q4  (Q4_0, Q4_1, Q4_K):     qs[t, b, g, r, c] uint8, g < 4: low nibble = input
               4g + c, high nibble = input 16 + 4g + c; d, c [t, b, 0, r] float32 with
               c = mn + 8 d (w = d q + mn: lanes.py's docstring), or d, mn as float16 bits
               (the kernel forms c = mn + 8 d in float32: the same value)
      kind Q5  (Q5_0, Q5_1, Q5_K):     as Q4 for the low 4 bits of q in 0..31, with c =
               mn + 16 d, and qh[t, b, g, L, h] uint32: bit 4 rr + c is the high bit of
               row 8 L + rr, input 16 h + 4 g + c (1 bit per weight, as the file has it)
      kind Q8  (Q8_0, IQ4_NL, IQ4_XS, MXFP4): qs[t, b, g, r, c] int8, g < 8 (input
               4g + c); d [t, b, 0, r]
      kind Q8X2 (Q6_K):                 as Q8 with d [t, b, h, r], h = 16-input half
      compact (Q4_K, Q6_K by default: ``repack_compact``): qs as Q4 / Q8X2, the scales as
               the file's small integers per block and float32 d (, dmin) per super-block
               (0.59 / 1.08 bytes per weight; the kernel multiplies them out exactly)
  so one 32-byte load holds 4 consecutive bytes of each of 8 rows, what the integer
  instructions need to produce 8 rows' int32 dot products in one register. The weights
  are gguf's exactly: `decompose` gives int8 q and float32 D, M with D * q + M equal,
  bit for bit, to gguf.quants.dequantize (K-quants' D = d * sc is an exact float32
  product). Scales: the file's float16 for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL
  (F16_SCALES; the kernels widen them exactly with F16C), float32 for the others. Memory
  per weight: Q4_1 0.625 byte (= the file), Q4_0 0.625 (1.11x), Q4_K 0.75 (1.33x), Q5_1
  0.75 (=), Q5_0 0.75 (1.09x), Q5_K 0.875 (1.27x), Q8_0 1.0625 (=), IQ4_NL 1.0625
  (1.89x), Q6_K 1.25 (1.52x), IQ4_XS / MXFP4 1.125.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from aotx.engine.backend import quants
from aotx.engine.backend.cpu import markers as cpu_markers

R = cpu_markers.R         # output rows per tile in the repacked layouts

KIND_OF: dict[T, str] = {
    T.Q4_0: "q4", T.Q4_1: "q4", T.Q4_K: "q4",
    T.Q5_0: "q5", T.Q5_1: "q5", T.Q5_K: "q5",
    T.Q8_0: "q8", T.IQ4_NL: "q8", T.IQ4_XS: "q8", T.MXFP4: "q8",
    T.Q6_K: "q8x2",
}
# Q3_K would fit Q8X2 exactly (q in -4..3, a scale per 16) but at 2.9x its file size; it
# stays in its file layout on the float path, as does Q2_K.
# Types whose scales the file keeps as float16 and the tiles keep so too (the kernels
# widen them exactly; Q4_0's mn = -8 d is float16-exact): the bytes per weight of the file.
F16_SCALES = frozenset({T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.Q5_1, T.IQ4_NL})
# the K-quants with a compact tile layout (repack_compact; markers.COMPACT's kinds)
COMPACT_OF: dict[T, str] = {T.Q4_K: "q4k", T.Q6_K: "q6p"}

IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)  # e2m1, doubled


# ------------------------------------------------------------------ decomposition

def _f16(a: np.ndarray) -> np.ndarray:
    """float32 from little-endian float16 bytes: a uint8 (..., 2) -> (...)."""
    return np.ascontiguousarray(a).view(np.float16)[..., 0].astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """uint8 (..., 16) block bytes -> (..., 32) values: low nibbles (inputs 0..15), then
    high nibbles (inputs 16..31), the order of block_q4_0 / q4_1 / iq4_nl / mxfp4."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """uint8 (..., 4) little-endian u32 -> (..., 32) bits, bit j = element j."""
    return (np.unpackbits(qh, axis=-1, bitorder="little")).astype(np.uint8)


def _k_scale_min(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 6-bit (scale, min) pairs of a Q4_K / Q5_K super-block from its 12 packed bytes
    (..., 12) (ggml-quants.c get_scale_min_k4) -> two (..., 8) arrays."""
    s = sc.astype(np.int32)
    lo_s, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_s = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return np.concatenate([lo_s, hi_s], -1), np.concatenate([lo_m, hi_m], -1)


def decompose(b: np.ndarray, qtype: T, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """A repackable type's rows as integers and scales: uint8 (m, row_bytes) ->
    (q int8 (m, k), D float32 (m, k / B), M float32 (m, k / B) or None, B), with B = 32 or
    16 inputs per scale, such that float32 D * q (+ M) equals gguf's dequantization bit for
    bit (ggml-common.h block layouts; gguf/quants.py's dequantize_blocks)."""
    m = b.shape[0]
    be, bb = GGML_QUANT_SIZES[qtype]
    blk = np.asarray(b).reshape(m, k // be, bb)
    if qtype in (T.Q4_0, T.Q4_1, T.IQ4_NL):
        o = 4 if qtype == T.Q4_1 else 2
        nib = _nibbles32(blk[:, :, o:o + 16])
        d = _f16(blk[:, :, 0:2])
        if qtype == T.Q4_0:
            return (nib.astype(np.int8) - 8).reshape(m, k), d, None, 32
        if qtype == T.IQ4_NL:
            return IQ4_NL_VALUES[nib].reshape(m, k), d, None, 32
        return nib.astype(np.int8).reshape(m, k), d, _f16(blk[:, :, 2:4]), 32
    if qtype in (T.Q5_0, T.Q5_1):
        o = 2 if qtype == T.Q5_0 else 4
        q = _nibbles32(blk[:, :, o + 4:o + 20]) | (_bits32(blk[:, :, o:o + 4]) << 4)
        d = _f16(blk[:, :, 0:2])
        if qtype == T.Q5_0:
            return (q.astype(np.int8) - 16).reshape(m, k), d, None, 32
        return q.astype(np.int8).reshape(m, k), d, _f16(blk[:, :, 2:4]), 32
    if qtype == T.Q8_0:
        return blk[:, :, 2:34].view(np.int8).reshape(m, k), _f16(blk[:, :, 0:2]), None, 32
    if qtype == T.MXFP4:
        e = blk[:, :, 0].astype(np.uint32)
        bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32)
        return MXFP4_VALUES[_nibbles32(blk[:, :, 1:17])].reshape(m, k), bits.view(np.float32), None, 32
    nsb = k // 256
    if qtype in (T.Q4_K, T.Q5_K):
        d = _f16(blk[:, :, 0:2])[..., None]
        dmin = _f16(blk[:, :, 2:4])[..., None]
        sc, mn = _k_scale_min(blk[:, :, 4:16])
        D = (d * sc.astype(np.float32)).reshape(m, nsb * 8)
        M = -(dmin * mn.astype(np.float32)).reshape(m, nsb * 8)
        o = 16 if qtype == T.Q4_K else 48
        qs = blk[:, :, o:o + 128].reshape(m, nsb, 4, 32)
        q = np.stack([qs & 15, qs >> 4], axis=3).reshape(m, nsb, 8, 32)     # sub-block 2g + h
        if qtype == T.Q5_K:
            qh = blk[:, :, 16:48]                                           # bit j of byte l: sub-block j
            q = q | (((qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1) << 4)
        return q.astype(np.int8).reshape(m, k), D, M, 32
    if qtype == T.IQ4_XS:
        d = _f16(blk[:, :, 0:2])[..., None]
        sh = blk[:, :, 2:4].copy().view(np.uint16)[..., 0].astype(np.int32)
        sl = blk[:, :, 4:8].astype(np.int32)
        j = np.arange(8)
        ls = ((sl[:, :, j // 2] >> (4 * (j % 2))) & 15) | (((sh[..., None] >> (2 * j)) & 3) << 4)
        D = (d * (ls - 32).astype(np.float32)).reshape(m, nsb * 8)
        q = _nibbles32(blk[:, :, 8:136].reshape(m, nsb, 8, 16))
        return IQ4_NL_VALUES[q].reshape(m, k), D, None, 32
    if qtype == T.Q6_K:
        ql = blk[:, :, 0:128].reshape(m, nsb, 2, 64)
        qh = blk[:, :, 128:192].reshape(m, nsb, 2, 32)
        lo = np.concatenate([ql & 15, ql >> 4], axis=3)                       # (m, nsb, 2, 128)
        hi = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3)
        q = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8).reshape(m, k)
        sc = blk[:, :, 192:208].view(np.int8).astype(np.float32)
        D = (_f16(blk[:, :, 208:210])[..., None] * sc).reshape(m, nsb * 16)
        return q, D, None, 16
    raise ValueError(f"{qtype.name} has no integer decomposition")


def combine(q: np.ndarray, D: np.ndarray, M: np.ndarray | None, B: int) -> np.ndarray:
    """float32 (m, k) = D * q (+ M), per B-input scale: the inverse of `decompose`."""
    m, k = q.shape
    w = np.repeat(D, B, axis=1) * q.astype(np.float32)
    return w if M is None else w + np.repeat(M, B, axis=1)


# ------------------------------------------------------------------ repacking at load

def _tile(a: np.ndarray, m_pad: int) -> np.ndarray:
    """Zero-pad rows to m_pad, then: (m, nb, G*4) bytes -> (m_pad/R, nb, G, R, 4);
    (m, nb, S) scales -> (m_pad/R, nb, S, R). Contiguous."""
    m = a.shape[0]
    if m_pad != m:
        a = np.concatenate([a, np.zeros((m_pad - m,) + a.shape[1:], a.dtype)])
    nb, w = a.shape[1:]
    if a.dtype != np.float32:
        a = a.reshape(m_pad // R, R, nb, w // 4, 4)
        return np.ascontiguousarray(a.transpose(0, 2, 3, 1, 4))
    return np.ascontiguousarray(a.reshape(m_pad // R, R, nb, w).transpose(0, 2, 3, 1))


class _NotHalf(ValueError):
    """A scale does not fit float16 (Q4_0's -8 d beyond 65504)."""


def repack(b: np.ndarray, qtype: T, m: int, k: int, half: bool | None = None
           ) -> tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Repack uint8 (m, row_bytes) rows of a type in KIND_OF into (kind, qs, qh, d, mn)
    tiles (module docstring; qh is an empty (0, 0, 4, 4, 2) array and mn an empty (0, 0,
    1, R) one for kinds without them). Scales are float16 bits (uint16) for the types in
    F16_SCALES, else float32. Reads the rows in slabs so a memmap is never copied whole."""
    if half is None:
        try:
            return repack(b, qtype, m, k, qtype in F16_SCALES)
        except _NotHalf:
            return repack(b, qtype, m, k, False)
    kind = KIND_OF[qtype]
    nb = k // 32
    m_pad = -(-m // R) * R
    nt = m_pad // R
    G, S = cpu_markers.GROUPS[kind], cpu_markers.SCALES[kind]
    nibbles = kind in ("q4", "q5")
    qs = np.empty((nt, nb, G, R, 4), np.uint8 if nibbles else np.int8)
    qh = np.empty((nt, nb, 4, R // 8, 2), np.uint32) if kind == "q5" else np.empty((0, 0, 4, R // 8, 2), np.uint32)
    sdt = np.uint16 if half else np.float32
    d = np.empty((nt, nb, S, R), sdt)
    has_min = kind in cpu_markers.OFFSET
    mn = np.empty((nt, nb, 1, R), sdt) if has_min else np.empty((0, 0, 1, R), sdt)
    slab = 64 * R
    for r0 in range(0, m_pad, slab):
        r1 = min(m_pad, r0 + slab)
        q, D, M, B = decompose(np.asarray(b[r0:min(r1, m)]), qtype, k)
        t0, t1 = r0 // R, r1 // R
        rows = q.shape[0]
        d[t0:t1] = _scales(_tile(D.reshape(rows, nb, S), r1 - r0), half)
        if nibbles:
            u = q.reshape(rows, nb, 32).astype(np.int16)
            if qtype in (T.Q4_0, T.Q5_0):   # q = u - 8 (or 16); w = d q = d u + (-8 d)
                off = cpu_markers.OFFSET[kind]
                u = u + off
                M = np.float32(-off) * D
            nib = u & 15
            qs[t0:t1] = _tile((nib[:, :, :16] | (nib[:, :, 16:] << 4)).astype(np.uint8), r1 - r0)
            if kind == "q5":
                qh[t0:t1] = _high_bits((u >> 4).astype(np.uint8), r1 - r0)
        else:
            qs[t0:t1] = _tile(q.reshape(rows, nb, 32), r1 - r0)
        if has_min:                         # the kernels take c = mn + off * d (lanes.py)
            C = M if half else M + np.float32(cpu_markers.OFFSET[kind]) * D
            mn[t0:t1] = _scales(_tile(C.reshape(rows, nb, 1), r1 - r0), half)
    return kind, qs, qh, d, mn


def _high_bits(hb: np.ndarray, m_pad: int) -> np.ndarray:
    """(m, nb, 32) 0/1 high bits (input order) -> (m_pad/R, nb, 4, R/8, 2) uint32: for
    group g, 8-row lane group L and half h, bit 4 rr + c = the high bit of row 8 L + rr,
    input 16 h + 4 g + c (byte 4 rr + c of that group's 32-byte nibble load)."""
    m = hb.shape[0]
    if m_pad != m:
        hb = np.concatenate([hb, np.zeros((m_pad - m,) + hb.shape[1:], hb.dtype)])
    nb = hb.shape[1]
    a = hb.reshape(m_pad // R, R // 8, 8, nb, 2, 4, 4)             # t, L, rr, b, h, g, c
    a = np.ascontiguousarray(a.transpose(0, 3, 5, 1, 4, 2, 6))     # t, b, g, L, h, rr, c
    return np.packbits(a.reshape(-1, 32), axis=-1, bitorder="little").view(np.uint32).reshape(
        m_pad // R, nb, 4, R // 8, 2)


def _scales(a: np.ndarray, half: bool) -> np.ndarray:
    """float32 scales as stored: float16 bits (exact: they came from the file's float16)."""
    if not half:
        return a
    h = a.astype(np.float16)
    if not np.array_equal(h.astype(np.float32), a, equal_nan=True):
        raise _NotHalf("a scale is not a float16 value")
    return h.view(np.uint16)



def repack_compact(b: np.ndarray, qtype: T, m: int, k: int, kind: str | None = None
                   ) -> tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q6_K rows (uint8 (m, row_bytes)) as a compact kind's tiles (markers.COMPACT):
    qs as ``repack`` lays out Q4_K (kind q4) or Q6_K (q8x2); d (T, nb, 2, R) the file's
    scale integers per block and row (Q4_K: uint8 sc then mn, 6 bits each; Q6_K: int8 sc
    of the block's two 16-input halves); qh (T, nsb, 2 or 1, R) float32 the super-block's
    d (and dmin) per row; mn empty. The kernel forms D = d sc, M = -(dmin mn) and c = M +
    8 D as ``decompose`` and ``repack`` do: the same values, bit for bit. Q6_K's default
    kind q6p packs its quants too (markers.Q6P: u = q + 32 as Q4 nibbles in qs, the 2 high
    bits in mn (T, nb, 2, R, 4)); kind="q6k" keeps them as int8 (Q8X2's qs, mn empty)."""
    kind = kind or COMPACT_OF[qtype]
    nb, nsb = k // 32, k // 256
    m_pad = -(-m // R) * R
    nt = m_pad // R
    G = cpu_markers.GROUPS[kind]
    n_s = 2 if kind == "q4k" else 1
    qs = np.empty((nt, nb, G, R, 4), np.int8 if kind == "q6k" else np.uint8)
    hi = np.empty((nt, nb, 2, R, 4) if kind == "q6p" else (0, 0, 1, R), np.uint8)
    sc = np.empty((nt, nb, 2, R), np.uint8 if kind == "q4k" else np.int8)
    sb = np.empty((nt, nsb, n_s, R), np.float32)
    be, bb = GGML_QUANT_SIZES[qtype]

    def lay(a: np.ndarray, rows: int) -> np.ndarray:    # (rows, x, y) -> (rows_pad / R, x, y, R)
        if rows % R:
            a = np.concatenate([a, np.zeros((R - rows % R,) + a.shape[1:], a.dtype)])
        return np.ascontiguousarray(a.reshape(-1, R, a.shape[1], a.shape[2]).transpose(0, 2, 3, 1))

    slab = 64 * R
    for r0 in range(0, m_pad, slab):
        r1 = min(m_pad, r0 + slab)
        raw = np.asarray(b[r0:min(r1, m)])
        rows = raw.shape[0]
        t0, t1 = r0 // R, r1 // R
        q, _, _, _ = decompose(raw, qtype, k)
        blk = raw.reshape(rows, nsb, bb)
        if kind == "q4k":
            u = q.reshape(rows, nb, 32).astype(np.uint8)
            qs[t0:t1] = _tile((u[:, :, :16] | (u[:, :, 16:] << 4)).astype(np.uint8), r1 - r0)
            s6, m6 = _k_scale_min(blk[:, :, 4:16])                        # (rows, nsb, 8) each
            sc[t0:t1] = lay(np.stack([s6.reshape(rows, nb), m6.reshape(rows, nb)], -1).astype(np.uint8), rows)
            dd = np.stack([_f16(blk[:, :, 0:2]), _f16(blk[:, :, 2:4])], -1)  # (rows, nsb, 2)
        else:
            if kind == "q6p":
                u = (q.reshape(rows, nb, 32).astype(np.int16) + 32).astype(np.uint8)
                nib = u & 15
                qs[t0:t1] = _tile((nib[:, :, :16] | (nib[:, :, 16:] << 4)).astype(np.uint8), r1 - r0)
                hb = (u >> 4).reshape(rows, nb, 2, 4, 4)                          # row, block, half, g, c
                h = np.zeros((r1 - r0, nb, 2, 4), np.uint8)
                for g in range(4):
                    h[:rows] |= hb[:, :, :, g, :] << np.uint8(2 * g)
                hi[t0:t1] = h.reshape(-1, R, nb, 2, 4).transpose(0, 2, 3, 1, 4)
            else:
                qs[t0:t1] = _tile(q.reshape(rows, nb, 32), r1 - r0)
            sc[t0:t1] = lay(blk[:, :, 192:208].view(np.int8).reshape(rows, nb, 2), rows)
            dd = _f16(blk[:, :, 208:210])[..., None]
        sb[t0:t1] = lay(dd.astype(np.float32), rows)
    return kind, qs, sb, sc, hi


def tile_shapes(qtype: T, m: int, k: int, compact: bool = False) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The shapes and dtypes of ``repack``'s (qs, qh, d, mn) for an (m, k) matrix of a type
    in KIND_OF with the scales as ``repack(..., half=qtype in F16_SCALES)`` stores them (or
    with ``compact``, ``repack_compact``'s for a type in COMPACT_OF), so a caller can lay
    out many matrices' tiles in one array (the expert stacks: experts/stacks.py)."""
    nb, nt = k // 32, -(-m // R)
    if compact:
        kind = COMPACT_OF[qtype]
        q4 = kind == "q4k"
        return {"qs": ((nt, nb, cpu_markers.GROUPS[kind], R, 4), np.dtype(np.int8 if kind == "q6k" else np.uint8)),
                "qh": ((nt, k // 256, 2 if q4 else 1, R), np.dtype(np.float32)),
                "d": ((nt, nb, 2, R), np.dtype(np.uint8 if q4 else np.int8)),
                "mn": ((nt, nb, 2, R, 4) if kind == "q6p" else (0, 0, 1, R), np.dtype(np.uint8))}
    kind = KIND_OF[qtype]
    sdt = np.dtype(np.uint16 if qtype in F16_SCALES else np.float32)
    G, S = cpu_markers.GROUPS[kind], cpu_markers.SCALES[kind]
    return {"qs": ((nt, nb, G, R, 4), np.dtype(np.uint8 if kind in ("q4", "q5") else np.int8)),
            "qh": ((nt, nb, 4, R // 8, 2) if kind == "q5" else (0, 0, 4, R // 8, 2), np.dtype(np.uint32)),
            "d": ((nt, nb, S, R), sdt),
            "mn": ((nt, nb, 1, R) if kind in cpu_markers.OFFSET else (0, 0, 1, R), sdt)}



def _byte_rows(raw: np.ndarray, qtype: T, k: int) -> np.ndarray:
    """quants.as_byte_rows for the supported types, and for the types only this module
    reads (KIND_OF's, until quants.py knows them)."""
    if qtype in quants.SUPPORTED_TYPES or qtype not in KIND_OF:
        return quants.as_byte_rows(raw, qtype, k)
    be, bb = GGML_QUANT_SIZES[qtype]
    if k % be:
        raise ValueError(f"row length {k} is not a multiple of the {qtype.name} block size {be}")
    b = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if b.size % (k // be * bb):
        raise ValueError(f"{qtype.name} tensor of {b.size} bytes is not a whole number of rows of {k} elements")
    return b.reshape(-1, k // be * bb)


def _dequantize(b: np.ndarray, qtype: T, k: int, ids: np.ndarray, out: np.ndarray) -> None:
    """out (n, k) float32 = gguf's dequantization of rows ids of b."""
    if qtype in quants.SUPPORTED_TYPES:
        quants.dequantize_byte_rows(b, qtype, ids, out)
    else:
        out[...] = combine(*decompose(np.asarray(b[ids]), qtype, k))
