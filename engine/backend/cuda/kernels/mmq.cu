// ---- MMQ: the int8 GEMV's sums on tensor cores, one weight read for many batch rows --------
// The decode GEMV on int8 activations (gemv.cu, Q8 1) forms each output in one canonical
// order: per 32-input block u its contribution (q8dot: an exact integer dot product isum of
// the weight block's int8 levels with the input block's, then a fixed float tail: q8dot's);
// virtual lane v (0..127) adds the blocks v, v + 128, ... from 0.f; per group g of 32 lanes
// the warp butterfly (xor 16, 8, 4, 2, 1) gives R_g; the sum is ((R_0 + R_1) + R_2) + R_3;
// then gemv_out. This kernel forms exactly those float operations, so every output has the
// GEMV's bits whatever the number of batch rows, a row's place in the tile, the tile shape or
// the grid (decode ticks, verify windows and prefill chunks agree bit for bit):
// * isum is exact in int32, so the order of its integer adds is free: it comes from
//   mma.sync m16n8k32 (s8 x s8 -> s32: 16 weight rows x 8 batch rows x one block), or from two
//   m16n8k16 (the block's two 16-input halves s0, s1) when a type has integer sub-block
//   scales (isum = sa s0 + sb s1, as q8dot);
// * the weight levels and scales are q8w<T>'s own (the GEMV's code, run on a copy of the
//   block in shared memory), the float tail is q8dot's (mmq_tail);
// * the butterfly over the 32 lanes of a group is one fixed binary tree: lanes l and l + 16
//   first, those sums 8 apart, then 4, 2, 1 (a float add commutes bit for bit). Its leaves,
//   left to right, are the lanes bitrev5(p), p = 0..31. Visiting the lanes in that order,
//   each output keeps a stack of pending subtree sums (st[level]): leaf p is merged with as
//   many of them as p has trailing one bits (a binary counter), which forms every add of
//   the butterfly, and at p = 31 the whole tree, R_g;
// * a lane's own sum (its blocks v, v + 128, ... in order, from 0.f) is formed when its leaf
//   is visited;
// * a subtree's sum needs only its own leaves, so S warp sets (S = 1, 2, 4) can form the S
//   subtrees of 32 / S leaves of a group side by side (set s: leaves s 32 / S ..), each with
//   its own stack, and set 0 adds them as the tree's top levels: P0 + P1, or
//   (P0 + P1) + (P2 + P3) (small matrices: more warps, a shorter chain of leaves).
//
// The block (CTA): WN x WM x S warps. Warp column wn owns 8 row pairs: its 16 weight rows, the
// m16 operand, are the pairs' A rows (rows 16 wn + 0..7 of the tile) and B rows (16 wn +
// 8..15), so a thread's accumulators (MMA rows gid and gid + 8) are the A and B sums of one
// pair, gemv_out's two operands. Warp row wm owns 16 batch rows (two n8 tiles); a thread
// holds 8 outputs: (tile t, column 2 tig + j, A or B), o = 4 t + 2 j + h.
// The K loop runs 4 x 32 / S iterations; in each, every warp set visits one leaf of its
// subtree, group by group. A group's lanes read the 1024-input chunks c = 4 r + g of every row
// (r = 0 .. rounds - 1): that "slab" is copied into shared memory once per group (cp.async,
// 16-byte pieces, each row's chunk contiguous, so every weight byte leaves memory once, and
// the S sets share it); per iteration the S leaves' blocks are expanded by q8w into a weight
// stage of int8 words and scales (double-buffered: the next iteration's expansion overlaps
// this one's MMAs), and the batch rows' input blocks are copied into an input stage two
// iterations ahead (three buffers: the copies' latency hides behind two iterations of work).
// Shared memory (dynamic, bytes): the slab ROWS x rmax x CHS, then two weight stages of S x
// rmax x ROWS records and three input stages of S x rmax x MT records (MMQ_REC bytes each:
// 32 bytes of int8 levels, then dw, mw, float sa, float sb, or dx, sum x), then S x WN WM x 256
// floats of subtree sums (S > 1); rmax = ceil(k / 4096). engine/backend/cuda/mmq.py computes
// the same size (smem_bytes) and the grid: (ceil(B / MT), ceil(n_pairs / (8 WN))), batch tiles
// fastest so that blocks sharing a weight tile run together. Needs sm_80+ (mma.sync s8,
// cp.async).

#define MMQ_REC 48          // bytes of a stage record (a 16-byte multiple; 12 words: no bank conflicts)

// A type's GGUF block (be inputs, bb bytes) and its 1024-input chunk (ch bytes; chs bytes of
// shared memory: room for a copy that starts at the 16-byte boundary below the chunk, up to 15
// bytes early, and for q8w's word loads, which may read up to 3 bytes past the last block)
template <int T> struct MmqBlk;
#define MMQ_BLK(T, BE, BB) template <> struct MmqBlk<T> { \
    static constexpr int be = BE, bb = BB, ch = 1024 / BE * BB, chs = (1024 / BE * BB + 47) / 16 * 16; };
MMQ_BLK(2, 32, 18)     // Q4_0
MMQ_BLK(3, 32, 20)     // Q4_1
MMQ_BLK(6, 32, 22)     // Q5_0
MMQ_BLK(7, 32, 24)     // Q5_1
MMQ_BLK(8, 32, 34)     // Q8_0
MMQ_BLK(11, 256, 110)  // Q3_K
MMQ_BLK(12, 256, 144)  // Q4_K
MMQ_BLK(13, 256, 176)  // Q5_K
MMQ_BLK(14, 256, 210)  // Q6_K
MMQ_BLK(20, 32, 18)    // IQ4_NL
MMQ_BLK(23, 256, 136)  // IQ4_XS
MMQ_BLK(39, 32, 17)    // MXFP4

__device__ __forceinline__ u32 mmq_sa(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mmq_cp16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(mmq_sa(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void mmq_cp8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" :: "r"(mmq_sa(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void mmq_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void mmq_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// c = A B (exact int32): A 16 x 32 int8 (a0 rows 0-7, a1 rows 8-15: inputs 4 tig .. 4 tig + 3;
// a2, a3: inputs 16 + 4 tig ..), B 32 x 8 (b0: inputs 4 tig .., b1: 16 + 4 tig .., column gid);
// c0, c1: row gid, columns 2 tig, 2 tig + 1; c2, c3: row gid + 8
__device__ __forceinline__ void mmq_k32(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    c[0] = 0; c[1] = 0; c[2] = 0; c[3] = 0;
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// the same over 16 inputs (a0 rows 0-7, a1 rows 8-15, b0: inputs 4 tig .. 4 tig + 3)
__device__ __forceinline__ void mmq_k16(int (&c)[4], u32 a0, u32 a1, u32 b0) {
    c[0] = 0; c[1] = 0; c[2] = 0; c[3] = 0;
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3]) : "r"(a0), "r"(a1), "r"(b0));
}

// i as a float, exactly, for |i| < 2^22 (the bits of 1.5 2^23 + i, minus 1.5 2^23: an integer add
// and a float add at full rate, where I2F runs at an eighth of it); the value __int2float_rn gives
__device__ __forceinline__ float mmq_i2f(int i) { return __fsub_rn(__int_as_float(0x4B400000 + i), 12582912.f); }

// q8dot's float tail (dequant.cuh, written there inline: the GEMV's code stays as it was), from
// the block's exact integer dot product as a float: (dw * dx) * isum, then for the types with
// an offset one fma of mw * (the sum of the block's float inputs). The same operations in the
// same order, so the same bits.
template <int T>
__device__ __forceinline__ float mmq_tail(float dw, float mw, float fisum, const float2 xd) {
    float t = __fmul_rn(__fmul_rn(dw, xd.x), fisum);
    if (Q8Traits<T>::has_min) t = fmaf(mw, xd.y, t);
    return t;
}

// Rounds of group g's chunks (c = 4 r + g < nch) and of lane v's blocks (v + 128 r < nu).
__device__ __forceinline__ int mmq_group_rounds(int g, int nch) { return g < nch ? (nch - 1 - g) / 4 + 1 : 0; }
__device__ __forceinline__ int mmq_lane_rounds(int v, int nu) { return v < nu ? (nu - 1 - v) / 128 + 1 : 0; }

// Group g's slab: chunk c = 4 r + g of every tile row into record (row, r) of the slab, from
// the 16-byte boundary at or below it (the record then starts (address & 15) bytes early),
// in 16-byte pieces, consecutive threads on consecutive pieces of one row's chunk.
template <int TA, int TB, int ROWS, int NT, int CHS>
__device__ __forceinline__ void mmq_load_slab(u8* slab, const u8* const* s_row, int g, int nu, int rmax) {
    constexpr int PM = CHS / 16;
    const int rg = mmq_group_rounds(g, (nu + 31) >> 5);
    const int n = ROWS * rg * PM;
    for (int e = threadIdx.x; e < n; e += NT) {
        const int q = e % PM, rr = e / PM, row = rr % ROWS, r = rr / ROWS, c = 4 * r + g;
        const bool isb = (row & 8) != 0;
        const int ch = isb ? MmqBlk<TB>::ch : MmqBlk<TA>::ch;
        const int be = isb ? MmqBlk<TB>::be : MmqBlk<TA>::be, bb = isb ? MmqBlk<TB>::bb : MmqBlk<TA>::bb;
        const int nbytes = min(32, nu - 32 * c) * 32 / be * bb;     // a partial last chunk: whole blocks
        const size_t src = (size_t)(s_row[row] + (size_t)c * ch);
        const size_t a0 = src & ~(size_t)15, a1 = (src + nbytes + 15) & ~(size_t)15;
        if (a0 + 16 * (size_t)q < a1)
            mmq_cp16(slab + ((size_t)row * rmax + r) * CHS + 16 * q, (const void*)(a0 + 16 * (size_t)q));
    }
}

// Lane v of leaf p in group g: the butterfly tree's leaf order
__device__ __forceinline__ int mmq_lane(int g, int p) { return 32 * g + (int)(__brev((u32)p) >> 27); }

// The weight stage of iteration it: for each warp set s2, the blocks (one per round r) of its
// leaf (group g = it / LS, leaf p = s2 LS + it % LS) of every tile row, expanded by q8w from the
// slab into est record (s2, r, row).
template <int TA, int TB, int ROWS, int NT, int CHS, int S>
__device__ __forceinline__ void mmq_stage_w(const u8* slab, u8* est, const u8* const* s_row, int it, int nu,
                                            int rmax) {
    constexpr int LS = 32 / S;
    const int g = it / LS;
    for (int r = 0; r < rmax; r++)
    for (int e = threadIdx.x; e < S * ROWS; e += NT) {       // divisions by constants only
        const int row = e % ROWS, s2 = e / ROWS;
        const int v = mmq_lane(g, s2 * LS + it % LS);
        if (r >= mmq_lane_rounds(v, nu)) continue;
        const int c = 4 * r + g;
        const bool isb = (row & 8) != 0;
        const size_t src = (size_t)(s_row[row] + (size_t)c * (isb ? MmqBlk<TB>::ch : MmqBlk<TA>::ch));
        const u8* chunk = slab + ((size_t)row * rmax + r) * CHS + (src & 15);
        Q8W W;
        if (TA == TB || !isb) q8w<TA>(chunk, v & 31, W);
        else q8w<TB>(chunk, v & 31, W);
        uint4* o = (uint4*)(est + ((size_t)(s2 * rmax + r) * ROWS + row) * MMQ_REC);
        o[0] = make_uint4((u32)W.q[0], (u32)W.q[1], (u32)W.q[2], (u32)W.q[3]);
        o[1] = make_uint4((u32)W.q[4], (u32)W.q[5], (u32)W.q[6], (u32)W.q[7]);
        o[2] = make_uint4(__float_as_uint(W.dw), __float_as_uint(W.mw), __float_as_uint(__int2float_rn(W.sa)),
                          __float_as_uint(__int2float_rn(W.sb)));
    }
}

// The input stage of iteration it: for each warp set s2, its leaf's blocks of the tile's batch
// rows (32 int8 bytes, then dx and sum x) copied into xst record (s2, r, m) (rows past B read row
// B - 1: their outputs are never stored). Needs no slab: issued two iterations ahead.
template <int MT, int NT, int S>
__device__ __forceinline__ void mmq_stage_x(u8* xst, int it, int nu, int rmax, const i8* __restrict__ xq, int ldx,
                                            const float2* __restrict__ xd, int ldd, int m0, int B) {
    constexpr int LS = 32 / S;
    const int g = it / LS;
    for (int r = 0; r < rmax; r++) {
        for (int e = threadIdx.x; e < 3 * S * MT; e += NT) {   // per record: two 16-byte pieces, the scales
            const int piece = e / (S * MT), m = e % MT, s2 = (e / MT) % S;
            const int v = mmq_lane(g, s2 * LS + it % LS);
            if (r >= mmq_lane_rounds(v, nu)) continue;
            const long long row = min(m0 + m, B - 1);
            u8* dst = xst + ((size_t)(s2 * rmax + r) * MT + m) * MMQ_REC;
            if (piece < 2) mmq_cp16(dst + 16 * piece, xq + row * ldx + 32 * (v + 128 * r) + 16 * piece);
            else mmq_cp8(dst + 32, xd + row * ldd + v + 128 * r);
        }
    }
}

// One round of a leaf for one warp: the MMAs of its 16 weight rows with its two n8 tiles of
// batch rows, mmq_tail, and each output's lane sum (acc, o = 4 t + 2 j + h).
template <int TA, int TB, int ROWS, int MT>
__device__ __forceinline__ void mmq_round(const u8* est, const u8* xst, int r, int wn, int wm, int gid, int tig,
                                          float (&acc)[8]) {
    constexpr bool SUB16 = Q8Traits<TA>::sub16 || Q8Traits<TB>::sub16;
    const u32* ea = (const u32*)(est + ((size_t)r * ROWS + 16 * wn + gid) * MMQ_REC);
    const u32* eb = (const u32*)(est + ((size_t)r * ROWS + 16 * wn + 8 + gid) * MMQ_REC);
    const u32 a0 = ea[tig], a1 = eb[tig], a2 = ea[4 + tig], a3 = eb[4 + tig];
    const uint4 sA = *(const uint4*)(ea + 8), sB = *(const uint4*)(eb + 8);
#pragma unroll
    for (int t = 0; t < 2; t++) {
        const u8* xr = xst + ((size_t)r * MT + 16 * wm + 8 * t) * MMQ_REC;
        const u32* xg = (const u32*)(xr + gid * MMQ_REC);
        const u32 b0 = xg[tig], b1 = xg[4 + tig];
        float cA[2], cB[2];                  // isum of (A row, column 2 tig + j) and (B row, ...), exactly
        if constexpr (SUB16) {
            // sa s0 + sb s1 can pass 2^22: the halves (|s| < 2^17) converted, then one exact fma
            // (|sb s1| and the sum are below 2^24, so every step is exact)
            int s0[4], s1[4];
            mmq_k16(s0, a0, a1, b0);
            mmq_k16(s1, a2, a3, b1);
#pragma unroll
            for (int j = 0; j < 2; j++) {
                cA[j] = Q8Traits<TA>::sub16
                    ? fmaf(__uint_as_float(sA.z), mmq_i2f(s0[j]), __fmul_rn(__uint_as_float(sA.w), mmq_i2f(s1[j])))
                    : mmq_i2f(s0[j] + s1[j]);
                cB[j] = Q8Traits<TB>::sub16
                    ? fmaf(__uint_as_float(sB.z), mmq_i2f(s0[2 + j]), __fmul_rn(__uint_as_float(sB.w), mmq_i2f(s1[2 + j])))
                    : mmq_i2f(s0[2 + j] + s1[2 + j]);
            }
        } else {
            int c[4];
            mmq_k32(c, a0, a1, a2, a3, b0, b1);
            cA[0] = mmq_i2f(c[0]); cA[1] = mmq_i2f(c[1]); cB[0] = mmq_i2f(c[2]); cB[1] = mmq_i2f(c[3]);
        }
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const float2 d = *(const float2*)(xr + (2 * tig + j) * MMQ_REC + 32);
            acc[4 * t + 2 * j] = __fadd_rn(acc[4 * t + 2 * j],
                                           mmq_tail<TA>(__uint_as_float(sA.x), __uint_as_float(sA.y), cA[j], d));
            acc[4 * t + 2 * j + 1] = __fadd_rn(acc[4 * t + 2 * j + 1],
                                               mmq_tail<TB>(__uint_as_float(sB.x), __uint_as_float(sB.y), cB[j], d));
        }
    }
}

// y = W . x over int8 rows: gemv<TA, TB, NB, MODE, WPP, PPW, 1>'s arguments and outputs (the
// same bits), 8 WN row pairs x 16 WM batch rows per block, S warp sets sharing each group's
// leaves (see above).
template <int TA, int TB, int MODE, int WN, int WM, int S>
__global__ void __launch_bounds__(32 * WN * WM * S) mmq(
    const u8* __restrict__ Wa, const u8* __restrict__ Wb, long long rba, long long rbb, int a_stride, int b_off,
    int n_pairs, int k, const float* __restrict__ x, int ldx, int B, const float* __restrict__ nw, float eps,
    const float* __restrict__ xs, const float* __restrict__ bias_a, const float* __restrict__ bias_b,
    float* __restrict__ y, int ldy,
    int row_base, int qd, int kd, int hd, int rope_half, int neox, int n_kv, int n_ctx,
    const int* __restrict__ tab_slot, const int* __restrict__ tab_pos,
    const float* __restrict__ rcos, const float* __restrict__ rsin, void* __restrict__ kc, void* __restrict__ vc,
    const float2* __restrict__ xd, int ldd)
{
    static_assert(Q8Traits<TA>::ok && Q8Traits<TB>::ok, "MMQ: both weight types have an integer form");
    static_assert(WN >= 1 && WN <= 4 && WM >= 1 && WM <= 4, "WN, WM in 1..4");
    static_assert(S == 1 || S == 2 || S == 4, "S is 1, 2 or 4");
    constexpr bool QKV = (MODE == M_QKV || MODE == M_QKV16);
    constexpr int NWT = WN * WM, NT = 32 * NWT * S, ROWS = 16 * WN, MT = 16 * WM, LS = 32 / S;
    constexpr int TOP = LS == 32 ? 3 : (LS == 16 ? 2 : 1);      // bits of q = t / 4 (t: a set's leaf, 0..LS-1)
    constexpr int CHS = MmqBlk<TA>::chs > MmqBlk<TB>::chs ? MmqBlk<TA>::chs : MmqBlk<TB>::chs;
    extern __shared__ __align__(16) u8 mmq_sm[];
    __shared__ const u8* s_row[ROWS];
    const int nu = k >> 5, rmax = (nu + 127) >> 7;
    const size_t esz = (size_t)S * rmax * ROWS * MMQ_REC, xsz = (size_t)S * rmax * MT * MMQ_REC;
    u8* slab = mmq_sm;
    u8* est = slab + (size_t)ROWS * rmax * CHS;        // 2 weight stages
    u8* xst = est + 2 * esz;                           // 3 input stages
    float* comb = (float*)(xst + 3 * xsz);             // S x NWT x 8 x 32 subtree sums (S > 1)
    const i8* xq = (const i8*)x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    const int set = warp / NWT, w2 = warp % NWT, wn = w2 % WN, wm = w2 / WN;
    const int m0 = blockIdx.x * MT, p0 = blockIdx.y * (8 * WN);
    if (threadIdx.x < ROWS) {          // tile row 16 w + 8 h + i: the A (h 0) or B (h 1) row of pair 8 w + i
        const int t = threadIdx.x;
        const int pr = min(p0 + 8 * (t >> 4) + (t & 7), n_pairs - 1);
        const PairRows r = pair_rows<QKV>(pr, a_stride, b_off, row_base, qd, kd, hd, rope_half, neox);
        s_row[t] = (t & 8) ? Wb + r.rb * rbb : Wa + r.ra * rba;
    }
    __syncthreads();
    float st[5][8], tot[8];
#pragma unroll
    for (int o = 0; o < 8; o++) {
        tot[o] = 0.f;
#pragma unroll
        for (int lv = 0; lv < 5; lv++) st[lv][o] = 0.f;
    }
    mmq_load_slab<TA, TB, ROWS, NT, CHS>(slab, s_row, 0, nu, rmax);
    mmq_stage_x<MT, NT, S>(xst, 0, nu, rmax, xq, ldx, xd, ldd, m0, B);
    mmq_stage_x<MT, NT, S>(xst + xsz, 1, nu, rmax, xq, ldx, xd, ldd, m0, B);
    mmq_commit();
    mmq_wait();
    __syncthreads();
    mmq_stage_w<TA, TB, ROWS, NT, CHS, S>(slab, est, s_row, 0, nu, rmax);
    __syncthreads();
    // 4 LS iterations, four at a time: in iteration it every warp set visits one leaf, t = it % LS
    // of its subtree; leaf t = 4 q + u closes 0, 1, 0 and 2 + tz(q) pending subtrees for u = 0..3
    // (tz: trailing one bits), so three of four merges are fixed at compile time
#pragma unroll 1
    for (int it4 = 0; it4 < 4 * LS; it4 += 4) {
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int it = it4 + u, g = it / LS, t = it % LS;
            const bool last = t == LS - 1;             // the group's last iteration
            // inputs two iterations ahead; the next iteration's weights (its group's slab is in
            // place), or at a group's last iteration the next group's slab (the slab is read by
            // expansions only, the last one done)
            if (it + 2 < 4 * LS)
                mmq_stage_x<MT, NT, S>(xst + ((it + 2) % 3) * xsz, it + 2, nu, rmax, xq, ldx, xd, ldd, m0, B);
            if (!last)
                mmq_stage_w<TA, TB, ROWS, NT, CHS, S>(slab, est + ((u + 1) & 1) * esz, s_row, it + 1, nu, rmax);
            else if (g < 3)
                mmq_load_slab<TA, TB, ROWS, NT, CHS>(slab, s_row, g + 1, nu, rmax);
            mmq_commit();
            // this iteration's leaf of the warp's set: lane v's sum of its blocks, from 0.f
            const int v = mmq_lane(g, set * LS + t);
            const int rv = mmq_lane_rounds(v, nu);
            const u8* eb = est + (u & 1) * esz + (size_t)set * rmax * ROWS * MMQ_REC;
            const u8* xb = xst + (it % 3) * xsz + (size_t)set * rmax * MT * MMQ_REC;
            float acc[8];
#pragma unroll
            for (int o = 0; o < 8; o++) acc[o] = 0.f;
            for (int r = 0; r < rv; r++) mmq_round<TA, TB, ROWS, MT>(eb, xb, r, wn, wm, gid, tig, acc);
            // the subtree: merge with the pending sums below level tz(t), keep the result at
            // level tz(t); at t = LS - 1 it is the set's subtree sum P
            if (u == 0 || u == 2) {
#pragma unroll
                for (int o = 0; o < 8; o++) st[0][o] = acc[o];
            } else if (u == 1) {
#pragma unroll
                for (int o = 0; o < 8; o++) st[1][o] = __fadd_rn(st[0][o], acc[o]);
            } else {
                const int tq = __ffs(~(t >> 2)) - 1;
#pragma unroll
                for (int o = 0; o < 8; o++) {
                    float xv = __fadd_rn(st[1][o], __fadd_rn(st[0][o], acc[o]));
                    if (TOP >= 1 && tq >= 1) xv = __fadd_rn(st[2][o], xv);
                    if (TOP >= 2 && tq >= 2) xv = __fadd_rn(st[3][o], xv);
                    if (TOP >= 3 && tq >= 3) xv = __fadd_rn(st[4][o], xv);
                    if (tq < TOP) {
                        if (tq == 0) st[2][o] = xv;
                        else if (tq == 1) st[3][o] = xv;
                        else st[4][o] = xv;
                    } else if (S == 1) {
                        tot[o] = g == 0 ? xv : __fadd_rn(tot[o], xv);       // R_g = P
                    } else {
                        comb[((set * NWT + w2) * 8 + o) * 32 + lane] = xv;
                    }
                }
            }
            if (last) mmq_wait();
            else asm volatile("cp.async.wait_group 1;" ::: "memory");    // all but this iteration's inputs
            __syncthreads();
            if (S > 1 && last && set == 0) {
                // R_g from the sets' subtrees, the tree's top levels: P0 + P1, or (P0 + P1) + (P2 + P3)
#pragma unroll
                for (int o = 0; o < 8; o++) {
                    const float* cb = comb + ((size_t)w2 * 8 + o) * 32 + lane;
                    float rg = __fadd_rn(cb[0], cb[NWT * 256]);
                    if (S == 4) rg = __fadd_rn(rg, __fadd_rn(cb[2 * NWT * 256], cb[3 * NWT * 256]));
                    tot[o] = g == 0 ? rg : __fadd_rn(tot[o], rg);
                }
            }
            if (last && g < 3) {               // the next group's first weight stage, from its slab
                mmq_stage_w<TA, TB, ROWS, NT, CHS, S>(slab, est + ((u + 1) & 1) * esz, s_row, it + 1, nu, rmax);
                __syncthreads();
            }
        }
    }
    // the epilogue (warp set 0): a thread holds pair 8 wn + gid's A and B sums for batch rows
    // 2 tig + j of its warp's two n8 tiles
    const int pr = p0 + 8 * wn + gid;
    if (set == 0 && pr < n_pairs) {
        const PairRows rows = pair_rows<QKV>(pr, a_stride, b_off, row_base, qd, kd, hd, rope_half, neox);
#pragma unroll
        for (int t = 0; t < 2; t++) {
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int b = m0 + 16 * wm + 8 * t + 2 * tig + j;
                if (b < B)
                    gemv_out<MODE>(tot[4 * t + 2 * j], tot[4 * t + 2 * j + 1], b, pr, rows, nw != nullptr,
                                   nw != nullptr ? xs[b] : 0.f, bias_a, bias_b, y, ldy, hd, rope_half, neox, n_kv,
                                   n_ctx, tab_slot, tab_pos, rcos, rsin, kc, vc);
            }
        }
    }
}
