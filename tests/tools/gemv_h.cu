// ---- fp16 decode GEMV (gemv_h): dequantize in registers to half2, HFMA2 --------------------
// The fp16 form of the decode GEMV, measured against the int8 one (integer dot products as
// llama.cpp's MMVQ) and slower: a measurement candidate the engine does not compile; the
// kernel choice does not time it (tests/tools/cuda_gemv_bench.py --fp16 does).
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
