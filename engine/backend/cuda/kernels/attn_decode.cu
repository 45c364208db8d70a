// E consecutive elements of a float32 (KVT 0) or float16 (KVT 1) cache row, element offset i
// (i * element size is a multiple of E * element size for E = 2, 4, 8); of a q8_0 / q4_0 one
// (KVT 2, 3: kv_quant.cu), element i of rows of 32 E values (E = HD / 32), dequantized
template <int E, int KVT> __device__ __forceinline__ void ldkv(const void* c, long long i, float* o) {
    if constexpr (KVT >= 2) {
        const long long row = i / (32 * E);
        kvq_ld<E, KVT>((const u8*)c + row * (E * KVQ_BB(KVT)), (int)(i - row * 32 * E), o);
    } else if (KVT == 0) {
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

