"""The recurrent ops on the CPU (engine/backend/cpu/recurrent.py): the short convolution and
the gated delta rule against float64 numpy written from their definitions (ops.py), the
chunked prefill form against the recurrence (float32 tolerance), and the invariances the
runtime relies on, bit for bit: a row's logits do not depend on the other segments of its
batch; verify rows equal decode rows; a rolled-back verify window leaves the state a plain
decode would have; a prompt split at multiples of the chunk size gives the bits of one
piece; a segment that does not continue its slot's state is refused.
"""

from __future__ import annotations

import numpy as np
import pytest

from aotx.engine.backend.cpu import recurrent as R
from aotx.engine.model.batch import Segment


def _one(x):
    return np.array([x], np.int64)


def test_short_conv_carries_its_state_across_segments():
    """Rows fed in three segments (the conv state carries the last K-1 inputs) equal the
    float64 convolution of the whole sequence from zero state."""
    rng = np.random.default_rng(1)
    n, C, K = 23, 12, 4
    x = rng.standard_normal((n, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    state = np.zeros((2, K - 1, C), np.float32)
    out = np.empty((n, C), np.float32)
    for a, b in ((0, 2), (2, 3), (3, n)):           # a segment shorter than K - 1, one row, the rest
        part = np.empty((b - a, C), np.float32)
        R.conv_rows(x[a:b], w, state, _one(1), _one(0), _one(b - a), True, part)
        out[a:b] = part
    u = np.concatenate([np.zeros((K - 1, C)), x.astype(np.float64)])
    y = sum(w[:, j].astype(np.float64) * u[j:j + n] for j in range(K))
    want = y / (1 + np.exp(-y))
    assert np.abs(out - want).max() < 1e-5
    assert np.array_equal(state[1], x[n - K + 1:])   # the state: the last K-1 inputs
    assert not state[0].any()                        # another slot untouched


def test_short_conv_rows_in_parallel_give_the_serial_bits():
    """conv_rows_par (a long segment's rows on several threads) equals conv_rows bit for
    bit, outputs and carried state, with and without silu, over two segments."""
    rng = np.random.default_rng(4)
    n, C, K = 37, 72, 4
    x = (2 * rng.standard_normal((n, C))).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    state0 = rng.standard_normal((3, K - 1, C)).astype(np.float32)
    segs = (np.array([2, 0], np.int64), np.array([0, 30], np.int64), np.array([30, 7], np.int64))
    for silu in (True, False):
        (s1, o1), (s2, o2) = [(state0.copy(), np.zeros((n, C), np.float32)) for _ in range(2)]
        R.conv_rows(x, w, s1, *segs, silu, o1)
        R.conv_rows_par(x, w, s2, *segs, silu, o2)
        assert np.array_equal(o1.view(np.uint32), o2.view(np.uint32))
        assert np.array_equal(s1, s2)


def _delta_inputs(rng, n, Hk=2, H=4, S=16):
    q = rng.standard_normal((n, Hk * S)).astype(np.float32)
    k = rng.standard_normal((n, Hk * S)).astype(np.float32)
    for m in (q, k):
        m3 = m.reshape(n, Hk, S)
        m3 /= np.sqrt((m3.astype(np.float64) ** 2).sum(-1, keepdims=True)).astype(np.float32)
    v = rng.standard_normal((n, H * S)).astype(np.float32)
    al = rng.standard_normal((n, H)).astype(np.float32)
    be = rng.standard_normal((n, H)).astype(np.float32)
    a = -rng.uniform(0.2, 1.5, H).astype(np.float32)
    dtb = rng.standard_normal(H).astype(np.float32)
    return q, k, v, al, be, a, dtb


def _delta64(q, k, v, al, be, a, dtb, Hk, S0=None, grouped=False):
    """float64 recurrence from the definition (S[i][j]; key head h % Hk, or h // (H / Hk)
    when ``grouped``)."""
    n, H = al.shape
    S = v.shape[1] // H
    q3, k3, v3 = (m.astype(np.float64).reshape(n, -1, S) for m in (q, k, v))
    x = al.astype(np.float64) + dtb
    g = a * np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
    b = 1 / (1 + np.exp(-be.astype(np.float64)))
    out = np.zeros((n, H, S))
    states = np.zeros((H, S, S)) if S0 is None else S0.astype(np.float64).copy()
    for h in range(H):
        St = states[h]
        hk = h // (H // Hk) if grouped else h % Hk
        for t in range(n):
            St = np.exp(g[t, h]) * St
            d = b[t, h] * (v3[t, h] - St.T @ k3[t, hk])
            St = St + np.outer(k3[t, hk], d)
            out[t, h] = (St.T @ q3[t, hk]) / np.sqrt(S)
        states[h] = St
    return out.reshape(n, H * S), states


@pytest.mark.parametrize("grouped", [False, True])
def test_delta_recurrence_matches_float64(grouped):
    """Both key-head layouts: Qwen3.5's tiled (h % Hk) and Qwen3-Next's grouped (h // 2)."""
    rng = np.random.default_rng(2)
    n, Hk, H, S = 40, 2, 4, 16
    q, k, v, al, be, a, dtb = _delta_inputs(rng, n, Hk, H, S)
    M = np.zeros((H, S, S), np.float32)
    out = np.empty((n, H * S), np.float32)
    kmap = np.arange(H) // (H // Hk) if grouped else np.arange(H) % Hk
    R.delta_rows(q, k, v, al, be, a, dtb, M, 0, n, kmap, 1 / np.sqrt(S), out)
    want, states = _delta64(q, k, v, al, be, a, dtb, Hk, grouped=grouped)
    assert np.abs(out - want).max() < 1e-5 * np.abs(want).max() + 1e-6
    assert np.abs(M.transpose(0, 2, 1) - states).max() < 1e-5     # M[h, j, i] = S_h[i][j]


def test_chunked_delta_equals_the_recurrence_within_float32():
    """Two chunks of CHUNK positions from a non-zero state: the chunked form's outputs and
    final state agree with the recurrence to float32 rounding (not bit for bit)."""
    rng = np.random.default_rng(3)
    n, Hk, H, S, C = 2 * R.CHUNK, 2, 4, 16, R.CHUNK
    q, k, v, al, be, a, dtb = _delta_inputs(rng, n, Hk, H, S)
    M0 = (0.3 * rng.standard_normal((H, S, S))).astype(np.float32)
    M_rec, M_chk = M0.copy(), M0.copy()
    out_rec = np.empty((n, H * S), np.float32)
    R.delta_rows(q, k, v, al, be, a, dtb, M_rec, 0, n, np.arange(H) % Hk, 1 / np.sqrt(S), out_rec)
    heads = np.arange(H) % Hk
    out_chk = np.empty((n, H * S), np.float32)
    for c in range(0, n, C):
        rs = slice(c, c + C)
        g, b = R._gates(al[rs], be[rs], a, dtb)
        qh = np.ascontiguousarray(q[rs].reshape(C, Hk, S)[:, heads].transpose(1, 0, 2))
        kh = np.ascontiguousarray(k[rs].reshape(C, Hk, S)[:, heads].transpose(1, 0, 2))
        vh = np.ascontiguousarray(v[rs].reshape(C, H, S).transpose(1, 0, 2))
        o = np.empty((H, C, S), np.float32)
        R.delta_chunk(qh, kh, vh, np.ascontiguousarray(g.T), np.ascontiguousarray(b.T), M_chk, 1 / np.sqrt(S), o)
        out_chk[rs] = o.transpose(1, 0, 2).reshape(C, H * S)
    want, states = _delta64(q, k, v, al, be, a, dtb, Hk, S0=M0.transpose(0, 2, 1))
    scale = np.abs(want).max()
    assert np.abs(out_rec - want).max() < 2e-5 * scale
    assert np.abs(out_chk - want).max() < 2e-5 * scale
    assert np.abs(M_chk.transpose(0, 2, 1) - states).max() < 1e-4
    assert not np.array_equal(out_chk, out_rec)     # two algorithms: equal only to rounding


@pytest.mark.parametrize("S", [6, 16])
def test_delta_recurrence_row_by_row_equals_rows_at_once(S):
    """One row per call (decode) and every row in one call give the same bits; S = 6 runs
    the rows left over after the kernel's groups of four."""
    rng = np.random.default_rng(5)
    n, Hk, H = 9, 2, 4
    q, k, v, al, be, a, dtb = _delta_inputs(rng, n, Hk, H, S)
    kmap = np.arange(H) % Hk
    M1, M2 = (np.full((H, S, S), 0.1, np.float32) for _ in range(2))
    o1, o2 = np.empty((n, H * S), np.float32), np.empty((n, H * S), np.float32)
    R.delta_rows(q, k, v, al, be, a, dtb, M1, 0, n, kmap, 0.25, o1)
    for t in range(n):
        R.delta_rows(q, k, v, al, be, a, dtb, M2, t, t + 1, kmap, 0.25, o2)
    assert np.array_equal(o1.view(np.uint32), o2.view(np.uint32)) and np.array_equal(M1, M2)
    want, _ = _delta64(q, k, v, al, be, a, dtb, Hk, S0=np.full((H, S, S), 0.1))
    assert np.abs(o1 - want * 0.25 * np.sqrt(S)).max() < 1e-4 * np.abs(want).max() * np.sqrt(S)


def test_chunked_delta_bits_do_not_depend_on_blas_threads():
    """The chunked form under one BLAS thread (as the op runs it) gives the bits of numpy's
    default thread count."""
    from aotx.engine.backend.cpu.blas import one_thread

    rng = np.random.default_rng(6)
    H, C, S = 4, R.CHUNK, 32
    q, k = (rng.standard_normal((H, C, S)).astype(np.float32) / np.sqrt(S) for _ in range(2))
    v = rng.standard_normal((H, C, S)).astype(np.float32)
    g = -rng.uniform(0.0, 0.3, (H, C)).astype(np.float32)
    b = rng.uniform(0.0, 1.0, (H, C)).astype(np.float32)
    M0 = (0.1 * rng.standard_normal((H, S, S))).astype(np.float32)
    (M1, o1), (M2, o2) = [(M0.copy(), np.empty((H, C, S), np.float32)) for _ in range(2)]
    R.delta_chunk(q, k, v, g, b, M1, 0.2, o1)
    with one_thread():
        R.delta_chunk(q, k, v, g, b, M2, 0.2, o2)
    assert np.array_equal(o1.view(np.uint32), o2.view(np.uint32)) and np.array_equal(M1, M2)


# ---- through the tiny qwen35 model ------------------------------------------------------

@pytest.fixture(scope="module")
def q35(tiny_tokenizer, tmp_path_factory):
    """The tiny qwen35 file on the CPU with float32 activations (no tokenizer needed)."""
    from tests.models import qwen35

    from aotx.engine.backend.cpu.backend import CpuBackend
    from aotx.engine.model.architectures import qwen35 as arch
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.transformer import build

    path = qwen35.write(tmp_path_factory.mktemp("q35") / "qwen35.gguf", tiny_tokenizer)
    gf = GGUFFile.open(path)
    return build(ModelConfig.from_metadata(gf.metadata, str(path)), gf, CpuBackend(), arch)


def _ids(n, seed=4):
    return np.random.default_rng(seed).integers(0, 49152, n).astype(np.int32)


def test_a_rows_bits_do_not_depend_on_the_other_segments(q35):
    """Slot 0's prefill of 150 rows (two aligned chunks in the chunked form, ragged ends by
    the recurrence), then a decode row: the same bits alone and batched with other slots'
    prefill and decode segments."""
    ids, other = _ids(151), _ids(70, seed=5)
    kv = q35.new_kv_cache(3, 256, "f32")
    alone = q35.forward(ids[:150], [Segment(0, 0, 150, all_logits=True)], kv)
    alone_dec = q35.forward(ids[150:], [Segment(0, 150, 1)], kv)
    kv = q35.new_kv_cache(3, 256, "f32")
    q35.forward(other[:3], [Segment(2, 0, 3)], kv)
    both = q35.forward(np.concatenate([other[:64], ids[:150], other[3:4]]),
                       [Segment(1, 0, 64, all_logits=True), Segment(0, 0, 150, all_logits=True),
                        Segment(2, 3, 1)], kv)
    assert np.array_equal(both[64:214], alone)
    dec = q35.forward(np.concatenate([other[4:5], ids[150:]]), [Segment(2, 4, 1), Segment(0, 150, 1)], kv)
    assert np.array_equal(dec[1:], alone_dec)


def test_verify_rows_equal_decode_rows_and_rollback_is_exact(q35):
    """A verify window of 5 rows gives each row the bits of a plain decode step; rolled back
    to its first 2 rows, the state continues exactly as if only those 2 had been fed."""
    ids = _ids(40)
    kv = q35.new_kv_cache(2, 64, "f32")
    q35.forward(ids[:30], [Segment(0, 0, 30)], kv)
    steps = [q35.forward(ids[p:p + 1], [Segment(0, p, 1)], kv) for p in range(30, 37)]
    kv2 = q35.new_kv_cache(2, 64, "f32")
    q35.forward(ids[:30], [Segment(1, 0, 30)], kv2)
    window = q35.forward(ids[30:35], [Segment(1, 30, 5, all_logits=True)], kv2)
    assert np.array_equal(window, np.concatenate(steps[:5]))
    kv2.state.rollback(1, 32)                      # keep 30, 31: drafts 32.. rejected
    kv2.clear(1, 32, 35)
    assert kv2.state.position(1) == 32
    again = [q35.forward(ids[p:p + 1], [Segment(1, p, 1)], kv2) for p in range(32, 37)]
    assert np.array_equal(np.concatenate(again), np.concatenate(steps[2:]))


def test_prefill_split_at_chunk_multiples_gives_the_same_bits(q35):
    ids = _ids(200)
    kv = q35.new_kv_cache(2, 256, "f32")
    whole = q35.forward(ids, [Segment(0, 0, 200, all_logits=True)], kv)
    parts = [q35.forward(ids[a:b], [Segment(1, a, b - a, all_logits=True)], kv)
             for a, b in ((0, 64), (64, 192), (192, 200))]
    assert np.array_equal(np.concatenate(parts), whole)


def test_a_segment_must_continue_its_slots_state(q35):
    """A hybrid model's state cannot be trimmed like KV: a segment that starts anywhere but
    at the state's position (or 0) is refused before anything runs."""
    ids = _ids(20)
    kv = q35.new_kv_cache(1, 64, "f32")
    q35.forward(ids[:12], [Segment(0, 0, 12)], kv)
    with pytest.raises(ValueError, match="cannot be trimmed"):
        q35.forward(ids[8:10], [Segment(0, 8, 2)], kv)
    assert kv.state.position(0) == 12
    q35.forward(ids[:3], [Segment(0, 0, 3)], kv)   # position 0: a fresh sequence
    assert kv.state.position(0) == 3
