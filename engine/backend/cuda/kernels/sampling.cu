typedef unsigned int u32;
typedef unsigned long long u64;

#define K_MAX 1024
#define H_MAX 256
#define P_WORDS 18        // int32 words of one sampler-table row

// Philox4x64-10 (Random123), word 0 of the block at counter (c0, 0, 0, 0), key (k0, 0).
__device__ __forceinline__ u64 philox4x64_w0(u64 c0, u64 k0) {
    u64 c[4] = {c0, 0ull, 0ull, 0ull};
    u64 k[2] = {k0, 0ull};
    const u64 M0 = 0xD2E7470EE14C6C93ull, M1 = 0xCA5A826395121157ull;
    const u64 W0 = 0x9E3779B97F4A7C15ull, W1 = 0xBB67AE8584CAA73Bull;
#pragma unroll
    for (int r = 0; r < 10; r++) {
        if (r) { k[0] += W0; k[1] += W1; }
        const u64 lo0 = M0 * c[0], hi0 = __umul64hi(M0, c[0]);
        const u64 lo1 = M1 * c[2], hi1 = __umul64hi(M1, c[2]);
        const u64 n0 = hi1 ^ c[1] ^ k[0], n2 = hi0 ^ c[3] ^ k[1];
        c[0] = n0; c[1] = lo1; c[2] = n2; c[3] = lo0;
    }
    return c[0];
}

__device__ __forceinline__ u32 okey(float f) {      // order-preserving: larger float, larger key
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// a comes before b: larger logit first, then lower id
__device__ __forceinline__ bool before(float va, int ia, float vb, int ib) {
    return va > vb || (va == vb && ia < ib);
}

// exclusive block scan of one int per thread (1024 threads); returns the thread's offset, *total the sum
__device__ int block_scan(int v, int* sh, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) { int y = __shfl_up_sync(0xffffffffu, x, o); if (lane >= o) x += y; }
    if (lane == 31) sh[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = sh[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) { int y = __shfl_up_sync(0xffffffffu, w, o); if (lane >= o) w += y; }
        sh[lane] = w;          // inclusive per warp
    }
    __syncthreads();
    const int base = warp ? sh[warp - 1] : 0;
    *total = sh[31];
    __syncthreads();
    return base + x - v;
}

// One block of 1024 threads per row b. prm: int32 (B, P_WORDS):
//   [0] mode (0 skip, 1 greedy, 2 sample)  [1] top_k  [2] n_hist  [3] tick
//   [4] penalty (float)  [6,7] temperature (double)  [8,9] top_p (double)  [10,11] min_p (double)
//   [12,13] seed (u64)  [14,15] step (u64): draws the request made before this one
//   [16,17] device address (u64) of the row's token bitmask (u32 words, bit i%32 of word i/32 set:
//   id i allowed), 0 for none: forbidden logits become -inf before anything else
// hist: int32 (B, H_MAX) the last repeat_last_n tokens (duplicates allowed). tab_slot / tab_pos: slot and position per
// batch row; out_idx (or null: the identity) maps logits row b to its batch row.
// Writes ids[b] (-1 for a skipped row) and rec[b] = {tick, slot, pos, token}.
extern "C" __global__ void __launch_bounds__(1024) sample_rows(
    float* __restrict__ logits, int ld, int V, const int* __restrict__ prm, const int* __restrict__ hist,
    const int* __restrict__ tab_slot, const int* __restrict__ tab_pos, const int* __restrict__ out_idx,
    int* __restrict__ ids, int* __restrict__ rec)
{
    __shared__ float cv[K_MAX];
    __shared__ int ci[K_MAX];
    __shared__ double pd[K_MAX];
    __shared__ int hbin[256];
    __shared__ int sh[32];
    __shared__ u32 s_prefix, s_mask;
    __shared__ int s_remaining, s_tok;
    __shared__ float sv[32];
    __shared__ int si[32];
    const int b = blockIdx.x, t = threadIdx.x;
    const int* P = prm + (long long)b * P_WORDS;
    const int mode = P[0];
    if (mode == 0) {
        if (t == 0) ids[b] = -1;
        return;
    }
    float* r = logits + (long long)b * ld;
    const u64 mask_addr = ((u64)(u32)P[17] << 32) | (u32)P[16];
    if (mask_addr) {                      // constrained decoding: forbidden ids out first
        const u32* M = (const u32*)mask_addr;
        for (int i = t; i < V; i += blockDim.x)
            if (!((M[i >> 5] >> (i & 31)) & 1u)) r[i] = -__int_as_float(0x7f800000);
        __syncthreads();
    }
    const float pen = __int_as_float(P[4]);
    if (pen != 1.0f) {                    // once per distinct id: at its first place in the window
        int* hs = (int*)pd;               // the window staged in shared memory (H_MAX ints; pd is free here)
        const int nh = min(P[2], H_MAX);
        for (int i = t; i < nh; i += blockDim.x) hs[i] = hist[(long long)b * H_MAX + i];
        __syncthreads();
        for (int i = t; i < nh; i += blockDim.x) {
            const int id = hs[i];
            bool first = id >= 0 && id < V;
            for (int j = 0; j < i && first; j++) first = hs[j] != id;
            if (first) { const float v = r[id]; r[id] = v > 0.f ? v / pen : v * pen; }
        }
        __syncthreads();
    }
    if (mode == 1) {                      // greedy: first index of the largest
        float best = -3.0e38f; int bi = 0x7fffffff;
        for (int i = t; i < V; i += blockDim.x) { const float v = r[i]; if (v > best) { best = v; bi = i; } }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
        if ((t & 31) == 0) { sv[t >> 5] = best; si[t >> 5] = bi; }
        __syncthreads();
        if (t < 32) {
            best = sv[t]; bi = si[t];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, best, o);
                const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
            }
            if (t == 0) s_tok = bi;
        }
        __syncthreads();
    } else {
        const int K = min(min(P[1], K_MAX), V);
        // ---- radix select: the key of the K-th largest logit
        if (t == 0) { s_prefix = 0u; s_mask = 0u; s_remaining = K; }
        for (int shift = 24; shift >= 0; shift -= 8) {
            if (t < 256) hbin[t] = 0;
            __syncthreads();
            const u32 prefix = s_prefix, mask = s_mask;
            // warp-aggregated counts: logits crowd into a few digits (the exponent bits),
            // so one atomic per distinct digit per warp instead of one per element
            const int n_iter = (V + blockDim.x - 1) / blockDim.x * blockDim.x;
            for (int i = t; i < n_iter; i += blockDim.x) {
                int bin = -1;
                if (i < V) { const u32 key = okey(r[i]); if ((key & mask) == prefix) bin = (int)((key >> shift) & 255u); }
                const unsigned peers = __match_any_sync(0xffffffffu, bin);
                if (bin >= 0 && (t & 31) == __ffs(peers) - 1) atomicAdd(&hbin[bin], __popc(peers));
            }
            __syncthreads();
            if (t < 32) {                 // lane l holds digits 255-8l .. 248-8l, highest first
                int c = 0;
#pragma unroll
                for (int j = 0; j < 8; j++) c += hbin[255 - 8 * t - j];
                int inc = c;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) { int y = __shfl_up_sync(0xffffffffu, inc, o); if (t >= o) inc += y; }
                const int rem = s_remaining;
                const int before_me = inc - c;
                const unsigned hit = __ballot_sync(0xffffffffu, inc >= rem);
                const int first = __ffs(hit) - 1;
                if (t == first) {
                    int cum = before_me;
                    for (int j = 0; j < 8; j++) {
                        const int d = 255 - 8 * t - j;
                        if (cum + hbin[d] >= rem) {
                            s_prefix = prefix | ((u32)d << shift);
                            s_mask = mask | (255u << shift);
                            s_remaining = rem - cum;
                            break;
                        }
                        cum += hbin[d];
                    }
                }
            }
            __syncthreads();
        }
        const u32 kth = s_prefix;
        const int need_eq = s_remaining;  // ties at the threshold to take, lowest ids first
        // ---- gather the K candidates in id order (contiguous chunk per thread)
        const int chunk = (V + blockDim.x - 1) / blockDim.x;
        const int i0 = min(V, t * chunk), i1 = min(V, i0 + chunk);
        int n_gt = 0, n_eq = 0;
        for (int i = i0; i < i1; i++) { const u32 key = okey(r[i]); n_gt += key > kth; n_eq += key == kth; }
        int tot_gt, tot_eq;
        int o_gt = block_scan(n_gt, sh, &tot_gt);
        int o_eq = block_scan(n_eq, sh, &tot_eq);
        for (int i = i0; i < i1; i++) {
            const float v = r[i];
            const u32 key = okey(v);
            if (key > kth) { cv[o_gt] = v; ci[o_gt] = i; o_gt++; }
            else if (key == kth) {
                if (o_eq < need_eq) { cv[tot_gt + o_eq] = v; ci[tot_gt + o_eq] = i; }
                o_eq++;
            }
        }
        __syncthreads();
        if (t >= K) { cv[t] = -__int_as_float(0x7f800000); ci[t] = 0x7fffffff; }
        __syncthreads();
        // ---- bitonic sort of K_MAX entries: logit descending, id ascending
        for (int k = 2; k <= K_MAX; k <<= 1) {
            for (int j = k >> 1; j > 0; j >>= 1) {
                const int l = t ^ j;
                if (l > t) {
                    const bool asc = (t & k) == 0;   // "ascending" in the before() order
                    const bool lb = before(cv[l], ci[l], cv[t], ci[t]);
                    if (asc ? lb : !lb) {
                        const float fv = cv[t]; cv[t] = cv[l]; cv[l] = fv;
                        const int fi = ci[t]; ci[t] = ci[l]; ci[l] = fi;
                    }
                }
                __syncthreads();
            }
        }
        // ---- probabilities at temperature 1 (float64), top-p, min-p, temperature, draw
        const double lg0 = (double)cv[0];
        if (t < K) pd[t] = exp((double)cv[t] - lg0);
        __syncthreads();
        if (t == 0) {
            const double temp = __hiloint2double(P[7], P[6]);
            const double top_p = __hiloint2double(P[9], P[8]);
            const double min_p = __hiloint2double(P[11], P[10]);
            const u64 seed = ((u64)(u32)P[13] << 32) | (u32)P[12];
            const u64 step = ((u64)(u32)P[15] << 32) | (u32)P[14];
            double s = 0.0;
            for (int i = 0; i < K; i++) s += pd[i];
            int keep = K;
            if (top_p < 1.0) {
                double c = 0.0; int n = 0;
                for (int i = 0; i < K; i++) { c += pd[i] / s; if (c < top_p) n++; else break; }
                keep = min(keep, n + 1);
            }
            if (min_p > 0.0) {
                const double p0 = pd[0] / s;
                int n = 0;
                for (int i = 0; i < K; i++) n += (pd[i] / s >= min_p * p0);
                keep = min(keep, max(1, n));
            }
            double qs = 0.0;
            for (int i = 0; i < keep; i++) { pd[i] = exp(((double)cv[i] - lg0) / temp); qs += pd[i]; }
            double c = 0.0;
            for (int i = 0; i < keep; i++) { c += pd[i] / qs; pd[i] = c; }
            const u64 x = philox4x64_w0(step + 1ull, seed);
            const double u = (double)(x >> 11) * (1.0 / 9007199254740992.0);
            const double target = u * pd[keep - 1];
            int idx = 0;
            while (idx < keep && pd[idx] <= target) idx++;
            s_tok = ci[min(idx, keep - 1)];
        }
        __syncthreads();
    }
    if (t == 0) {
        const int tok = s_tok;
        ids[b] = tok;
        int* R = rec + (long long)b * 4;
        const int src = out_idx ? out_idx[b] : b;
        R[0] = P[3]; R[1] = tab_slot[src]; R[2] = tab_pos[src]; R[3] = tok;
    }
}
