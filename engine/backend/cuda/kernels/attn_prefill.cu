// ---- flash-style prefill attention: tensor cores, no score matrix ----------------------------
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
// f16, cp.async, ldmatrix): attention.py registers the instances only there; older targets
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
// (FA_BN, HD + 8) float16; keys past kmax as zeros. A q8_0 / q4_0 cache (KVT 2, 3) is
// dequantized on the way in (kv_quant.cu's kvq_ld) and rounded to float16 as a float32 one is.
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
        if constexpr (KVT >= 2) {
            uint4 o = make_uint4(0u, 0u, 0u, 0u);
            if (ok) {
                float a[8];
                kvq_ld<8, KVT>((const u8*)c + (base / HD + k0 + r) * ((HD / 32) * KVQ_BB(KVT)), ch * 8, a);
                o.x = fa_pack(fa_sat(a[0]), fa_sat(a[1])); o.y = fa_pack(fa_sat(a[2]), fa_sat(a[3]));
                o.z = fa_pack(fa_sat(a[4]), fa_sat(a[5])); o.w = fa_pack(fa_sat(a[6]), fa_sat(a[7]));
            }
            *(uint4*)d = o;
        } else if (KVT == 1) {
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

