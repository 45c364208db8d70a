"""A CPU model, float32 bit for bit, of the int8 decode GEMV's reduction order and of the MMQ's.

Owns: numpy forms of what the CUDA kernels compute on int8 activations
(``engine/backend/cuda/kernels/dequant.cuh``, ``gemv.cu``, ``mmq.cu``):

* ``q8_weights``: a weight matrix's blocks as ``q8w<T>`` reads them (per 32-input block the
  int8 levels, the float scale ``dw``, the offset ``mw``, the integer sub-block scales
  ``sa``/``sb``), for every type of ``Q8_TYPES``, from the GGUF bytes;
* ``quant_rows``: the activation rows as ``quant_rows`` writes them (int8 levels per
  32-input block, ``dx`` = max|x| / 127, the block's float sum by the warp butterfly);
* ``block_terms``: q8dot's contribution of every (weight row, batch row, block): the exact
  integer dot product, then ``(dw * dx) * float(isum)`` and, for types with an offset, one
  fused multiply-add of ``mw * sum x`` (``fma32``: one rounding, as ``fmaf``);
* ``gemv_sums``: the GEMV's order: virtual lane ``v`` adds its blocks ``v, v + 128, ...``
  from 0, the warp butterfly (xor 16, 8, 4, 2, 1) per group of 32 lanes, then
  ``((R0 + R1) + R2) + R3``;
* ``mmq_sums``: the MMQ's order as ``mmq.cu`` runs it: the 128 lanes visited group by group
  in the butterfly tree's leaf order (lane ``32 g + bitrev5(p)``), each lane's blocks summed
  when it is visited, and the tree formed by a stack of pending subtree sums (merge as many
  times as ``p`` has trailing one bits); with a split S, S warp sets each form one subtree
  of 32 / S leaves and the tree's top levels add those;
* ``epilogue``: ``gemv_out`` for the store, add, SwiGLU and GEGLU modes.

``tests/test_cuda_mmq_model.py`` proves the two orders give the same bits on random data
for every type, and ``tests/tools/gpu_fake_cupy.py`` emulates ``quant_rows``, the int8
``gemv`` and ``mmq`` with these functions (its ``emulate`` flag). Leaves the kernels'
memory layout and launch geometry to the kernels and ``engine/backend/cuda/mmq.py``; the
GPU checks the kernels themselves (``tests/test_cuda_mmq.py``).

Shapes: weights ``(m, row_bytes)`` uint8; activations ``(B, k)`` float32; per-block terms
``(m, B, nu)`` float32 with ``nu = k / 32``.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

f32 = np.float32

#: per type with an integer form: (has an offset ``mw``, two 16-input sub-block scales)
Q8_TRAITS = {T.Q4_0: (False, False), T.Q4_1: (True, False), T.Q5_0: (False, False), T.Q5_1: (True, False),
             T.Q8_0: (False, False), T.Q3_K: (False, True), T.Q4_K: (True, False), T.Q5_K: (True, False),
             T.Q6_K: (False, True), T.IQ4_NL: (False, False), T.IQ4_XS: (False, False), T.MXFP4: (False, False)}
# ggml-common.h kvalues_iq4nl, and kvalues_mxfp4 (the E2M1 values doubled)
KV_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int32)
KV_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int32)


def bitrev5(p: int) -> int:
    """The lane of leaf ``p`` (0..31) of the butterfly tree: ``p``'s five bits reversed."""
    return int(f"{p:05b}"[::-1], 2)


# ---- float32 arithmetic as the kernels do it --------------------------------------------------------

def fma32(a, b, c) -> np.ndarray:
    """``fmaf(a, b, c)`` on float32 arrays: ``a * b + c`` rounded once (round to nearest even).
    The product is exact in float64; TwoSum gives the float64 sum's error, which decides a
    float32 tie the float64 rounding may have made."""
    a64 = np.asarray(a, f32).astype(np.float64)
    b64 = np.asarray(b, f32).astype(np.float64)
    c64 = np.asarray(c, f32).astype(np.float64)
    p = a64 * b64
    s = p + c64
    bp = s - c64
    e = (p - bp) + (c64 - (s - bp))
    r = s.astype(f32)
    r64 = r.astype(np.float64)
    toward = np.where(s > r64, np.float32(np.inf), np.float32(-np.inf)).astype(f32)
    other = np.nextafter(r, toward)
    o64 = other.astype(np.float64)
    tie = (s != r64) & (np.abs(s - r64) == np.abs(o64 - s)) & (e != 0)
    pick = tie & (np.sign(e) == np.sign(o64 - s))
    return np.where(pick, other, r).astype(f32)


def warp_sum(vals: np.ndarray) -> np.ndarray:
    """``warp_sum`` over axis 0 (32 lanes): every stage ``v(lane) + v(lane ^ o)`` for o = 16,
    8, 4, 2, 1, in float32; the value every lane ends with (lane 0's)."""
    v = np.asarray(vals, f32).copy()
    lanes = np.arange(32)
    for o in (16, 8, 4, 2, 1):
        v = (v + v[lanes ^ o]).astype(f32)
    return v[0]


# ---- the weight side: q8w<T> -----------------------------------------------------------------------

def _f16(blk: np.ndarray, off: int) -> np.ndarray:
    return blk[..., off:off + 2].copy().view(np.float16)[..., 0].astype(f32)


def _u32(blk: np.ndarray, off: int) -> np.ndarray:
    return blk[..., off:off + 4].copy().view("<u4")[..., 0].astype(np.int64)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes (..., 16) as 32 levels: low nibbles are elements 0..15, high ones 16..31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int32)


def q8_weights(raw: np.ndarray, qtype: int, k: int):
    """``q8w<T>`` of every block of every row: ``(levels (m, nu, 32) int32, dw (m, nu) float32,
    mw (m, nu) float32, sa (m, nu) int32, sb (m, nu) int32)``; the weight is
    ``dw * s * level + mw`` with ``s`` = sa for inputs 0..15 and sb for 16..31 (1 where the type
    has no sub-block scales)."""
    qt = T(int(qtype))
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(raw.shape[0], -1)
    m = raw.shape[0]
    be, bb = GGML_QUANT_SIZES[qt]
    nu = k // 32
    blk = raw.reshape(m, k // be, bb).astype(np.int64)
    ones = np.ones((m, nu), np.int32)
    zeros = np.zeros((m, nu), f32)
    if qt in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL, T.MXFP4):
        if qt == T.Q4_0:
            lv, dw, mw = _nibbles(blk[:, :, 2:18]) - 8, _f16(raw.reshape(m, nu, bb), 0), zeros
        elif qt == T.Q4_1:
            lv, dw, mw = _nibbles(blk[:, :, 4:20]), _f16(raw.reshape(m, nu, bb), 0), _f16(raw.reshape(m, nu, bb), 2)
        elif qt in (T.Q5_0, T.Q5_1):
            o = 2 if qt == T.Q5_0 else 4
            qh = _u32(raw.reshape(m, nu, bb), o)
            hb = ((qh[:, :, None] >> np.arange(32)) & 1).astype(np.int32)
            lv = _nibbles(blk[:, :, o + 4:o + 20]) | (hb << 4)
            dw = _f16(raw.reshape(m, nu, bb), 0)
            if qt == T.Q5_0:
                lv, mw = lv - 16, zeros
            else:
                mw = _f16(raw.reshape(m, nu, bb), 2)
        elif qt == T.Q8_0:
            lv = raw.reshape(m, nu, bb)[:, :, 2:34].view(np.int8).astype(np.int32)
            dw, mw = _f16(raw.reshape(m, nu, bb), 0), zeros
        elif qt == T.IQ4_NL:
            lv, dw, mw = KV_IQ4NL[_nibbles(blk[:, :, 2:18])], _f16(raw.reshape(m, nu, bb), 0), zeros
        else:                                                  # MXFP4: E8M0 exponent, then IQ4_NL-style nibbles
            e = blk[:, :, 0].astype(np.uint32)
            bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23).astype(np.uint32)
            lv, dw, mw = KV_MXFP4[_nibbles(blk[:, :, 1:17])], bits.view(f32), zeros
        return lv, dw.astype(f32), mw.astype(f32), ones, ones
    # the 256-input types: block u is sub-block j = u % 8 of super-block u // 8
    nsb = k // 256
    lv = np.zeros((m, nsb, 8, 32), np.int32)
    dw = np.zeros((m, nsb, 8), f32)
    mw = np.zeros((m, nsb, 8), f32)
    sa = np.ones((m, nsb, 8), np.int32)
    sb = np.ones((m, nsb, 8), np.int32)
    rb = raw.reshape(m, nsb, bb)
    if qt in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(rb, 0), _f16(rb, 2)
        q = blk[:, :, 4:16]
        for j in range(8):                                     # ggml get_scale_min_k4
            if j < 4:
                sc, mn = q[:, :, j] & 63, q[:, :, j + 4] & 63
            else:
                sc = (q[:, :, j + 4] & 15) | ((q[:, :, j - 4] >> 6) << 4)
                mn = (q[:, :, j + 4] >> 4) | ((q[:, :, j] >> 6) << 4)
            dw[:, :, j] = d * sc.astype(f32)
            mw[:, :, j] = -(dmin * mn.astype(f32))
            qs0 = 16 if qt == T.Q4_K else 48
            qs = blk[:, :, qs0 + 32 * (j >> 1):qs0 + 32 * (j >> 1) + 32]
            lj = ((qs >> (4 * (j & 1))) & 15).astype(np.int32)
            if qt == T.Q5_K:
                lj = lj | ((((blk[:, :, 16:48] >> j) & 1) << 4).astype(np.int32))
            lv[:, :, j] = lj
    elif qt == T.Q6_K:
        d = _f16(rb, 208)
        sc = rb[:, :, 192:208].view(np.int8).astype(np.int32)
        for j in range(8):
            g, t = j >> 2, j & 3
            ql = blk[:, :, 64 * g + 32 * (t & 1):64 * g + 32 * (t & 1) + 32]
            qh = blk[:, :, 128 + 32 * g:128 + 32 * g + 32]
            lv[:, :, j] = ((((ql >> (4 * (t >> 1))) & 15) | (((qh >> (2 * t)) & 3) << 4)) - 32).astype(np.int32)
            dw[:, :, j] = d
            sa[:, :, j], sb[:, :, j] = sc[:, :, 8 * g + 2 * t], sc[:, :, 8 * g + 2 * t + 1]
    elif qt == T.Q3_K:
        d = _f16(rb, 108)
        for j in range(8):
            qs = blk[:, :, 32 + 32 * (j >> 2):32 + 32 * (j >> 2) + 32]
            hm = blk[:, :, 0:32]
            lv[:, :, j] = (((qs >> (2 * (j & 3))) & 3) - np.where((hm >> j) & 1, 0, 4)).astype(np.int32)
            dw[:, :, j] = d
            for h, arr in ((0, sa), (1, sb)):
                s = 2 * j + h
                lo = (blk[:, :, 96 + (s & 7)] >> (4 * (s >> 3))) & 15
                hi = (blk[:, :, 104 + (s & 3)] >> (2 * (s >> 2))) & 3
                arr[:, :, j] = (lo | (hi << 4)) - 32
    elif qt == T.IQ4_XS:
        d = _f16(rb, 0)
        sh = rb[:, :, 2:4].copy().view("<u2")[:, :, 0].astype(np.int64)
        for ib in range(8):
            ls = ((blk[:, :, 4 + (ib >> 1)] >> (4 * (ib & 1))) & 15) | (((sh >> (2 * ib)) & 3) << 4)
            dw[:, :, ib] = d * (ls - 32).astype(f32)
            lv[:, :, ib] = KV_IQ4NL[_nibbles(blk[:, :, 8 + 16 * ib:8 + 16 * ib + 16])]
    else:
        raise ValueError(f"{qt.name} has no integer form (q8w)")
    return (lv.reshape(m, nu, 32), dw.reshape(m, nu), mw.reshape(m, nu), sa.reshape(m, nu), sb.reshape(m, nu))


def dequant_from_q8(w) -> np.ndarray:
    """float64 (m, k) weights from ``q8_weights``' parts (a check of their meaning)."""
    lv, dw, mw, sa, sb = w
    s = np.concatenate([np.repeat(sa[:, :, None], 16, 2), np.repeat(sb[:, :, None], 16, 2)], axis=2)
    out = dw.astype(np.float64)[:, :, None] * s * lv + mw.astype(np.float64)[:, :, None]
    return out.reshape(lv.shape[0], -1)


# ---- the activation side: quant_rows ----------------------------------------------------------------

def quant_rows(x: np.ndarray, nw: np.ndarray | None = None, eps: float = 1e-5):
    """``quant_rows`` on float32 rows (B, k): ``(xq (B, k) int8, dx (B, nu) float32, sx (B, nu)
    float32, xs (B,) float32)``. ``xs`` (the RMSNorm scale, with ``nw``) is rsqrt(mean(x^2) +
    eps) in numpy: the device's ``rsqrtf`` is not correctly rounded, so only the fake CuPy
    uses it (both of its GEMV forms read the same one)."""
    x = np.asarray(x, f32)
    B, k = x.shape
    v = (x * np.asarray(nw, f32)).astype(f32) if nw is not None else x.copy()
    blk = v.reshape(B, k // 32, 32)
    amax = np.abs(blk).max(axis=2)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, (f32(127.0) / amax).astype(f32), f32(0)).astype(f32)
    xq = np.rint((blk * inv[:, :, None]).astype(f32)).astype(np.int8).reshape(B, k)
    dx = (amax / f32(127.0)).astype(f32)
    sx = warp_sum(np.moveaxis(blk, 2, 0))
    ss = (x.astype(np.float64) ** 2).mean(axis=1)
    with np.errstate(divide="ignore"):
        xs = (1.0 / np.sqrt(ss + eps)).astype(f32)
    return xq, dx, sx.astype(f32), xs


# ---- q8dot -------------------------------------------------------------------------------------------

def block_terms(w, qtype: int, xq: np.ndarray, dx: np.ndarray, sx: np.ndarray) -> np.ndarray:
    """q8dot of every (weight row, batch row, block): float32 (m, B, nu)."""
    has_min, sub16 = Q8_TRAITS[T(int(qtype))]
    lv, dw, mw, sa, sb = w
    m, nu, _ = lv.shape
    B = xq.shape[0]
    xl = xq.reshape(B, nu, 32).astype(np.int64)
    s0 = np.einsum("mui,bui->mbu", lv[:, :, :16].astype(np.int64), xl[:, :, :16])
    s1 = np.einsum("mui,bui->mbu", lv[:, :, 16:].astype(np.int64), xl[:, :, 16:])
    isum = sa[:, None, :] * s0 + sb[:, None, :] * s1 if sub16 else s0 + s1
    assert np.abs(isum).max(initial=0) < 1 << 24, "isum exceeds float32's exact integers"
    t = ((dw[:, None, :] * dx[None, :, :]).astype(f32) * isum.astype(f32)).astype(f32)
    if has_min:
        t = fma32(np.broadcast_to(mw[:, None, :], t.shape), np.broadcast_to(sx[None, :, :], t.shape), t)
    return t


# ---- the two reduction orders ----------------------------------------------------------------------

def lane_sums(terms: np.ndarray) -> np.ndarray:
    """Each virtual lane's sum: (128, ...) float32; lane v adds blocks v, v + 128, ... from 0."""
    nu = terms.shape[-1]
    out = np.zeros((128,) + terms.shape[:-1], f32)
    for v in range(128):
        acc = np.zeros(terms.shape[:-1], f32)
        for u in range(v, nu, 128):
            acc = (acc + terms[..., u]).astype(f32)
        out[v] = acc
    return out


def gemv_sums(terms: np.ndarray) -> np.ndarray:
    """The int8 GEMV's sums (gemv.cu, gemv_sums): lanes, the butterfly per group of 32,
    ``((R0 + R1) + R2) + R3``. ``terms`` (..., nu) -> (...)."""
    lanes = lane_sums(terms)
    tot = warp_sum(lanes[0:32])
    for g in (1, 2, 3):
        tot = (tot + warp_sum(lanes[32 * g:32 * g + 32])).astype(f32)
    return tot


def mmq_sums(terms: np.ndarray, split: int = 1, chain: bool = False) -> np.ndarray:
    """The MMQ's sums, as mmq.cu's leaf loop forms them (see the module docstring). ``split``
    (mmq.cu's S: 1, 2 or 4): warp set s of a block visits the leaves p = s 32 / S .. (s + 1)
    32 / S - 1 of each group with a stack of its own, which ends with that subtree's sum P_s;
    the group's sum is P_0 (S 1), P_0 + P_1 (S 2) or (P_0 + P_1) + (P_2 + P_3) (S 4): the
    tree's top levels over those subtrees. ``chain``: ((P_0 + P_1) + P_2) + P_3 instead (a
    wrong order, for the tests' counter-example)."""
    nu = terms.shape[-1]
    shape = terms.shape[:-1]
    ls = 32 // split
    tot = np.zeros(shape, f32)
    for g in range(4):
        parts = []
        for s_ in range(split):
            st = [np.zeros(shape, f32) for _ in range(5)]
            part = None
            for t in range(ls):
                v = 32 * g + bitrev5(s_ * ls + t)
                acc = np.zeros(shape, f32)
                for r in range(rounds(v, nu)):
                    acc = (acc + terms[..., v + 128 * r]).astype(f32)
                tz = trailing_ones(t)
                x = acc
                for lv in range(5):
                    if lv < tz:
                        x = (st[lv] + x).astype(f32)
                if t == ls - 1:
                    part = x                       # tz(ls - 1) = log2(ls): the subtree's root
                else:
                    st[tz] = x
            parts.append(part)
        if split == 1:
            rg = parts[0]
        elif split == 2:
            rg = (parts[0] + parts[1]).astype(f32)
        elif chain:
            rg = (((parts[0] + parts[1]).astype(f32) + parts[2]).astype(f32) + parts[3]).astype(f32)
        else:
            rg = ((parts[0] + parts[1]).astype(f32) + (parts[2] + parts[3]).astype(f32)).astype(f32)
        tot = rg if g == 0 else (tot + rg).astype(f32)
    return tot


def rounds(v: int, nu: int) -> int:
    """How many blocks virtual lane ``v`` adds (blocks v, v + 128, ... below nu)."""
    return (nu - 1 - v) // 128 + 1 if v < nu else 0


def trailing_ones(p: int) -> int:
    """The trailing one bits of ``p`` (0..31): how many pending subtrees leaf p closes (5 at p = 31)."""
    n = 0
    while n < 5 and (p >> n) & 1:
        n += 1
    return n


# ---- the epilogue (gemv_out) -----------------------------------------------------------------------

def silu(g: np.ndarray) -> np.ndarray:
    return (g / (f32(1) + np.exp(-g)).astype(f32)).astype(f32)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, f32)
    inner = (f32(0.7978845608028654) * x * (f32(1) + f32(0.044715) * x * x)).astype(f32)
    return (f32(0.5) * x * (f32(1) + np.tanh(inner))).astype(f32)


def epilogue(a: np.ndarray, c: np.ndarray, mode: int, sc: np.ndarray | None, ba: np.ndarray, bb: np.ndarray):
    """gemv_out's values for one pair set: ``a``, ``c`` (n_pairs, B) sums of the A and B rows,
    ``sc`` (B,) the norm scales (None: no norm), ``ba``, ``bb`` (n_pairs,) biases. Returns the
    two rows' values (store and add modes: the caller adds) or, for SwiGLU (2) / GEGLU (4),
    the one value per pair (then ``c`` is None in the result)."""
    if sc is not None:
        a = (a * sc[None, :]).astype(f32)
        c = (c * sc[None, :]).astype(f32)
    a = (a + ba[:, None]).astype(f32)
    c = (c + bb[:, None]).astype(f32)
    if mode == 2:
        return (silu(a) * c).astype(f32), None
    if mode == 4:
        return (gelu_tanh(a) * c).astype(f32), None
    return a, c
