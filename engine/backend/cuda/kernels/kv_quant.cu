// ---- quantized KV caches: llama.cpp's q8_0 (KVT 2) and q4_0 (KVT 3) blocks ----------------
// A head's row of HD values is HD / 32 blocks: q8_0 34 bytes (float16 d, 32 int8 q; x = d q),
// q4_0 18 bytes (float16 d, 16 bytes of nibbles; x[j] = d (lo(qs[j]) - 8), x[j + 16] =
// d (hi(qs[j]) - 8)), as engine/backend/kvformat.py and the CPU's kvquant.py keep them, so a
// slot's bytes mean the same on both. Quantized per block as the CPU does it (one warp, lane j
// the block's value j): q8_0 d = amax / 127, q = round-half-even(x * (127 / amax)); q4_0 m =
// the first value of largest magnitude, d = m / -8, q = min(15, trunc(x / d + 8.5)); d rounded
// to float16 to nearest even. Every operation is IEEE-rounded (__fdiv_rn, __fmul_rn,
// __fadd_rn): the same bytes as the CPU for the same inputs.
// Rotation (llama.cpp's attn_rot_k / attn_rot_v, kvformat.rotations): where the head size is a
// multiple of 64, K and the queries are rotated by the nk-point Walsh-Hadamard matrix over
// each block of nk values, V (and the attention output, back) by the 64-point one; entry
// (i, j) = (-1)^popcount(i & j) / sqrt(n). Output j of a block = sum over i, in increasing
// order, of x_i H_ij, one fmaf per term from 0: the CPU's kvquant._rotate, term for term.

#define KVQ_BB(KVT) ((KVT) == 2 ? 34 : 18)

__device__ __forceinline__ float kvq_h(int i, int j, float inv) {        // Hadamard entry
    return (__popc(i & j) & 1) ? -inv : inv;
}

// E consecutive values j .. j + E - 1 of one quantized row (E divides 32 and j % E == 0:
// they lie in one block), dequantized (d q is exact in float32)
template <int E, int KVT>
__device__ __forceinline__ void kvq_ld(const u8* __restrict__ row, int j, float* o) {
    const u8* blk = row + (j >> 5) * KVQ_BB(KVT);
    const float d = h2f(ld16(blk));
    const int jj = j & 31;
#pragma unroll
    for (int e = 0; e < E; e++) {
        if (KVT == 2) {
            o[e] = d * (float)(i8)blk[2 + jj + e];
        } else {
            const int k = jj + e;
            const int b = blk[2 + (k & 15)];
            o[e] = d * (float)((k < 16 ? (b & 15) : (b >> 4)) - 8);
        }
    }
}

// One warp rotates s[0 .. hd) (shared memory) in place by blocks of n (a power of two, 32 to
// 256; hd a multiple of n), inv = 1 / sqrt(n) rounded to float (the host passes it: the
// CPU's matrix holds the same float)
__device__ __forceinline__ void kvq_rotate_warp(float* s, int hd, int n, float inv) {
    float r[8];                                    // hd <= 256: at most 8 outputs per lane
    int m = 0;
    for (int j = threadIdx.x & 31; j < hd; j += 32, m++) {
        const int b0 = j - (j & (n - 1)), jj = j & (n - 1);
        float acc = 0.f;
        for (int i = 0; i < n; i++) acc = fmaf(s[b0 + i], kvq_h(i, jj, inv), acc);
        r[m] = acc;
    }
    __syncwarp();
    m = 0;
    for (int j = threadIdx.x & 31; j < hd; j += 32, m++) s[j] = r[m];
    __syncwarp();
}

// One warp quantizes s[0 .. hd) (shared memory) into the row of blocks at `row`
template <int KVT>
__device__ __forceinline__ void kvq_store_warp(const float* s, u8* __restrict__ row, int hd) {
    const int lane = threadIdx.x & 31;
    for (int b = 0; b < hd / 32; b++) {
        u8* blk = row + b * KVQ_BB(KVT);
        const float x = s[b * 32 + lane];
        float d;
        if (KVT == 2) {
            const float amax = warp_max(fabsf(x));
            d = __fdiv_rn(amax, 127.f);
            const float iv = amax != 0.f ? __fdiv_rn(127.f, amax) : 0.f;
            blk[2 + lane] = (u8)(i8)__float2int_rn(__fmul_rn(x, iv));
        } else {
            // the first lane of largest magnitude: max of (|x|, -lane) pairs
            float a = fabsf(x);
            int who = lane;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float a2 = __shfl_xor_sync(0xffffffffu, a, o);
                const int w2 = __shfl_xor_sync(0xffffffffu, who, o);
                if (a2 > a || (a2 == a && w2 < who)) { a = a2; who = w2; }
            }
            const float m = __shfl_sync(0xffffffffu, x, who);
            d = __fdiv_rn(m, -8.f);
            const float iv = d != 0.f ? __fdiv_rn(1.f, d) : 0.f;
            const int q = min(15, __float2int_rz(__fadd_rn(__fmul_rn(x, iv), 8.5f)));
            const int hi = __shfl_down_sync(0xffffffffu, q, 16);
            if (lane < 16) blk[2 + lane] = (u8)(q | (hi << 4));
        }
        // the scale as one 16-bit store (blocks are 34 or 18 bytes: 2-aligned), as kv_st<1> stores
        // a float16 cache. Splitting f2h's result into two byte stores wrote 0 as the low byte on
        // an H200 (CUDA 13.2): every scale lost its 8 low mantissa bits (issue 33's 97%/94%).
        if (lane == 0) *(u16*)blk = f2h(d);
    }
}

// Rows of heads rotated in place: x (n_rows, ld), heads of hd at columns h hd; grid (H, n_rows),
// 32 threads. The queries before attention over a rotated cache (K's block), its output after
// (V's block: back, the matrix is its own inverse).
__global__ void __launch_bounds__(32) kvq_rotate(float* x, int ld, int hd, int n, float inv)
{
    __shared__ float s[256];
    float* p = x + (long long)blockIdx.y * ld + blockIdx.x * hd;
    for (int d = threadIdx.x; d < hd; d += 32) s[d] = p[d];
    __syncwarp();
    kvq_rotate_warp(s, hd, n, inv);
    for (int d = threadIdx.x; d < hd; d += 32) p[d] = s[d];
}

// The KV store into a quantized cache (kv_store's, for KVT 2 and 3): row r of k (n_rows, ldk)
// and v, KV head h, rotated (nk, nv > 0: by those blocks) and quantized into slot[r],
// position pos[r]. Grid (2 n_kv, n_rows): blocks x < n_kv store K, the others V; 32 threads.
template <int KVT>
__global__ void __launch_bounds__(32) kvq_store(const float* __restrict__ k, int ldk, const float* __restrict__ v,
    int ldv, int n_kv, int hd, int n_ctx, const int* __restrict__ slot, const int* __restrict__ pos,
    u8* __restrict__ kc, u8* __restrict__ vc, int nk, float ik, int nv, float iv)
{
    __shared__ float s[256];
    const int r = blockIdx.y, isv = blockIdx.x >= n_kv, h = isv ? blockIdx.x - n_kv : blockIdx.x;
    const float* src = (isv ? v + (long long)r * ldv : k + (long long)r * ldk) + h * hd;
    for (int d = threadIdx.x; d < hd; d += 32) s[d] = src[d];
    __syncwarp();
    const int n = isv ? nv : nk;
    if (n > 0) kvq_rotate_warp(s, hd, n, isv ? iv : ik);
    const int rb = (hd / 32) * KVQ_BB(KVT);
    kvq_store_warp<KVT>(s, (isv ? vc : kc) + (((long long)slot[r] * n_kv + h) * n_ctx + pos[r]) * rb, hd);
}

// Positions c0 .. c0 + n - 1 of slot `slot`, every KV head, of a quantized cache as float32
// (n_kv, n, hd) (the eager path's cuBLAS attention); grid (n, n_kv), 32 threads
template <int KVT>
__global__ void __launch_bounds__(32) kvq_dequant(const u8* __restrict__ c, int slot, int c0, int n, int n_kv,
    int hd, int n_ctx, float* __restrict__ out)
{
    const int t = blockIdx.x, h = blockIdx.y;
    const int rb = (hd / 32) * KVQ_BB(KVT);
    const u8* row = c + (((long long)slot * n_kv + h) * n_ctx + c0 + t) * rb;
    float* o = out + ((long long)h * n + t) * hd;
    for (int j = threadIdx.x; j < hd; j += 32) kvq_ld<1, KVT>(row, j, o + j);
}
// ---- end of the quantized KV caches ----
