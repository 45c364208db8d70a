"""CUDA C++ source of the CUDA backend's kernels (compiled by CuPy's NVRTC, cached on disk).

Owns: every device kernel the CUDA backend launches, as one source string, and the
tensor-type codes the templates take (GGML's enum values). Leaves to ``cuda.py`` the
compilation (``cupy.RawModule`` with exactly the template instances a model needs)
and to ``cuda_program.py`` the order of launches.

Layout conventions (all row-major, float32 unless said):
* weights stay in GGUF block layout, one row of ``k`` inputs = ``row_bytes`` bytes;
  ``deq8<T>(row, u, w)`` dequantizes inputs ``8u .. 8u+7`` of a row into registers.
  Each uses only the loads its block's alignment allows: a row starts at a multiple of
  ``row_bytes`` from a 256-byte aligned buffer, so blocks of 18/22/110 bytes (Q4_0, IQ4_NL,
  Q5_0, Q3_K) are 2-byte aligned, 20/24/84 (Q4_1, Q5_1, Q2_K) 4-byte, 136/144/176 (IQ4_XS,
  Q4_K, Q5_K) at least 8-byte, and MXFP4's 17-byte blocks only byte aligned (byte loads).
  Every product in a deq8 is exact in float32 (a float16 scale times small integers), so
  the values equal gguf's ``dequantize`` bit for bit whether or not the compiler fuses
  the one add into an FMA.
* int8 activations (``cuda_program`` with ``int8_activations``): ``quant_rows`` writes a
  GEMV's input rows as int8 blocks of 32 (``xq`` (B, ldq) and ``xd`` (B, ldq / 32) float2
  scale and float sum), ``q8w<T>`` reads a weight block as int8 levels and ``gemv<..., Q8 =
  1>`` multiplies them with ``__dp4a`` (the types of ``Q8_TYPES``).
* activations ``x`` are ``(B, ld)``; KV cache per layer ``(n_slots, n_kv, n_ctx, hd)``,
  float32 or float16 (template argument ``KVT``: 0 or 1).
* device tables for decode: ``tab_tok``, ``tab_slot``, ``tab_pos`` int32 ``(B,)``.
* RoPE reads cos/sin tables ``(n_ctx, rope_half)`` float32 made on the host (frequency
  factors and scaling folded in); "neox" rotates dims j and j + rope_half of a head, the
  llama ("norm") style adjacent dims 2j and 2j + 1.

No headers are included (NVRTC has none by default): half/bfloat16 conversion uses
PTX ``cvt`` and bit shifts.
"""

from __future__ import annotations

# GGML tensor-type codes (gguf.GGMLQuantizationType values)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4 = 10, 11, 20, 23, 39
#: every type with a ``deq8<T>`` specialization (and so ``embed``/``dequant``/``gemv`` instances)
TYPES = (F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, BF16, MXFP4)
#: the types with an integer form (``q8w<T>``): their GEMVs can run on int8 activations (gemv Q8 1)
Q8_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4)

# gemv epilogue modes: store, add (residual), SwiGLU and GEGLU of a gate/up pair, the QKV
# projection with RoPE and the KV write fused (float32 or float16 KV cache)
MODE_STORE, MODE_ADD, MODE_SWIGLU, MODE_QKV, MODE_GEGLU, MODE_QKV16 = 0, 1, 2, 3, 4, 5
KV_TYPES = {"f32": 0, "f16": 1}          # KVT template argument of the attention and KV-write kernels
#: head dimensions of the flash-style prefill attention (``attn_prefill<HD, KVT>``, sm_80+)
FLASH_HEAD_DIMS = (32, 64, 96, 128)

SRC = r"""
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef signed char i8;

__device__ __forceinline__ float h2f(u16 h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ float bf2f(u16 h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ u16 ld16(const u8* p) { return *(const u16*)p; }
__device__ __forceinline__ u32 ld32_2(const u8* p) {   // 4 bytes from a 2-byte aligned address
    return (u32)ld16(p) | ((u32)ld16(p + 2) << 16);
}
__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// (float) of byte i of v (a value below 256), through the exponent trick: the byte placed
// in the mantissa of 2^23, minus 2^23 (exact; one PRMT and one FADD instead of an I2F)
__device__ __forceinline__ float byte_f(u32 v, int i) {
    return __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7650u | (u32)i)) - 8388608.f;
}
// 8 bytes from a 2-byte aligned address, as two words (aligned loads and a byte permute)
__device__ __forceinline__ void ld8_2(const u8* p, u32* o) {
    const u32* a = (const u32*)((size_t)p & ~(size_t)3);
    const u32 w0 = a[0], w1 = a[1];
    if (((size_t)p & 2) == 0) { o[0] = w0; o[1] = w1; return; }
    const u32 w2 = a[2];
    o[0] = __byte_perm(w0, w1, 0x5432);
    o[1] = __byte_perm(w1, w2, 0x5432);
}

// 6-bit (scale, min) of sub-block j (0..7) from the 12 packed bytes q (ggml get_scale_min_k4)
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, float& sc, float& mn) {
    if (j < 4) { sc = (float)(q[j] & 63); mn = (float)(q[j + 4] & 63); }
    else { sc = (float)((q[j + 4] & 15) | ((q[j - 4] >> 6) << 4));
           mn = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4)); }
}

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


__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

#define GEMV_WARPS 4

__device__ __forceinline__ u16 f2h(float f) {
    u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
// GELU, tanh approximation (ggml_gelu's formula)
__device__ __forceinline__ float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * x * (1.0f + 0.044715f * x * x)));
}

// KV cache element i of a float32 (KVT 0) or float16 (KVT 1) cache
template <int KVT> __device__ __forceinline__ void kv_st(void* c, long long i, float v);
template <> __device__ __forceinline__ void kv_st<0>(void* c, long long i, float v) { ((float*)c)[i] = v; }
template <> __device__ __forceinline__ void kv_st<1>(void* c, long long i, float v) { ((u16*)c)[i] = f2h(v); }

// gemv epilogue modes (MODE_* in Python)
#define M_STORE 0
#define M_ADD 1
#define M_SWIGLU 2
#define M_QKV 3
#define M_GEGLU 4
#define M_QKV16 5

// ---- the decode GEMV and its canonical reduction order ------------------------------------
// Batch invariance (shared/DESIGN.md) asks one reduction order per output element, whatever
// the batch bucket or the kernel variant the kernel choice picked. Every variant below
// computes the dot product of one weight row with one (normed) batch row in THE SAME order:
// * the row's inputs are units u of 8 (u = 0 .. k/8 - 1); "virtual lane" v (0..127) takes
//   the units u = v, v + 128, v + 256, ... in that order and accumulates, unit by unit,
//   acc = fmaf(w[i], x[i], acc) for i = 0..7 (w already multiplied by the norm weight);
// * the 32 virtual lanes of each group g (v = 32 g + lane, g = 0..3) are summed by the warp
//   butterfly (warp_sum: xor 16, 8, 4, 2, 1; every lane ends with the same bits), giving R_g;
// * the row's sum is ((R_0 + R_1) + R_2) + R_3; then the epilogue (norm scale, bias, mode).
// A variant only maps virtual lanes onto threads: WPP warps share a row pair and each
// thread computes S = 4 / WPP groups (g = sub + WPP * s): interleaved in one pass when few
// accumulators (S * NB <= 4), else one group after the other (then a thread holds 2 NB
// accumulators, not 2 S NB: NB 16 runs with WPP 1). NB batch rows share each weight load;
// PPW row pairs per warp share each x and norm-weight load (each pair its own sums).
// The butterfly runs as a reduce-scatter (warp_sum_scatter: the same adds, so the same
// bits, in fewer shuffles): lane j ends with A of batch row j, lane NB + j with its B, and
// lane j runs row j's epilogue. Explicit fmaf / __fmul_rn / __fadd_rn keep the compiler from
// fusing differently in different instances; loop unrolling never reorders a sum.
// The RMSNorm scale of a batch row is rsqrt(ss / k + eps), ss summed by row_ss: 128 threads,
// thread t takes elements t, t + 128, ... (fmaf), the warp butterfly, then the 4 warp sums
// in order. The GEMV's prologue (xs == null: rows_scale, all NB rows in one pass) and the
// row_scale kernel (xs != null: the scale was computed before the launch) form the same
// sums in the same order, so both give the same bits.

__device__ __forceinline__ float row_ss(const float* __restrict__ xr, int k, float* red) {
    float ss = 0.f;
    for (int e = threadIdx.x; e < k; e += 128) { const float v = xr[e]; ss = fmaf(v, v, ss); }
    ss = warp_sum(ss);
    __syncthreads();                         // red may still be read by the previous call
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    float t = red[0];
    t = __fadd_rn(t, red[1]);
    t = __fadd_rn(t, red[2]);
    t = __fadd_rn(t, red[3]);
    return t;
}
__device__ __forceinline__ float norm_scale(float ss, int k, float eps) {
    return rsqrtf(__fadd_rn(__fdiv_rn(ss, (float)k), eps));
}

// The warp butterfly of V = 2 NB values at once, as a reduce-scatter: the first stages
// (xor 16 .. V) add all V values, each later stage (xor V/2 .. 1) halves the values a lane
// keeps (the lane with bit o set keeps the upper half) and sends the other half to its
// partner. Every add is v(lane) + v(lane ^ o) of the same partial sums warp_sum forms, in
// the same stage order, so on return lane l holds exactly warp_sum's bits of value
// (l & (V - 1)), with 31 + V * (5 - log2 V) shuffles instead of 5 V.
template <int V, int O>       // a full stage: every value v(lane) + v(lane ^ O)
__device__ __forceinline__ void ws_full(float (&v)[V]) {
#pragma unroll
    for (int i = 0; i < V; i++) v[i] += __shfl_xor_sync(0xffffffffu, v[i], O);
}
template <int V, int O>       // a halving stage: values [0, 2 O) -> [0, O)
__device__ __forceinline__ void ws_half(float (&v)[V], int lane) {
    const bool up = (lane & O) != 0;
#pragma unroll
    for (int i = 0; i < O; i++) {
        const float send = up ? v[i] : v[i + O];
        const float keep = up ? v[i + O] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
}
template <int V>
__device__ __forceinline__ float warp_sum_scatter(float (&v)[V]) {
    static_assert(V >= 2 && V <= 32 && (V & (V - 1)) == 0, "V is a power of two, 2 .. 32");
    const int lane = threadIdx.x & 31;
    if constexpr (V <= 16) ws_full<V, 16>(v);
    if constexpr (V <= 8) ws_full<V, 8>(v);
    if constexpr (V <= 4) ws_full<V, 4>(v);
    if constexpr (V <= 2) ws_full<V, 2>(v);
    if constexpr (V >= 32) ws_half<V, 16>(v, lane);
    if constexpr (V >= 16) ws_half<V, 8>(v, lane);
    if constexpr (V >= 8) ws_half<V, 4>(v, lane);
    if constexpr (V >= 4) ws_half<V, 2>(v, lane);
    ws_half<V, 1>(v, lane);
    return v[0];
}

// The norm scales of NB batch rows at once (the GEMV's per-block prologue; 128 threads):
// for each row the same per-thread chains, butterfly and final adds as row_ss, so the same
// bits as row_scale, with one pass over the rows and one barrier instead of NB of each.
// s_scale[j] is ready after the caller's __syncthreads.
template <int NB>
__device__ __forceinline__ void rows_scale(const float* __restrict__ x, int ldx, int b0, int nb, int k, float eps,
                                           float* s_scale, float (*red)[4]) {
    float ss[NB];
#pragma unroll
    for (int j = 0; j < NB; j++) ss[j] = 0.f;
    for (int e = threadIdx.x; e < k; e += 128) {
#pragma unroll
        for (int j = 0; j < NB; j++) {
            const float v = x[(long long)(b0 + min(j, nb - 1)) * ldx + e];
            ss[j] = fmaf(v, v, ss[j]);
        }
    }
#pragma unroll
    for (int j = 0; j < NB; j++) ss[j] = warp_sum(ss[j]);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int j = 0; j < NB; j++) red[j][threadIdx.x >> 5] = ss[j];
    }
    __syncthreads();
    if (threadIdx.x < NB) {
        const int j = threadIdx.x;
        float t = red[j][0];
        t = __fadd_rn(t, red[j][1]);
        t = __fadd_rn(t, red[j][2]);
        t = __fadd_rn(t, red[j][3]);
        s_scale[j] = norm_scale(t, k, eps);
    }
}

// out[r] = rsqrt(mean(x[r]^2) + eps) for r < gridDim.x: the norm scale the GEMV reads when
// its ``xs`` argument is given (one launch per norm instead of one per GEMV block). 128 threads.
__global__ void __launch_bounds__(128) row_scale(const float* __restrict__ x, int ldx, int k, float eps,
                                                 float* __restrict__ out)
{
    __shared__ float red[4];
    const float ss = row_ss(x + (long long)blockIdx.x * ldx, k, red);
    if (threadIdx.x == 0) out[blockIdx.x] = norm_scale(ss, k, eps);
}

// x rows as int8 blocks: out row b of xq (ldq bytes) and xd (ldd float2 per row), from x
// row b (times the norm weight nw when given); with nw, also the row's norm scale into xs
// (row_ss and norm_scale: the bits row_scale gives). Grid (B, ceil(k / 128)), 128 threads:
// block (b, y) quantizes inputs 128 y .. 128 y + 127 of row b, warp w the 32-input block
// 4 y + w, lane l its input l; block (b, 0) also computes the norm scale.
__global__ void __launch_bounds__(128) quant_rows(const float* __restrict__ x, int ldx, int k,
                                                  const float* __restrict__ nw, float eps, float* __restrict__ xs,
                                                  i8* __restrict__ xq, int ldq, float2* __restrict__ xd, int ldd)
{
    __shared__ float red[4];
    const float* xr = x + (long long)blockIdx.x * ldx;
    if (nw != nullptr && blockIdx.y == 0) {
        const float ss = row_ss(xr, k, red);
        if (threadIdx.x == 0) xs[blockIdx.x] = norm_scale(ss, k, eps);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    i8* qr = xq + (long long)blockIdx.x * ldq;
    float2* dr = xd + (long long)blockIdx.x * ldd;
    const int blk = 4 * blockIdx.y + warp;
    if (blk < (k >> 5)) {
        const int e = 32 * blk + lane;
        float v = xr[e];
        if (nw != nullptr) v = __fmul_rn(v, nw[e]);
        const float amax = warp_max(fabsf(v));
        const float sum = warp_sum(v);
        const float inv = amax > 0.f ? __fdiv_rn(127.f, amax) : 0.f;
        qr[e] = (i8)__float2int_rn(__fmul_rn(v, inv));
        if (lane == 0) dr[blk] = make_float2(__fdiv_rn(amax, 127.f), sum);
    }
}

// The two weight rows of pair p (and, for the QKV modes, the head, section and dims they are).
struct PairRows {
    long long ra, rb;
    int sect, head, dd, da, db;
};
template <bool QKV>
__device__ __forceinline__ PairRows pair_rows(int p, int a_stride, int b_off, int row_base, int qd, int kd, int hd,
                                              int rope_half, int neox) {
    PairRows r;
    r.sect = 0; r.head = 0; r.dd = 0; r.da = 0; r.db = 0;
    if (QKV) {
        const int g = row_base + 2 * p;
        r.sect = g < qd ? 0 : (g < qd + kd ? 1 : 2);
        const int s0 = r.sect == 0 ? 0 : (r.sect == 1 ? qd : qd + kd);
        r.head = (g - s0) / hd;
        r.dd = g - s0 - r.head * hd;
        if (neox && r.sect < 2 && r.dd < 2 * rope_half) { r.da = r.dd >> 1; r.db = r.da + rope_half; }
        else { r.da = r.dd; r.db = r.dd + 1; }
        r.ra = (long long)(s0 + r.head * hd + r.da - row_base);
        r.rb = (long long)(s0 + r.head * hd + r.db - row_base);
    } else {
        r.ra = (long long)p * a_stride;
        r.rb = r.ra + b_off;
    }
    return r;
}

// The epilogue of one pair for batch row b: the sums a (row ra) and c (row rb) times the
// norm scale sc (when nw is given), plus the biases, then the mode's store.
template <int MODE>
__device__ __forceinline__ void gemv_out(float a, float c, int b, int p, const PairRows r, bool normed, float sc,
                                         const float* __restrict__ bias_a, const float* __restrict__ bias_b,
                                         float* __restrict__ y, int ldy, int hd, int rope_half, int neox, int n_kv,
                                         int n_ctx, const int* __restrict__ tab_slot, const int* __restrict__ tab_pos,
                                         const float* __restrict__ rcos, const float* __restrict__ rsin,
                                         void* __restrict__ kc, void* __restrict__ vc) {
    const float ba = bias_a != nullptr ? bias_a[r.ra] : 0.f, bb = bias_b != nullptr ? bias_b[r.rb] : 0.f;
    if (normed) { a = __fmul_rn(a, sc); c = __fmul_rn(c, sc); }
    a = __fadd_rn(a, ba);
    c = __fadd_rn(c, bb);
    float* yr = y + (long long)b * ldy;
    if (MODE == M_STORE) { yr[r.ra] = a; yr[r.rb] = c; }
    else if (MODE == M_ADD) { yr[r.ra] = __fadd_rn(yr[r.ra], a); yr[r.rb] = __fadd_rn(yr[r.rb], c); }
    else if (MODE == M_SWIGLU) { yr[p] = __fmul_rn(silu(a), c); }
    else if (MODE == M_GEGLU) { yr[p] = __fmul_rn(gelu_tanh(a), c); }
    else {
        const int pos = tab_pos[b];
        const int dd = r.dd, da = r.da, db = r.db;
        if (r.sect < 2) {
            const int jj = neox ? (dd < 2 * rope_half ? da : -1) : ((dd >> 1) < rope_half ? (dd >> 1) : -1);
            if (jj >= 0) {
                const float cs = rcos[(long long)pos * rope_half + jj], sn = rsin[(long long)pos * rope_half + jj];
                const float a2 = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(c, sn));
                const float c2 = __fadd_rn(__fmul_rn(a, sn), __fmul_rn(c, cs));
                a = a2; c = c2;
            }
        }
        if (r.sect == 0) { yr[r.head * hd + da] = a; yr[r.head * hd + db] = c; }
        else {
            const long long o = (((long long)tab_slot[b] * n_kv + r.head) * n_ctx + pos) * hd;
            void* cache = r.sect == 1 ? kc : vc;
            kv_st<MODE == M_QKV16 ? 1 : 0>(cache, o + da, a);
            kv_st<MODE == M_QKV16 ? 1 : 0>(cache, o + db, c);
        }
    }
}

// The norm scales of this block's NB batch rows into s_scale (xs given: read; else computed
// here). Every thread of the block calls it; s_scale is ready on return.
template <int NB>
__device__ __forceinline__ void gemv_scales(const float* __restrict__ x, int ldx, int b0, int nb, int k, float eps,
                                            const float* __restrict__ nw, const float* __restrict__ xs,
                                            float* s_scale, float (*s_ss)[4]) {
    if (nw != nullptr) {
        if (xs != nullptr) {
            if (threadIdx.x < NB) s_scale[threadIdx.x] = xs[b0 + min((int)threadIdx.x, nb - 1)];
        } else {
            rows_scale<NB>(x, ldx, b0, nb, k, eps, s_scale, s_ss);
        }
        __syncthreads();
    }
}

// PPW row pairs per warp (1, 2 or 4): the warp walks the units of PPW pairs at once, each
// x (and norm weight) load of a unit serving all of them; every pair keeps its own
// accumulators, so its sums are the ones PPW 1 forms (the loads are shared, not the adds).
template <int TA, int TB, int NB, int PPW>
__device__ __forceinline__ void gemv_units(const u8* const (&rowA)[PPW], const u8* const (&rowB)[PPW], int u,
                                           const float* __restrict__ nw, const float* __restrict__ x, int ldx,
                                           int b0, int nb, float (&acc)[PPW][2 * NB]) {
    float wa[PPW][8], wb[PPW][8];
#pragma unroll
    for (int q = 0; q < PPW; q++) {
        deq8<TA>(rowA[q], u, wa[q]);
        deq8<TB>(rowB[q], u, wb[q]);
    }
    if (nw != nullptr) {
        const float4* np = (const float4*)(nw + 8 * u);
        const float4 n0 = np[0], n1 = np[1];
        const float nn[8] = {n0.x, n0.y, n0.z, n0.w, n1.x, n1.y, n1.z, n1.w};
#pragma unroll
        for (int q = 0; q < PPW; q++) {
#pragma unroll
            for (int i = 0; i < 8; i++) { wa[q][i] = __fmul_rn(wa[q][i], nn[i]); wb[q][i] = __fmul_rn(wb[q][i], nn[i]); }
        }
    }
#pragma unroll
    for (int j = 0; j < NB; j++) {
        const float4* xp = (const float4*)(x + (long long)(b0 + min(j, nb - 1)) * ldx + 8 * u);
        const float4 x0 = xp[0], x1 = xp[1];
        const float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
        for (int q = 0; q < PPW; q++) {
            float a = acc[q][j], c = acc[q][NB + j];
#pragma unroll
            for (int i = 0; i < 8; i++) { a = fmaf(wa[q][i], xv[i], a); c = fmaf(wb[q][i], xv[i], c); }
            acc[q][j] = a;
            acc[q][NB + j] = c;
        }
    }
}

// The Q8 form of gemv_units: unit u is input block u (32 inputs) of int8 rows xq (ldq bytes
// per row) with block scales xd (ldd per row); each block's contribution (q8dot) is added to
// the pair's sums with one rounding, block after block.
template <int TA, int TB, int NB, int PPW>
__device__ __forceinline__ void gemv_units_q8(const u8* const (&rowA)[PPW], const u8* const (&rowB)[PPW], int u,
                                              const i8* __restrict__ xq, int ldq, const float2* __restrict__ xd,
                                              int ldd, int b0, int nb, float (&acc)[PPW][2 * NB]) {
    Q8W wa[PPW], wb[PPW];
#pragma unroll
    for (int q = 0; q < PPW; q++) {
        q8w<TA>(rowA[q], u, wa[q]);
        q8w<TB>(rowB[q], u, wb[q]);
    }
#pragma unroll
    for (int j = 0; j < NB; j++) {
        const long long r = b0 + min(j, nb - 1);
        const int4* xp = (const int4*)(xq + r * ldq + 32 * u);
        const int4 xa = xp[0], xb = xp[1];
        const float2 d = xd[r * ldd + u];
#pragma unroll
        for (int q = 0; q < PPW; q++) {
            acc[q][j] = __fadd_rn(acc[q][j], q8dot<TA>(wa[q], xa, xb, d));
            acc[q][NB + j] = __fadd_rn(acc[q][NB + j], q8dot<TB>(wb[q], xa, xb, d));
        }
    }
}

// The sums of the warp's PPW row pairs: each pair's A and B rows of the NB batch rows over the
// virtual lanes (gemv_units), warp_sum_scatter, then ((R_0 + R_1) + R_2) + R_3 (across the WPP
// warps of a pair through s_red, rows [pl0, pl0 + PPW) of it). On return lane vi = lane & (2NB - 1)
// holds in tot[q] value vi of pair q (A of batch row vi < NB, B of row vi - NB). `gemv` and
// `moe_gemv` both form their sums here: one copy of the arithmetic. Every thread of the block
// calls it (WPP > 1: a __syncthreads); false for the warps whose partial sums went to s_red
// (sub != 0): they are done.
// Q8 1: units are 32-input blocks of int8 rows (x: the int8 rows, ldx bytes; xd, ldd: their
// block scales; gemv_units_q8), else units of 8 float inputs (xd unused).
template <int TA, int TB, int NB, int WPP, int PPW, int Q8 = 0>
__device__ __forceinline__ bool gemv_sums(const u8* const (&rowA)[PPW], const u8* const (&rowB)[PPW], int k,
                                          const float* __restrict__ nw, const float* __restrict__ x, int ldx,
                                          int b0, int nb, int pl0, float (*s_red)[4][2 * NB], float (&tot)[PPW],
                                          const float2* __restrict__ xd = nullptr, int ldd = 0) {
    constexpr int S = 4 / WPP;                     // virtual-lane groups per thread
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int sub = warp % WPP;
    // accumulate: value i of acc[q] is A row of batch row i (i < NB) or B row of batch row i - NB
    constexpr int V = 2 * NB;
    const int nu = Q8 ? k >> 5 : k >> 3;
    const i8* xq = (const i8*)x;             // Q8: x holds the int8 rows (ldx bytes per row)
    float R[S][PPW];                         // R_g of value (lane & (V - 1)) for g = sub + WPP * s
    if constexpr (S * NB <= 4) {
        // few accumulators: the S groups interleaved in one pass over the row
        constexpr int UNR = S == 1 ? 4 : (S == 2 ? 2 : 1);
        float acc[S][PPW][V];
#pragma unroll
        for (int s = 0; s < S; s++) {
#pragma unroll
            for (int q = 0; q < PPW; q++) {
#pragma unroll
                for (int i = 0; i < V; i++) acc[s][q][i] = 0.f;
            }
        }
#pragma unroll UNR
        for (int u0 = 0; u0 < nu; u0 += 128) {
#pragma unroll
            for (int s = 0; s < S; s++) {
                const int u = u0 + 32 * (sub + WPP * s) + lane;
                if (u < nu) {
                    if constexpr (Q8) gemv_units_q8<TA, TB, NB, PPW>(rowA, rowB, u, xq, ldx, xd, ldd, b0, nb, acc[s]);
                    else gemv_units<TA, TB, NB, PPW>(rowA, rowB, u, nw, x, ldx, b0, nb, acc[s]);
                }
            }
        }
#pragma unroll
        for (int s = 0; s < S; s++) {
#pragma unroll
            for (int q = 0; q < PPW; q++) R[s][q] = warp_sum_scatter<V>(acc[s][q]);
        }
    } else {
        // many accumulators: one group after the other (registers: PPW V accumulators, not S PPW V)
#pragma unroll
        for (int s = 0; s < S; s++) {
            float acc[PPW][V];
#pragma unroll
            for (int q = 0; q < PPW; q++) {
#pragma unroll
                for (int i = 0; i < V; i++) acc[q][i] = 0.f;
            }
#pragma unroll 1
            for (int u = 32 * (sub + WPP * s) + lane; u < nu; u += 128) {
                if constexpr (Q8) gemv_units_q8<TA, TB, NB, PPW>(rowA, rowB, u, xq, ldx, xd, ldd, b0, nb, acc);
                else gemv_units<TA, TB, NB, PPW>(rowA, rowB, u, nw, x, ldx, b0, nb, acc);
            }
#pragma unroll
            for (int q = 0; q < PPW; q++) R[s][q] = warp_sum_scatter<V>(acc[q]);
        }
    }
    // the row's sum ((R_0 + R_1) + R_2) + R_3, for value vi = lane & (V - 1)
    const int vi = lane & (V - 1);
    if constexpr (WPP == 1) {
#pragma unroll
        for (int q = 0; q < PPW; q++) {
            tot[q] = R[0][q];
#pragma unroll
            for (int s = 1; s < S; s++) tot[q] = __fadd_rn(tot[q], R[s][q]);
        }
    } else {
        if (lane < V) {
#pragma unroll
            for (int q = 0; q < PPW; q++) {
#pragma unroll
                for (int s = 0; s < S; s++) s_red[pl0 + q][sub + WPP * s][lane] = R[s][q];
            }
        }
        __syncthreads();
        if (sub != 0) return false;
#pragma unroll
        for (int q = 0; q < PPW; q++) {
            tot[q] = s_red[pl0 + q][0][vi];
#pragma unroll
            for (int g = 1; g < 4; g++) tot[q] = __fadd_rn(tot[q], s_red[pl0 + q][g][vi]);
        }
    }
    return true;
}

// y = W . (optionally rmsnorm'ed) x (+ bias): two output rows ("a pair") per WPP warps (PPW
// pairs per WPP warps), NB batch rows per block (grid.y covers the batch), GEMV_WARPS / WPP * PPW
// pairs per block (grid.x).
// Rows of a pair: ra = p * a_stride (of Wa), rb = p * a_stride + b_off (of Wb); bias_a[ra],
// bias_b[rb] are added after the norm (either pointer may be null). nw: the RMSNorm weight
// (k,) folded into the weights, or null (no norm); then xs: the rows' norm scales computed
// by row_scale before this launch, or null (computed here, per block).
// MODE 0 store (rows ra, rb), 1 add, 2 swiglu: y[b, p] = silu(a) * b, 4 geglu: gelu_tanh(a) * b,
// 3 / 5 qkv (float32 / float16 KV): the pair is two rows of one head of [q; k; v] (global row
// g = row_base + 2p; adjacent dims for RoPE "norm" and V, dims j and j + rope_half for RoPE
// "neox"); q rows are roped into y, k rows roped into kc, v rows into vc at (slot, pos) of the
// batch row.
// Q8 1: int8 activations (quant_rows before the launch): x is the int8 rows (ldx bytes per
// row), xd their block scales (ldd float2 per row), and xs is required when nw is given (the
// norm weight was folded into x by quant_rows, its scale is applied here). The canonical
// order then has units of 32 inputs (one block: its contribution q8dot, exact integer dot
// products and a fixed float tail, added with one rounding) in place of units of 8; the
// lanes, groups, butterfly and epilogue are the same. Q8 0: xd, ldd unused.
template <int TA, int TB, int NB, int MODE, int WPP, int PPW = 1, int Q8 = 0>
__device__ __forceinline__ void gemv_block(const int bx, const int by,
    const u8* __restrict__ Wa, const u8* __restrict__ Wb, long long rba, long long rbb, int a_stride, int b_off,
    int n_pairs, int k, const float* __restrict__ x, int ldx, int B, const float* __restrict__ nw, float eps,
    const float* __restrict__ xs, const float* __restrict__ bias_a, const float* __restrict__ bias_b,
    float* __restrict__ y, int ldy,
    int row_base, int qd, int kd, int hd, int rope_half, int neox, int n_kv, int n_ctx,
    const int* __restrict__ tab_slot, const int* __restrict__ tab_pos,
    const float* __restrict__ rcos, const float* __restrict__ rsin, void* __restrict__ kc, void* __restrict__ vc,
    const float2* __restrict__ xd, int ldd)
{
    static_assert(WPP == 1 || WPP == 2 || WPP == 4, "WPP is 1, 2 or 4");
    static_assert(PPW == 1 || PPW == 2 || PPW == 4, "PPW is 1, 2 or 4");
    static_assert(Q8 == 0 || (Q8Traits<TA>::ok && Q8Traits<TB>::ok), "Q8: both weight types have an integer form");
    constexpr bool QKV = (MODE == M_QKV || MODE == M_QKV16);
    constexpr int PPB = GEMV_WARPS / WPP * PPW;    // row pairs per block
    __shared__ float s_scale[NB];
    __shared__ float s_red[WPP > 1 ? PPB : 1][4][2 * NB];   // per pair: R_g of A and B rows (WPP > 1)
    __shared__ float s_ss[NB][4];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int b0 = by * NB;
    const int nb = min(NB, B - b0);
    gemv_scales<NB>(x, ldx, b0, nb, k, eps, nw, xs, s_scale, s_ss);
    const int pl0 = (warp / WPP) * PPW;      // the warp's first pair within the block
    int p[PPW];
    bool valid[PPW];
    PairRows rows[PPW];
    const u8* rowA[PPW];
    const u8* rowB[PPW];
#pragma unroll
    for (int q = 0; q < PPW; q++) {
        const int p_raw = bx * PPB + pl0 + q;
        valid[q] = p_raw < n_pairs;
        p[q] = valid[q] ? p_raw : n_pairs - 1;
        rows[q] = pair_rows<QKV>(p[q], a_stride, b_off, row_base, qd, kd, hd, rope_half, neox);
        rowA[q] = Wa + rows[q].ra * rba;
        rowB[q] = Wb + rows[q].rb * rbb;
    }
    float tot[PPW];
    if (!gemv_sums<TA, TB, NB, WPP, PPW, Q8>(rowA, rowB, k, nw, x, ldx, b0, nb, pl0, s_red, tot, xd, ldd)) return;
    // lane j < NB holds A of batch row j; lane j + NB holds its B
#pragma unroll
    for (int q = 0; q < PPW; q++) {
        const float other = __shfl_xor_sync(0xffffffffu, tot[q], NB);
        if (lane < nb && valid[q])
            gemv_out<MODE>(tot[q], other, b0 + lane, p[q], rows[q], nw != nullptr, s_scale[lane], bias_a, bias_b, y,
                           ldy, hd, rope_half, neox, n_kv, n_ctx, tab_slot, tab_pos, rcos, rsin, kc, vc);
    }
}
// the kernel: one block of gemv_block per (bx, by) of the grid (the persistent decode
// step, cuda_persistent.py, runs the same block function over virtual blocks)
template <int TA, int TB, int NB, int MODE, int WPP, int PPW = 1, int Q8 = 0>
__global__ void __launch_bounds__(GEMV_WARPS * 32) gemv(
    const u8* __restrict__ Wa, const u8* __restrict__ Wb, long long rba, long long rbb, int a_stride, int b_off,
    int n_pairs, int k, const float* __restrict__ x, int ldx, int B, const float* __restrict__ nw, float eps,
    const float* __restrict__ xs, const float* __restrict__ bias_a, const float* __restrict__ bias_b,
    float* __restrict__ y, int ldy,
    int row_base, int qd, int kd, int hd, int rope_half, int neox, int n_kv, int n_ctx,
    const int* __restrict__ tab_slot, const int* __restrict__ tab_pos,
    const float* __restrict__ rcos, const float* __restrict__ rsin, void* __restrict__ kc, void* __restrict__ vc,
    const float2* __restrict__ xd, int ldd)
{
    gemv_block<TA, TB, NB, MODE, WPP, PPW, Q8>(blockIdx.x, blockIdx.y, Wa, Wb, rba, rbb, a_stride, b_off, n_pairs,
        k, x, ldx, B, nw, eps, xs, bias_a, bias_b, y, ldy, row_base, qd, kd, hd, rope_half, neox, n_kv, n_ctx,
        tab_slot, tab_pos, rcos, rsin, kc, vc, xd, ldd);
}

// One warp per (head, row): grid (H + 2 n_kv, N), 32 threads. Row r of src (N, ld) holds
// [q (H*hd) | k (n_kv*hd) | v (n_kv*hd)] (plus bias, when not null). Per head: RMSNorm over
// its hd values with weight q_norm (q heads) or k_norm (k heads) when given (QK-norm), RoPE
// on q and k (rope_half pairs: adjacent dims, or j and j + rope_half for "neox"), then q to
// q_out (N, ldq; may alias src), k and v to the caches at (slot[r], pos[r]).
template <int KVT>
__global__ void __launch_bounds__(32) head_rope_kv(
    const float* src, int ld, const float* __restrict__ bias, int H, int n_kv, int hd, int rope_half, int neox,
    const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,
    const int* __restrict__ slot, const int* __restrict__ pos,
    const float* __restrict__ rcos, const float* __restrict__ rsin, float* q_out, int ldq,
    void* __restrict__ kc, void* __restrict__ vc, int n_ctx)
{
    __shared__ float s[256];
    const int hh = blockIdx.x, r = blockIdx.y, lane = threadIdx.x;
    const int qd = H * hd, kd = n_kv * hd;
    const int sect = hh < H ? 0 : (hh < H + n_kv ? 1 : 2);
    const int head = sect == 0 ? hh : (sect == 1 ? hh - H : hh - H - n_kv);
    const int col0 = (sect == 0 ? 0 : (sect == 1 ? qd : qd + kd)) + head * hd;
    const float* xr = src + (long long)r * ld + col0;
    float ss = 0.f;
    for (int d = lane; d < hd; d += 32) {
        const float v = xr[d] + (bias != nullptr ? bias[col0 + d] : 0.f);
        s[d] = v;
        ss += v * v;
    }
    const float* nw = sect == 0 ? q_norm : (sect == 1 ? k_norm : nullptr);
    __syncwarp();
    if (nw != nullptr) {
        ss = warp_sum(ss);
        const float sc = rsqrtf(ss / (float)hd + eps);
        for (int d = lane; d < hd; d += 32) s[d] = s[d] * sc * nw[d];
        __syncwarp();
    }
    const int p = pos[r];
    if (sect < 2) {
        for (int j = lane; j < rope_half; j += 32) {
            const int ia = neox ? j : 2 * j, ib = neox ? j + rope_half : 2 * j + 1;
            const float a = s[ia], c = s[ib];
            const float cs = rcos[(long long)p * rope_half + j], sn = rsin[(long long)p * rope_half + j];
            s[ia] = a * cs - c * sn;
            s[ib] = a * sn + c * cs;
        }
        __syncwarp();
    }
    if (sect == 0) {
        float* o = q_out + (long long)r * ldq + head * hd;
        for (int d = lane; d < hd; d += 32) o[d] = s[d];
    } else {
        const long long o = (((long long)slot[r] * n_kv + head) * n_ctx + p) * hd;
        void* cache = sect == 1 ? kc : vc;
        for (int d = lane; d < hd; d += 32) kv_st<KVT>(cache, o + d, s[d]);
    }
}

// x[b, :] = scale * row tab_tok[b] of W (embedding lookup), k inputs.
template <int T>
__device__ __forceinline__ void embed_block(const int bx, const int by,
    const u8* __restrict__ W, long long rb, const int* __restrict__ tok, int k, float* __restrict__ x, int ldx,
    float scale)
{
    const int b = by;
    const int u = bx * blockDim.x + threadIdx.x;
    if (u >= (k >> 3)) return;
    float w[8];
    deq8<T>(W + (long long)tok[b] * rb, u, w);
    float* o = x + (long long)b * ldx + 8 * u;
#pragma unroll
    for (int i = 0; i < 8; i++) o[i] = w[i] * scale;
}
template <int T>
__global__ void embed(const u8* __restrict__ W, long long rb, const int* __restrict__ tok, int k,
                      float* __restrict__ x, int ldx, float scale)
{
    embed_block<T>(blockIdx.x, blockIdx.y, W, rb, tok, k, x, ldx, scale);
}

// out (m, k) float32 = every row of W dequantized
template <int T>
__global__ void dequant(const u8* __restrict__ W, long long rb, int m, int k, float* __restrict__ out)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int nu = k >> 3;
    if (i >= (long long)m * nu) return;
    const long long r = i / nu;
    const int u = (int)(i % nu);
    float w[8];
    deq8<T>(W + r * rb, u, w);
    float4* o = (float4*)(out + r * k + 8 * u);
    o[0] = make_float4(w[0], w[1], w[2], w[3]);
    o[1] = make_float4(w[4], w[5], w[6], w[7]);
}

// float16 bits of f, saturated to +-65504 (NaN stays NaN): the prefill GEMM's inputs never
// become infinite
__device__ __forceinline__ u16 f2h_sat(float f) {
    const float c = fminf(fmaxf(f, -65504.f), 65504.f);
    return f2h(f == f ? c : f);
}

// out (m, k) float16 = every row of W dequantized (a tile of rows of a weight for the
// prefill GEMM: pass W at the tile's first row), saturated like f2h_sat
template <int T>
__global__ void dequant_h(const u8* __restrict__ W, long long rb, int m, int k, u16* __restrict__ out)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int nu = k >> 3;
    if (i >= (long long)m * nu) return;
    const long long r = i / nu;
    const int u = (int)(i % nu);
    float w[8];
    deq8<T>(W + r * rb, u, w);
    uint4 o;
    o.x = (u32)f2h_sat(w[0]) | ((u32)f2h_sat(w[1]) << 16);
    o.y = (u32)f2h_sat(w[2]) | ((u32)f2h_sat(w[3]) << 16);
    o.z = (u32)f2h_sat(w[4]) | ((u32)f2h_sat(w[5]) << 16);
    o.w = (u32)f2h_sat(w[6]) | ((u32)f2h_sat(w[7]) << 16);
    *(uint4*)(out + r * k + 8 * u) = o;
}

// out[r, :k] (float16, ld ldo) = x[r] * rsqrt(mean(x[r]^2) + eps) * nw (nw given: the RMSNorm
// folded in, its scale from row_ss) or x[r] (nw null), saturated like f2h_sat: the prefill
// GEMM's activations, converted once per op. One block of 128 threads per row.
__global__ void __launch_bounds__(128) rows_half(const float* __restrict__ x, int ldx, const float* __restrict__ nw,
                                                 float eps, int k, u16* __restrict__ out, int ldo)
{
    __shared__ float red[4];
    const float* xr = x + (long long)blockIdx.x * ldx;
    u16* o = out + (long long)blockIdx.x * ldo;
    if (nw != nullptr) {
        const float sc = norm_scale(row_ss(xr, k, red), k, eps);
        for (int e = threadIdx.x; e < k; e += 128) o[e] = f2h_sat(__fmul_rn(__fmul_rn(xr[e], sc), nw[e]));
    } else {
        for (int e = threadIdx.x; e < k; e += 128) o[e] = f2h_sat(xr[e]);
    }
}

// E consecutive elements of a float32 (KVT 0) or float16 (KVT 1) cache row, element offset i
// (i * element size is a multiple of E * element size for E = 2, 4, 8)
template <int E, int KVT> __device__ __forceinline__ void ldkv(const void* c, long long i, float* o) {
    if (KVT == 0) {
        const float* p = (const float*)c + i;
        if (E == 2) { float2 v = *(const float2*)p; o[0] = v.x; o[1] = v.y; }
        else if (E % 4 == 0) {
#pragma unroll
            for (int e = 0; e < E; e += 4) {
                float4 v = *(const float4*)(p + e);
                o[e] = v.x; o[e + 1] = v.y; o[e + 2] = v.z; o[e + 3] = v.w;
            }
        } else {
#pragma unroll
            for (int e = 0; e < E; e++) o[e] = p[e];
        }
    } else {
        const u16* p = (const u16*)c + i;
        if (E == 2) { u32 v = *(const u32*)p; o[0] = h2f((u16)(v & 0xffff)); o[1] = h2f((u16)(v >> 16)); }
        else if (E == 4) {
            uint2 v = *(const uint2*)p;
            o[0] = h2f((u16)(v.x & 0xffff)); o[1] = h2f((u16)(v.x >> 16));
            o[2] = h2f((u16)(v.y & 0xffff)); o[3] = h2f((u16)(v.y >> 16));
        } else if (E == 8) {
            uint4 v = *(const uint4*)p;
            u32 a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int e = 0; e < 4; e++) { o[2 * e] = h2f((u16)(a[e] & 0xffff)); o[2 * e + 1] = h2f((u16)(a[e] >> 16)); }
        } else {
#pragma unroll
            for (int e = 0; e < E; e++) o[e] = h2f(p[e]);
        }
    }
}

// Attention of rows over their slot's KV, split over the context: grid (NSMAX, H, B), 128
// threads. Row b attends to positions lo .. tab_pos[b] of slot tab_slot[b], lo = 0, or
// tab_pos[b] + 1 - window for a sliding window (window > 0). The block of split s handles a
// contiguous chunk in rounds of 4 * PW positions: each warp loads the K and V rows of its PW
// positions into registers at once (lane holds E = HD/32 dims), then updates its online
// softmax. Partials (m, l, acc[HD]) go to part; the last split block to finish (atomic
// ticket) combines them and resets its counter. Query head h reads KV head h / (H / n_kv).
// sinks (gpt-oss; null: none): head h's learned logit z joins the softmax denominator with
// no value, at the final combination: M' = max(M, z), out = acc e^(M - M') / (L e^(M - M')
// + e^(z - M')). A function of the row's own scores: batch invariance holds.
template <int HD, int KVT>
__device__ __forceinline__ void attn_block(const int bx, const int by, const int bz,
    const float* __restrict__ q, int ldq, const void* __restrict__ kc, const void* __restrict__ vc,
    const int* __restrict__ tab_slot, const int* __restrict__ tab_pos, int H, int n_kv, int n_ctx, float scale,
    int window, const float* __restrict__ sinks, float* __restrict__ part, int* __restrict__ counters,
    float* __restrict__ out, int ldo, int nsmax, int minchunk)
{
    constexpr int E = HD / 32;
    constexpr int PW = 32 / E;
    __shared__ float s_m[4], s_l[4], s_acc[4][HD];
    __shared__ int s_last;
    const int s = bx, h = by, b = bz;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int len = tab_pos[b] + 1;
    const int lo = (window > 0 && len > window) ? len - window : 0;
    const int span = len - lo;
    int nsplit = (span + minchunk - 1) / minchunk;
    if (nsplit > nsmax) nsplit = nsmax;
    if (s >= nsplit) return;
    const int chunk = (span + nsplit - 1) / nsplit;
    const int t0 = lo + s * chunk, t1 = min(len, t0 + chunk);
    const int g = h / (H / n_kv);
    const long long base = ((long long)tab_slot[b] * n_kv + g) * n_ctx * HD + lane * E;
    float qv[E], acc[E];
    {
        const float* qp = q + (long long)b * ldq + h * HD + lane * E;
#pragma unroll
        for (int e = 0; e < E; e++) qv[e] = qp[e];
    }
#pragma unroll
    for (int e = 0; e < E; e++) { qv[e] *= scale; acc[e] = 0.f; }
    float m = -1e30f, l = 0.f;
    for (int r0 = t0 + warp * PW; r0 < t1; r0 += 4 * PW) {
        float kr[PW][E], vr[PW][E], sc[PW];
#pragma unroll
        for (int i = 0; i < PW; i++) {
            const int t = (r0 + i < t1) ? r0 + i : t0;
            ldkv<E, KVT>(kc, base + (long long)t * HD, kr[i]);
            ldkv<E, KVT>(vc, base + (long long)t * HD, vr[i]);
        }
#pragma unroll
        for (int i = 0; i < PW; i++) {
            float d = 0.f;
#pragma unroll
            for (int e = 0; e < E; e++) d += qv[e] * kr[i][e];
            sc[i] = d;
        }
#pragma unroll
        for (int i = 0; i < PW; i++) sc[i] = warp_sum(sc[i]);
        float mx = m;
#pragma unroll
        for (int i = 0; i < PW; i++) if (r0 + i < t1) mx = fmaxf(mx, sc[i]);
        const float corr = expf(m - mx);
        l *= corr;
#pragma unroll
        for (int e = 0; e < E; e++) acc[e] *= corr;
#pragma unroll
        for (int i = 0; i < PW; i++) {
            const float pr = (r0 + i < t1) ? expf(sc[i] - mx) : 0.f;
            l += pr;
#pragma unroll
            for (int e = 0; e < E; e++) acc[e] += pr * vr[i][e];
        }
        m = mx;
    }
    if (lane == 0) { s_m[warp] = m; s_l[warp] = l; }
#pragma unroll
    for (int e = 0; e < E; e++) s_acc[warp][lane * E + e] = acc[e];
    __syncthreads();
    const float M = fmaxf(fmaxf(s_m[0], s_m[1]), fmaxf(s_m[2], s_m[3]));
    float L = 0.f;
#pragma unroll
    for (int w = 0; w < 4; w++) L += s_l[w] * expf(s_m[w] - M);
    const long long bh = (long long)b * H + h;
    if (nsplit == 1) {
        float f = 1.f;                     // the sink's rescale of the values
        if (sinks != nullptr) {
            const float z = sinks[h], M2 = fmaxf(M, z);
            f = expf(M - M2);
            L = L * f + expf(z - M2);
        }
        for (int d = threadIdx.x; d < HD; d += 128) {
            float o = 0.f;
#pragma unroll
            for (int w = 0; w < 4; w++) o += s_acc[w][d] * expf(s_m[w] - M);
            out[(long long)b * ldo + h * HD + d] = (sinks != nullptr ? o * f : o) / L;
        }
        return;
    }
    float* P = part + (bh * nsmax + s) * (HD + 2);
    for (int d = threadIdx.x; d < HD; d += 128) {
        float o = 0.f;
#pragma unroll
        for (int w = 0; w < 4; w++) o += s_acc[w][d] * expf(s_m[w] - M);
        P[2 + d] = o;
    }
    if (threadIdx.x == 0) { P[0] = M; P[1] = L; }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int ticket = atomicAdd(counters + bh, 1);
        s_last = (ticket == nsplit - 1);
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const float* P0 = part + bh * nsmax * (HD + 2);
    float MM = -1e30f;
    for (int i = 0; i < nsplit; i++) MM = fmaxf(MM, __ldcg(P0 + i * (HD + 2)));
    float LL = 0.f;
    for (int i = 0; i < nsplit; i++) LL += __ldcg(P0 + i * (HD + 2) + 1) * expf(__ldcg(P0 + i * (HD + 2)) - MM);
    float f = 1.f;
    if (sinks != nullptr) {
        const float z = sinks[h], M2 = fmaxf(MM, z);
        f = expf(MM - M2);
        LL = LL * f + expf(z - M2);
    }
    for (int d = threadIdx.x; d < HD; d += 128) {
        float o = 0.f;
        for (int i = 0; i < nsplit; i++)
            o += __ldcg(P0 + i * (HD + 2) + 2 + d) * expf(__ldcg(P0 + i * (HD + 2)) - MM);
        out[(long long)b * ldo + h * HD + d] = (sinks != nullptr ? o * f : o) / LL;
    }
    if (threadIdx.x == 0) counters[bh] = 0;
}
template <int HD, int KVT>
__global__ void __launch_bounds__(128) attn_decode(
    const float* __restrict__ q, int ldq, const void* __restrict__ kc, const void* __restrict__ vc,
    const int* __restrict__ tab_slot, const int* __restrict__ tab_pos, int H, int n_kv, int n_ctx, float scale,
    int window, const float* __restrict__ sinks, float* __restrict__ part, int* __restrict__ counters,
    float* __restrict__ out, int ldo, int nsmax, int minchunk)
{
    attn_block<HD, KVT>(blockIdx.x, blockIdx.y, blockIdx.z, q, ldq, kc, vc, tab_slot, tab_pos, H, n_kv, n_ctx,
        scale, window, sinks, part, counters, out, ldo, nsmax, minchunk);
}

// ---- eager (prefill and mixed batches) and generic helpers --------------------------------

// out[r] = (add ? out[r] : 0) + x[r] * rsqrt(mean(x[r]^2) + eps) * w; one block per row
// (add: a norm after a sublayer whose result joins the residual stream, as gemma3's).
__global__ void rms_norm(const float* __restrict__ x, int ldx, const float* __restrict__ w, float eps, int d,
                         float* __restrict__ out, int ldo, int add)
{
    __shared__ float red[32];
    const float* xr = x + (long long)blockIdx.x * ldx;
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) { float v = xr[i]; ss += v * v; }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
        v = warp_sum(v);
        if (threadIdx.x == 0) red[0] = v;
    }
    __syncthreads();
    const float sc = rsqrtf(red[0] / (float)d + eps);
    float* o = out + (long long)blockIdx.x * ldo;
    if (add) { for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] += xr[i] * sc * w[i]; }
    else { for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = xr[i] * sc * w[i]; }
}

// Softmax over rows of S (rows, ld) for one segment's queries: row r is query i = r % n at
// position pos0 + i; column t is key position c0 + t. Keys after the query, and with a sliding
// window (window > 0) keys at or before query - window, get probability 0. Scores are
// multiplied by scale first. sinks (gpt-oss; null: none): row r belongs to query head r / n
// (rows are (KV, G, n) in order), whose sink logit joins the max and the denominator.
__global__ void causal_softmax(float* __restrict__ S, int ld, int n, int pos0, int c0, int window, float scale,
                               const float* __restrict__ sinks)
{
    __shared__ float red[32];
    __shared__ float bc;
    const long long r = blockIdx.x;
    float* row = S + r * ld;
    const int qp = pos0 + (int)(r % n);
    const int hi = qp + 1 - c0;                                          // columns [lo, hi) are attended
    const int lo = (window > 0 && qp + 1 - window > c0) ? qp + 1 - window - c0 : 0;
    float mx = -3.0e38f;
    for (int t = lo + threadIdx.x; t < hi; t += blockDim.x) mx = fmaxf(mx, row[t] * scale);
    mx = warp_max(mx);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : -3.0e38f;
        v = warp_max(v);
        if (threadIdx.x == 0) bc = v;
    }
    __syncthreads();
    mx = bc;
    const float z = sinks != nullptr ? sinks[r / n] : 0.f;
    if (sinks != nullptr) mx = fmaxf(mx, z);
    float sum = 0.f;
    for (int t = lo + threadIdx.x; t < hi; t += blockDim.x) { float e = expf(row[t] * scale - mx); row[t] = e; sum += e; }
    sum = warp_sum(sum);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = sum;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
        v = warp_sum(v);
        if (threadIdx.x == 0) bc = sinks != nullptr ? v + expf(z - mx) : v;
    }
    __syncthreads();
    const float inv = 1.0f / bc;
    for (int t = threadIdx.x; t < ld; t += blockDim.x) row[t] = (t >= lo && t < hi) ? row[t] * inv : 0.f;
}

// xo[j, :ld] = x[idx[j], :ld], one block per output row j: the rows whose logits a graph
// replay needs, gathered before the output GEMV so it runs on those rows only
__device__ __forceinline__ void gather_block(const int bx,
    const float* __restrict__ x, int ld, const int* __restrict__ idx, float* __restrict__ xo)
{
    const float* src = x + (long long)idx[bx] * ld;
    float* dst = xo + (long long)bx * ld;
    for (int e = threadIdx.x; e < ld; e += blockDim.x) dst[e] = src[e];
}
__global__ void gather_rows(const float* __restrict__ x, int ld, const int* __restrict__ idx, float* __restrict__ xo)
{
    gather_block(blockIdx.x, x, ld, idx, xo);
}

// gpt-oss's clamped SwiGLU on the GPU expert tier (ggml_swiglu_oai; cpu_moe.swiglu_oai):
// x = min(g, limit), y = clamp(u, -limit, limit), out = x / (1 + exp(-alpha x)) * (y + 1)
__global__ void swiglu_oai_rows(const float* __restrict__ g, int ldg, const float* __restrict__ u, int ldu, int n,
                                int f, float alpha, float limit, float* __restrict__ out, int ldo)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * f) return;
    const long long r = i / f, c = i % f;
    const float x = fminf(g[r * ldg + c], limit);
    const float y = fminf(fmaxf(u[r * ldu + c], -limit), limit);
    out[r * ldo + c] = x / (1.0f + expf(-alpha * x)) * (y + 1.0f);
}

// out[r, c] = act(g[r, c]) * u[r, c] for r < n, c < f; act 0 silu (SwiGLU), 1 gelu_tanh (GEGLU)
__global__ void glu_rows(const float* __restrict__ g, int ldg, const float* __restrict__ u, int ldu, int n, int f,
                         int act, float* __restrict__ out, int ldo)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * f) return;
    const long long r = i / f, c = i % f;
    const float a = g[r * ldg + c];
    out[r * ldo + c] = (act ? gelu_tanh(a) : silu(a)) * u[r * ldu + c];
}

// out[r, c] = a + b (op 0), s * a (op 1), s * tanh(a / s) (op 2, soft-capping), a (op 3);
// out may be a (in place)
__global__ void ew_rows(const float* a, int lda, const float* b, int ldb, float* out, int ldo, int n_rows, int n,
                        int op, float s)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_rows * n) return;
    const long long r = i / n, c = i % n;
    const float x = a[r * lda + c];
    float y;
    if (op == 0) y = x + b[r * ldb + c];
    else if (op == 1) y = s * x;
    else if (op == 2) y = s * tanhf(x / s);
    else y = x;
    out[r * ldo + c] = y;
}

// y[r, c] += bias[c] for r < n_rows, c < n
__global__ void bias_rows(float* __restrict__ y, int ldy, const float* __restrict__ bias, int n_rows, int n)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_rows * n) return;
    const long long r = i / n, c = i % n;
    y[r * ldy + c] += bias[c];
}

// Generic per-head op, one warp per (head, row): grid (n_heads, rows). Head chunk of row r of x
// (hd values at column head * hd): RMSNorm with weight nw (when not null), then RoPE (when
// rope_half > 0; positions pos[r]), written to out (may be x).
__global__ void __launch_bounds__(32) head_ops(const float* x, int ldx, float* out, int ldo, int hd,
                                               const float* __restrict__ nw, float eps, int rope_half, int neox,
                                               const int* __restrict__ pos, const float* __restrict__ rcos,
                                               const float* __restrict__ rsin)
{
    __shared__ float s[256];
    const int h = blockIdx.x, r = blockIdx.y, lane = threadIdx.x;
    const float* xr = x + (long long)r * ldx + h * hd;
    float ss = 0.f;
    for (int d = lane; d < hd; d += 32) { const float v = xr[d]; s[d] = v; ss += v * v; }
    __syncwarp();
    if (nw != nullptr) {
        ss = warp_sum(ss);
        const float sc = rsqrtf(ss / (float)hd + eps);
        for (int d = lane; d < hd; d += 32) s[d] = s[d] * sc * nw[d];
        __syncwarp();
    }
    if (rope_half > 0) {
        const int p = pos[r];
        for (int j = lane; j < rope_half; j += 32) {
            const int ia = neox ? j : 2 * j, ib = neox ? j + rope_half : 2 * j + 1;
            const float a = s[ia], c = s[ib];
            const float cs = rcos[(long long)p * rope_half + j], sn = rsin[(long long)p * rope_half + j];
            s[ia] = a * cs - c * sn;
            s[ib] = a * sn + c * cs;
        }
        __syncwarp();
    }
    float* o = out + (long long)r * ldo + h * hd;
    for (int d = lane; d < hd; d += 32) o[d] = s[d];
}

// Generic KV store: rows r < n_rows of k (ldk) and v (ldv), n_kv * hd values each, into the
// caches at (slot[r], pos[r]).
template <int KVT>
__global__ void kv_store(const float* __restrict__ k, int ldk, const float* __restrict__ v, int ldv, int n_rows,
                         int n_kv, int hd, int n_ctx, const int* __restrict__ slot, const int* __restrict__ pos,
                         void* __restrict__ kc, void* __restrict__ vc)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int w = n_kv * hd;
    if (i >= (long long)n_rows * w) return;
    const int r = (int)(i / w), c = (int)(i % w);
    const long long o = (((long long)slot[r] * n_kv + c / hd) * n_ctx + pos[r]) * hd + (c % hd);
    kv_st<KVT>(kc, o, k[(long long)r * ldk + c]);
    kv_st<KVT>(vc, o, v[(long long)r * ldv + c]);
}

// ---- flash-style prefill attention (issue 19 item 2): tensor cores, no score matrix ----------
// attn_prefill<HD, KVT>: the attention of one long segment (n rows of slot `slot` at positions
// pos0 .. pos0 + n - 1; q and out point at its first row) read straight from the KV cache, as
// IR.md section 5 says: row i attends to keys [lo, pos0 + i], lo = max(0, pos0 + i + 1 - window)
// when window > 0, else 0; query head h reads KV head h / (H / n_kv); sinks (gpt-oss; null:
// none) join the denominator as in attn_decode. Grid (ceil(n / FA_BM), H), 128 threads: a block
// takes FA_BM = 64 query rows of one head (16 per warp) and walks key tiles of FA_BN = 64 keys
// from the block's lowest key to its highest (the longest row tiles run first). Per tile:
// S = Q K^T and O += P V on tensor cores (mma.sync m16n8k16, float16 inputs, float32
// accumulation) and an online softmax in float32 on the accumulator fragments (base 2: log2(e)
// is folded into the query scale). K and V tiles go to shared memory as float16, rows padded to
// HD + 8 halves (ldmatrix without bank conflicts): 2 x 64 x (HD + 8) x 2 bytes = 34 KB static
// at HD 128. A float16 cache is copied by cp.async, V's copy overlapping Q K^T and the next K's
// overlapping P V; a float32 cache is rounded to float16 on the way in (saturated at +-65504).
// Keys past the segment's last row read as zeros (and are masked).
// Numerics: float16 rounding of q (relative 2^-11 per element), of a float32 cache's K and V
// and of the probabilities (in [0, 1]) bounds the error at about 1e-3 relative; every sum is
// float32. q is multiplied by scale * log2(e) in float32 BEFORE its float16 rounding: attention
// inputs are O(1-10) (a few hundred at worst) and scale is 1/sqrt(hd) or so (scale * log2(e)
// < 1.5 for every model here), so the scaled values sit far inside float16's range (65504),
// and scaling first can only shrink them; the rounding is relative either way (11 bits down to
// 6e-5; smaller entries are negligible terms of the dot product). Needs sm_80 (mma m16n8k16
// f16, cp.async, ldmatrix): cuda_program registers the instances only there; older targets
// compile an empty body.
#define FA_BM 64
#define FA_BN 64
#define FA_INF __int_as_float(0x7f800000)   // +infinity (no math.h here)

__device__ __forceinline__ float fa_sat(float x) {            // float16's finite range, NaN kept
    return x == x ? fminf(fmaxf(x, -65504.f), 65504.f) : x;
}
__device__ __forceinline__ u32 fa_pack(float lo, float hi) {  // two floats as float16x2 (lo: bits 0-15)
    u32 r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
__device__ __forceinline__ u32 fa_smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void fa_mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void fa_ldsm4(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void fa_ldsm4t(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void fa_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void fa_wait1() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

// keys k0 .. k0 + FA_BN - 1 of one (slot, KV head) (element offset `base` in the layer) into sm
// (FA_BN, HD + 8) float16; keys past kmax as zeros
template <int HD, int KVT>
__device__ __forceinline__ void fa_tile(u16* sm, const void* __restrict__ c, long long base, int k0, int kmax)
{
    constexpr int CPR = HD / 8;                 // 16-byte chunks of float16 per row
    static_assert((FA_BN * CPR) % 128 == 0, "fa_tile: whole rounds of 128 threads");
#pragma unroll
    for (int it = 0; it < FA_BN * CPR / 128; it++) {
        const int i = it * 128 + threadIdx.x;
        const int r = i / CPR, ch = i % CPR;
        const bool ok = k0 + r <= kmax;
        const long long src = base + (long long)(ok ? k0 + r : kmax) * HD + ch * 8;
        u16* d = sm + r * (HD + 8) + ch * 8;
        if (KVT == 1) {
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                         :: "r"(fa_smem(d)), "l"((const u16*)c + src), "r"(ok ? 16 : 0) : "memory");
        } else {
            uint4 o = make_uint4(0u, 0u, 0u, 0u);
            if (ok) {
                const float4 a = *(const float4*)((const float*)c + src);
                const float4 b = *(const float4*)((const float*)c + src + 4);
                o.x = fa_pack(fa_sat(a.x), fa_sat(a.y)); o.y = fa_pack(fa_sat(a.z), fa_sat(a.w));
                o.z = fa_pack(fa_sat(b.x), fa_sat(b.y)); o.w = fa_pack(fa_sat(b.z), fa_sat(b.w));
            }
            *(uint4*)d = o;
        }
    }
}

template <int HD, int KVT>
__global__ void __launch_bounds__(128) attn_prefill(
    const float* __restrict__ q, int ldq, const void* __restrict__ kc, const void* __restrict__ vc, int slot,
    int pos0, int n, int H, int n_kv, int n_ctx, float scale, int window, const float* __restrict__ sinks,
    float* __restrict__ out, int ldo)
{
#if __CUDA_ARCH__ >= 800
    static_assert(HD % 16 == 0 && HD <= 128, "attn_prefill: HD a multiple of 16, at most 128");
    constexpr int LD = HD + 8, KS = HD / 16, NO = HD / 8, NS = FA_BN / 8;
    constexpr float LOG2E = 1.4426950408889634f;
    __shared__ __align__(16) u16 sK[FA_BN * LD];
    __shared__ __align__(16) u16 sV[FA_BN * LD];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y;
    const int r0 = (gridDim.x - 1 - blockIdx.x) * FA_BM;       // the longest row tiles first
    const int k_lo = window > 0 ? max(0, pos0 + r0 + 1 - window) : 0;
    const int k_hi = pos0 + min(n, r0 + FA_BM) - 1;            // the block's keys: [k_lo, k_hi]
    const long long base = ((long long)slot * n_kv + h / (H / n_kv)) * n_ctx * HD;
    const int wr = r0 + warp * 16;                             // this warp's first row
    const int wpos = pos0 + wr;
    const int p0 = wpos + g, p1 = p0 + 8;                      // this thread's two rows' positions
    const int lo0 = window > 0 ? p0 + 1 - window : 0, lo1 = window > 0 ? p1 + 1 - window : 0;
    // A fragments of this warp's 16 query rows (rows g and g + 8; dims 2t, 2t + 1, 2t + 8, 2t + 9
    // of each 16), scaled, as float16 (the numerics note above)
    u32 qa[KS][4];
    {
        const float qs = scale * LOG2E;
        const float* q0 = q + (long long)(wr + g) * ldq + h * HD;
        const float* q1 = q0 + 8LL * ldq;
        const bool v0 = wr + g < n, v1 = wr + g + 8 < n;
#pragma unroll
        for (int kk = 0; kk < KS; kk++) {
            const int d = 16 * kk + 2 * t;
            float x[8];
            x[0] = v0 ? q0[d] : 0.f;     x[1] = v0 ? q0[d + 1] : 0.f;
            x[2] = v1 ? q1[d] : 0.f;     x[3] = v1 ? q1[d + 1] : 0.f;
            x[4] = v0 ? q0[d + 8] : 0.f; x[5] = v0 ? q0[d + 9] : 0.f;
            x[6] = v1 ? q1[d + 8] : 0.f; x[7] = v1 ? q1[d + 9] : 0.f;
#pragma unroll
            for (int e = 0; e < 4; e++) qa[kk][e] = fa_pack(fa_sat(x[2 * e] * qs), fa_sat(x[2 * e + 1] * qs));
        }
    }
    float o[NO][4];
#pragma unroll
    for (int j = 0; j < NO; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m0 = -FA_INF, m1 = -FA_INF, l0 = 0.f, l1 = 0.f;
    // ldmatrix: lane supplies the address of row (lane & 7) of 8x8 matrix (lane >> 3)
    const int mi = lane >> 3, mr = lane & 7;
    const u32 kaddr = fa_smem(sK) + 2 * (((mi >> 1) * 8 + mr) * LD + (mi & 1) * 8);   // K: keys x dims
    const u32 vaddr = fa_smem(sV) + 2 * (((mi & 1) * 8 + mr) * LD + (mi >> 1) * 8);   // V, transposed
    fa_tile<HD, KVT>(sK, kc, base, k_lo, k_hi);
    fa_commit();
    for (int k0 = k_lo; k0 <= k_hi; k0 += FA_BN) {
        fa_tile<HD, KVT>(sV, vc, base, k0, k_hi);
        fa_commit();
        fa_wait1();                                            // this tile's K is in
        __syncthreads();
        // this warp has work where its rows exist and the tile meets their keys
        const bool go = wr < n && k0 <= wpos + 15 && (window <= 0 || k0 + FA_BN - 1 >= wpos + 1 - window);
        float s[NS][4];
        if (go) {
#pragma unroll
            for (int j = 0; j < NS; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KS; kk++) {
#pragma unroll
                for (int p = 0; p < NS / 2; p++) {
                    u32 b[4];
                    fa_ldsm4(kaddr + 2 * (16 * p * LD + 16 * kk), b);
                    fa_mma(s[2 * p], qa[kk], b[0], b[1]);
                    fa_mma(s[2 * p + 1], qa[kk], b[2], b[3]);
                }
            }
            // the mask, on tiles that cross a row's last key (causal) or first (window) only
            if (k0 + FA_BN - 1 > wpos || (window > 0 && k0 < wpos + 16 - window)) {
#pragma unroll
                for (int j = 0; j < NS; j++) {
                    const int key = k0 + 8 * j + 2 * t;
                    if (key > p0 || key < lo0) s[j][0] = -FA_INF;
                    if (key + 1 > p0 || key + 1 < lo0) s[j][1] = -FA_INF;
                    if (key > p1 || key < lo1) s[j][2] = -FA_INF;
                    if (key + 1 > p1 || key + 1 < lo1) s[j][3] = -FA_INF;
                }
            }
            // online softmax: row maxima over the quad's 4 threads, rescale, exponentiate
            float x0 = -FA_INF, x1 = -FA_INF;
#pragma unroll
            for (int j = 0; j < NS; j++) {
                x0 = fmaxf(x0, fmaxf(s[j][0], s[j][1]));
                x1 = fmaxf(x1, fmaxf(s[j][2], s[j][3]));
            }
            x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 1));
            x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 2));
            x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 1));
            x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 2));
            const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);
            const float b0 = n0 == -FA_INF ? 0.f : n0, b1 = n1 == -FA_INF ? 0.f : n1;   // no key yet: no NaN
            const float c0 = exp2f(m0 - b0), c1 = exp2f(m1 - b1);
            m0 = n0;
            m1 = n1;
            l0 *= c0;
            l1 *= c1;
#pragma unroll
            for (int j = 0; j < NO; j++) { o[j][0] *= c0; o[j][1] *= c0; o[j][2] *= c1; o[j][3] *= c1; }
#pragma unroll
            for (int j = 0; j < NS; j++) {
                s[j][0] = exp2f(s[j][0] - b0); s[j][1] = exp2f(s[j][1] - b0);
                s[j][2] = exp2f(s[j][2] - b1); s[j][3] = exp2f(s[j][3] - b1);
                l0 += s[j][0] + s[j][1];
                l1 += s[j][2] + s[j][3];
            }
        }
        __syncthreads();                                       // every warp is done with K
        if (k0 + FA_BN <= k_hi) fa_tile<HD, KVT>(sK, kc, base, k0 + FA_BN, k_hi);
        fa_commit();                                           // (an empty group after the last tile)
        fa_wait1();                                            // this tile's V is in
        __syncthreads();
        if (go) {
            // O += P V: the S accumulators of key columns 2kk, 2kk + 1 are the A fragment of keys 16kk ..
#pragma unroll
            for (int kk = 0; kk < NS / 2; kk++) {
                const u32 a[4] = {fa_pack(s[2 * kk][0], s[2 * kk][1]), fa_pack(s[2 * kk][2], s[2 * kk][3]),
                                  fa_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                  fa_pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
                for (int d = 0; d < HD / 16; d++) {
                    u32 b[4];
                    fa_ldsm4t(vaddr + 2 * (16 * kk * LD + 16 * d), b);
                    fa_mma(o[2 * d], a, b[0], b[1]);
                    fa_mma(o[2 * d + 1], a, b[2], b[3]);
                }
            }
        }
        __syncthreads();                                       // every warp is done with V
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    float f0 = 1.f / l0, f1 = 1.f / l1;
    if (sinks != nullptr) {               // attn_decode's formula, in base 2
        const float z = sinks[h] * LOG2E;
        const float M0 = fmaxf(m0, z), M1 = fmaxf(m1, z);
        const float e0 = exp2f(m0 - M0), e1 = exp2f(m1 - M1);
        f0 = e0 / (l0 * e0 + exp2f(z - M0));
        f1 = e1 / (l1 * e1 + exp2f(z - M1));
    }
    float* o0 = out + (long long)(wr + g) * ldo + h * HD + 2 * t;
    float* o1 = o0 + 8LL * ldo;
    if (wr + g < n) {
#pragma unroll
        for (int j = 0; j < NO; j++) { o0[8 * j] = o[j][0] * f0; o0[8 * j + 1] = o[j][1] * f0; }
    }
    if (wr + g + 8 < n) {
#pragma unroll
        for (int j = 0; j < NO; j++) { o1[8 * j] = o[j][2] * f1; o1[8 * j + 1] = o[j][3] * f1; }
    }
#endif
}
// ---- end of the flash-style prefill attention ----

// ---- the GPU expert tier (issue 22; cuda_program._GpuExperts): one launch per GEMV for all experts ----
// xo[j, :k] = x[idx[j], :k], one block per output row j: the rows routed to the experts held on
// the device, gathered in (expert, row) pair order from the index table the host copied once
__global__ void moe_gather(const float* __restrict__ x, int ldx, const int* __restrict__ idx, int k,
                           float* __restrict__ xo, int ldo)
{
    const float* src = x + (long long)idx[blockIdx.x] * ldx;
    float* dst = xo + (long long)blockIdx.x * ldo;
    for (int e = threadIdx.x; e < k; e += blockDim.x) dst[e] = src[e];
}

// The experts' GEMV: `gemv` without a norm, in modes M_STORE and M_SWIGLU, over the tiles of many
// experts in one launch. Tile t = blockIdx.y: tiles[3t .. 3t+2] = (expert slot e, first batch
// row b0, rows nb <= NB) of x (an expert's rows are consecutive; one tile never spans two
// experts); expert e's matrices start ea / eb bytes apart (Wa + e ea, Wb + e eb), its biases
// ebias floats apart (either may be null). The sums and the epilogue are `gemv`'s own device
// functions (gemv_sums, gemv_out; PPW 1, no norm), on expert e's rows and biases, so a row gets
// the bits a `gemv` launch on its expert alone gives, whatever the tile, the other experts and
// the variant.
template <int TA, int TB, int NB, int MODE, int WPP>
__global__ void __launch_bounds__(GEMV_WARPS * 32) moe_gemv(
    const u8* __restrict__ Wa, const u8* __restrict__ Wb, long long ea, long long eb, long long rba, long long rbb,
    int a_stride, int b_off, int n_pairs, int k, const float* __restrict__ x, int ldx,
    const int* __restrict__ tiles, const float* __restrict__ bias_a, const float* __restrict__ bias_b, int ebias,
    float* __restrict__ y, int ldy)
{
    static_assert(WPP == 1 || WPP == 2 || WPP == 4, "WPP is 1, 2 or 4");
    static_assert(MODE == M_STORE || MODE == M_SWIGLU, "moe_gemv: store or swiglu");
    constexpr int PPB = GEMV_WARPS / WPP;    // row pairs per block
    __shared__ float s_red[WPP > 1 ? PPB : 1][4][2 * NB];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int* tile = tiles + 3 * blockIdx.y;
    const int e = tile[0], b0 = tile[1], nb = tile[2];
    if (nb <= 0) return;                     // a spare tile of moe_tiles' fixed grid (the device-resident step)
    const int pl = warp / WPP;
    const int p_raw = blockIdx.x * PPB + pl;
    const bool valid = p_raw < n_pairs;
    const int p = valid ? p_raw : n_pairs - 1;
    const PairRows r = pair_rows<false>(p, a_stride, b_off, 0, 0, 0, 0, 0, 0);
    const u8* const rowA[1] = {Wa + (long long)e * ea + r.ra * rba};
    const u8* const rowB[1] = {Wb + (long long)e * eb + r.rb * rbb};
    float tot[1];
    if (!gemv_sums<TA, TB, NB, WPP, 1>(rowA, rowB, k, nullptr, x, ldx, b0, nb, pl, s_red, tot)) return;
    const float other = __shfl_xor_sync(0xffffffffu, tot[0], NB);   // lane j < NB: A of row j; j + NB: its B
    if (lane >= nb || !valid) return;
    const float* ba = bias_a != nullptr ? bias_a + (long long)e * ebias : nullptr;   // expert e's biases
    const float* bb = bias_b != nullptr ? bias_b + (long long)e * ebias : nullptr;
    gemv_out<MODE>(tot[0], other, b0 + lane, p, r, false, 0.f, ba, bb, y, ldy, 0, 0, 0, 0, 0, nullptr, nullptr,
                   nullptr, nullptr, nullptr, nullptr);
}

// ---- the device-resident moe step (cuda_program._MoeHost.device_ready): every expert of the layer on the
// GPU, so the router, the routing, the experts and the join run here in launches a CUDA graph captures (no
// host round trip). The experts' GEMVs are moe_gemv above; these three kernels do the rest.

// moe_route: one warp per row i of the router logits lg (n rows, ldl apart; + bias (E) when given): the k
// experts cpu_moe._route picks, by its rules: sel[i k + j] in decreasing value (ties: the lower id), w[i k + j]
// their weights. Gating softmax (sw 0): p = softmax(l) (float64 sum), w = p[sel]; softmax_weight (sw 1):
// selected by l, w = softmax of those k. norm_w: w / max(sum w, MOE_NORM_MIN) (float32 sum in j order);
// w_scale multiplies w unless it is 0 or 1. E <= 1024 (p in shared memory, E floats per warp).
#define MOE_ROUTE_WARPS 4
__global__ void __launch_bounds__(MOE_ROUTE_WARPS * 32) moe_route(
    const float* __restrict__ lg, int ldl, const float* __restrict__ bias, int n, int E, int k, int sw, int norm_w,
    float w_scale, int* __restrict__ sel, float* __restrict__ wts)
{
    extern __shared__ float s_route[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int i = blockIdx.x * MOE_ROUTE_WARPS + warp;
    if (i >= n) return;
    float* p = s_route + warp * E;
    const float* l = lg + (long long)i * ldl;
    float mx = -__int_as_float(0x7f800000);
    for (int e = lane; e < E; e += 32) {
        const float v = bias != nullptr ? l[e] + bias[e] : l[e];
        p[e] = v;
        mx = fmaxf(mx, v);
    }
    if (!sw) {
        for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        double s = 0.0;
        for (int e = lane; e < E; e += 32) {
            const float v = expf(p[e] - mx);
            p[e] = v;
            s += (double)v;
        }
        for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        const float inv = (float)(1.0 / s);
        for (int e = lane; e < E; e += 32) p[e] = p[e] * inv;
    }
    __syncwarp();
    unsigned taken = 0u;                     // bit t: expert lane + 32 t is taken
    float wv[32];
    int sv[32];
    for (int j = 0; j < k; ++j) {
        float bv = 0.f;
        int bi = -1;
        for (int t = 0, e = lane; e < E; ++t, e += 32) {
            if ((taken >> t) & 1u) continue;
            const float v = p[e];
            if (bi < 0 || v > bv) { bv = v; bi = e; }
        }
        for (int o = 16; o; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            const bool take = oi >= 0 && (bi < 0 || ov > bv || (!(bv > ov) && oi < bi));
            if (take) { bv = ov; bi = oi; }
        }
        if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
        wv[j] = bv;
        sv[j] = bi;
    }
    if (lane != 0) return;
    if (sw) {
        float m2 = wv[0];
        for (int j = 1; j < k; ++j) m2 = wv[j] > m2 ? wv[j] : m2;
        double s = 0.0;
        for (int j = 0; j < k; ++j) { wv[j] = expf(wv[j] - m2); s += (double)wv[j]; }
        const float inv = (float)(1.0 / s);
        for (int j = 0; j < k; ++j) wv[j] = wv[j] * inv;
    }
    if (norm_w) {
        float s = 0.f;
        for (int j = 0; j < k; ++j) s += wv[j];
        if (s < 6.103515625e-5f) s = 6.103515625e-5f;
        for (int j = 0; j < k; ++j) wv[j] = wv[j] / s;
    }
    const bool scale = w_scale != 0.f && w_scale != 1.f;
    for (int j = 0; j < k; ++j) {
        sel[(long long)i * k + j] = sv[j];
        wts[(long long)i * k + j] = scale ? wv[j] * w_scale : wv[j];
    }
}

// moe_tiles: one block of 1024 threads: the P = n k pairs of sel (pair q: row q / k, slot q % k) by expert,
// experts in increasing id and pairs in increasing q within one: tab[0 .. P) = each position's row (moe_gather's
// index), pos[q] = pair q's position (moe_join's); then tmax tiles from tab + P (expert slot, first position,
// rows <= nb; moe_gemv's table), an expert's positions cut into tiles of nb, the tiles past the last empty
// (0 rows: moe_gemv skips them). traffic (E) int64, when given, gets each expert's pairs added, but those of
// padding rows (row_slot[row] == pad_slot; row_slot null: none). E <= 1024.
#define MOE_TILES_CHUNK 4096
__global__ void __launch_bounds__(1024) moe_tiles(
    const int* __restrict__ sel, int P, int k, int E, const int* __restrict__ slot, int nb, int tmax,
    int* __restrict__ tab, int* __restrict__ pos, unsigned long long* __restrict__ traffic,
    const int* __restrict__ row_slot, int pad_slot)
{
    __shared__ int s_cnt[1024], s_off[1024], s_toff[1025], s_real[1024];
    __shared__ int s_sel[MOE_TILES_CHUNK];
    const int e = threadIdx.x;
    if (e < E) s_cnt[e] = s_real[e] = 0;
    __syncthreads();
    for (int q = threadIdx.x; q < P; q += blockDim.x) {
        atomicAdd(&s_cnt[sel[q]], 1);
        if (row_slot == nullptr || row_slot[q / k] != pad_slot) atomicAdd(&s_real[sel[q]], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int o = 0, t = 0;
        for (int x = 0; x < E; ++x) {
            s_off[x] = o;
            s_toff[x] = t;
            o += s_cnt[x];
            t += (s_cnt[x] + nb - 1) / nb;
        }
        s_toff[E] = t;
    }
    __syncthreads();
    const int cnt = e < E ? s_cnt[e] : 0;
    int o = e < E ? s_off[e] : 0;
    for (int c0 = 0; c0 < P; c0 += MOE_TILES_CHUNK) {
        const int m = min(MOE_TILES_CHUNK, P - c0);
        __syncthreads();
        for (int q = threadIdx.x; q < m; q += blockDim.x) s_sel[q] = sel[c0 + q];
        __syncthreads();
        if (cnt > 0) {
            for (int q = 0; q < m; ++q) {
                if (s_sel[q] == e) {
                    tab[o] = (c0 + q) / k;
                    pos[c0 + q] = o;
                    ++o;
                }
            }
        }
    }
    if (e < E && cnt > 0) {
        const int o0 = s_off[e], sl = slot[e];
        int t = s_toff[e];
        for (int b = 0; b < cnt; b += nb, ++t) {
            int* tl = tab + P + 3 * t;
            tl[0] = sl;
            tl[1] = o0 + b;
            tl[2] = min(nb, cnt - b);
        }
        if (traffic != nullptr) traffic[e] += (unsigned long long)s_real[e];
    }
    for (int t = s_toff[E] + threadIdx.x; t < tmax; t += blockDim.x) {
        int* tl = tab + P + 3 * t;
        tl[0] = 0;
        tl[1] = 0;
        tl[2] = 0;
    }
}

// moe_join: out[i, c] = sum_j w[i k + j] y[pos[i k + j], c] for j = 0 .. k-1 in that order, each product and
// sum rounded (no fused multiply-add): cpu_moe.join's bits. One block per row.
__global__ void moe_join(const float* __restrict__ y, int ldy, const int* __restrict__ pos,
                         const float* __restrict__ w, int k, int d, float* __restrict__ out, int ldo)
{
    const long long q = (long long)blockIdx.x * k;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = __fmul_rn(w[q], y[(long long)pos[q] * ldy + c]);
        for (int j = 1; j < k; ++j) acc = __fadd_rn(acc, __fmul_rn(w[q + j], y[(long long)pos[q + j] * ldy + c]));
        out[(long long)blockIdx.x * ldo + c] = acc;
    }
}
"""

# ---- fp16 decode GEMV: a measurement candidate (issue 19 item 1), not in the kernel choice ------
#: the weight types with a half2 form (``hw<T>``): ``gemv_h`` instances exist for these
H_TYPES = (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)

SRC += r"""
// ---- fp16 decode GEMV (gemv_h): dequantize in registers to half2, HFMA2 --------------------
// The other half of issue 19 item 1 ("integer dot products as MMVQ, or dequantize in
// registers with fp16 math: measure both"). A measurement candidate: cuda_program does not
// launch it and the kernel choice does not time it (tests/tools/cuda_gemv_bench.py --fp16 does).
//
// Activations: ``quant_rows_h`` (one launch per GEMV, like quant_rows for int8) writes each
// 32-input block of x (times the norm weight nw when given) as float16 values x * 2^es, es a
// power of two per block that puts max |x| in [2^14, 2^15], plus per block a float4 (sx =
// 2^(24 - es), s0, s1 = the float32 sums of the block's inputs 0..15 and 16..31, 0).
// Weights: ``hw<T>`` reads weight block u (32 inputs) as 16 half2 words whose halves are
// unsigned integer levels L in the low bits of a float16 (exponent field 0: the value is
// L * 2^-24, a subnormal, exact for L < 1024), so a level costs one mask (LOP3), no
// conversion and no 1024-offset subtraction; the block's weights are da * L + oa (inputs
// 0..15) and db * L + ob (16..31): signed and offset levels (Q4_0's q - 8, Q8_0's int8 as
// b + 128, Q6_K's q - 32, the K-quant mins) become the float offsets oa, ob times s0, s1.
// The product L * 2^-24 * x * 2^es is at most 255 * 2^-9 (< 0.5), a chain of 8 of them < 4:
// no overflow; products below 2^-14 are subnormal, absolute error 2^-25, i.e. 2^-17 of the
// block's largest product.
// Pairing: word i of a block's levels holds inputs 4i .. 4i+3 in its bytes; mask 0x000F000F
// (or 0x00F000F0, 0x00FF00FF, 0x003F003F) of the word gives inputs (4i, 4i+2), the same
// mask of the word >> 8 inputs (4i+1, 4i+3). quant_rows_h stores x in that order (half2 A_i
// = (x[4i], x[4i+2]), B_i = (x[4i+1], x[4i+3]), block = A_0 B_0 A_1 ... B_7, 64 bytes), and
// lane-interleaved: 16-byte chunk c (0..3) of block u at chunk index (u / 32 * 4 + c) * 32 +
// u % 32 of the row, so the 32 lanes of a warp (32 consecutive blocks) read 512 contiguous
// bytes per load instruction. A row holds ceil(k / 1024) * 1024 halves (ldh).
//
// The canonical order (per output; every variant NB, WPP, PPW has it): the row's units are
// its 32-input blocks; virtual lanes, groups, butterfly, ((R_0 + R_1) + R_2) + R_3 and the
// epilogue are gemv Q8 1's (same lanes, same gemv_out). A unit's contribution (hdot):
//   Ha = HFMA2 chain over A_0 B_0 .. A_3 B_3 (inputs 0..15), Hb over A_4 .. B_7 (16..31),
//   each from 0, in half2 (each half of a chain sums 8 products);
//   fa = float(Ha.lo) + float(Ha.hi), fb likewise (float32);
//   t = sx * fmaf(da, fa, db * fb); then fmaf(oa, s0, t), fmaf(ob, s1, t) (offset types);
//   acc += t (float32).
// The precision trade: half sums are at most 8 products long (relative error of a chain a
// few 2^-12, float16's half ulp), one float conversion per 16 inputs keeps the conversions
// and float work at ~0.25 instruction per weight; every longer half chain (32, 64 products)
// would save a few of those but grow the error with the chain, and a float32 accumulator
// per 8 inputs would double them. x itself is rounded to float16 (2^-12 relative) after
// the per-block power-of-two scaling, which costs nothing in precision (exact) and keeps the
// half products out of float16's underflow for any activation range (the FFN down input
// passes float16's range on some models: here it cannot overflow, the scale is per block).
// Offsets in float: sum (da L + oa) x = da sum L x + oa sum x, with sum x exact in float32
// terms; the cancellation between the two terms (levels centred around 8, 32, 128) costs
// about a factor 2 of the half-chain error. Expected relative distance from the float32
// GEMV: ~3e-4 to 1e-3 (int8 activations: ~1e-2).
// Types: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K (H_TYPES in Python); k a multiple of 32.

__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 d; asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d;
}
// float(lo) + float(hi) of a half2
__device__ __forceinline__ float h2sum(u32 v) {
    float a, b;
    asm("{.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;}"
        : "=f"(a), "=f"(b) : "r"(v));
    return __fadd_rn(a, b);
}

struct HW {
    u32 h[16];             // A_0 B_0 A_1 B_1 .. A_7 B_7: half2 levels (L * 2^-24)
    float da, db, oa, ob;  // weight = da L + oa (inputs 0..15), db L + ob (16..31)
};
template <int T> struct HTraits { static constexpr bool ok = false, has_off = false; };
#define H_TRAITS(T, OFF) template <> struct HTraits<T> { static constexpr bool ok = true, has_off = OFF; };
H_TRAITS(2, true)    // Q4_0: d (q - 8)
H_TRAITS(3, true)    // Q4_1: d q + m
H_TRAITS(8, true)    // Q8_0: d b = d (b + 128) - 128 d
H_TRAITS(12, true)   // Q4_K: d sc q - dmin mn
H_TRAITS(14, true)   // Q6_K: d s (q - 32)

template <int T> __device__ __forceinline__ void hw(const u8* __restrict__ row, int u, HW& W);

// Q4_0 / Q4_1: byte j of qs: low nibble input j, high nibble input j + 16; the high
// nibbles are read in place (16 L), their scale divided by 16 (exact)
__device__ __forceinline__ void hw_q4(const u32 (&v)[4], HW& W) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 s = v[i] >> 8;
        W.h[2 * i] = v[i] & 0x000F000Fu;
        W.h[2 * i + 1] = s & 0x000F000Fu;
        W.h[8 + 2 * i] = v[i] & 0x00F000F0u;
        W.h[9 + 2 * i] = s & 0x00F000F0u;
    }
}
template <> __device__ __forceinline__ void hw<2>(const u8* __restrict__ row, int u, HW& W) {  // Q4_0
    const u8* b = row + 18 * u;
    const float d = h2f(ld16(b));
    u32 v[4]; ldw<4>(b + 2, v);
    hw_q4(v, W);
    W.da = d; W.db = __fmul_rn(d, 0.0625f); W.oa = W.ob = __fmul_rn(d, -8.f);
}
template <> __device__ __forceinline__ void hw<3>(const u8* __restrict__ row, int u, HW& W) {  // Q4_1
    const u8* b = row + 20 * u;
    const u32 dm = *(const u32*)b;
    const float d = h2f((u16)(dm & 0xffff)), m = h2f((u16)(dm >> 16));
    const u32* qs = (const u32*)(b + 4);
    const u32 v[4] = {qs[0], qs[1], qs[2], qs[3]};
    hw_q4(v, W);
    W.da = d; W.db = __fmul_rn(d, 0.0625f); W.oa = W.ob = m;
}
template <> __device__ __forceinline__ void hw<8>(const u8* __restrict__ row, int u, HW& W) {  // Q8_0
    const u8* b = row + 34 * u;
    const float d = h2f(ld16(b));
    u32 v[8]; ldw<8>(b + 2, v);
#pragma unroll
    for (int i = 0; i < 8; i++) {            // int8 b as the level b + 128 (flip the sign bit)
        W.h[2 * i] = (v[i] & 0x00FF00FFu) ^ 0x00800080u;
        W.h[2 * i + 1] = ((v[i] >> 8) & 0x00FF00FFu) ^ 0x00800080u;
    }
    W.da = W.db = d; W.oa = W.ob = __fmul_rn(d, -128.f);
}
template <> __device__ __forceinline__ void hw<12>(const u8* __restrict__ row, int u, HW& W) {  // Q4_K
    // sub-block j = u & 7 of super-block u >> 3: nibble plane j & 1 of qs[32 (j / 2) ..]; the
    // high plane read in place (16 L), its scale divided by 16
    const u8* b = row + 144 * (u >> 3);
    const int j = u & 7;
    const u32 dm = *(const u32*)b;
    const float d = h2f((u16)(dm & 0xffff)), dmin = h2f((u16)(dm >> 16));
    float sc, mn; scale_min_k4(j, b + 4, sc, mn);
    const float ds = __fmul_rn(d, sc);
    W.da = W.db = (j & 1) ? __fmul_rn(ds, 0.0625f) : ds;
    W.oa = W.ob = -__fmul_rn(dmin, mn);
    const uint4* p = (const uint4*)(b + 16 + 32 * (j >> 1));
    const uint4 v0 = p[0], v1 = p[1];
    const u32 v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    const u32 mask = (j & 1) ? 0x00F000F0u : 0x000F000Fu;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        W.h[2 * i] = v[i] & mask;
        W.h[2 * i + 1] = (v[i] >> 8) & mask;
    }
}
template <> __device__ __forceinline__ void hw<14>(const u8* __restrict__ row, int u, HW& W) {  // Q6_K
    // block j = u & 7 of super-block u >> 3 as q8w<14>: 6-bit levels q, weight d s (q - 32),
    // s = scales[8 g + 2 t] for inputs 0..15, scales[8 g + 2 t + 1] for 16..31
    const u8* b = row + 210 * (u >> 3);
    const int j = u & 7, g = j >> 2, t = j & 3;
    const float d = h2f(ld16(b + 208));
    const u16 sc = ld16(b + 192 + 8 * g + 2 * t);
    W.da = __fmul_rn(d, (float)(i8)(sc & 255));
    W.db = __fmul_rn(d, (float)(i8)(sc >> 8));
    W.oa = __fmul_rn(W.da, -32.f); W.ob = __fmul_rn(W.db, -32.f);
    u32 l[8], h[8];
    ldw<8>(b + 64 * g + 32 * (t & 1), l);
    ldw<8>(b + 128 + 32 * g, h);
    const int shl = 4 * (t >> 1), shh = 2 * t;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const u32 q = ((l[i] >> shl) & 0x0F0F0F0Fu) | (((h[i] >> shh) & 0x03030303u) << 4);
        W.h[2 * i] = q & 0x003F003Fu;
        W.h[2 * i + 1] = (q >> 8) & 0x003F003Fu;
    }
}

// One unit's contribution to one batch row (the order above); x0 .. x3 the block's 4 chunks
// of half2 x (A_0 B_0 A_1 B_1, A_2 .. B_3, A_4 .., A_6 .. B_7), d its (sx, s0, s1, -)
template <int T>
__device__ __forceinline__ float hdot(const HW& W, const uint4 x0, const uint4 x1, const uint4 x2, const uint4 x3,
                                      const float4 d) {
    u32 a = hfma2(W.h[0], x0.x, 0u), c = hfma2(W.h[8], x2.x, 0u);
    a = hfma2(W.h[1], x0.y, a); c = hfma2(W.h[9], x2.y, c);
    a = hfma2(W.h[2], x0.z, a); c = hfma2(W.h[10], x2.z, c);
    a = hfma2(W.h[3], x0.w, a); c = hfma2(W.h[11], x2.w, c);
    a = hfma2(W.h[4], x1.x, a); c = hfma2(W.h[12], x3.x, c);
    a = hfma2(W.h[5], x1.y, a); c = hfma2(W.h[13], x3.y, c);
    a = hfma2(W.h[6], x1.z, a); c = hfma2(W.h[14], x3.z, c);
    a = hfma2(W.h[7], x1.w, a); c = hfma2(W.h[15], x3.w, c);
    const float fa = h2sum(a), fb = h2sum(c);
    float t = __fmul_rn(d.x, fmaf(W.da, fa, __fmul_rn(W.db, fb)));
    if (HTraits<T>::has_off) { t = fmaf(W.oa, d.y, t); t = fmaf(W.ob, d.z, t); }
    return t;
}

// x rows as scaled float16 blocks (the layout above): xh row b (ldh halves), xd row b (ldd
// float4), from x row b (times nw when given; then also its norm scale into xs, the bits
// row_scale gives). Grid (B, ceil(k / 128)), 128 threads: warp w of block (b, y) the 32-input
// block 4 y + w, lane l its input l; block (b, 0) also computes the norm scale.
__global__ void __launch_bounds__(128) quant_rows_h(const float* __restrict__ x, int ldx, int k,
                                                    const float* __restrict__ nw, float eps, float* __restrict__ xs,
                                                    u16* __restrict__ xh, int ldh, float4* __restrict__ xd, int ldd)
{
    __shared__ float red[4];
    const float* xr = x + (long long)blockIdx.x * ldx;
    if (nw != nullptr && blockIdx.y == 0) {
        const float ss = row_ss(xr, k, red);
        if (threadIdx.x == 0) xs[blockIdx.x] = norm_scale(ss, k, eps);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int blk = 4 * blockIdx.y + warp;
    if (blk >= (k >> 5)) return;
    const int e = 32 * blk + lane;
    float v = xr[e];
    if (nw != nullptr) v = __fmul_rn(v, nw[e]);
    const float amax = warp_max(fabsf(v));
    float s = v;                                 // sums of lanes 0..15 and 16..31 (xor 8, 4, 2, 1)
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
    const float s1 = __shfl_sync(0xffffffffu, s, 16);
    const int ex = (int)((__float_as_uint(amax) >> 23) & 255u) - 127;   // amax in [2^ex, 2^(ex + 1))
    const int es = min(127, max(-103, 14 - ex));
    const float h = amax > 0.f ? __fmul_rn(v, __uint_as_float((u32)(es + 127) << 23)) : 0.f;
    const int w = lane >> 2, r = lane & 3;
    const int idx = 4 * w + 2 * (r & 1) + (r >> 1);          // position within the block (A_w, B_w)
    const long long g = ((long long)(blk >> 5) * 4 + (idx >> 3)) * 32 + (blk & 31);
    xh[(long long)blockIdx.x * ldh + 8 * g + (idx & 7)] = f2h(h);
    if (lane == 0)
        xd[(long long)blockIdx.x * ldd + blk] =
            make_float4(amax > 0.f ? __uint_as_float((u32)(24 - es + 127) << 23) : 0.f, s, s1, 0.f);
}

template <int TA, int TB, int NB, int PPW>
__device__ __forceinline__ void gemv_units_h(const u8* const (&rowA)[PPW], const u8* const (&rowB)[PPW], int u,
                                             const uint4* __restrict__ xh, int ldg, const float4* __restrict__ xd,
                                             int ldd, int b0, int nb, float (&acc)[PPW][2 * NB]) {
    HW wa[PPW], wb[PPW];
#pragma unroll
    for (int q = 0; q < PPW; q++) {
        hw<TA>(rowA[q], u, wa[q]);
        hw<TB>(rowB[q], u, wb[q]);
    }
    const int g0 = (u >> 5) * 128 + (u & 31);    // chunk c of block u: g0 + 32 c
#pragma unroll
    for (int j = 0; j < NB; j++) {
        const long long r = b0 + min(j, nb - 1);
        const uint4* xp = xh + r * ldg + g0;
        const uint4 x0 = xp[0], x1 = xp[32], x2 = xp[64], x3 = xp[96];
        const float4 d = xd[r * ldd + u];
#pragma unroll
        for (int q = 0; q < PPW; q++) {
            acc[q][j] = __fadd_rn(acc[q][j], hdot<TA>(wa[q], x0, x1, x2, x3, d));
            acc[q][NB + j] = __fadd_rn(acc[q][NB + j], hdot<TB>(wb[q], x0, x1, x2, x3, d));
        }
    }
}

// gemv_sums (gemv Q8 1's lanes and groups) with gemv_units_h: units of 32 inputs. A copy of
// gemv_sums's walk, kept here so that the candidate touches nothing the engine runs; if it
// is adopted, it becomes one more unit form of gemv_sums.
template <int TA, int TB, int NB, int WPP, int PPW>
__device__ __forceinline__ bool gemv_sums_h(const u8* const (&rowA)[PPW], const u8* const (&rowB)[PPW], int k,
                                            const uint4* __restrict__ xh, int ldg, const float4* __restrict__ xd,
                                            int ldd, int b0, int nb, int pl0, float (*s_red)[4][2 * NB],
                                            float (&tot)[PPW]) {
    constexpr int S = 4 / WPP;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int sub = warp % WPP;
    constexpr int V = 2 * NB;
    const int nu = k >> 5;
    float R[S][PPW];
    if constexpr (S * NB <= 4) {
        constexpr int UNR = S == 1 ? 4 : (S == 2 ? 2 : 1);
        float acc[S][PPW][V];
#pragma unroll
        for (int s = 0; s < S; s++) {
#pragma unroll
            for (int q = 0; q < PPW; q++) {
#pragma unroll
                for (int i = 0; i < V; i++) acc[s][q][i] = 0.f;
            }
        }
#pragma unroll UNR
        for (int u0 = 0; u0 < nu; u0 += 128) {
#pragma unroll
            for (int s = 0; s < S; s++) {
                const int u = u0 + 32 * (sub + WPP * s) + lane;
                if (u < nu) gemv_units_h<TA, TB, NB, PPW>(rowA, rowB, u, xh, ldg, xd, ldd, b0, nb, acc[s]);
            }
        }
#pragma unroll
        for (int s = 0; s < S; s++) {
#pragma unroll
            for (int q = 0; q < PPW; q++) R[s][q] = warp_sum_scatter<V>(acc[s][q]);
        }
    } else {
#pragma unroll
        for (int s = 0; s < S; s++) {
            float acc[PPW][V];
#pragma unroll
            for (int q = 0; q < PPW; q++) {
#pragma unroll
                for (int i = 0; i < V; i++) acc[q][i] = 0.f;
            }
#pragma unroll 1
            for (int u = 32 * (sub + WPP * s) + lane; u < nu; u += 128)
                gemv_units_h<TA, TB, NB, PPW>(rowA, rowB, u, xh, ldg, xd, ldd, b0, nb, acc);
#pragma unroll
            for (int q = 0; q < PPW; q++) R[s][q] = warp_sum_scatter<V>(acc[q]);
        }
    }
    const int vi = lane & (V - 1);
    if constexpr (WPP == 1) {
#pragma unroll
        for (int q = 0; q < PPW; q++) {
            tot[q] = R[0][q];
#pragma unroll
            for (int s = 1; s < S; s++) tot[q] = __fadd_rn(tot[q], R[s][q]);
        }
    } else {
        if (lane < V) {
#pragma unroll
            for (int q = 0; q < PPW; q++) {
#pragma unroll
                for (int s = 0; s < S; s++) s_red[pl0 + q][sub + WPP * s][lane] = R[s][q];
            }
        }
        __syncthreads();
        if (sub != 0) return false;
#pragma unroll
        for (int q = 0; q < PPW; q++) {
            tot[q] = s_red[pl0 + q][0][vi];
#pragma unroll
            for (int g = 1; g < 4; g++) tot[q] = __fadd_rn(tot[q], s_red[pl0 + q][g][vi]);
        }
    }
    return true;
}

// gemv (every MODE, the same grid, rows and epilogue) on the rows quant_rows_h wrote: xh the
// float16 rows (ldh halves per row), xd their block data (ldd float4 per row); with nw given
// (only as a flag: it was folded into xh by quant_rows_h) xs is required. The argument list
// is gemv's, x/ldx and xd/ldd standing for xh/ldh and the float4 block data.
template <int TA, int TB, int NB, int MODE, int WPP, int PPW = 1>
__global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_h(
    const u8* __restrict__ Wa, const u8* __restrict__ Wb, long long rba, long long rbb, int a_stride, int b_off,
    int n_pairs, int k, const u16* __restrict__ xh, int ldh, int B, const float* __restrict__ nw, float eps,
    const float* __restrict__ xs, const float* __restrict__ bias_a, const float* __restrict__ bias_b,
    float* __restrict__ y, int ldy,
    int row_base, int qd, int kd, int hd, int rope_half, int neox, int n_kv, int n_ctx,
    const int* __restrict__ tab_slot, const int* __restrict__ tab_pos,
    const float* __restrict__ rcos, const float* __restrict__ rsin, void* __restrict__ kc, void* __restrict__ vc,
    const float4* __restrict__ xd, int ldd)
{
    static_assert(WPP == 1 || WPP == 2 || WPP == 4, "WPP is 1, 2 or 4");
    static_assert(PPW == 1 || PPW == 2, "PPW is 1 or 2 (a unit's half2 levels are 16 registers)");
    static_assert(HTraits<TA>::ok && HTraits<TB>::ok, "gemv_h: both weight types have a half2 form");
    constexpr bool QKV = (MODE == M_QKV || MODE == M_QKV16);
    constexpr int PPB = GEMV_WARPS / WPP * PPW;
    __shared__ float s_scale[NB];
    __shared__ float s_red[WPP > 1 ? PPB : 1][4][2 * NB];
    __shared__ float s_ss[NB][4];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int b0 = blockIdx.y * NB;
    const int nb = min(NB, B - b0);
    gemv_scales<NB>(nullptr, 0, b0, nb, k, eps, nw, xs, s_scale, s_ss);   // xs given: read only
    const int pl0 = (warp / WPP) * PPW;
    int p[PPW];
    bool valid[PPW];
    PairRows rows[PPW];
    const u8* rowA[PPW];
    const u8* rowB[PPW];
#pragma unroll
    for (int q = 0; q < PPW; q++) {
        const int p_raw = blockIdx.x * PPB + pl0 + q;
        valid[q] = p_raw < n_pairs;
        p[q] = valid[q] ? p_raw : n_pairs - 1;
        rows[q] = pair_rows<QKV>(p[q], a_stride, b_off, row_base, qd, kd, hd, rope_half, neox);
        rowA[q] = Wa + rows[q].ra * rba;
        rowB[q] = Wb + rows[q].rb * rbb;
    }
    float tot[PPW];
    if (!gemv_sums_h<TA, TB, NB, WPP, PPW>(rowA, rowB, k, (const uint4*)xh, ldh >> 3, xd, ldd, b0, nb, pl0, s_red,
                                           tot)) return;
#pragma unroll
    for (int q = 0; q < PPW; q++) {
        const float other = __shfl_xor_sync(0xffffffffu, tot[q], NB);
        if (lane < nb && valid[q])
            gemv_out<MODE>(tot[q], other, b0 + lane, p[q], rows[q], nw != nullptr, s_scale[lane], bias_a, bias_b, y,
                           ldy, hd, rope_half, neox, n_kv, n_ctx, tab_slot, tab_pos, rcos, rsin, kc, vc);
    }
}
// ---- end of the fp16 decode GEMV ----
"""
