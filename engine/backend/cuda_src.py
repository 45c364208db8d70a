"""CUDA C++ source of the CUDA backend's kernels (compiled by CuPy's NVRTC, cached on disk).

Owns: every device kernel the CUDA backend launches, as one source string, and the
tensor-type codes the templates take (GGML's enum values). Leaves to ``cuda.py`` the
compilation (``cupy.RawModule`` with exactly the template instances a model needs)
and to ``cuda_llama.py`` the order of launches.

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
* activations ``x`` are ``(B, ld)``; KV cache per layer ``(n_slots, n_kv, n_ctx, hd)``.
* device tables for decode: ``tab_tok``, ``tab_slot``, ``tab_pos`` int32 ``(B,)``.

No headers are included (NVRTC has none by default): half/bfloat16 conversion uses
PTX ``cvt`` and bit shifts.
"""

from __future__ import annotations

# GGML tensor-type codes (gguf.GGMLQuantizationType values)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4 = 10, 11, 20, 23, 39
#: every type with a ``deq8<T>`` specialization (and so ``embed``/``dequant``/``gemv`` instances)
TYPES = (F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, BF16, MXFP4)

# gemv epilogue modes
MODE_STORE, MODE_ADD, MODE_SWIGLU, MODE_QKV = 0, 1, 2, 3

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
    const u8* b = row + 210 * (u >> 5);
    int e0 = 8 * (u & 31), g = e0 >> 7, ww = e0 & 127;
    float d = h2f(ld16(b + 208));
    float ds = d * (float)(i8)b[192 + (e0 >> 4)];
    const u8* ql = b + g * 64 + (ww & 63);
    const u8* qh = b + 128 + g * 32 + (ww & 31);
    int shl = 4 * (ww >> 6), shh = 2 * (ww >> 5);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int lo = (ql[i] >> shl) & 15, hi = (qh[i] >> shh) & 3;
        w[i] = ds * (float)((lo | (hi << 4)) - 32);
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

// y = (optionally rmsnorm'ed) x @ W.T: two output rows ("a pair") per WPP warps, NB batch
// rows per block (grid.y covers the batch). The WPP warps of a pair split the row's inputs.
// Rows of a pair: ra = p * a_stride (of Wa), rb = p * a_stride + b_off (of Wb).
// MODE 0 store (rows 2p, 2p+1), 1 add, 2 swiglu: y[b, p] = silu(a) * b,
// 3 qkv: global row r = row_base + 2p of [q; k; v]; q rows roped into y, k roped into kc, v into vc.
template <int TA, int TB, int NB, int MODE, int WPP>
__global__ void __launch_bounds__(GEMV_WARPS * 32) gemv(
    const u8* __restrict__ Wa, const u8* __restrict__ Wb, long long rba, long long rbb, int a_stride, int b_off,
    int n_pairs, int k, const float* __restrict__ x, int ldx, int B, const float* __restrict__ nw, float eps,
    float* __restrict__ y, int ldy,
    int row_base, int qd, int kd, int hd, int rope_half, int n_kv, int n_ctx,
    const int* __restrict__ tab_slot, const int* __restrict__ tab_pos,
    const float* __restrict__ rcos, const float* __restrict__ rsin, float* __restrict__ kc, float* __restrict__ vc)
{
    __shared__ float s_scale[NB];
    __shared__ float s_red[WPP > 1 ? GEMV_WARPS : 1][2 * NB];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int b0 = blockIdx.y * NB;
    const int nb = min(NB, B - b0);
    if (nw != nullptr) {
        for (int j = warp; j < NB; j += GEMV_WARPS) {
            const float* xr = x + (long long)(b0 + min(j, nb - 1)) * ldx;
            float ss = 0.f;
            for (int e = lane; e < k; e += 32) { float v = xr[e]; ss += v * v; }
            ss = warp_sum(ss);
            if (lane == 0) s_scale[j] = rsqrtf(ss / (float)k + eps);
        }
        __syncthreads();
    }
    const int p_raw = blockIdx.x * (GEMV_WARPS / WPP) + warp / WPP;
    const bool valid = p_raw < n_pairs;
    const int p = valid ? p_raw : n_pairs - 1;
    const int sub = warp % WPP;
    const long long ra = (long long)p * a_stride, rb = ra + b_off;
    const u8* rowA = Wa + ra * rba;
    const u8* rowB = Wb + rb * rbb;
    float accA[NB], accB[NB];
#pragma unroll
    for (int j = 0; j < NB; j++) { accA[j] = 0.f; accB[j] = 0.f; }
    const int nu = k >> 3;
#pragma unroll 2
    for (int u = sub * 32 + lane; u < nu; u += 32 * WPP) {
        float wa[8], wb[8];
        deq8<TA>(rowA, u, wa);
        deq8<TB>(rowB, u, wb);
        if (nw != nullptr) {
            const float4* np = (const float4*)(nw + 8 * u);
            float4 n0 = np[0], n1 = np[1];
            float nn[8] = {n0.x, n0.y, n0.z, n0.w, n1.x, n1.y, n1.z, n1.w};
#pragma unroll
            for (int i = 0; i < 8; i++) { wa[i] *= nn[i]; wb[i] *= nn[i]; }
        }
#pragma unroll
        for (int j = 0; j < NB; j++) {
            const float4* xp = (const float4*)(x + (long long)(b0 + min(j, nb - 1)) * ldx + 8 * u);
            float4 x0 = xp[0], x1 = xp[1];
            accA[j] += wa[0] * x0.x + wa[1] * x0.y + wa[2] * x0.z + wa[3] * x0.w
                     + wa[4] * x1.x + wa[5] * x1.y + wa[6] * x1.z + wa[7] * x1.w;
            accB[j] += wb[0] * x0.x + wb[1] * x0.y + wb[2] * x0.z + wb[3] * x0.w
                     + wb[4] * x1.x + wb[5] * x1.y + wb[6] * x1.z + wb[7] * x1.w;
        }
    }
#pragma unroll
    for (int j = 0; j < NB; j++) { accA[j] = warp_sum(accA[j]); accB[j] = warp_sum(accB[j]); }
    if (WPP > 1) {
        if (lane == 0) {
#pragma unroll
            for (int j = 0; j < NB; j++) { s_red[warp][2 * j] = accA[j]; s_red[warp][2 * j + 1] = accB[j]; }
        }
        __syncthreads();
        if (sub != 0) return;
        if (lane == 0) {
#pragma unroll
            for (int j = 0; j < NB; j++) {
#pragma unroll
                for (int w = 1; w < WPP; w++) { accA[j] += s_red[warp + w][2 * j]; accB[j] += s_red[warp + w][2 * j + 1]; }
            }
        }
    }
    if (lane != 0 || !valid) return;
#pragma unroll
    for (int j = 0; j < NB; j++) {
        if (j >= nb) break;
        const int b = b0 + j;
        float a = accA[j], c = accB[j];
        if (nw != nullptr) { a *= s_scale[j]; c *= s_scale[j]; }
        float* yr = y + (long long)b * ldy;
        if (MODE == 0) { yr[ra] = a; yr[rb] = c; }
        else if (MODE == 1) { yr[ra] += a; yr[rb] += c; }
        else if (MODE == 2) { yr[p] = silu(a) * c; }
        else {
            int r = row_base + 2 * p;
            int pos = tab_pos[b];
            if (r < qd + kd) {
                int rr = r < qd ? r : r - qd;
                int dd = rr % hd, jj = dd >> 1;
                if (jj < rope_half) {
                    float cs = rcos[(long long)pos * rope_half + jj], sn = rsin[(long long)pos * rope_half + jj];
                    float a2 = a * cs - c * sn, c2 = a * sn + c * cs;
                    a = a2; c = c2;
                }
                if (r < qd) { yr[r] = a; yr[r + 1] = c; }
                else {
                    long long o = (((long long)tab_slot[b] * n_kv + rr / hd) * n_ctx + pos) * hd + dd;
                    kc[o] = a; kc[o + 1] = c;
                }
            } else {
                int rr = r - qd - kd, dd = rr % hd;
                long long o = (((long long)tab_slot[b] * n_kv + rr / hd) * n_ctx + pos) * hd + dd;
                vc[o] = a; vc[o + 1] = c;
            }
        }
    }
}

// x[b, :] = row tab_tok[b] of W (embedding lookup), k inputs.
template <int T>
__global__ void embed(const u8* __restrict__ W, long long rb, const int* __restrict__ tok, int k,
                      float* __restrict__ x, int ldx)
{
    const int b = blockIdx.y;
    const int u = blockIdx.x * blockDim.x + threadIdx.x;
    if (u >= (k >> 3)) return;
    float w[8];
    deq8<T>(W + (long long)tok[b] * rb, u, w);
    float* o = x + (long long)b * ldx + 8 * u;
#pragma unroll
    for (int i = 0; i < 8; i++) o[i] = w[i];
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

template <int E> __device__ __forceinline__ void ldv(const float* p, float* o);
template <> __device__ __forceinline__ void ldv<2>(const float* p, float* o) {
    float2 v = *(const float2*)p; o[0] = v.x; o[1] = v.y;
}
template <> __device__ __forceinline__ void ldv<4>(const float* p, float* o) {
    float4 v = *(const float4*)p; o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
}

// Decode attention, split over the context: grid (NSMAX, H, B), 128 threads.
// Row b attends to positions 0..tab_pos[b] of slot tab_slot[b]; the block of split s
// handles a contiguous chunk in rounds of 4 * PW positions: each warp loads the K and V
// rows of its PW positions into registers at once (lane holds E = HD/32 dims), then
// updates its online softmax. Partials (m, l, acc[HD]) go to part; the last split block
// to finish (atomic ticket) combines them and resets its counter.
template <int HD>
__global__ void __launch_bounds__(128) attn_decode(
    const float* __restrict__ q, int ldq, const float* __restrict__ kc, const float* __restrict__ vc,
    const int* __restrict__ tab_slot, const int* __restrict__ tab_pos, int H, int n_kv, int n_ctx, float scale,
    float* __restrict__ part, int* __restrict__ counters, float* __restrict__ out, int ldo, int nsmax, int minchunk)
{
    constexpr int E = HD / 32;
    constexpr int PW = 32 / E;
    __shared__ float s_m[4], s_l[4], s_acc[4][HD];
    __shared__ int s_last;
    const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int len = tab_pos[b] + 1;
    int nsplit = (len + minchunk - 1) / minchunk;
    if (nsplit > nsmax) nsplit = nsmax;
    if (s >= nsplit) return;
    const int chunk = (len + nsplit - 1) / nsplit;
    const int t0 = s * chunk, t1 = min(len, t0 + chunk);
    const int g = h / (H / n_kv);
    const long long base = ((long long)tab_slot[b] * n_kv + g) * n_ctx * HD;
    const float* K = kc + base + lane * E;
    const float* V = vc + base + lane * E;
    float qv[E], acc[E];
    ldv<E>(q + (long long)b * ldq + h * HD + lane * E, qv);
#pragma unroll
    for (int e = 0; e < E; e++) { qv[e] *= scale; acc[e] = 0.f; }
    float m = -1e30f, l = 0.f;
    for (int r0 = t0 + warp * PW; r0 < t1; r0 += 4 * PW) {
        float kr[PW][E], vr[PW][E], sc[PW];
#pragma unroll
        for (int i = 0; i < PW; i++) {
            const int t = (r0 + i < t1) ? r0 + i : t0;
            ldv<E>(K + (long long)t * HD, kr[i]);
            ldv<E>(V + (long long)t * HD, vr[i]);
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
        for (int d = threadIdx.x; d < HD; d += 128) {
            float o = 0.f;
#pragma unroll
            for (int w = 0; w < 4; w++) o += s_acc[w][d] * expf(s_m[w] - M);
            out[(long long)b * ldo + h * HD + d] = o / L;
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
    for (int d = threadIdx.x; d < HD; d += 128) {
        float o = 0.f;
        for (int i = 0; i < nsplit; i++)
            o += __ldcg(P0 + i * (HD + 2) + 2 + d) * expf(__ldcg(P0 + i * (HD + 2)) - MM);
        out[(long long)b * ldo + h * HD + d] = o / LL;
    }
    if (threadIdx.x == 0) counters[bh] = 0;
}

// ids[b] = first index of the largest of logits[b, :V]; 1024 threads per row.
__global__ void __launch_bounds__(1024) argmax_rows(const float* __restrict__ logits, int ld, int V,
                                                    int* __restrict__ ids)
{
    __shared__ float sv[32];
    __shared__ int si[32];
    const int b = blockIdx.x;
    const float* r = logits + (long long)b * ld;
    float best = -3.0e38f; int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        float v = r[i];
        if (v > best) { best = v; bi = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { sv[warp] = best; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        best = lane < nw ? sv[lane] : -3.0e38f;
        bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
        if (lane == 0) ids[b] = bi;
    }
}

// ---- eager (prefill and mixed batches) helpers -----------------------------------

// out[i] = x[i] * rsqrt(mean(x[i]^2) + eps) * w; one block per row.
__global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w, float eps, int d,
                         float* __restrict__ out)
{
    __shared__ float red[32];
    const float* xr = x + (long long)blockIdx.x * d;
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
    float* o = out + (long long)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = xr[i] * sc * w[i];
}

// Rotate adjacent pairs of rows x[n, ld] in columns [c0, c0 + nh*hd): one thread per pair.
__global__ void rope_rows(float* __restrict__ x, int ld, int c0, int n, int nh, int hd, int rope_half,
                          const int* __restrict__ pos, const float* __restrict__ rcos, const float* __restrict__ rsin)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int pairs = nh * rope_half;
    if (i >= (long long)n * pairs) return;
    const int r = (int)(i / pairs), pi = (int)(i % pairs);
    const int hh = pi / rope_half, j = pi % rope_half;
    float* p = x + (long long)r * ld + c0 + hh * hd + 2 * j;
    const float cs = rcos[(long long)pos[r] * rope_half + j], sn = rsin[(long long)pos[r] * rope_half + j];
    const float a = p[0], c = p[1];
    p[0] = a * cs - c * sn;
    p[1] = a * sn + c * cs;
}

// Write K and V rows (columns [ck, ck+n_kv*hd) and [cv, ...) of src (n, ld)) into the caches.
__global__ void kv_write(const float* __restrict__ src, int ld, int ck, int cv, int n, int n_kv, int hd, int n_ctx,
                         const int* __restrict__ slot, const int* __restrict__ pos,
                         float* __restrict__ kc, float* __restrict__ vc)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int w = n_kv * hd;
    if (i >= (long long)n * w) return;
    const int r = (int)(i / w), c = (int)(i % w);
    const long long o = (((long long)slot[r] * n_kv + c / hd) * n_ctx + pos[r]) * hd + (c % hd);
    kc[o] = src[(long long)r * ld + ck + c];
    vc[o] = src[(long long)r * ld + cv + c];
}

// Causal softmax over rows of S (rows, ld): row r is query i = r % n at position pos0 + i;
// columns beyond pos0 + i are zeroed. Scores are multiplied by scale first.
__global__ void causal_softmax(float* __restrict__ S, int ld, int n, int pos0, float scale)
{
    __shared__ float red[32];
    __shared__ float bc;
    const long long r = blockIdx.x;
    float* row = S + r * ld;
    const int lim = pos0 + (int)(r % n) + 1;
    float mx = -3.0e38f;
    for (int t = threadIdx.x; t < lim; t += blockDim.x) mx = fmaxf(mx, row[t] * scale);
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
    float sum = 0.f;
    for (int t = threadIdx.x; t < lim; t += blockDim.x) { float e = expf(row[t] * scale - mx); row[t] = e; sum += e; }
    sum = warp_sum(sum);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = sum;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
        v = warp_sum(v);
        if (threadIdx.x == 0) bc = v;
    }
    __syncthreads();
    const float inv = 1.0f / bc;
    for (int t = threadIdx.x; t < ld; t += blockDim.x) row[t] = t < lim ? row[t] * inv : 0.f;
}

// xo[j, :ld] = x[idx[j], :ld], one block per output row j: the rows whose logits a graph
// replay needs, gathered before the output GEMV so it runs on those rows only
__global__ void gather_rows(const float* __restrict__ x, int ld, const int* __restrict__ idx, float* __restrict__ xo)
{
    const float* src = x + (long long)idx[blockIdx.x] * ld;
    float* dst = xo + (long long)blockIdx.x * ld;
    for (int e = threadIdx.x; e < ld; e += blockDim.x) dst[e] = src[e];
}

// out (n, f) = silu(gu[:, :f]) * gu[:, f:2f]
__global__ void silu_mul(const float* __restrict__ gu, int n, int f, float* __restrict__ out)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * f) return;
    const long long r = i / f, c = i % f;
    out[i] = silu(gu[r * 2 * f + c]) * gu[r * 2 * f + f + c];
}
"""
