// ---- the GPU expert tier (experts.py, GpuExperts): one launch per GEMV for all experts ----
// xo[j, :k] = x[idx[j], :k], one block per output row j: the rows routed to the experts held on
// the device, gathered in (expert, row) pair order from the index table the host copied once
__global__ void moe_gather(const float* __restrict__ x, int ldx, const int* __restrict__ idx, int k,
                           float* __restrict__ xo, int ldo)
{
    const float* src = x + (long long)idx[blockIdx.x] * ldx;
    float* dst = xo + (long long)blockIdx.x * ldo;
    for (int e = threadIdx.x; e < k; e += blockDim.x) dst[e] = src[e];
}

// The experts' GEMV: `gemv` without a norm, in modes M_STORE and M_SWIGLU, over the tiles of many
// experts in one launch. Tile t = blockIdx.y: tiles[3t .. 3t+2] = (expert slot e, first batch
// row b0, rows nb <= NB) of x (an expert's rows are consecutive; one tile never spans two
// experts); expert e's matrices start ea / eb bytes apart (Wa + e ea, Wb + e eb), its biases
// ebias floats apart (either may be null). The sums and the epilogue are `gemv`'s own device
// functions (gemv_sums, gemv_out; PPW 1, no norm), on expert e's rows and biases, so a row gets
// the bits a `gemv` launch on its expert alone gives, whatever the tile, the other experts and
// the variant.
template <int TA, int TB, int NB, int MODE, int WPP>
__global__ void __launch_bounds__(GEMV_WARPS * 32) moe_gemv(
    const u8* __restrict__ Wa, const u8* __restrict__ Wb, long long ea, long long eb, long long rba, long long rbb,
    int a_stride, int b_off, int n_pairs, int k, const float* __restrict__ x, int ldx,
    const int* __restrict__ tiles, const float* __restrict__ bias_a, const float* __restrict__ bias_b, int ebias,
    float* __restrict__ y, int ldy)
{
    static_assert(WPP == 1 || WPP == 2 || WPP == 4, "WPP is 1, 2 or 4");
    static_assert(MODE == M_STORE || MODE == M_SWIGLU, "moe_gemv: store or swiglu");
    constexpr int PPB = GEMV_WARPS / WPP;    // row pairs per block
    __shared__ float s_red[WPP > 1 ? PPB : 1][4][2 * NB];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int* tile = tiles + 3 * blockIdx.y;
    const int e = tile[0], b0 = tile[1], nb = tile[2];
    if (nb <= 0) return;                     // a spare tile of moe_tiles' fixed grid (the device-resident step)
    const int pl = warp / WPP;
    const int p_raw = blockIdx.x * PPB + pl;
    const bool valid = p_raw < n_pairs;
    const int p = valid ? p_raw : n_pairs - 1;
    const PairRows r = pair_rows<false>(p, a_stride, b_off, 0, 0, 0, 0, 0, 0);
    const u8* const rowA[1] = {Wa + (long long)e * ea + r.ra * rba};
    const u8* const rowB[1] = {Wb + (long long)e * eb + r.rb * rbb};
    float tot[1];
    if (!gemv_sums<TA, TB, NB, WPP, 1>(rowA, rowB, k, nullptr, x, ldx, b0, nb, pl, s_red, tot)) return;
    const float other = __shfl_xor_sync(0xffffffffu, tot[0], NB);   // lane j < NB: A of row j; j + NB: its B
    if (lane >= nb || !valid) return;
    const float* ba = bias_a != nullptr ? bias_a + (long long)e * ebias : nullptr;   // expert e's biases
    const float* bb = bias_b != nullptr ? bias_b + (long long)e * ebias : nullptr;
    gemv_out<MODE>(tot[0], other, b0 + lane, p, r, false, 0.f, ba, bb, y, ldy, 0, 0, 0, 0, 0, nullptr, nullptr,
                   nullptr, nullptr, nullptr, nullptr);
}

// ---- the device-resident moe step (moe.py, MoeStep.device_ready): every expert of the layer on the
// GPU, so the router, the routing, the experts and the join run here in launches a CUDA graph captures (no
// host round trip). The experts' GEMVs are moe_gemv above; these three kernels do the rest.

// moe_route: one warp per row i of the router logits lg (n rows, ldl apart; + bias (E) when given): the k
// experts cpu/experts.py's _route picks, by its rules: sel[i k + j] in decreasing value (ties: the lower id), w[i k + j]
// their weights. Gating softmax (sw 0): p = softmax(l) (float64 sum), w = p[sel]; softmax_weight (sw 1):
// selected by l, w = softmax of those k. norm_w: w / max(sum w, MOE_NORM_MIN) (float32 sum in j order);
// w_scale multiplies w unless it is 0 or 1. E <= 1024 (p in shared memory, E floats per warp).
#define MOE_ROUTE_WARPS 4
__global__ void __launch_bounds__(MOE_ROUTE_WARPS * 32) moe_route(
    const float* __restrict__ lg, int ldl, const float* __restrict__ bias, int n, int E, int k, int sw, int norm_w,
    float w_scale, int* __restrict__ sel, float* __restrict__ wts)
{
    extern __shared__ float s_route[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int i = blockIdx.x * MOE_ROUTE_WARPS + warp;
    if (i >= n) return;
    float* p = s_route + warp * E;
    const float* l = lg + (long long)i * ldl;
    float mx = -__int_as_float(0x7f800000);
    for (int e = lane; e < E; e += 32) {
        const float v = bias != nullptr ? l[e] + bias[e] : l[e];
        p[e] = v;
        mx = fmaxf(mx, v);
    }
    if (!sw) {
        for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        double s = 0.0;
        for (int e = lane; e < E; e += 32) {
            const float v = expf(p[e] - mx);
            p[e] = v;
            s += (double)v;
        }
        for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        const float inv = (float)(1.0 / s);
        for (int e = lane; e < E; e += 32) p[e] = p[e] * inv;
    }
    __syncwarp();
    unsigned taken = 0u;                     // bit t: expert lane + 32 t is taken
    float wv[32];
    int sv[32];
    for (int j = 0; j < k; ++j) {
        float bv = 0.f;
        int bi = -1;
        for (int t = 0, e = lane; e < E; ++t, e += 32) {
            if ((taken >> t) & 1u) continue;
            const float v = p[e];
            if (bi < 0 || v > bv) { bv = v; bi = e; }
        }
        for (int o = 16; o; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            const bool take = oi >= 0 && (bi < 0 || ov > bv || (!(bv > ov) && oi < bi));
            if (take) { bv = ov; bi = oi; }
        }
        if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
        wv[j] = bv;
        sv[j] = bi;
    }
    if (lane != 0) return;
    if (sw) {
        float m2 = wv[0];
        for (int j = 1; j < k; ++j) m2 = wv[j] > m2 ? wv[j] : m2;
        double s = 0.0;
        for (int j = 0; j < k; ++j) { wv[j] = expf(wv[j] - m2); s += (double)wv[j]; }
        const float inv = (float)(1.0 / s);
        for (int j = 0; j < k; ++j) wv[j] = wv[j] * inv;
    }
    if (norm_w) {
        float s = 0.f;
        for (int j = 0; j < k; ++j) s += wv[j];
        if (s < 6.103515625e-5f) s = 6.103515625e-5f;
        for (int j = 0; j < k; ++j) wv[j] = wv[j] / s;
    }
    const bool scale = w_scale != 0.f && w_scale != 1.f;
    for (int j = 0; j < k; ++j) {
        sel[(long long)i * k + j] = sv[j];
        wts[(long long)i * k + j] = scale ? wv[j] * w_scale : wv[j];
    }
}

// moe_tiles: one block of 1024 threads: the P = n k pairs of sel (pair q: row q / k, slot q % k) by expert,
// experts in increasing id and pairs in increasing q within one: tab[0 .. P) = each position's row (moe_gather's
// index), pos[q] = pair q's position (moe_join's); then tmax tiles from tab + P (expert slot, first position,
// rows <= nb; moe_gemv's table), an expert's positions cut into tiles of nb, the tiles past the last empty
// (0 rows: moe_gemv skips them). traffic (E) int64, when given, gets each expert's pairs added, but those of
// padding rows (row_slot[row] == pad_slot; row_slot null: none). E <= 1024.
#define MOE_TILES_CHUNK 4096
__global__ void __launch_bounds__(1024) moe_tiles(
    const int* __restrict__ sel, int P, int k, int E, const int* __restrict__ slot, int nb, int tmax,
    int* __restrict__ tab, int* __restrict__ pos, unsigned long long* __restrict__ traffic,
    const int* __restrict__ row_slot, int pad_slot)
{
    __shared__ int s_cnt[1024], s_off[1024], s_toff[1025], s_real[1024];
    __shared__ int s_sel[MOE_TILES_CHUNK];
    const int e = threadIdx.x;
    if (e < E) s_cnt[e] = s_real[e] = 0;
    __syncthreads();
    for (int q = threadIdx.x; q < P; q += blockDim.x) {
        atomicAdd(&s_cnt[sel[q]], 1);
        if (row_slot == nullptr || row_slot[q / k] != pad_slot) atomicAdd(&s_real[sel[q]], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int o = 0, t = 0;
        for (int x = 0; x < E; ++x) {
            s_off[x] = o;
            s_toff[x] = t;
            o += s_cnt[x];
            t += (s_cnt[x] + nb - 1) / nb;
        }
        s_toff[E] = t;
    }
    __syncthreads();
    const int cnt = e < E ? s_cnt[e] : 0;
    int o = e < E ? s_off[e] : 0;
    for (int c0 = 0; c0 < P; c0 += MOE_TILES_CHUNK) {
        const int m = min(MOE_TILES_CHUNK, P - c0);
        __syncthreads();
        for (int q = threadIdx.x; q < m; q += blockDim.x) s_sel[q] = sel[c0 + q];
        __syncthreads();
        if (cnt > 0) {
            for (int q = 0; q < m; ++q) {
                if (s_sel[q] == e) {
                    tab[o] = (c0 + q) / k;
                    pos[c0 + q] = o;
                    ++o;
                }
            }
        }
    }
    if (e < E && cnt > 0) {
        const int o0 = s_off[e], sl = slot[e];
        int t = s_toff[e];
        for (int b = 0; b < cnt; b += nb, ++t) {
            int* tl = tab + P + 3 * t;
            tl[0] = sl;
            tl[1] = o0 + b;
            tl[2] = min(nb, cnt - b);
        }
        if (traffic != nullptr) traffic[e] += (unsigned long long)s_real[e];
    }
    for (int t = s_toff[E] + threadIdx.x; t < tmax; t += blockDim.x) {
        int* tl = tab + P + 3 * t;
        tl[0] = 0;
        tl[1] = 0;
        tl[2] = 0;
    }
}

// moe_join: out[i, c] = sum_j w[i k + j] y[pos[i k + j], c] for j = 0 .. k-1 in that order, each product and
// sum rounded (no fused multiply-add): cpu/experts.py join's bits. One block per row.
__global__ void moe_join(const float* __restrict__ y, int ldy, const int* __restrict__ pos,
                         const float* __restrict__ w, int k, int d, float* __restrict__ out, int ldo)
{
    const long long q = (long long)blockIdx.x * k;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = __fmul_rn(w[q], y[(long long)pos[q] * ldy + c]);
        for (int j = 1; j < k; ++j) acc = __fadd_rn(acc, __fmul_rn(w[q + j], y[(long long)pos[q + j] * ldy + c]));
        out[(long long)blockIdx.x * ldo + c] = acc;
    }
}

