// One warp per (head, row): grid (H + 2 n_kv, N), 32 threads. Row r of src (N, ld) holds
// [q (H*hd) | k (n_kv*hd) | v (n_kv*hd)] (plus bias, when not null). Per head: RMSNorm over
// its hd values with weight q_norm (q heads) or k_norm (k heads) when given (QK-norm), RoPE
// on q and k (rope_half pairs: adjacent dims, or j and j + rope_half for "neox"), then q to
// q_out (N, ldq; may alias src), k and v to the caches at (slot[r], pos[r]). A quantized cache
// (KVT 2, 3: kv_quant.cu) takes k rotated by blocks of nk and v by blocks of nv (0: none), then
// quantized a block at a time.
template <int KVT>
__global__ void __launch_bounds__(32) head_rope_kv(
    const float* src, int ld, const float* __restrict__ bias, int H, int n_kv, int hd, int rope_half, int neox,
    const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,
    const int* __restrict__ slot, const int* __restrict__ pos,
    const float* __restrict__ rcos, const float* __restrict__ rsin, float* q_out, int ldq,
    void* __restrict__ kc, void* __restrict__ vc, int n_ctx, int nk, float ik, int nv, float iv)
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
    } else if constexpr (KVT >= 2) {
        const int nb = sect == 1 ? nk : nv;
        if (nb > 0) kvq_rotate_warp(s, hd, nb, sect == 1 ? ik : iv);
        const long long o = (((long long)slot[r] * n_kv + head) * n_ctx + p) * ((hd / 32) * KVQ_BB(KVT));
        kvq_store_warp<KVT>(s, (u8*)(sect == 1 ? kc : vc) + o, hd);
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

