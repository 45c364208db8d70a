"""A CPU model of the decode GEMV's reductions (cuda_src.py), float32 bit for bit.

The GEMV's batch invariance rests on every variant forming the same sums in the same
order. Two pieces of that order are easy to get wrong in the kernel's index arithmetic and
cannot run here: the butterfly done as a reduce-scatter (``warp_sum_scatter``: which lane
ends with which value, and that its bits are ``warp_sum``'s) and the per-block norm
prologue over all NB rows at once (``rows_scale``: the same bits as ``row_ss``). This
models both, stage for stage as the CUDA code is written, with numpy float32 adds, and
checks them against the plain forms on random data (the GPU tests check the kernels
themselves: tests/test_cuda_invariance.py).
"""

from __future__ import annotations

import numpy as np
import pytest

f32 = np.float32


def warp_sum(vals: np.ndarray) -> np.ndarray:
    """warp_sum: ``vals`` (32,) one value per lane; every lane's result (32,)."""
    v = vals.astype(f32).copy()
    for o in (16, 8, 4, 2, 1):
        v = (v + v[np.arange(32) ^ o]).astype(f32)
    return v


def warp_sum_scatter(v: np.ndarray) -> np.ndarray:
    """warp_sum_scatter<V> as cuda_src writes it: ``v`` (32 lanes, V) -> (32,) = v[0] per lane."""
    v = v.astype(f32).copy()
    V = v.shape[1]
    lanes = np.arange(32)
    for o in (16, 8, 4, 2):                       # ws_full<V, O> for O >= V
        if o >= V:
            v = (v + v[lanes ^ o]).astype(f32)
    for o in (16, 8, 4, 2, 1):                    # ws_half<V, O> for O < V
        if o >= V:
            continue
        up = (lanes & o) != 0
        new = v.copy()
        for i in range(o):
            send = np.where(up, v[:, i], v[:, i + o])
            keep = np.where(up, v[:, i + o], v[:, i])
            new[:, i] = (keep + send[lanes ^ o]).astype(f32)
        v = new
    return v[:, 0]


@pytest.mark.parametrize("nb", [1, 2, 4, 8, 16])
def test_reduce_scatter_gives_lane_l_the_butterfly_bits_of_value_l(nb):
    rng = np.random.default_rng(nb)
    V = 2 * nb
    for _ in range(20):
        vals = (rng.standard_normal((32, V)) * 10.0 ** rng.integers(-3, 4, (32, V))).astype(f32)
        got = warp_sum_scatter(vals)
        for lane in range(32):
            ref = warp_sum(vals[:, lane & (V - 1)])
            assert np.all(ref == ref[0])
            assert got[lane].tobytes() == ref[0].tobytes(), (nb, lane)
        # the epilogue: lane j < NB holds A of row j, its partner lane j ^ NB (= j + NB) holds B
        for j in range(nb):
            assert got[j].tobytes() == warp_sum(vals[:, j])[0].tobytes()
            assert got[j ^ nb].tobytes() == warp_sum(vals[:, nb + j])[0].tobytes()


def row_ss(xr: np.ndarray) -> f32:
    """row_ss: 128 threads, thread t takes elements t, t + 128, ... (fmaf), butterfly per
    warp, then the 4 warp sums in order."""
    k = xr.shape[0]
    part = np.zeros(128, f32)
    for t in range(128):
        acc = f32(0)
        for e in range(t, k, 128):
            acc = f32(np.float64(xr[e]) * np.float64(xr[e]) + np.float64(acc))   # fmaf: one rounding
        part[t] = acc
    red = [warp_sum(part[32 * w:32 * w + 32])[0] for w in range(4)]
    t_ = red[0]
    for w in (1, 2, 3):
        t_ = f32(t_ + red[w])
    return t_


def rows_scale_ss(x: np.ndarray, b0: int, nb_valid: int, NB: int) -> list:
    """rows_scale<NB>'s sums as cuda_src writes it: per thread NB chains in one pass over e
    (rows past the batch repeat the last one), butterfly per row, red[j][warp], then
    thread j adds red[j][0..3] in order."""
    k = x.shape[1]
    ss = np.zeros((128, NB), f32)
    for t in range(128):
        for e in range(t, k, 128):
            for j in range(NB):
                v = x[b0 + min(j, nb_valid - 1), e]
                ss[t, j] = f32(np.float64(v) * np.float64(v) + np.float64(ss[t, j]))
    out = []
    for j in range(NB):
        red = [warp_sum(ss[32 * w:32 * w + 32, j])[0] for w in range(4)]
        t_ = red[0]
        for w in (1, 2, 3):
            t_ = f32(t_ + red[w])
        out.append(t_)
    return out


@pytest.mark.parametrize("NB,k", [(1, 576), (4, 576), (4, 200), (16, 64)])
def test_rows_scale_prologue_has_row_ss_bits(NB, k):
    rng = np.random.default_rng(k + NB)
    x = (rng.standard_normal((NB + 3, k)) * 3).astype(f32)
    nb_valid = NB - 1 if NB > 1 else 1               # a partial block: the last row repeats
    got = rows_scale_ss(x, 2, nb_valid, NB)
    for j in range(NB):
        ref = row_ss(x[2 + min(j, nb_valid - 1)])
        assert got[j].tobytes() == ref.tobytes(), j
