// The persistent decode step (tests/tools/persistent_step.py builds the module: the engine's
// kernels without their restrict qualifiers, then this file, AOTX_PERSISTENT_ARG_WORDS and
// AOTX_PERSISTENT_PREFETCH defined before them, and the line "AOTX_PERSISTENT_CASES" below
// replaced by one case per kernel instance of the step table, each calling its block function).
struct PStep { int kind, nvb, gx, gy; unsigned long long pf[2]; int pfn[2]; int pad[2];
               long long a[AOTX_PERSISTENT_ARG_WORDS]; };

// block j of m asks L2 for its 16-byte aligned share of bytes [p, p + n) (a hint: no effect
// on what any load returns)
__device__ __forceinline__ void l2_prefetch_share(unsigned long long p, int n, int j, int m) {
    if (n <= 0) return;
    const unsigned long long a = (p + 15ull) & ~15ull;
    const long long len = (long long)n - (long long)(a - p);
    if (len < 16) return;
    const long long chunk = ((len + m - 1) / m + 15) & ~15ll;
    const long long off = (long long)j * chunk;
    if (off >= len) return;
    long long sz = len - off < chunk ? len - off : chunk;
    sz &= ~15ll;
    if (sz <= 0) return;
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(a + off), "r"((unsigned)sz) : "memory");
#endif
}

__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// Every block of the grid arrives, then leaves when the last one has: bar[0] counts the
// arrivals, bar[1] is the generation the last arrival advances (read before arriving).
__device__ __forceinline__ void grid_barrier(unsigned* bar, unsigned nblocks) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned gen = ld_acquire_gpu(bar + 1);
        __threadfence();
        if (atomicAdd(bar, 1u) == nblocks - 1u) {
            atomicExch(bar, 0u);
            __threadfence();
            atomicAdd(bar + 1, 1u);
        } else {
            while (ld_acquire_gpu(bar + 1) == gen) { }
        }
        __threadfence();
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(128) persistent_step(const PStep* steps, int n_steps, unsigned* bar,
                                                                 int nblocks)
{
    for (int i = 0; i < n_steps; i++) {
        const PStep* st = steps + i;
        const int kind = st->kind, nvb = st->nvb, gx = st->gx, gy = st->gy;
        const unsigned char* a = (const unsigned char*)st->a;
#if AOTX_PERSISTENT_PREFETCH
        if (threadIdx.x == 0 && i + 1 < n_steps) {
            const PStep* nx = st + 1;
            l2_prefetch_share(nx->pf[0], nx->pfn[0], blockIdx.x, gridDim.x);
            l2_prefetch_share(nx->pf[1], nx->pfn[1], blockIdx.x, gridDim.x);
        }
#endif
        for (int vb = blockIdx.x; vb < nvb; vb += gridDim.x) {
            const int bx = vb % gx, by = (vb / gx) % gy, bz = vb / (gx * gy);
            switch (kind) {
AOTX_PERSISTENT_CASES
            default: break;
            }
            __syncthreads();      // the block's shared memory is reused by its next virtual block
        }
        if (i + 1 < n_steps) grid_barrier(bar, (unsigned)nblocks);
    }
}
