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

// gpt-oss's clamped SwiGLU on the GPU expert tier (ggml_swiglu_oai; cpu/experts.py swiglu_oai):
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

