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

// (float) of byte i of v (a value below 256), through the exponent trick: the byte placed
// in the mantissa of 2^23, minus 2^23 (exact; one PRMT and one FADD instead of an I2F)
__device__ __forceinline__ float byte_f(u32 v, int i) {
    return __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7650u | (u32)i)) - 8388608.f;
}
// 8 bytes from a 2-byte aligned address, as two words (aligned loads and a byte permute)
__device__ __forceinline__ void ld8_2(const u8* p, u32* o) {
    const u32* a = (const u32*)((size_t)p & ~(size_t)3);
    const u32 w0 = a[0], w1 = a[1];
    if (((size_t)p & 2) == 0) { o[0] = w0; o[1] = w1; return; }
    const u32 w2 = a[2];
    o[0] = __byte_perm(w0, w1, 0x5432);
    o[1] = __byte_perm(w1, w2, 0x5432);
}

// 6-bit (scale, min) of sub-block j (0..7) from the 12 packed bytes q (ggml get_scale_min_k4)
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, float& sc, float& mn) {
    if (j < 4) { sc = (float)(q[j] & 63); mn = (float)(q[j + 4] & 63); }
    else { sc = (float)((q[j + 4] & 15) | ((q[j - 4] >> 6) << 4));
           mn = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4)); }
}

