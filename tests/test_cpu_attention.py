"""cpu_attention.attention_rows against float64 attention, and its batch invariance;
cpu_fdot's float16 conversions and exp against independent references.

Reference: softmax(q . K^T * scale) V in float64 over each row's window (the textbook
formula, Vaswani et al. 2017; grouped-query heads as Ainslie et al. 2023), K/V read as
the exact float32 of the cache. Tolerance 2e-6 relative (float32 arithmetic; observed
~3e-7). Invariance: a row's output is bit-identical alone and inside any batch, for
float32 and float16 caches, any window, any slot order, decode, verify or prefill rows."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aotx.engine.backend.cpu import attention as cpu_attention
from aotx.engine.backend.cpu import fdot as cpu_fdot

H, KV, HD, N_SLOTS, N_CTX = 6, 2, 40, 3, 96        # head_dim 40: a tail after 8-wide lanes


def _cache(rng, dtype: str):
    k = rng.standard_normal((N_SLOTS, KV, N_CTX, HD)).astype(np.float32)
    v = rng.standard_normal((N_SLOTS, KV, N_CTX, HD)).astype(np.float32)
    if dtype == "f16":
        return cpu_fdot.f32_to_f16(k), cpu_fdot.f32_to_f16(v)
    return k, v


def _as_f32(a: np.ndarray) -> np.ndarray:
    return a.view(np.float16).astype(np.float32) if a.dtype == np.uint16 else a


def reference(q, kc, vc, slots, lengths, scale, window, sinks=None) -> np.ndarray:
    kc, vc = _as_f32(kc).astype(np.float64), _as_f32(vc).astype(np.float64)
    out = np.zeros(q.shape)
    G = q.shape[1] // kc.shape[1]
    for i, (s, L) in enumerate(zip(slots, lengths)):
        lo = max(0, L - window) if window > 0 else 0
        for h in range(q.shape[1]):
            k, v = kc[s, h // G, lo:L], vc[s, h // G, lo:L]
            sc = k @ q[i, h].astype(np.float64) * scale
            if sinks is None:
                p = np.exp(sc - sc.max())
                out[i, h] = p @ v / p.sum()
            else:      # gpt-oss: the sink logit joins the softmax, with no value
                m = max(sc.max(), float(sinks[h]))
                p = np.exp(sc - m)
                out[i, h] = p @ v / (p.sum() + np.exp(float(sinks[h]) - m))
    return out


def run(q, kc, vc, slots, lengths, scale=0.17, window=0, sinks=None) -> np.ndarray:
    out = np.full(q.shape, np.nan, np.float32)
    assert cpu_attention.attention_rows(q, kc, vc, np.asarray(slots, np.int32), np.asarray(lengths, np.int32),
                                        scale, window, out, sinks) is out
    return out


@pytest.mark.parametrize("window", [0, 1, 7, 50])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_matches_float64_attention(dtype, window):
    rng = np.random.default_rng(window)
    kc, vc = _cache(rng, dtype)
    slots = [2, 0, 0, 0, 1, 2, 2]
    lengths = [96, 1, 2, 3, 40, 57, 58]
    q = rng.standard_normal((len(slots), H, HD)).astype(np.float32)
    got = run(q, kc, vc, slots, lengths, window=window)
    ref = reference(q, kc, vc, slots, lengths, 0.17, window)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-6


def test_window_and_heads_are_used():
    """Guards the reference test: another window, or heads mapped to the wrong KV head,
    would be visible at its tolerance."""
    rng = np.random.default_rng(1)
    kc, vc = _cache(rng, "f32")
    q = rng.standard_normal((1, H, HD)).astype(np.float32)
    got = run(q, kc, vc, [1], [80], window=20)
    assert np.abs(got - reference(q, kc, vc, [1], [80], 0.17, 0)).max() > 1e-3
    swapped = reference(q[:, ::-1].copy(), kc, vc, [1], [80], 0.17, 20)[:, ::-1]
    assert np.abs(got - swapped).max() > 1e-3


@st.composite
def batches(draw):
    """A batch as the runtime builds one: segments of consecutive positions, at most one
    per slot, each a decode row, a verify window or a prefill chunk."""
    slots = draw(st.permutations(range(N_SLOTS)))[:draw(st.integers(1, N_SLOTS))]
    rows_s, rows_l = [], []
    for s in slots:
        n = draw(st.sampled_from([1, 1, 2, 5, 17, 40]))
        end = draw(st.integers(n, N_CTX))
        rows_s += [s] * n
        rows_l += list(range(end - n + 1, end + 1))
    return rows_s, rows_l, draw(st.sampled_from([0, 0, 1, 9, 33])), draw(st.sampled_from(["f32", "f16"]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.integers(0, 2 ** 32 - 1))
def test_every_row_equals_itself_alone(batch, seed):
    slots, lengths, window, dtype = batch
    rng = np.random.default_rng(seed)
    kc, vc = _cache(rng, dtype)
    q = rng.standard_normal((len(slots), H, HD)).astype(np.float32)
    got = run(q, kc, vc, slots, lengths, window=window)
    for i in range(len(slots)):
        np.testing.assert_array_equal(got[i:i + 1], run(q[i:i + 1], kc, vc, slots[i:i + 1], lengths[i:i + 1],
                                                        window=window))


@pytest.mark.parametrize("window", [0, 70])
@pytest.mark.parametrize("length", [1, 31, 32, 33, 1001])
def test_a_decode_row_over_float16_by_chunks_has_the_bits_of_a_prefill_row(length, window):
    """A one-row job over a float16 cache converts its history CHUNK positions at a time
    (`_rows_half_chunks`); a job of several rows converts the whole span first. The same
    row gives the same bits both ways, and float64's result."""
    rng = np.random.default_rng(length)
    hd, n_ctx = 64, 1024
    kc = cpu_fdot.f32_to_f16(rng.standard_normal((1, KV, n_ctx, hd)).astype(np.float32))
    vc = cpu_fdot.f32_to_f16(rng.standard_normal((1, KV, n_ctx, hd)).astype(np.float32))
    q = rng.standard_normal((3, H, hd)).astype(np.float32)
    lengths = [max(1, length - 2), max(1, length - 1), length]     # a prefill's last rows
    block = run(q, kc, vc, [0, 0, 0], lengths, window=window)
    alone = run(q[2:], kc, vc, [0], [length], window=window)
    np.testing.assert_array_equal(alone, block[2:])
    ref = reference(q[2:], kc, vc, [0], [length], 0.17, window)
    assert np.abs(alone - ref).max() / np.abs(ref).max() < 2e-6


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_sinks_match_float64_and_stay_row_invariant(dtype):
    """Attention sinks (gpt-oss): per-head logits in the softmax denominator. Sinks above
    and below the scores, a decode row and a prefill run; each row equals itself alone."""
    rng = np.random.default_rng(5)
    kc, vc = _cache(rng, dtype)
    sinks = np.array([-3.0, 0.0, 2.5, 8.0, -0.5, 1.0], np.float32)
    slots = [1] + [0] * 12
    lengths = [50] + list(range(20, 32))
    q = rng.standard_normal((len(slots), H, HD)).astype(np.float32)
    got = run(q, kc, vc, slots, lengths, window=9, sinks=sinks)
    ref = reference(q, kc, vc, slots, lengths, 0.17, 9, sinks)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-6
    plain = reference(q, kc, vc, slots, lengths, 0.17, 9)
    assert np.abs(ref - plain).max() > 1e-2                  # the sinks changed the result
    for i in (0, 5):
        np.testing.assert_array_equal(got[i:i + 1], run(q[i:i + 1], kc, vc, slots[i:i + 1], lengths[i:i + 1],
                                                        window=9, sinks=sinks))
    with pytest.raises(ValueError, match="sinks has 2 entries"):
        run(q, kc, vc, slots, lengths, sinks=sinks[:2])


def test_store_rows_rounds_float16_to_nearest_even():
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((4, KV, HD)).astype(np.float32)
    for dtype in (np.float32, np.uint16):
        cache = np.zeros((N_SLOTS, KV, N_CTX, HD), dtype)
        cpu_attention.store_rows(cache, np.zeros_like(cache), rows, rows, np.full(4, 2, np.int32),
                                 np.arange(10, 14, dtype=np.int32))
        got = _as_f32(cache[2, :, 10:14]).transpose(1, 0, 2)
        want = rows if dtype == np.float32 else rows.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(got, want)
        assert not cache[:2].any() and not cache[2, :, :10].any() and not cache[2, :, 14:].any()


# ------------------------------------------------------------------ cpu_fdot

@pytest.mark.parametrize("mode", [cpu_fdot.PORTABLE, pytest.param(
    cpu_fdot.F16C, marks=pytest.mark.skipif(not cpu_fdot.host_has_f16c(), reason="CPU without F16C"))],
    ids=["portable", "f16c"])
def test_f16_to_f32_is_exact_for_every_pattern(mode):
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    want = np.array([struct.unpack("<e", struct.pack("<H", int(b)))[0] for b in bits], np.float32)
    got = cpu_fdot.f16_to_f32(bits, mode)
    nan = np.isnan(want)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.isnan(got[nan]).all()
    np.testing.assert_array_equal(cpu_fdot.f16_to_f32(bits[:13], mode), want[:13])   # the 8-wide tail


def test_f32_to_f16_rounds_to_nearest_even():
    """Against Python's struct 'e' (IEEE binary16, round-half-even), on values that tie
    exactly between two halves, subnormals, overflow and random floats."""
    rng = np.random.default_rng(4)
    h = np.arange(0, 0x7BFF, 37, dtype=np.uint16)
    lo = h.view(np.float16).astype(np.float64)
    hi = (h + 1).view(np.float16).astype(np.float64)
    x = np.concatenate([((lo + hi) / 2).astype(np.float32), rng.standard_normal(5000).astype(np.float32) * 300,
                        np.float32([6.1e-5, 3e-8, 65519.0, 65520.0, 1e6, -0.0])])
    x = np.concatenate([x, -x])
    want = np.array([struct.unpack("<H", struct.pack("<e", float(v)))[0] if abs(v) < 65520 else
                     (0xFC00 if v < 0 else 0x7C00) for v in x], np.uint16)
    np.testing.assert_array_equal(cpu_fdot.f32_to_f16(x), want)


def test_exp_nonpos_within_two_ulp():
    from numba import njit

    @njit
    def ex(x, out):
        for i in range(x.size):
            out[i] = cpu_fdot.exp_nonpos(x[i])

    x = -np.linspace(0, 87, 400001).astype(np.float32)
    out = np.empty_like(x)
    ex(x, out)
    ref = np.exp(x.astype(np.float64))
    assert out[0] == 1.0
    assert (np.abs(out - ref) / np.spacing(ref.astype(np.float32))).max() <= 2.0
