// ---- the decode GEMV and its canonical reduction order ------------------------------------
// Batch invariance (DESIGN.md) asks one reduction order per output element, whatever
// the batch bucket or the kernel variant the kernel choice picked. Every variant below
// computes the dot product of one weight row with one (normed) batch row in THE SAME order:
// * the row's inputs are units u of 8 (u = 0 .. k/8 - 1); "virtual lane" v (0..127) takes
//   the units u = v, v + 128, v + 256, ... in that order and accumulates, unit by unit,
//   acc = fmaf(w[i], x[i], acc) for i = 0..7 (w already multiplied by the norm weight);
// * the 32 virtual lanes of each group g (v = 32 g + lane, g = 0..3) are summed by the warp
//   butterfly (warp_sum: xor 16, 8, 4, 2, 1; every lane ends with the same bits), giving R_g;
// * the row's sum is ((R_0 + R_1) + R_2) + R_3; then the epilogue (norm scale, bias, mode).
// A variant only maps virtual lanes onto threads: WPP warps share a row pair and each
// thread computes S = 4 / WPP groups (g = sub + WPP * s): interleaved in one pass when few
// accumulators (S * NB <= 4), else one group after the other (then a thread holds 2 NB
// accumulators, not 2 S NB: NB 16 runs with WPP 1). NB batch rows share each weight load;
// PPW row pairs per warp share each x and norm-weight load (each pair its own sums).
// The butterfly runs as a reduce-scatter (warp_sum_scatter: the same adds, so the same
// bits, in fewer shuffles): lane j ends with A of batch row j, lane NB + j with its B, and
// lane j runs row j's epilogue. Explicit fmaf / __fmul_rn / __fadd_rn keep the compiler from
// fusing differently in different instances; loop unrolling never reorders a sum.
// The RMSNorm scale of a batch row is rsqrt(ss / k + eps), ss summed by row_ss: 128 threads,
// thread t takes elements t, t + 128, ... (fmaf), the warp butterfly, then the 4 warp sums
// in order. The GEMV's prologue (xs == null: rows_scale, all NB rows in one pass) and the
// row_scale kernel (xs != null: the scale was computed before the launch) form the same
// sums in the same order, so both give the same bits.

__device__ __forceinline__ float row_ss(const float* __restrict__ xr, int k, float* red) {
    float ss = 0.f;
    for (int e = threadIdx.x; e < k; e += 128) { const float v = xr[e]; ss = fmaf(v, v, ss); }
    ss = warp_sum(ss);
    __syncthreads();                         // red may still be read by the previous call
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    float t = red[0];
    t = __fadd_rn(t, red[1]);
    t = __fadd_rn(t, red[2]);
    t = __fadd_rn(t, red[3]);
    return t;
}
__device__ __forceinline__ float norm_scale(float ss, int k, float eps) {
    return rsqrtf(__fadd_rn(__fdiv_rn(ss, (float)k), eps));
}

// The warp butterfly of V = 2 NB values at once, as a reduce-scatter: the first stages
// (xor 16 .. V) add all V values, each later stage (xor V/2 .. 1) halves the values a lane
// keeps (the lane with bit o set keeps the upper half) and sends the other half to its
// partner. Every add is v(lane) + v(lane ^ o) of the same partial sums warp_sum forms, in
// the same stage order, so on return lane l holds exactly warp_sum's bits of value
// (l & (V - 1)), with 31 + V * (5 - log2 V) shuffles instead of 5 V.
template <int V, int O>       // a full stage: every value v(lane) + v(lane ^ O)
__device__ __forceinline__ void ws_full(float (&v)[V]) {
#pragma unroll
    for (int i = 0; i < V; i++) v[i] += __shfl_xor_sync(0xffffffffu, v[i], O);
}
template <int V, int O>       // a halving stage: values [0, 2 O) -> [0, O)
__device__ __forceinline__ void ws_half(float (&v)[V], int lane) {
    const bool up = (lane & O) != 0;
#pragma unroll
    for (int i = 0; i < O; i++) {
        const float send = up ? v[i] : v[i + O];
        const float keep = up ? v[i + O] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
}
template <int V>
__device__ __forceinline__ float warp_sum_scatter(float (&v)[V]) {
    static_assert(V >= 2 && V <= 32 && (V & (V - 1)) == 0, "V is a power of two, 2 .. 32");
    const int lane = threadIdx.x & 31;
    if constexpr (V <= 16) ws_full<V, 16>(v);
    if constexpr (V <= 8) ws_full<V, 8>(v);
    if constexpr (V <= 4) ws_full<V, 4>(v);
    if constexpr (V <= 2) ws_full<V, 2>(v);
    if constexpr (V >= 32) ws_half<V, 16>(v, lane);
    if constexpr (V >= 16) ws_half<V, 8>(v, lane);
    if constexpr (V >= 8) ws_half<V, 4>(v, lane);
    if constexpr (V >= 4) ws_half<V, 2>(v, lane);
    ws_half<V, 1>(v, lane);
    return v[0];
}

// The norm scales of NB batch rows at once (the GEMV's per-block prologue; 128 threads):
// for each row the same per-thread chains, butterfly and final adds as row_ss, so the same
// bits as row_scale, with one pass over the rows and one barrier instead of NB of each.
// s_scale[j] is ready after the caller's __syncthreads.
template <int NB>
__device__ __forceinline__ void rows_scale(const float* __restrict__ x, int ldx, int b0, int nb, int k, float eps,
                                           float* s_scale, float (*red)[4]) {
    float ss[NB];
#pragma unroll
    for (int j = 0; j < NB; j++) ss[j] = 0.f;
    for (int e = threadIdx.x; e < k; e += 128) {
#pragma unroll
        for (int j = 0; j < NB; j++) {
            const float v = x[(long long)(b0 + min(j, nb - 1)) * ldx + e];
            ss[j] = fmaf(v, v, ss[j]);
        }
    }
#pragma unroll
    for (int j = 0; j < NB; j++) ss[j] = warp_sum(ss[j]);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int j = 0; j < NB; j++) red[j][threadIdx.x >> 5] = ss[j];
    }
    __syncthreads();
    if (threadIdx.x < NB) {
        const int j = threadIdx.x;
        float t = red[j][0];
        t = __fadd_rn(t, red[j][1]);
        t = __fadd_rn(t, red[j][2]);
        t = __fadd_rn(t, red[j][3]);
        s_scale[j] = norm_scale(t, k, eps);
    }
}

// out[r] = rsqrt(mean(x[r]^2) + eps) for r < gridDim.x: the norm scale the GEMV reads when
// its ``xs`` argument is given (one launch per norm instead of one per GEMV block). 128 threads.
__global__ void __launch_bounds__(128) row_scale(const float* __restrict__ x, int ldx, int k, float eps,
                                                 float* __restrict__ out)
{
    __shared__ float red[4];
    const float ss = row_ss(x + (long long)blockIdx.x * ldx, k, red);
    if (threadIdx.x == 0) out[blockIdx.x] = norm_scale(ss, k, eps);
}

// x rows as int8 blocks: out row b of xq (ldq bytes) and xd (ldd float2 per row), from x
// row b (times the norm weight nw when given); with nw, also the row's norm scale into xs
// (row_ss and norm_scale: the bits row_scale gives). Grid (B, ceil(k / 128)), 128 threads:
// block (b, y) quantizes inputs 128 y .. 128 y + 127 of row b, warp w the 32-input block
// 4 y + w, lane l its input l; block (b, 0) also computes the norm scale.
__global__ void __launch_bounds__(128) quant_rows(const float* __restrict__ x, int ldx, int k,
                                                  const float* __restrict__ nw, float eps, float* __restrict__ xs,
                                                  i8* __restrict__ xq, int ldq, float2* __restrict__ xd, int ldd)
{
    __shared__ float red[4];
    const float* xr = x + (long long)blockIdx.x * ldx;
    if (nw != nullptr && blockIdx.y == 0) {
        const float ss = row_ss(xr, k, red);
        if (threadIdx.x == 0) xs[blockIdx.x] = norm_scale(ss, k, eps);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    i8* qr = xq + (long long)blockIdx.x * ldq;
    float2* dr = xd + (long long)blockIdx.x * ldd;
    const int blk = 4 * blockIdx.y + warp;
    if (blk < (k >> 5)) {
        const int e = 32 * blk + lane;
        float v = xr[e];
        if (nw != nullptr) v = __fmul_rn(v, nw[e]);
        const float amax = warp_max(fabsf(v));
        const float sum = warp_sum(v);
        const float inv = amax > 0.f ? __fdiv_rn(127.f, amax) : 0.f;
        qr[e] = (i8)__float2int_rn(__fmul_rn(v, inv));
        if (lane == 0) dr[blk] = make_float2(__fdiv_rn(amax, 127.f), sum);
    }
}

// The two weight rows of pair p (and, for the QKV modes, the head, section and dims they are).
struct PairRows {
    long long ra, rb;
    int sect, head, dd, da, db;
};
template <bool QKV>
__device__ __forceinline__ PairRows pair_rows(int p, int a_stride, int b_off, int row_base, int qd, int kd, int hd,
                                              int rope_half, int neox) {
    PairRows r;
    r.sect = 0; r.head = 0; r.dd = 0; r.da = 0; r.db = 0;
    if (QKV) {
        const int g = row_base + 2 * p;
        r.sect = g < qd ? 0 : (g < qd + kd ? 1 : 2);
        const int s0 = r.sect == 0 ? 0 : (r.sect == 1 ? qd : qd + kd);
        r.head = (g - s0) / hd;
        r.dd = g - s0 - r.head * hd;
        if (neox && r.sect < 2 && r.dd < 2 * rope_half) { r.da = r.dd >> 1; r.db = r.da + rope_half; }
        else { r.da = r.dd; r.db = r.dd + 1; }
        r.ra = (long long)(s0 + r.head * hd + r.da - row_base);
        r.rb = (long long)(s0 + r.head * hd + r.db - row_base);
    } else {
        r.ra = (long long)p * a_stride;
        r.rb = r.ra + b_off;
    }
    return r;
}

// The epilogue of one pair for batch row b: the sums a (row ra) and c (row rb) times the
// norm scale sc (when nw is given), plus the biases, then the mode's store.
template <int MODE>
__device__ __forceinline__ void gemv_out(float a, float c, int b, int p, const PairRows r, bool normed, float sc,
                                         const float* __restrict__ bias_a, const float* __restrict__ bias_b,
                                         float* __restrict__ y, int ldy, int hd, int rope_half, int neox, int n_kv,
                                         int n_ctx, const int* __restrict__ tab_slot, const int* __restrict__ tab_pos,
                                         const float* __restrict__ rcos, const float* __restrict__ rsin,
                                         void* __restrict__ kc, void* __restrict__ vc) {
    const float ba = bias_a != nullptr ? bias_a[r.ra] : 0.f, bb = bias_b != nullptr ? bias_b[r.rb] : 0.f;
    if (normed) { a = __fmul_rn(a, sc); c = __fmul_rn(c, sc); }
    a = __fadd_rn(a, ba);
    c = __fadd_rn(c, bb);
    float* yr = y + (long long)b * ldy;
    if (MODE == M_STORE) { yr[r.ra] = a; yr[r.rb] = c; }
    else if (MODE == M_ADD) { yr[r.ra] = __fadd_rn(yr[r.ra], a); yr[r.rb] = __fadd_rn(yr[r.rb], c); }
    else if (MODE == M_SWIGLU) { yr[p] = __fmul_rn(silu(a), c); }
    else if (MODE == M_GEGLU) { yr[p] = __fmul_rn(gelu_tanh(a), c); }
    else {
        const int pos = tab_pos[b];
        const int dd = r.dd, da = r.da, db = r.db;
        if (r.sect < 2) {
            const int jj = neox ? (dd < 2 * rope_half ? da : -1) : ((dd >> 1) < rope_half ? (dd >> 1) : -1);
            if (jj >= 0) {
                const float cs = rcos[(long long)pos * rope_half + jj], sn = rsin[(long long)pos * rope_half + jj];
                const float a2 = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(c, sn));
                const float c2 = __fadd_rn(__fmul_rn(a, sn), __fmul_rn(c, cs));
                a = a2; c = c2;
            }
        }
        if (r.sect == 0) { yr[r.head * hd + da] = a; yr[r.head * hd + db] = c; }
        else {
            const long long o = (((long long)tab_slot[b] * n_kv + r.head) * n_ctx + pos) * hd;
            void* cache = r.sect == 1 ? kc : vc;
            kv_st<MODE == M_QKV16 ? 1 : 0>(cache, o + da, a);
            kv_st<MODE == M_QKV16 ? 1 : 0>(cache, o + db, c);
        }
    }
}

// The norm scales of this block's NB batch rows into s_scale (xs given: read; else computed
// here). Every thread of the block calls it; s_scale is ready on return.
template <int NB>
__device__ __forceinline__ void gemv_scales(const float* __restrict__ x, int ldx, int b0, int nb, int k, float eps,
                                            const float* __restrict__ nw, const float* __restrict__ xs,
                                            float* s_scale, float (*s_ss)[4]) {
    if (nw != nullptr) {
        if (xs != nullptr) {
            if (threadIdx.x < NB) s_scale[threadIdx.x] = xs[b0 + min((int)threadIdx.x, nb - 1)];
        } else {
            rows_scale<NB>(x, ldx, b0, nb, k, eps, s_scale, s_ss);
        }
        __syncthreads();
    }
}

// PPW row pairs per warp (1, 2 or 4): the warp walks the units of PPW pairs at once, each
// x (and norm weight) load of a unit serving all of them; every pair keeps its own
// accumulators, so its sums are the ones PPW 1 forms (the loads are shared, not the adds).
template <int TA, int TB, int NB, int PPW>
__device__ __forceinline__ void gemv_units(const u8* const (&rowA)[PPW], const u8* const (&rowB)[PPW], int u,
                                           const float* __restrict__ nw, const float* __restrict__ x, int ldx,
                                           int b0, int nb, float (&acc)[PPW][2 * NB]) {
    float wa[PPW][8], wb[PPW][8];
#pragma unroll
    for (int q = 0; q < PPW; q++) {
        deq8<TA>(rowA[q], u, wa[q]);
        deq8<TB>(rowB[q], u, wb[q]);
    }
    if (nw != nullptr) {
        const float4* np = (const float4*)(nw + 8 * u);
        const float4 n0 = np[0], n1 = np[1];
        const float nn[8] = {n0.x, n0.y, n0.z, n0.w, n1.x, n1.y, n1.z, n1.w};
#pragma unroll
        for (int q = 0; q < PPW; q++) {
#pragma unroll
            for (int i = 0; i < 8; i++) { wa[q][i] = __fmul_rn(wa[q][i], nn[i]); wb[q][i] = __fmul_rn(wb[q][i], nn[i]); }
        }
    }
#pragma unroll
    for (int j = 0; j < NB; j++) {
        const float4* xp = (const float4*)(x + (long long)(b0 + min(j, nb - 1)) * ldx + 8 * u);
        const float4 x0 = xp[0], x1 = xp[1];
        const float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
        for (int q = 0; q < PPW; q++) {
            float a = acc[q][j], c = acc[q][NB + j];
#pragma unroll
            for (int i = 0; i < 8; i++) { a = fmaf(wa[q][i], xv[i], a); c = fmaf(wb[q][i], xv[i], c); }
            acc[q][j] = a;
            acc[q][NB + j] = c;
        }
    }
}

// The Q8 form of gemv_units: unit u is input block u (32 inputs) of int8 rows xq (ldq bytes
// per row) with block scales xd (ldd per row); each block's contribution (q8dot) is added to
// the pair's sums with one rounding, block after block.
template <int TA, int TB, int NB, int PPW>
__device__ __forceinline__ void gemv_units_q8(const u8* const (&rowA)[PPW], const u8* const (&rowB)[PPW], int u,
                                              const i8* __restrict__ xq, int ldq, const float2* __restrict__ xd,
                                              int ldd, int b0, int nb, float (&acc)[PPW][2 * NB]) {
    Q8W wa[PPW], wb[PPW];
#pragma unroll
    for (int q = 0; q < PPW; q++) {
        q8w<TA>(rowA[q], u, wa[q]);
        q8w<TB>(rowB[q], u, wb[q]);
    }
#pragma unroll
    for (int j = 0; j < NB; j++) {
        const long long r = b0 + min(j, nb - 1);
        const int4* xp = (const int4*)(xq + r * ldq + 32 * u);
        const int4 xa = xp[0], xb = xp[1];
        const float2 d = xd[r * ldd + u];
#pragma unroll
        for (int q = 0; q < PPW; q++) {
            acc[q][j] = __fadd_rn(acc[q][j], q8dot<TA>(wa[q], xa, xb, d));
            acc[q][NB + j] = __fadd_rn(acc[q][NB + j], q8dot<TB>(wb[q], xa, xb, d));
        }
    }
}

// The sums of the warp's PPW row pairs: each pair's A and B rows of the NB batch rows over the
// virtual lanes (gemv_units), warp_sum_scatter, then ((R_0 + R_1) + R_2) + R_3 (across the WPP
// warps of a pair through s_red, rows [pl0, pl0 + PPW) of it). On return lane vi = lane & (2NB - 1)
// holds in tot[q] value vi of pair q (A of batch row vi < NB, B of row vi - NB). `gemv` and
// `moe_gemv` both form their sums here: one copy of the arithmetic. Every thread of the block
// calls it (WPP > 1: a __syncthreads); false for the warps whose partial sums went to s_red
// (sub != 0): they are done.
// Q8 1: units are 32-input blocks of int8 rows (x: the int8 rows, ldx bytes; xd, ldd: their
// block scales; gemv_units_q8), else units of 8 float inputs (xd unused).
template <int TA, int TB, int NB, int WPP, int PPW, int Q8 = 0>
__device__ __forceinline__ bool gemv_sums(const u8* const (&rowA)[PPW], const u8* const (&rowB)[PPW], int k,
                                          const float* __restrict__ nw, const float* __restrict__ x, int ldx,
                                          int b0, int nb, int pl0, float (*s_red)[4][2 * NB], float (&tot)[PPW],
                                          const float2* __restrict__ xd = nullptr, int ldd = 0) {
    constexpr int S = 4 / WPP;                     // virtual-lane groups per thread
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int sub = warp % WPP;
    // accumulate: value i of acc[q] is A row of batch row i (i < NB) or B row of batch row i - NB
    constexpr int V = 2 * NB;
    const int nu = Q8 ? k >> 5 : k >> 3;
    const i8* xq = (const i8*)x;             // Q8: x holds the int8 rows (ldx bytes per row)
    float R[S][PPW];                         // R_g of value (lane & (V - 1)) for g = sub + WPP * s
    if constexpr (S * NB <= 4) {
        // few accumulators: the S groups interleaved in one pass over the row
        constexpr int UNR = S == 1 ? 4 : (S == 2 ? 2 : 1);
        float acc[S][PPW][V];
#pragma unroll
        for (int s = 0; s < S; s++) {
#pragma unroll
            for (int q = 0; q < PPW; q++) {
#pragma unroll
                for (int i = 0; i < V; i++) acc[s][q][i] = 0.f;
            }
        }
#pragma unroll UNR
        for (int u0 = 0; u0 < nu; u0 += 128) {
#pragma unroll
            for (int s = 0; s < S; s++) {
                const int u = u0 + 32 * (sub + WPP * s) + lane;
                if (u < nu) {
                    if constexpr (Q8) gemv_units_q8<TA, TB, NB, PPW>(rowA, rowB, u, xq, ldx, xd, ldd, b0, nb, acc[s]);
                    else gemv_units<TA, TB, NB, PPW>(rowA, rowB, u, nw, x, ldx, b0, nb, acc[s]);
                }
            }
        }
#pragma unroll
        for (int s = 0; s < S; s++) {
#pragma unroll
            for (int q = 0; q < PPW; q++) R[s][q] = warp_sum_scatter<V>(acc[s][q]);
        }
    } else {
        // many accumulators: one group after the other (registers: PPW V accumulators, not S PPW V)
#pragma unroll
        for (int s = 0; s < S; s++) {
            float acc[PPW][V];
#pragma unroll
            for (int q = 0; q < PPW; q++) {
#pragma unroll
                for (int i = 0; i < V; i++) acc[q][i] = 0.f;
            }
#pragma unroll 1
            for (int u = 32 * (sub + WPP * s) + lane; u < nu; u += 128) {
                if constexpr (Q8) gemv_units_q8<TA, TB, NB, PPW>(rowA, rowB, u, xq, ldx, xd, ldd, b0, nb, acc);
                else gemv_units<TA, TB, NB, PPW>(rowA, rowB, u, nw, x, ldx, b0, nb, acc);
            }
#pragma unroll
            for (int q = 0; q < PPW; q++) R[s][q] = warp_sum_scatter<V>(acc[q]);
        }
    }
    // the row's sum ((R_0 + R_1) + R_2) + R_3, for value vi = lane & (V - 1)
    const int vi = lane & (V - 1);
    if constexpr (WPP == 1) {
#pragma unroll
        for (int q = 0; q < PPW; q++) {
            tot[q] = R[0][q];
#pragma unroll
            for (int s = 1; s < S; s++) tot[q] = __fadd_rn(tot[q], R[s][q]);
        }
    } else {
        if (lane < V) {
#pragma unroll
            for (int q = 0; q < PPW; q++) {
#pragma unroll
                for (int s = 0; s < S; s++) s_red[pl0 + q][sub + WPP * s][lane] = R[s][q];
            }
        }
        __syncthreads();
        if (sub != 0) return false;
#pragma unroll
        for (int q = 0; q < PPW; q++) {
            tot[q] = s_red[pl0 + q][0][vi];
#pragma unroll
            for (int g = 1; g < 4; g++) tot[q] = __fadd_rn(tot[q], s_red[pl0 + q][g][vi]);
        }
    }
    return true;
}

// y = W . (optionally rmsnorm'ed) x (+ bias): two output rows ("a pair") per WPP warps (PPW
// pairs per WPP warps), NB batch rows per block (grid.y covers the batch), GEMV_WARPS / WPP * PPW
// pairs per block (grid.x).
// Rows of a pair: ra = p * a_stride (of Wa), rb = p * a_stride + b_off (of Wb); bias_a[ra],
// bias_b[rb] are added after the norm (either pointer may be null). nw: the RMSNorm weight
// (k,) folded into the weights, or null (no norm); then xs: the rows' norm scales computed
// by row_scale before this launch, or null (computed here, per block).
// MODE 0 store (rows ra, rb), 1 add, 2 swiglu: y[b, p] = silu(a) * b, 4 geglu: gelu_tanh(a) * b,
// 3 / 5 qkv (float32 / float16 KV): the pair is two rows of one head of [q; k; v] (global row
// g = row_base + 2p; adjacent dims for RoPE "norm" and V, dims j and j + rope_half for RoPE
// "neox"); q rows are roped into y, k rows roped into kc, v rows into vc at (slot, pos) of the
// batch row.
// Q8 1: int8 activations (quant_rows before the launch): x is the int8 rows (ldx bytes per
// row), xd their block scales (ldd float2 per row), and xs is required when nw is given (the
// norm weight was folded into x by quant_rows, its scale is applied here). The canonical
// order then has units of 32 inputs (one block: its contribution q8dot, exact integer dot
// products and a fixed float tail, added with one rounding) in place of units of 8; the
// lanes, groups, butterfly and epilogue are the same. Q8 0: xd, ldd unused.
template <int TA, int TB, int NB, int MODE, int WPP, int PPW = 1, int Q8 = 0>
__device__ __forceinline__ void gemv_block(const int bx, const int by,
    const u8* __restrict__ Wa, const u8* __restrict__ Wb, long long rba, long long rbb, int a_stride, int b_off,
    int n_pairs, int k, const float* __restrict__ x, int ldx, int B, const float* __restrict__ nw, float eps,
    const float* __restrict__ xs, const float* __restrict__ bias_a, const float* __restrict__ bias_b,
    float* __restrict__ y, int ldy,
    int row_base, int qd, int kd, int hd, int rope_half, int neox, int n_kv, int n_ctx,
    const int* __restrict__ tab_slot, const int* __restrict__ tab_pos,
    const float* __restrict__ rcos, const float* __restrict__ rsin, void* __restrict__ kc, void* __restrict__ vc,
    const float2* __restrict__ xd, int ldd)
{
    static_assert(WPP == 1 || WPP == 2 || WPP == 4, "WPP is 1, 2 or 4");
    static_assert(PPW == 1 || PPW == 2 || PPW == 4, "PPW is 1, 2 or 4");
    static_assert(Q8 == 0 || (Q8Traits<TA>::ok && Q8Traits<TB>::ok), "Q8: both weight types have an integer form");
    constexpr bool QKV = (MODE == M_QKV || MODE == M_QKV16);
    constexpr int PPB = GEMV_WARPS / WPP * PPW;    // row pairs per block
    __shared__ float s_scale[NB];
    __shared__ float s_red[WPP > 1 ? PPB : 1][4][2 * NB];   // per pair: R_g of A and B rows (WPP > 1)
    __shared__ float s_ss[NB][4];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int b0 = by * NB;
    const int nb = min(NB, B - b0);
    gemv_scales<NB>(x, ldx, b0, nb, k, eps, nw, xs, s_scale, s_ss);
    const int pl0 = (warp / WPP) * PPW;      // the warp's first pair within the block
    int p[PPW];
    bool valid[PPW];
    PairRows rows[PPW];
    const u8* rowA[PPW];
    const u8* rowB[PPW];
#pragma unroll
    for (int q = 0; q < PPW; q++) {
        const int p_raw = bx * PPB + pl0 + q;
        valid[q] = p_raw < n_pairs;
        p[q] = valid[q] ? p_raw : n_pairs - 1;
        rows[q] = pair_rows<QKV>(p[q], a_stride, b_off, row_base, qd, kd, hd, rope_half, neox);
        rowA[q] = Wa + rows[q].ra * rba;
        rowB[q] = Wb + rows[q].rb * rbb;
    }
    float tot[PPW];
    if (!gemv_sums<TA, TB, NB, WPP, PPW, Q8>(rowA, rowB, k, nw, x, ldx, b0, nb, pl0, s_red, tot, xd, ldd)) return;
    // lane j < NB holds A of batch row j; lane j + NB holds its B
#pragma unroll
    for (int q = 0; q < PPW; q++) {
        const float other = __shfl_xor_sync(0xffffffffu, tot[q], NB);
        if (lane < nb && valid[q])
            gemv_out<MODE>(tot[q], other, b0 + lane, p[q], rows[q], nw != nullptr, s_scale[lane], bias_a, bias_b, y,
                           ldy, hd, rope_half, neox, n_kv, n_ctx, tab_slot, tab_pos, rcos, rsin, kc, vc);
    }
}
// the kernel: one block of gemv_block per (bx, by) of the grid (tests/tools/persistent_step.py
// runs the same block function over virtual blocks)
template <int TA, int TB, int NB, int MODE, int WPP, int PPW = 1, int Q8 = 0>
__global__ void __launch_bounds__(GEMV_WARPS * 32) gemv(
    const u8* __restrict__ Wa, const u8* __restrict__ Wb, long long rba, long long rbb, int a_stride, int b_off,
    int n_pairs, int k, const float* __restrict__ x, int ldx, int B, const float* __restrict__ nw, float eps,
    const float* __restrict__ xs, const float* __restrict__ bias_a, const float* __restrict__ bias_b,
    float* __restrict__ y, int ldy,
    int row_base, int qd, int kd, int hd, int rope_half, int neox, int n_kv, int n_ctx,
    const int* __restrict__ tab_slot, const int* __restrict__ tab_pos,
    const float* __restrict__ rcos, const float* __restrict__ rsin, void* __restrict__ kc, void* __restrict__ vc,
    const float2* __restrict__ xd, int ldd)
{
    gemv_block<TA, TB, NB, MODE, WPP, PPW, Q8>(blockIdx.x, blockIdx.y, Wa, Wb, rba, rbb, a_stride, b_off, n_pairs,
        k, x, ldx, B, nw, eps, xs, bias_a, bias_b, y, ldy, row_base, qd, kd, hd, rope_half, neox, n_kv, n_ctx,
        tab_slot, tab_pos, rcos, rsin, kc, vc, xd, ldd);
}

