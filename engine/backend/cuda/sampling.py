"""Sampling on the GPU: the sampler chain of ``runtime/sampling.py`` as one CUDA kernel.

Owns: the ``sample_rows`` kernel, the per-row sampler table it reads (the "device
tables" of DESIGN.md: sampling parameters, RNG key and counter, penalty
history), the publication records it writes, and the host helpers that fill the
table from a request's ``SamplerConfig`` / ``SamplerState`` (the runtime's objects, read by
attribute: a backend does not import the runtime). Leaves the order of
launches and the CUDA graph to ``cuda_llama.py`` and the bookkeeping of the sampler
state (step counter, history) to the runtime, which mirrors what the kernel did.

The chain is the host's, step for step (llama.cpp's default order, common/sampling.cpp):
repetition penalty on the distinct ids of the row's history (float32, in place, so the
logits then match the host's), then greedy argmax (ties to the lowest id) or: top-k by
radix select over order-preserving integer keys (4 passes of 8 bits) and a bitonic
sort of the k candidates by (logit descending, id ascending); probabilities at
temperature 1 in float64 for top-p (cumulative < top_p, plus one) and min-p
(p >= min_p * p_max); temperature; a draw with ``u`` from Philox4x64-10 keyed by
the request's seed at counter ``step + 1``, word 0, ``(x >> 11) * 2^-53``: exactly
``numpy.random.Generator(Philox(key=seed, counter=step)).random()`` (Salmon et al.
2011; numpy's ``_philox.pyx`` increments the counter before each block), so the
device and the host draw the same number for the same (seed, step). The float64
sums run sequentially in one thread; numpy sums pairwise, so a draw that lands
within a few ulps of a cumulative boundary may pick the neighbour: measure zero in
practice, and the tests compare thousands of draws.

A constrained row (the runtime's grammar state, ``runtime/constraints.py``) brings a token
bitmask: ``MaskTable.load`` copies the tick's masks to a device table and each row's
sampler-table words 16-17 hold the device address of its mask (0: none; ``fill_row`` reads
``mask_ptr`` from the row's state). The kernel first sets every logit the mask forbids to
-inf, then runs the chain unchanged: greedy picks the best allowed id, sampling draws among
allowed ones only, exactly as ``sampling.apply_mask`` does on the host. The address lives in
the table (uploaded every replay), not in the kernel's arguments, so captured graphs need
no change.

Limits (the runtime falls back to host sampling): top-k between 1 and ``K_MAX``
(1024) when sampling; a penalty window of at most ``H_MAX`` (256) tokens (staged in the
kernel's shared memory; each distinct id is penalized once, at its first place in the
window, whatever the vocabulary's size).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

# the runtime's sampling.SamplerConfig (frozen: temperature, top_k, top_p, min_p,
# repeat_penalty, repeat_last_n) and SamplerState (seed, step, history)
SamplerConfig = SamplerState = Any

K_MAX = 1024      # most top-k candidates the kernel sorts
H_MAX = 256       # most penalty-history tokens per row
P_WORDS = 18      # int32 words of one row of the sampler table (16, 17: the row's mask address)
REC_WORDS = 4     # int32 words of one publication record: tick, slot, position, token

MODE_SKIP, MODE_GREEDY, MODE_SAMPLE = 0, 1, 2

SRC = r"""
typedef unsigned int u32;
typedef unsigned long long u64;

#define K_MAX 1024
#define H_MAX 256
#define P_WORDS 18        // int32 words of one sampler-table row

// Philox4x64-10 (Random123), word 0 of the block at counter (c0, 0, 0, 0), key (k0, 0).
__device__ __forceinline__ u64 philox4x64_w0(u64 c0, u64 k0) {
    u64 c[4] = {c0, 0ull, 0ull, 0ull};
    u64 k[2] = {k0, 0ull};
    const u64 M0 = 0xD2E7470EE14C6C93ull, M1 = 0xCA5A826395121157ull;
    const u64 W0 = 0x9E3779B97F4A7C15ull, W1 = 0xBB67AE8584CAA73Bull;
#pragma unroll
    for (int r = 0; r < 10; r++) {
        if (r) { k[0] += W0; k[1] += W1; }
        const u64 lo0 = M0 * c[0], hi0 = __umul64hi(M0, c[0]);
        const u64 lo1 = M1 * c[2], hi1 = __umul64hi(M1, c[2]);
        const u64 n0 = hi1 ^ c[1] ^ k[0], n2 = hi0 ^ c[3] ^ k[1];
        c[0] = n0; c[1] = lo1; c[2] = n2; c[3] = lo0;
    }
    return c[0];
}

__device__ __forceinline__ u32 okey(float f) {      // order-preserving: larger float, larger key
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// a comes before b: larger logit first, then lower id
__device__ __forceinline__ bool before(float va, int ia, float vb, int ib) {
    return va > vb || (va == vb && ia < ib);
}

// exclusive block scan of one int per thread (1024 threads); returns the thread's offset, *total the sum
__device__ int block_scan(int v, int* sh, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) { int y = __shfl_up_sync(0xffffffffu, x, o); if (lane >= o) x += y; }
    if (lane == 31) sh[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = sh[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) { int y = __shfl_up_sync(0xffffffffu, w, o); if (lane >= o) w += y; }
        sh[lane] = w;          // inclusive per warp
    }
    __syncthreads();
    const int base = warp ? sh[warp - 1] : 0;
    *total = sh[31];
    __syncthreads();
    return base + x - v;
}

// One block of 1024 threads per row b. prm: int32 (B, P_WORDS):
//   [0] mode (0 skip, 1 greedy, 2 sample)  [1] top_k  [2] n_hist  [3] tick
//   [4] penalty (float)  [6,7] temperature (double)  [8,9] top_p (double)  [10,11] min_p (double)
//   [12,13] seed (u64)  [14,15] step (u64): draws the request made before this one
//   [16,17] device address (u64) of the row's token bitmask (u32 words, bit i%32 of word i/32 set:
//   id i allowed), 0 for none: forbidden logits become -inf before anything else
// hist: int32 (B, H_MAX) the last repeat_last_n tokens (duplicates allowed). tab_slot / tab_pos: slot and position per
// batch row; out_idx (or null: the identity) maps logits row b to its batch row.
// Writes ids[b] (-1 for a skipped row) and rec[b] = {tick, slot, pos, token}.
extern "C" __global__ void __launch_bounds__(1024) sample_rows(
    float* __restrict__ logits, int ld, int V, const int* __restrict__ prm, const int* __restrict__ hist,
    const int* __restrict__ tab_slot, const int* __restrict__ tab_pos, const int* __restrict__ out_idx,
    int* __restrict__ ids, int* __restrict__ rec)
{
    __shared__ float cv[K_MAX];
    __shared__ int ci[K_MAX];
    __shared__ double pd[K_MAX];
    __shared__ int hbin[256];
    __shared__ int sh[32];
    __shared__ u32 s_prefix, s_mask;
    __shared__ int s_remaining, s_tok;
    __shared__ float sv[32];
    __shared__ int si[32];
    const int b = blockIdx.x, t = threadIdx.x;
    const int* P = prm + (long long)b * P_WORDS;
    const int mode = P[0];
    if (mode == 0) {
        if (t == 0) ids[b] = -1;
        return;
    }
    float* r = logits + (long long)b * ld;
    const u64 mask_addr = ((u64)(u32)P[17] << 32) | (u32)P[16];
    if (mask_addr) {                      // constrained decoding: forbidden ids out first
        const u32* M = (const u32*)mask_addr;
        for (int i = t; i < V; i += blockDim.x)
            if (!((M[i >> 5] >> (i & 31)) & 1u)) r[i] = -__int_as_float(0x7f800000);
        __syncthreads();
    }
    const float pen = __int_as_float(P[4]);
    if (pen != 1.0f) {                    // once per distinct id: at its first place in the window
        int* hs = (int*)pd;               // the window staged in shared memory (H_MAX ints; pd is free here)
        const int nh = min(P[2], H_MAX);
        for (int i = t; i < nh; i += blockDim.x) hs[i] = hist[(long long)b * H_MAX + i];
        __syncthreads();
        for (int i = t; i < nh; i += blockDim.x) {
            const int id = hs[i];
            bool first = id >= 0 && id < V;
            for (int j = 0; j < i && first; j++) first = hs[j] != id;
            if (first) { const float v = r[id]; r[id] = v > 0.f ? v / pen : v * pen; }
        }
        __syncthreads();
    }
    if (mode == 1) {                      // greedy: first index of the largest
        float best = -3.0e38f; int bi = 0x7fffffff;
        for (int i = t; i < V; i += blockDim.x) { const float v = r[i]; if (v > best) { best = v; bi = i; } }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
        if ((t & 31) == 0) { sv[t >> 5] = best; si[t >> 5] = bi; }
        __syncthreads();
        if (t < 32) {
            best = sv[t]; bi = si[t];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, best, o);
                const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
            }
            if (t == 0) s_tok = bi;
        }
        __syncthreads();
    } else {
        const int K = min(min(P[1], K_MAX), V);
        // ---- radix select: the key of the K-th largest logit
        if (t == 0) { s_prefix = 0u; s_mask = 0u; s_remaining = K; }
        for (int shift = 24; shift >= 0; shift -= 8) {
            if (t < 256) hbin[t] = 0;
            __syncthreads();
            const u32 prefix = s_prefix, mask = s_mask;
            // warp-aggregated counts: logits crowd into a few digits (the exponent bits),
            // so one atomic per distinct digit per warp instead of one per element
            const int n_iter = (V + blockDim.x - 1) / blockDim.x * blockDim.x;
            for (int i = t; i < n_iter; i += blockDim.x) {
                int bin = -1;
                if (i < V) { const u32 key = okey(r[i]); if ((key & mask) == prefix) bin = (int)((key >> shift) & 255u); }
                const unsigned peers = __match_any_sync(0xffffffffu, bin);
                if (bin >= 0 && (t & 31) == __ffs(peers) - 1) atomicAdd(&hbin[bin], __popc(peers));
            }
            __syncthreads();
            if (t < 32) {                 // lane l holds digits 255-8l .. 248-8l, highest first
                int c = 0;
#pragma unroll
                for (int j = 0; j < 8; j++) c += hbin[255 - 8 * t - j];
                int inc = c;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) { int y = __shfl_up_sync(0xffffffffu, inc, o); if (t >= o) inc += y; }
                const int rem = s_remaining;
                const int before_me = inc - c;
                const unsigned hit = __ballot_sync(0xffffffffu, inc >= rem);
                const int first = __ffs(hit) - 1;
                if (t == first) {
                    int cum = before_me;
                    for (int j = 0; j < 8; j++) {
                        const int d = 255 - 8 * t - j;
                        if (cum + hbin[d] >= rem) {
                            s_prefix = prefix | ((u32)d << shift);
                            s_mask = mask | (255u << shift);
                            s_remaining = rem - cum;
                            break;
                        }
                        cum += hbin[d];
                    }
                }
            }
            __syncthreads();
        }
        const u32 kth = s_prefix;
        const int need_eq = s_remaining;  // ties at the threshold to take, lowest ids first
        // ---- gather the K candidates in id order (contiguous chunk per thread)
        const int chunk = (V + blockDim.x - 1) / blockDim.x;
        const int i0 = min(V, t * chunk), i1 = min(V, i0 + chunk);
        int n_gt = 0, n_eq = 0;
        for (int i = i0; i < i1; i++) { const u32 key = okey(r[i]); n_gt += key > kth; n_eq += key == kth; }
        int tot_gt, tot_eq;
        int o_gt = block_scan(n_gt, sh, &tot_gt);
        int o_eq = block_scan(n_eq, sh, &tot_eq);
        for (int i = i0; i < i1; i++) {
            const float v = r[i];
            const u32 key = okey(v);
            if (key > kth) { cv[o_gt] = v; ci[o_gt] = i; o_gt++; }
            else if (key == kth) {
                if (o_eq < need_eq) { cv[tot_gt + o_eq] = v; ci[tot_gt + o_eq] = i; }
                o_eq++;
            }
        }
        __syncthreads();
        if (t >= K) { cv[t] = -__int_as_float(0x7f800000); ci[t] = 0x7fffffff; }
        __syncthreads();
        // ---- bitonic sort of K_MAX entries: logit descending, id ascending
        for (int k = 2; k <= K_MAX; k <<= 1) {
            for (int j = k >> 1; j > 0; j >>= 1) {
                const int l = t ^ j;
                if (l > t) {
                    const bool asc = (t & k) == 0;   // "ascending" in the before() order
                    const bool lb = before(cv[l], ci[l], cv[t], ci[t]);
                    if (asc ? lb : !lb) {
                        const float fv = cv[t]; cv[t] = cv[l]; cv[l] = fv;
                        const int fi = ci[t]; ci[t] = ci[l]; ci[l] = fi;
                    }
                }
                __syncthreads();
            }
        }
        // ---- probabilities at temperature 1 (float64), top-p, min-p, temperature, draw
        const double lg0 = (double)cv[0];
        if (t < K) pd[t] = exp((double)cv[t] - lg0);
        __syncthreads();
        if (t == 0) {
            const double temp = __hiloint2double(P[7], P[6]);
            const double top_p = __hiloint2double(P[9], P[8]);
            const double min_p = __hiloint2double(P[11], P[10]);
            const u64 seed = ((u64)(u32)P[13] << 32) | (u32)P[12];
            const u64 step = ((u64)(u32)P[15] << 32) | (u32)P[14];
            double s = 0.0;
            for (int i = 0; i < K; i++) s += pd[i];
            int keep = K;
            if (top_p < 1.0) {
                double c = 0.0; int n = 0;
                for (int i = 0; i < K; i++) { c += pd[i] / s; if (c < top_p) n++; else break; }
                keep = min(keep, n + 1);
            }
            if (min_p > 0.0) {
                const double p0 = pd[0] / s;
                int n = 0;
                for (int i = 0; i < K; i++) n += (pd[i] / s >= min_p * p0);
                keep = min(keep, max(1, n));
            }
            double qs = 0.0;
            for (int i = 0; i < keep; i++) { pd[i] = exp(((double)cv[i] - lg0) / temp); qs += pd[i]; }
            double c = 0.0;
            for (int i = 0; i < keep; i++) { c += pd[i] / qs; pd[i] = c; }
            const u64 x = philox4x64_w0(step + 1ull, seed);
            const double u = (double)(x >> 11) * (1.0 / 9007199254740992.0);
            const double target = u * pd[keep - 1];
            int idx = 0;
            while (idx < keep && pd[idx] <= target) idx++;
            s_tok = ci[min(idx, keep - 1)];
        }
        __syncthreads();
    }
    if (t == 0) {
        const int tok = s_tok;
        ids[b] = tok;
        int* R = rec + (long long)b * 4;
        const int src = out_idx ? out_idx[b] : b;
        R[0] = P[3]; R[1] = tab_slot[src]; R[2] = tab_pos[src]; R[3] = tok;
    }
}
"""


def device_ok(cfg: SamplerConfig, n_drafts: int = 0) -> bool:
    """Whether ``sample_rows`` computes exactly what ``sampling.sample`` would for a row
    of this request (else the runtime samples on the host from copied logits)."""
    if cfg.temperature <= 0.0:
        return n_drafts == 0 or cfg.repeat_penalty == 1.0
    if n_drafts:
        return False          # speculative sampling's acceptance runs on the host
    return 0 < cfg.top_k <= K_MAX and (cfg.repeat_penalty == 1.0 or 0 <= cfg.repeat_last_n)


@functools.lru_cache(maxsize=512)
def _template(cfg: SamplerConfig) -> np.ndarray:
    """The request-constant words of a sampler-table row for ``cfg`` (read-only)."""
    prm = np.zeros(P_WORDS, np.int32)
    f = prm.view(np.float32)
    penalty = cfg.repeat_penalty != 1.0 and cfg.repeat_last_n != 0
    f[4] = np.float32(cfg.repeat_penalty if penalty else 1.0)
    if cfg.temperature <= 0.0:
        prm[0] = MODE_GREEDY
    else:
        prm[0] = MODE_SAMPLE
        prm[1] = cfg.top_k
        prm[6:12].view(np.float64)[:] = (cfg.temperature, cfg.top_p, cfg.min_p)
    prm.setflags(write=False)
    return prm


def fill_row(prm: np.ndarray, hist: np.ndarray, cfg: SamplerConfig | None, st: SamplerState | None,
             tick: int, extra_history=()) -> bool:
    """Write one row of the sampler table: ``prm`` (P_WORDS,) int32 view, ``hist`` (H_MAX,)
    int32 view. ``cfg`` None marks a row without output (skip). ``extra_history``: tokens
    already accepted in this tick before the row (greedy verify windows). Returns whether
    the row needs the history table (penalty on). Raises ValueError when the distinct
    penalty ids do not fit ``H_MAX`` (``fits_history`` says so beforehand)."""
    if cfg is None:
        prm[:] = 0
        return False
    prm[:] = _template(cfg)
    prm[3] = tick & 0x7FFFFFFF
    if prm[0] == MODE_SAMPLE:
        prm[12:16].view(np.uint64)[:] = (st.seed & ((1 << 64) - 1), st.step)
    mask_ptr = getattr(st, "mask_ptr", 0)
    if mask_ptr:
        prm[16:18].view(np.uint64)[0] = mask_ptr
    if cfg.repeat_penalty == 1.0 or cfg.repeat_last_n == 0:
        return False
    h = st.history[-cfg.repeat_last_n:] if cfg.repeat_last_n > 0 else st.history
    if extra_history:
        h = list(h) + list(extra_history)
        if cfg.repeat_last_n > 0:
            h = h[-cfg.repeat_last_n:]
    if len(h) > H_MAX:
        raise ValueError(f"a penalty window of {len(h)} tokens (the device table holds {H_MAX})")
    prm[2] = len(h)
    hist[:len(h)] = h
    return True


class MaskTable:
    """The device table of token bitmasks for one tick's constrained rows (grown as
    needed), with a pinned host mirror. ``load`` copies masks in and returns each row's
    device address for ``fill_row`` (``mask_ptr`` of the row's state). The copy is
    synchronous (pinned source): it is complete before the tick's graph or kernels
    launch, on whichever stream they run, and no earlier tick still reads the table (the
    model synchronizes at the end of every call)."""

    def __init__(self, vocab: int, rows: int = 64):
        self.words = (vocab + 31) // 32
        self.rows = 0
        self._grow(rows)

    def _grow(self, rows: int) -> None:
        import cupy as cp

        self.rows = rows
        self.dev = cp.zeros((rows, self.words), cp.int32)
        mem = cp.cuda.alloc_pinned_memory(rows * self.words * 4)
        self.host = np.frombuffer(mem, np.int32, rows * self.words).reshape(rows, self.words)

    @property
    def nbytes(self) -> int:
        return int(self.dev.nbytes)

    def load(self, masks: np.ndarray) -> list[int]:
        """Copy (n, words) int32 masks to the device; the device address of each row."""
        import cupy as cp

        n = int(masks.shape[0])
        if masks.shape[1] != self.words:
            raise ValueError(f"masks of {masks.shape[1]} words for a table of {self.words}")
        if n > self.rows:
            r = self.rows
            while r < n:
                r *= 2
            self._grow(r)
        self.host[:n] = masks
        cp.cuda.runtime.memcpy(self.dev.data.ptr, self.host.ctypes.data, n * self.words * 4,
                               cp.cuda.runtime.memcpyHostToDevice)
        base, step = self.dev.data.ptr, self.words * 4
        return [base + i * step for i in range(n)]


def fits_history(cfg: SamplerConfig, st: SamplerState) -> bool:
    """Whether the row's penalty window (plus a verify window's drafts) fits the device
    table."""
    if cfg.repeat_penalty == 1.0 or cfg.repeat_last_n == 0:
        return True
    n = min(cfg.repeat_last_n, len(st.history)) if cfg.repeat_last_n > 0 else len(st.history)
    return n <= H_MAX - 16
