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

