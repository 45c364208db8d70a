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
// (a quantized cache, KVT 2 or 3, is stored a block at a time: kvq_store_warp in kv_quant.cu)
template <> __device__ __forceinline__ void kv_st<2>(void* c, long long i, float v) {}
template <> __device__ __forceinline__ void kv_st<3>(void* c, long long i, float v) {}

// gemv epilogue modes (MODE_* in Python)
#define M_STORE 0
#define M_ADD 1
#define M_SWIGLU 2
#define M_QKV 3
#define M_GEGLU 4
#define M_QKV16 5

