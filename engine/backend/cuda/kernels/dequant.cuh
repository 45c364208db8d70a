// inputs 8u .. 8u+7 of one row
template <int T> __device__ __forceinline__ void deq8(const u8* __restrict__ row, int u, float* w);

template <> __device__ __forceinline__ void deq8<0>(const u8* __restrict__ row, int u, float* w) {  // F32
    const float4* p = (const float4*)(row + 32 * u);
    float4 a = p[0], b = p[1];
    w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w; w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
}
template <> __device__ __forceinline__ void deq8<1>(const u8* __restrict__ row, int u, float* w) {  // F16
    uint4 v = *(const uint4*)(row + 16 * u);
    u32 a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) { w[2 * i] = h2f((u16)(a[i] & 0xffff)); w[2 * i + 1] = h2f((u16)(a[i] >> 16)); }
}
template <> __device__ __forceinline__ void deq8<30>(const u8* __restrict__ row, int u, float* w) {  // BF16
    uint4 v = *(const uint4*)(row + 16 * u);
    u32 a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) { w[2 * i] = bf2f((u16)(a[i] & 0xffff)); w[2 * i + 1] = bf2f((u16)(a[i] >> 16)); }
}
template <> __device__ __forceinline__ void deq8<2>(const u8* __restrict__ row, int u, float* w) {  // Q4_0: d | qs[16]
    const u8* b = row + 18 * (u >> 2);
    int q = u & 3;
    float d = h2f(ld16(b));
    u32 lo = ld32_2(b + 2 + 8 * (q & 1)), hi = ld32_2(b + 6 + 8 * (q & 1));
    int sh = (q >> 1) * 4;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        w[i] = d * (float)((int)((lo >> (8 * i + sh)) & 15) - 8);
        w[4 + i] = d * (float)((int)((hi >> (8 * i + sh)) & 15) - 8);
    }
}
template <> __device__ __forceinline__ void deq8<3>(const u8* __restrict__ row, int u, float* w) {  // Q4_1: d | m | qs[16]
    const u8* b = row + 20 * (u >> 2);
    int q = u & 3;
    u32 dm = *(const u32*)b;
    float d = h2f((u16)(dm & 0xffff)), m = h2f((u16)(dm >> 16));
    const u32* qs = (const u32*)(b + 4 + 8 * (q & 1));
    u32 lo = qs[0], hi = qs[1];
    int sh = (q >> 1) * 4;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        w[i] = d * (float)((lo >> (8 * i + sh)) & 15) + m;
        w[4 + i] = d * (float)((hi >> (8 * i + sh)) & 15) + m;
    }
}
template <> __device__ __forceinline__ void deq8<6>(const u8* __restrict__ row, int u, float* w) {  // Q5_0: d | qh u32 | qs[16]
    const u8* b = row + 22 * (u >> 2);
    int q = u & 3;
    float d = h2f(ld16(b));
    u32 qh = ld32_2(b + 2);
    u32 lo = ld32_2(b + 6 + 8 * (q & 1)), hi = ld32_2(b + 10 + 8 * (q & 1));
    int sh = (q >> 1) * 4;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int e0 = 8 * q + i, e1 = 8 * q + 4 + i;
        int v0 = (int)(((lo >> (8 * i + sh)) & 15) | (((qh >> e0) & 1) << 4));
        int v1 = (int)(((hi >> (8 * i + sh)) & 15) | (((qh >> e1) & 1) << 4));
        w[i] = d * (float)(v0 - 16);
        w[4 + i] = d * (float)(v1 - 16);
    }
}
template <> __device__ __forceinline__ void deq8<7>(const u8* __restrict__ row, int u, float* w) {  // Q5_1: d | m | qh | qs[16]
    const u8* b = row + 24 * (u >> 2);
    int q = u & 3;
    float d = h2f(ld16(b)), m = h2f(ld16(b + 2));
    u32 qh = *(const u32*)(b + 4);
    const u32* qs = (const u32*)(b + 8 + 8 * (q & 1));
    u32 lo = qs[0], hi = qs[1];
    int sh = (q >> 1) * 4;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int e0 = 8 * q + i, e1 = 8 * q + 4 + i;
        u32 v0 = ((lo >> (8 * i + sh)) & 15) | (((qh >> e0) & 1) << 4);
        u32 v1 = ((hi >> (8 * i + sh)) & 15) | (((qh >> e1) & 1) << 4);
        w[i] = d * (float)v0 + m;
        w[4 + i] = d * (float)v1 + m;
    }
}
template <> __device__ __forceinline__ void deq8<8>(const u8* __restrict__ row, int u, float* w) {  // Q8_0: d | qs[32]
    const u8* b = row + 34 * (u >> 2);
    int q = u & 3;
    float d = h2f(ld16(b));
    u32 a = ld32_2(b + 2 + 8 * q), c = ld32_2(b + 6 + 8 * q);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        w[i] = d * (float)(i8)((a >> (8 * i)) & 255);
        w[4 + i] = d * (float)(i8)((c >> (8 * i)) & 255);
    }
}
template <> __device__ __forceinline__ void deq8<12>(const u8* __restrict__ row, int u, float* w) {  // Q4_K
    const u8* b = row + 144 * (u >> 5);
    int e0 = 8 * (u & 31), j = e0 >> 5, l0 = e0 & 31;
    u32 dm = *(const u32*)b;
    float d = h2f((u16)(dm & 0xffff)), dmin = h2f((u16)(dm >> 16));
    float sc, mn; scale_min_k4(j, b + 4, sc, mn);
    float ds = d * sc, ms = dmin * mn;
    uint2 v = *(const uint2*)(b + 16 + (j >> 1) * 32 + l0);
    int sh = 4 * (j & 1);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        w[i] = ds * (float)((v.x >> (8 * i + sh)) & 15) - ms;
        w[4 + i] = ds * (float)((v.y >> (8 * i + sh)) & 15) - ms;
    }
}
template <> __device__ __forceinline__ void deq8<13>(const u8* __restrict__ row, int u, float* w) {  // Q5_K
    const u8* b = row + 176 * (u >> 5);
    int e0 = 8 * (u & 31), j = e0 >> 5, l0 = e0 & 31;
    u32 dm = *(const u32*)b;
    float d = h2f((u16)(dm & 0xffff)), dmin = h2f((u16)(dm >> 16));
    float sc, mn; scale_min_k4(j, b + 4, sc, mn);
    float ds = d * sc, ms = dmin * mn;
    uint2 v = *(const uint2*)(b + 48 + (j >> 1) * 32 + l0);
    uint2 h = *(const uint2*)(b + 16 + l0);
    int sh = 4 * (j & 1);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 q0 = ((v.x >> (8 * i + sh)) & 15) | (((h.x >> (8 * i + j)) & 1) << 4);
        u32 q1 = ((v.y >> (8 * i + sh)) & 15) | (((h.y >> (8 * i + j)) & 1) << 4);
        w[i] = ds * (float)q0 - ms;
        w[4 + i] = ds * (float)q1 - ms;
    }
}
template <> __device__ __forceinline__ void deq8<14>(const u8* __restrict__ row, int u, float* w) {  // Q6_K
    // ql[128] | qh[64] | scales[16] (int8) | d; the 8 ql and 8 qh bytes of a unit are read as
    // aligned words (the 210-byte blocks are only 2-byte aligned) and decoded 4 at a time.
    const u8* b = row + 210 * (u >> 5);
    const int e0 = 8 * (u & 31), g = e0 >> 7, ww = e0 & 127;
    const float d = h2f(ld16(b + 208));
    const float ds = d * (float)(i8)b[192 + (e0 >> 4)];
    u32 l[2], h[2];
    ld8_2(b + g * 64 + (ww & 63), l);
    ld8_2(b + 128 + g * 32 + (ww & 31), h);
    const int shl = 4 * (ww >> 6), shh = 2 * (ww >> 5);
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const u32 q = ((l[k] >> shl) & 0x0F0F0F0Fu) | (((h[k] >> shh) & 0x03030303u) << 4);
#pragma unroll
        for (int i = 0; i < 4; i++) w[4 * k + i] = ds * (byte_f(q, i) - 32.f);
    }
}

template <> __device__ __forceinline__ void deq8<10>(const u8* __restrict__ row, int u, float* w) {  // Q2_K
    // block_q2_K (84 / 256): scales[16] (low nibble scale, high nibble min) | qs[64] | d | dmin;
    // element e: 2 bits (2 * ((e / 32) % 4)) of qs[32 * (e / 128) + e % 32], sub-block e / 16
    const u8* b = row + 84 * (u >> 5);
    const int e0 = 8 * (u & 31);
    const u32 dm = *(const u32*)(b + 80);
    const float d = h2f((u16)(dm & 0xffff)), dmin = h2f((u16)(dm >> 16));
    const int sc = b[e0 >> 4];
    const float dl = d * (float)(sc & 15), ml = dmin * (float)(sc >> 4);
    const u32* qp = (const u32*)(b + 16 + 32 * (e0 >> 7) + (e0 & 31));
    const u32 a = qp[0], c = qp[1];
    const int sh = 2 * ((e0 >> 5) & 3);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        w[i] = dl * (float)((a >> (8 * i + sh)) & 3) - ml;
        w[4 + i] = dl * (float)((c >> (8 * i + sh)) & 3) - ml;
    }
}
template <> __device__ __forceinline__ void deq8<11>(const u8* __restrict__ row, int u, float* w) {  // Q3_K
    // block_q3_K (110 / 256): hmask[32] | qs[64] | scales[12] (16 x 6 bits) | d;
    // element e: low 2 bits as Q2_K's (qs at 32), minus 4 where bit e / 32 of hmask[e % 32]
    // is clear; sub-block sb = e / 16 has scale (4 bits of scales[sb % 8], low nibble for
    // sb < 8) | (2 bits 2 * (sb / 4) of scales[8 + sb % 4]) << 4, minus 32
    const u8* b = row + 110 * (u >> 5);
    const int e0 = 8 * (u & 31), sb = e0 >> 4, l0 = e0 & 31;
    const float d = h2f(ld16(b + 108));
    const int lo = (b[96 + (sb & 7)] >> (4 * (sb >> 3))) & 15;
    const int hi = (b[104 + (sb & 3)] >> (2 * (sb >> 2))) & 3;
    const float dl = d * (float)((lo | (hi << 4)) - 32);
    const u8* qp = b + 32 + 32 * (e0 >> 7) + l0;
    const u32 qa = ld32_2(qp), qc = ld32_2(qp + 4);
    const u32 ha = ld32_2(b + l0), hc = ld32_2(b + l0 + 4);
    const int sh = 2 * ((e0 >> 5) & 3), hb = e0 >> 5;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int q0 = (int)((qa >> (8 * i + sh)) & 3) - (((ha >> (8 * i + hb)) & 1) ? 0 : 4);
        const int q1 = (int)((qc >> (8 * i + sh)) & 3) - (((hc >> (8 * i + hb)) & 1) ? 0 : 4);
        w[i] = dl * (float)q0;
        w[4 + i] = dl * (float)q1;
    }
}

// Non-linear 4-bit types: a nibble indexes a table of 16 int8 levels, held in 4 words of
// immediates (byte j of word t is entry 4t + j) and read with byte permutes, so a lookup
// touches no memory. ggml-common.h kvalues_iq4nl (IQ4_NL, IQ4_XS) and kvalues_mxfp4 (the
// FP4 E2M1 values doubled: 0, .5, 1, 1.5, 2, 3, 4, 6 times 2, then their negatives).
#define KV_IQ4NL 0xBFAD9881u, 0xF6EADDCFu, 0x26190D01u, 0x71594535u
#define KV_MXFP4 0x03020100u, 0x0C080604u, 0xFDFEFF00u, 0xF4F8FAFCu

// byte i of the result = table entry (byte i of idx), for 4 indices < 16 at once
__device__ __forceinline__ u32 lut16x4(u32 idx, u32 t0, u32 t1, u32 t2, u32 t3) {
    u32 sel = (idx | (idx >> 4)) & 0x00ff00ffu;
    sel = (sel | (sel >> 8)) & 0x7777u;                 // nibble i = index i mod 8
    const u32 lo = __byte_perm(t0, t1, sel);            // entries 0..7
    const u32 hi = __byte_perm(t2, t3, sel);            // entries 8..15
    const u32 m = ((idx >> 3) & 0x01010101u) * 0xffu;   // 0xff in bytes whose index is >= 8
    return (lo & ~m) | (hi & m);
}
__device__ __forceinline__ float i8f(u32 v, int i) { return (float)(i8)((v >> (8 * i)) & 255); }

template <> __device__ __forceinline__ void deq8<20>(const u8* __restrict__ row, int u, float* w) {  // IQ4_NL
    // block_iq4_nl (18 / 32): d | qs[16]; element j < 16: low nibble of qs[j], 16 + j: high nibble
    const u8* b = row + 18 * (u >> 2);
    const int q = u & 3;
    const float d = h2f(ld16(b));
    const int sh = (q >> 1) * 4;
    const u32 va = lut16x4((ld32_2(b + 2 + 8 * (q & 1)) >> sh) & 0x0f0f0f0fu, KV_IQ4NL);
    const u32 vb = lut16x4((ld32_2(b + 6 + 8 * (q & 1)) >> sh) & 0x0f0f0f0fu, KV_IQ4NL);
#pragma unroll
    for (int i = 0; i < 4; i++) { w[i] = d * i8f(va, i); w[4 + i] = d * i8f(vb, i); }
}
template <> __device__ __forceinline__ void deq8<23>(const u8* __restrict__ row, int u, float* w) {  // IQ4_XS
    // block_iq4_xs (136 / 256): d | scales_h u16 | scales_l[4] | qs[128]; sub-block ib = e / 32
    // has scale ((scales_l[ib / 2] >> 4 * (ib % 2)) & 15 | ((scales_h >> 2 * ib) & 3) << 4) - 32
    // and its 16 bytes qs[16 ib ..] laid out as an IQ4_NL block's
    const u8* b = row + 136 * (u >> 5);
    const int e0 = 8 * (u & 31), ib = e0 >> 5, l0 = e0 & 31;
    const u32 dh = *(const u32*)b;
    const float d = h2f((u16)(dh & 0xffff));
    const int ls = ((b[4 + (ib >> 1)] >> (4 * (ib & 1))) & 15) | ((int)((dh >> (16 + 2 * ib)) & 3) << 4);
    const float dl = d * (float)(ls - 32);
    const uint2 v = *(const uint2*)(b + 8 + 16 * ib + (l0 & 15));
    const int sh = (l0 >> 4) * 4;
    const u32 va = lut16x4((v.x >> sh) & 0x0f0f0f0fu, KV_IQ4NL), vb = lut16x4((v.y >> sh) & 0x0f0f0f0fu, KV_IQ4NL);
#pragma unroll
    for (int i = 0; i < 4; i++) { w[i] = dl * i8f(va, i); w[4 + i] = dl * i8f(vb, i); }
}
template <> __device__ __forceinline__ void deq8<39>(const u8* __restrict__ row, int u, float* w) {  // MXFP4
    // block_mxfp4 (17 / 32): e (E8M0) | qs[16], nibbles as IQ4_NL's; scale 2^(e - 128) as
    // ggml_e8m0_to_fp32_half (bits (e - 1) << 23, subnormals for e < 2). Byte loads only.
    const u8* b = row + 17 * (u >> 2);
    const int q = u & 3;
    const u32 e = b[0];
    const float d = __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
    const u8* p = b + 1 + 8 * (q & 1);
    const u32 lo = (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
    const u32 hi = (u32)p[4] | ((u32)p[5] << 8) | ((u32)p[6] << 16) | ((u32)p[7] << 24);
    const int sh = (q >> 1) * 4;
    const u32 va = lut16x4((lo >> sh) & 0x0f0f0f0fu, KV_MXFP4), vb = lut16x4((hi >> sh) & 0x0f0f0f0fu, KV_MXFP4);
#pragma unroll
    for (int i = 0; i < 4; i++) { w[i] = d * i8f(va, i); w[4 + i] = d * i8f(vb, i); }
}
// ---- end of the deq8 specializations ----

// ---- int8 activations: the weight side of the integer dot products (gemv Q8 = 1) ----------
// With int8 activations (``quant_rows``: per 32-input block, xq = rint(x * 127 / max|x|),
// xd = (max|x| / 127, sum of the block's float inputs)), a GEMV's unit is one block of 32
// inputs. q8w<T>(row, u, W) reads block u of a weight row as 8 words of 4 signed bytes (the
// integer levels, inputs 4i .. 4i+3 in word i) and the block's float scale dw, its offset mw
// (the weight is dw * level + mw; mw = 0 for types without one) and, for types with two
// 16-input sub-blocks per block, their integer scales sa, sb (the weight is dw * s * level).
// q8dot then gives the block's contribution dw * dx * isum (+ mw * sum x), isum exact in
// int32 (dp4a), so only its float operations order a sum; every Q8 variant calls it alike.
struct Q8W {
    int q[8];
    float dw, mw;
    int sa, sb;
};
template <int T> struct Q8Traits { static constexpr bool ok = false, has_min = false, sub16 = false; };
#define Q8_TRAITS(T, MIN, SUB) \
    template <> struct Q8Traits<T> { static constexpr bool ok = true, has_min = MIN, sub16 = SUB; };
Q8_TRAITS(2, false, false)   // Q4_0
Q8_TRAITS(3, true, false)    // Q4_1
Q8_TRAITS(6, false, false)   // Q5_0
Q8_TRAITS(7, true, false)    // Q5_1
Q8_TRAITS(8, false, false)   // Q8_0
Q8_TRAITS(11, false, true)   // Q3_K
Q8_TRAITS(12, true, false)   // Q4_K
Q8_TRAITS(13, true, false)   // Q5_K
Q8_TRAITS(14, false, true)   // Q6_K
Q8_TRAITS(20, false, false)  // IQ4_NL
Q8_TRAITS(23, false, false)  // IQ4_XS
Q8_TRAITS(39, false, false)  // MXFP4

// N words (4N bytes) from any address: aligned word loads and funnel shifts (the last word
// read may lie up to 3 bytes past the block; buffers are allocated in 256-byte units)
template <int N>
__device__ __forceinline__ void ldw(const u8* p, u32 (&o)[N]) {
    const u32* a = (const u32*)((size_t)p & ~(size_t)3);
    const u32 sh = 8u * (u32)((size_t)p & 3);
    u32 w[N + 1];
#pragma unroll
    for (int i = 0; i <= N; i++) w[i] = (i < N || sh) ? a[i] : 0u;
#pragma unroll
    for (int i = 0; i < N; i++) o[i] = __funnelshift_r(w[i], w[i + 1], sh);
}
// bit i of the 4-bit value h (i = 0..3) into bit 4 of byte i
__device__ __forceinline__ u32 spread4(u32 h) { return ((h * 0x00204081u) & 0x01010101u) << 4; }

template <int T> __device__ __forceinline__ void q8w(const u8* __restrict__ row, int u, Q8W& W);

template <> __device__ __forceinline__ void q8w<2>(const u8* __restrict__ row, int u, Q8W& W) {  // Q4_0
    const u8* b = row + 18 * u;
    W.dw = h2f(ld16(b)); W.mw = 0.f; W.sa = W.sb = 1;
    u32 v[4]; ldw<4>(b + 2, v);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        W.q[i] = (int)__vsub4(v[i] & 0x0F0F0F0Fu, 0x08080808u);
        W.q[4 + i] = (int)__vsub4((v[i] >> 4) & 0x0F0F0F0Fu, 0x08080808u);
    }
}
template <> __device__ __forceinline__ void q8w<3>(const u8* __restrict__ row, int u, Q8W& W) {  // Q4_1
    const u8* b = row + 20 * u;
    const u32 dm = *(const u32*)b;
    W.dw = h2f((u16)(dm & 0xffff)); W.mw = h2f((u16)(dm >> 16)); W.sa = W.sb = 1;
    const u32* qs = (const u32*)(b + 4);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 w = qs[i];
        W.q[i] = (int)(w & 0x0F0F0F0Fu);
        W.q[4 + i] = (int)((w >> 4) & 0x0F0F0F0Fu);
    }
}
template <> __device__ __forceinline__ void q8w<6>(const u8* __restrict__ row, int u, Q8W& W) {  // Q5_0
    const u8* b = row + 22 * u;
    W.dw = h2f(ld16(b)); W.mw = 0.f; W.sa = W.sb = 1;
    u32 v[5]; ldw<5>(b + 2, v);          // qh | qs[16]
    const u32 qh = v[0];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 lo = (v[1 + i] & 0x0F0F0F0Fu) | spread4((qh >> (4 * i)) & 15u);
        const u32 hi = ((v[1 + i] >> 4) & 0x0F0F0F0Fu) | spread4((qh >> (16 + 4 * i)) & 15u);
        W.q[i] = (int)__vsub4(lo, 0x10101010u);
        W.q[4 + i] = (int)__vsub4(hi, 0x10101010u);
    }
}
template <> __device__ __forceinline__ void q8w<7>(const u8* __restrict__ row, int u, Q8W& W) {  // Q5_1
    const u8* b = row + 24 * u;
    const uint2 dq = *(const uint2*)b;   // d | m | qh
    W.dw = h2f((u16)(dq.x & 0xffff)); W.mw = h2f((u16)(dq.x >> 16)); W.sa = W.sb = 1;
    const u32 qh = dq.y;
    const u32* qs = (const u32*)(b + 8);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 w = qs[i];
        W.q[i] = (int)((w & 0x0F0F0F0Fu) | spread4((qh >> (4 * i)) & 15u));
        W.q[4 + i] = (int)(((w >> 4) & 0x0F0F0F0Fu) | spread4((qh >> (16 + 4 * i)) & 15u));
    }
}
template <> __device__ __forceinline__ void q8w<8>(const u8* __restrict__ row, int u, Q8W& W) {  // Q8_0
    const u8* b = row + 34 * u;
    W.dw = h2f(ld16(b)); W.mw = 0.f; W.sa = W.sb = 1;
    u32 v[8]; ldw<8>(b + 2, v);
#pragma unroll
    for (int i = 0; i < 8; i++) W.q[i] = (int)v[i];
}
template <> __device__ __forceinline__ void q8w<11>(const u8* __restrict__ row, int u, Q8W& W) {  // Q3_K
    // block u >> 3 (110 bytes): hmask[32] | qs[64] | scales[12] | d; block j = u & 7 of 32 inputs:
    // low 2 bits at shift 2 (j % 4) of qs[32 (j / 4) + l], minus 4 where bit j of hmask[l] is
    // clear; sub-blocks 2j and 2j + 1 (16 inputs each) with 6-bit scales minus 32
    const u8* b = row + 110 * (u >> 3);
    const int j = u & 7;
    W.dw = h2f(ld16(b + 108)); W.mw = 0.f;
    int s[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int sb = 2 * j + h;
        const int lo = (b[96 + (sb & 7)] >> (4 * (sb >> 3))) & 15;
        const int hi = (b[104 + (sb & 3)] >> (2 * (sb >> 2))) & 3;
        s[h] = (lo | (hi << 4)) - 32;
    }
    W.sa = s[0]; W.sb = s[1];
    u32 qv[8], hv[8];
    ldw<8>(b + 32 + 32 * (j >> 2), qv);
    ldw<8>(b, hv);
    const int sh = 2 * (j & 3);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const u32 q = (qv[i] >> sh) & 0x03030303u;
        const u32 m = (~(hv[i] >> j) & 0x01010101u) << 2;     // 4 where the high bit is clear
        W.q[i] = (int)__vsub4(q, m);
    }
}
// Q4_K / Q5_K: block j's scale d * sc and offset -dmin * mn from the super-block's header
__device__ __forceinline__ void q8w_k4_scales(const u8* b, int j, Q8W& W) {
    const u32 dm = *(const u32*)b;
    const float d = h2f((u16)(dm & 0xffff)), dmin = h2f((u16)(dm >> 16));
    float sc, mn; scale_min_k4(j, b + 4, sc, mn);
    W.dw = __fmul_rn(d, sc); W.mw = -__fmul_rn(dmin, mn); W.sa = W.sb = 1;
}
template <> __device__ __forceinline__ void q8w<12>(const u8* __restrict__ row, int u, Q8W& W) {  // Q4_K
    const u8* b = row + 144 * (u >> 3);
    const int j = u & 7;
    q8w_k4_scales(b, j, W);
    const uint4* p = (const uint4*)(b + 16 + 32 * (j >> 1));
    const uint4 v0 = p[0], v1 = p[1];
    const u32 v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    const int sh = 4 * (j & 1);
#pragma unroll
    for (int i = 0; i < 8; i++) W.q[i] = (int)((v[i] >> sh) & 0x0F0F0F0Fu);
}
template <> __device__ __forceinline__ void q8w<13>(const u8* __restrict__ row, int u, Q8W& W) {  // Q5_K
    const u8* b = row + 176 * (u >> 3);
    const int j = u & 7;
    q8w_k4_scales(b, j, W);
    const uint4* p = (const uint4*)(b + 48 + 32 * (j >> 1));
    const uint4 v0 = p[0], v1 = p[1];
    const uint4* hp = (const uint4*)(b + 16);
    const uint4 h0 = hp[0], h1 = hp[1];
    const u32 v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    const u32 h[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
    const int sh = 4 * (j & 1);
#pragma unroll
    for (int i = 0; i < 8; i++) W.q[i] = (int)(((v[i] >> sh) & 0x0F0F0F0Fu) | (((h[i] >> j) & 0x01010101u) << 4));
}
template <> __device__ __forceinline__ void q8w<14>(const u8* __restrict__ row, int u, Q8W& W) {  // Q6_K
    // block u >> 3 (210 bytes): ql[128] | qh[64] | scales[16] | d; block j = u & 7 of 32
    // inputs (half g = j / 4, quarter t = j % 4): low 4 bits at shift 4 (t / 2) of
    // ql[64 g + 32 (t % 2) + l], high 2 bits at shift 2 t of qh[32 g + l], minus 32; its two
    // 16-input sub-blocks have scales[8 g + 2 t] and scales[8 g + 2 t + 1]
    const u8* b = row + 210 * (u >> 3);
    const int j = u & 7, g = j >> 2, t = j & 3;
    W.dw = h2f(ld16(b + 208)); W.mw = 0.f;
    const u16 sc = ld16(b + 192 + 8 * g + 2 * t);
    W.sa = (int)(i8)(sc & 255); W.sb = (int)(i8)(sc >> 8);
    u32 l[8], h[8];
    ldw<8>(b + 64 * g + 32 * (t & 1), l);
    ldw<8>(b + 128 + 32 * g, h);
    const int shl = 4 * (t >> 1), shh = 2 * t;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const u32 q = ((l[i] >> shl) & 0x0F0F0F0Fu) | (((h[i] >> shh) & 0x03030303u) << 4);
        W.q[i] = (int)__vsub4(q, 0x20202020u);
    }
}
template <> __device__ __forceinline__ void q8w<20>(const u8* __restrict__ row, int u, Q8W& W) {  // IQ4_NL
    const u8* b = row + 18 * u;
    W.dw = h2f(ld16(b)); W.mw = 0.f; W.sa = W.sb = 1;
    u32 v[4]; ldw<4>(b + 2, v);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        W.q[i] = (int)lut16x4(v[i] & 0x0F0F0F0Fu, KV_IQ4NL);
        W.q[4 + i] = (int)lut16x4((v[i] >> 4) & 0x0F0F0F0Fu, KV_IQ4NL);
    }
}
template <> __device__ __forceinline__ void q8w<23>(const u8* __restrict__ row, int u, Q8W& W) {  // IQ4_XS
    const u8* b = row + 136 * (u >> 3);
    const int ib = u & 7;
    const u32 dh = *(const u32*)b;
    const float d = h2f((u16)(dh & 0xffff));
    const int ls = ((b[4 + (ib >> 1)] >> (4 * (ib & 1))) & 15) | ((int)((dh >> (16 + 2 * ib)) & 3) << 4);
    W.dw = __fmul_rn(d, (float)(ls - 32)); W.mw = 0.f; W.sa = W.sb = 1;
    const uint2* p = (const uint2*)(b + 8 + 16 * ib);
    const uint2 v0 = p[0], v1 = p[1];
    const u32 v[4] = {v0.x, v0.y, v1.x, v1.y};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        W.q[i] = (int)lut16x4(v[i] & 0x0F0F0F0Fu, KV_IQ4NL);
        W.q[4 + i] = (int)lut16x4((v[i] >> 4) & 0x0F0F0F0Fu, KV_IQ4NL);
    }
}
template <> __device__ __forceinline__ void q8w<39>(const u8* __restrict__ row, int u, Q8W& W) {  // MXFP4
    const u8* b = row + 17 * u;
    const u32 e = b[0];
    W.dw = __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23); W.mw = 0.f; W.sa = W.sb = 1;
    u32 v[4]; ldw<4>(b + 1, v);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        W.q[i] = (int)lut16x4(v[i] & 0x0F0F0F0Fu, KV_MXFP4);
        W.q[4 + i] = (int)lut16x4((v[i] >> 4) & 0x0F0F0F0Fu, KV_MXFP4);
    }
}

// The contribution of one weight block to one batch row's sum: xa, xb its 32 int8 inputs,
// xd = (dx, sum of the float inputs).
template <int T>
__device__ __forceinline__ float q8dot(const Q8W& W, const int4 xa, const int4 xb, const float2 xd) {
    int s0 = 0, s1 = 0;
    s0 = __dp4a(W.q[0], xa.x, s0); s0 = __dp4a(W.q[1], xa.y, s0);
    s0 = __dp4a(W.q[2], xa.z, s0); s0 = __dp4a(W.q[3], xa.w, s0);
    s1 = __dp4a(W.q[4], xb.x, s1); s1 = __dp4a(W.q[5], xb.y, s1);
    s1 = __dp4a(W.q[6], xb.z, s1); s1 = __dp4a(W.q[7], xb.w, s1);
    const int isum = Q8Traits<T>::sub16 ? W.sa * s0 + W.sb * s1 : s0 + s1;
    float t = __fmul_rn(__fmul_rn(W.dw, xd.x), __int2float_rn(isum));
    if (Q8Traits<T>::has_min) t = fmaf(W.mw, xd.y, t);
    return t;
}


