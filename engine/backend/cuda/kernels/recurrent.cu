// Hybrid models' recurrent layers (qwen35, qwen3next): the causal short convolution and its
// carried state, the gated delta rule as a recurrence, and the small row ops around them
// (l2_norm_rows, sigmoid_gate_rows, deinterleave_rows). Host side: cuda/recurrent.py.
//
// Rows and segments: a batch row r has a slot and a position (the row table, or the eager
// path's meta rows). A segment is a run of rows of one slot at consecutive positions,
// contiguous in the batch; row r continues row r - 1's segment when both have the same slot
// and pos[r] = pos[r - 1] + 1 (rec_continues). Rows of the slot ``skip_slot`` (a graph's
// padding rows: the scratch slot) are not computed: their outputs are written 0 and no state
// is touched. A segment starting at position 0 starts from a zero state (the slot's buffers
// are read as zero); any other start continues the slot's state (the host checked it stands
// there: cuda/recurrent.py ``CudaRecurrentState.begin``).
//
// State layouts (float32, per slot): the convolution's last K - 1 inputs (K - 1, C), row i
// the input at position p - (K - 1) + i (the CPU's layout); the delta rule's S_h per value
// head h as (H, S, S) with [h][i][j] = S_h[i][j] (i along the key, j along the value: the
// transpose of the CPU's M[h][j][i], so that thread j's loads over i are coalesced; the
// host transposes on snapshot and restore).
//
// Undo (rollback of a verify window): a segment of 2 .. REC_UNDO_ROWS rows copies the slot's
// state from before it into ``undo_pre`` and its input rows into ``undo_x`` / ``undo_in``
// (per slot, REC_UNDO_ROWS rows); the host's rollback puts the state back and runs the kept
// rows again through these same kernels (undo pointers 0), which reproduces their state bit
// for bit.
//
// Batch invariance: each (slot, channel) and each (slot, head) is computed by one thread /
// one block from that slot's state and its own segment's rows, in one fixed order whatever
// the other rows of the batch are or where the segment sits.

#define REC_UNDO_ROWS 16

// Row r continues row r - 1's segment.
__device__ __forceinline__ bool rec_continues(const int* __restrict__ slot, const int* __restrict__ pos, int r)
{
    return r > 0 && slot[r - 1] == slot[r] && pos[r - 1] + 1 == pos[r];
}

// out[r, c] = act(sum_{j<K} w[c, j] u[t-K+1+j][c]) for row r at offset t of its segment
// (u: the segment's rows of x, before them the slot's state, zero before position 0),
// summed in that order (ggml_ssm_conv; cpu/recurrent.py conv_rows). silu: 1 or 0. Reads the
// state only; conv_state updates it afterwards. Grid (ceil(C / 128), n_rows), 128 threads.
__global__ void __launch_bounds__(128) short_conv(const float* __restrict__ x, int ldx, const float* __restrict__ w,
                                                  int C, int K, const float* __restrict__ state,
                                                  const int* __restrict__ slot, const int* __restrict__ pos,
                                                  int n_rows, int skip_slot, int silu, float* __restrict__ out,
                                                  int ldo)
{
    const int c = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
    if (c >= C || r >= n_rows) return;
    const int s = slot[r];
    float acc = 0.f;
    if (s != skip_slot) {
        int back = 0;          // earlier rows of this segment, up to K - 1
        while (back < K - 1 && rec_continues(slot, pos, r - back)) back++;
        const bool fresh = back < K - 1 && pos[r - back] == 0;
        const float* st = state + (long long)s * (K - 1) * C;
        for (int j = 0; j < K; j++) {
            const int d = K - 1 - j;               // rows back from r
            float u;
            if (d <= back) u = x[(long long)(r - d) * ldx + c];
            else u = fresh ? 0.f : st[(long long)(K - 1 + back - d) * C + c];
            acc += u * w[(long long)c * K + j];
        }
        if (silu) acc = acc / (1.f + expf(-acc));
    }
    out[(long long)r * ldo + c] = acc;
}

// The convolution state after each segment: its last K - 1 inputs (the segment's rows, before
// them the old state), written by the thread of the segment's last row, ascending (old row
// i + n is read before row i + n is written). With undo_pre, a segment of 2 .. REC_UNDO_ROWS
// rows first keeps the old state and its input rows (undo_x: (n_slots, REC_UNDO_ROWS, C)).
// Grid (ceil(C / 128), n_rows), 128 threads.
__global__ void __launch_bounds__(128) conv_state(const float* __restrict__ x, int ldx, int C, int K,
                                                  float* __restrict__ state, const int* __restrict__ slot,
                                                  const int* __restrict__ pos, int n_rows, int skip_slot,
                                                  float* __restrict__ undo_pre, float* __restrict__ undo_x)
{
    const int c = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
    if (c >= C || r >= n_rows) return;
    const int s = slot[r];
    if (s == skip_slot || (r + 1 < n_rows && rec_continues(slot, pos, r + 1))) return;
    const int lim = K > REC_UNDO_ROWS ? K : REC_UNDO_ROWS;
    int n = 1;                 // the segment's rows, counted up to lim + 1
    while (n <= lim && rec_continues(slot, pos, r - n + 1)) n++;
    const bool fresh = n <= lim && pos[r - n + 1] == 0;
    float* st = state + (long long)s * (K - 1) * C;
    if (undo_pre != nullptr && n >= 2 && n <= REC_UNDO_ROWS) {
        float* up = undo_pre + (long long)s * (K - 1) * C;
        for (int i = 0; i < K - 1; i++) up[(long long)i * C + c] = fresh ? 0.f : st[(long long)i * C + c];
        float* ux = undo_x + (long long)s * REC_UNDO_ROWS * C;
        for (int t = 0; t < n; t++) ux[(long long)t * C + c] = x[(long long)(r - n + 1 + t) * ldx + c];
    }
    for (int i = 0; i < K - 1; i++) {
        const int src = n - (K - 1) + i;           // >= 0 whenever n was not counted to the end
        float u;
        if (src >= 0) u = x[(long long)(r - (K - 2) + i) * ldx + c];
        else u = fresh ? 0.f : st[(long long)(i + n) * C + c];
        st[(long long)i * C + c] = u;
    }
}

// The gated delta rule (ggml_gated_delta_net; cpu/recurrent.py delta_rows), one row at a time
// in order, per value head h and segment: block (h, first row of the segment), S threads;
// thread j owns column j of S_h, held in registers (``col``) from the segment's first row to
// its last; S, the head size, is the template argument (16, 32, 64, 128). Key head:
// h / (H / Hk) (grouped) or h % Hk (tiled). Per row:
//     g = a[h] softplus(alpha + dt_bias[h]) (softplus(x) = x above 20);  b = sigmoid(beta)
//     for each j: S[:, j] *= exp(g); d = (v_j - S[:, j].k) b; S[:, j] += k d; out_j = scale S[:, j].q
// each dot product summed over i in order, as the CPU does. q, k (rows, Hk*S) L2-normalised,
// v (rows, H*S), alpha, beta (rows, H) with their own leading dimensions. With undo_pre, a
// segment of 2 .. REC_UNDO_ROWS rows keeps the state before it and its inputs (undo_in: per
// slot REC_UNDO_ROWS rows of undo_ld floats: q (Hk*S), k (Hk*S), v (H*S), alpha (H), beta (H):
// the layout a rollback reads them back in).
template <int S>
__global__ void __launch_bounds__(S) delta_rule(const float* __restrict__ q, int ldq, const float* __restrict__ k,
                                                int ldk, const float* __restrict__ v, int ldv,
                                                const float* __restrict__ alpha, int lda,
                                                const float* __restrict__ beta, int ldb,
                                                const float* __restrict__ a, const float* __restrict__ dtb, int H,
                                                int Hk, int grouped, float scale,
                                                float* __restrict__ state, const int* __restrict__ slot,
                                                const int* __restrict__ pos, int n_rows, int skip_slot,
                                                float* __restrict__ undo_pre, float* __restrict__ undo_in,
                                                int undo_ld, float* __restrict__ out, int ldo)
{
    __shared__ float kq[2 * S];                // the row's key (0 .. S) and query (S .. 2S) of head hk
    __shared__ float gb[2];                    // exp(g), b
    const int h = blockIdx.x, r = blockIdx.y, j = threadIdx.x;
    if (r >= n_rows) return;
    const int s = slot[r];
    if (s == skip_slot) {
        out[(long long)r * ldo + h * S + j] = 0.f;
        return;
    }
    if (rec_continues(slot, pos, r)) return;   // run by the block of its segment's first row
    int n = 1;
    while (r + n < n_rows && rec_continues(slot, pos, r + n)) n++;
    const int rep = H / Hk;
    const int hk = grouped ? h / rep : h % Hk;
    const bool first_of_key = grouped ? (h % rep == 0) : (h < Hk);
    float* St = state + ((long long)s * H + h) * S * S;
    float col[S];                              // col[i] = S_h[i][j]
    const bool fresh = pos[r] == 0;
#pragma unroll
    for (int i = 0; i < S; i++) col[i] = fresh ? 0.f : St[(long long)i * S + j];
    if (undo_pre != nullptr && n >= 2 && n <= REC_UNDO_ROWS) {
        float* up = undo_pre + ((long long)s * H + h) * S * S;
#pragma unroll
        for (int i = 0; i < S; i++) up[(long long)i * S + j] = col[i];
        float* ui = undo_in + (long long)s * REC_UNDO_ROWS * undo_ld;
        const int kw = Hk * S;
        for (int t = 0; t < n; t++) {
            float* u = ui + (long long)t * undo_ld;
            const long long rr = r + t;
            if (first_of_key) {
                u[hk * S + j] = q[rr * ldq + hk * S + j];
                u[kw + hk * S + j] = k[rr * ldk + hk * S + j];
            }
            u[2 * kw + h * S + j] = v[rr * ldv + h * S + j];
            if (j == 0) {
                u[2 * kw + H * S + h] = alpha[rr * lda + h];
                u[2 * kw + H * S + H + h] = beta[rr * ldb + h];
            }
        }
    }
    for (int t = 0; t < n; t++) {
        const long long rr = r + t;
        kq[j] = k[rr * ldk + hk * S + j];
        kq[S + j] = q[rr * ldq + hk * S + j];
        if (j == 0) {
            const float xa = alpha[rr * lda + h] + dtb[h];
            const float sp = xa > 20.f ? xa : logf(1.f + expf(xa));
            gb[0] = expf(a[h] * sp);
            gb[1] = 1.f / (1.f + expf(-beta[rr * ldb + h]));
        }
        __syncthreads();
        const float eg = gb[0], bt = gb[1];
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < S; i++) {
            const float m = col[i] * eg;
            col[i] = m;
            sum += m * kq[i];
        }
        const float d = (v[rr * ldv + h * S + j] - sum) * bt;
        __syncthreads();                       // kq is read again below, not kept in registers (S = 128 fits)
        float o = 0.f;
#pragma unroll
        for (int i = 0; i < S; i++) {
            const float m = col[i] + kq[i] * d;
            col[i] = m;
            o += m * kq[S + i];
        }
        out[rr * ldo + h * S + j] = o * scale;
        __syncthreads();                       // every thread is done with kq before the next row's
    }
#pragma unroll
    for (int i = 0; i < S; i++) St[(long long)i * S + j] = col[i];
}

// out = x / sqrt(sum(x^2) + eps) over each hd chunk of a row (the sum in double, a fixed
// order: lane-strided partial sums, then the butterfly). Grid (width / hd, rows), 32 threads.
__global__ void __launch_bounds__(32) l2_norm_rows(const float* __restrict__ x, int ldx, float* __restrict__ out,
                                                   int ldo, int hd, float eps)
{
    const int h = blockIdx.x, r = blockIdx.y, lane = threadIdx.x;
    const float* xr = x + (long long)r * ldx + h * hd;
    double ss = 0.0;
    for (int d = lane; d < hd; d += 32) {
        const double e = (double)xr[d];
        ss += e * e;
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const double den = ss + (double)eps;
    const float f = den > 0.0 ? (float)(1.0 / sqrt(den)) : 0.f;
    float* orow = out + (long long)r * ldo + h * hd;
    for (int d = lane; d < hd; d += 32) orow[d] = xr[d] * f;
}

// out = x * sigmoid(g) = x / (1 + exp(-g)), element-wise over rows x w.
__global__ void __launch_bounds__(256) sigmoid_gate_rows(const float* __restrict__ x, int ldx,
                                                         const float* __restrict__ g, int ldg, float* __restrict__ out,
                                                         int ldo, int rows, int w)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * w) return;
    const int r = (int)(i / w), c = (int)(i % w);
    out[(long long)r * ldo + c] = x[(long long)r * ldx + c] / (1.f + expf(-g[(long long)r * ldg + c]));
}

// Output ``part`` of a deinterleave: out[r, h*hd + e] = x[r, (h*parts + part)*hd + e] for
// ``heads`` heads (Qwen3.5's query and gate, interleaved per head).
__global__ void __launch_bounds__(256) deinterleave_rows(const float* __restrict__ x, int ldx, float* __restrict__ out,
                                                         int ldo, int rows, int heads, int hd, int parts, int part)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int w = heads * hd;
    if (i >= (long long)rows * w) return;
    const int r = (int)(i / w), c = (int)(i % w);
    const int h = c / hd, e = c % hd;
    out[(long long)r * ldo + c] = x[(long long)r * ldx + (long long)(h * parts + part) * hd + e];
}
