"""Joined matmuls on the CPU (cpu_matmul.join_rows, cpu_program.join_linears) and the
one-call K/V store (cpu_attention.store_rows).

Regression: decode on the CPU was 0.86-0.89x the pre-port tree (64e403f) on the
default model; the time went to per-call overhead (seven matmul calls per block, each
quantizing the same activations again; a K/V store of four numpy operations per layer;
attention's argument checks per call), not to arithmetic. The program now joins q/k/v and
gate/up into one matmul each and stores K/V in one kernel. Both must give the numbers the
separate operations gave, bit for bit: the batch-invariance tests and every reference
rely on it.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from aotx.engine.backend.cpu import attention as cpu_attention
from aotx.engine.backend.cpu import matmul as cpu_matmul
from aotx.engine.backend.cpu import repack as cpu_repack
from aotx.engine.backend.cpu.program import CpuProgram
from aotx.engine.model.batch import BatchLayout, Segment

R = cpu_repack.R


def _matrix(qtype: T, m: int, k: int, seed: int) -> cpu_matmul.QuantMatrix:
    from tests.test_cpu_qdot import raw_weights   # random valid blocks of any type (gguf quantizes few)

    return cpu_matmul.QuantMatrix(raw_weights(qtype, m, k, np.random.default_rng(seed)), qtype, m, k, f"w{seed}")


# one type per integer kind: q4 (with and without offsets), q5, q8, q8x2
KINDS = [T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_1, T.Q8_0, T.IQ4_NL, T.Q6_K]


@pytest.mark.parametrize("qtype", KINDS, ids=lambda t: t.name)
def test_joined_rows_give_the_separate_matmuls_bit_for_bit(qtype):
    k = 256
    mats = [_matrix(qtype, m, k, seed) for seed, m in enumerate((2 * R, R, 40))]   # the last may be padded
    x = np.random.default_rng(9).standard_normal((5, k)).astype(np.float32)
    before = [[w.matmul(x[:n]) for w in mats] for n in (1, 2, 5)]
    j = cpu_matmul.join_rows(mats)
    assert j is not None and j.m == 2 * R + R + 40
    for n, want in zip((1, 2, 5), before):
        np.testing.assert_array_equal(j.matmul(x[:n]), np.concatenate(want, axis=1))
        bound = np.empty((n, j.m), np.float32)
        j.bound_matmul()(np.ascontiguousarray(x[:n]), bound)
        np.testing.assert_array_equal(bound, np.concatenate(want, axis=1))
        for w, y in zip(mats, want):           # the members are views of the joined tiles now
            np.testing.assert_array_equal(w.matmul(x[:n]), y)
    assert all(np.shares_memory(w._qs, j._qs) for w in mats)
    with pytest.raises(ValueError, match="no file rows"):
        j.rows(np.array([0]))


def test_rows_that_cannot_share_tiles_are_not_joined():
    k = 128
    assert cpu_matmul.join_rows([_matrix(T.Q4_0, R + 4, k, 1), _matrix(T.Q4_0, R, k, 2)]) is None   # padded tile
    assert cpu_matmul.join_rows([_matrix(T.Q4_0, R, k, 1), _matrix(T.Q8_0, R, k, 2)]) is None    # two kinds
    assert cpu_matmul.join_rows([_matrix(T.Q4_0, R, k, 1), _matrix(T.Q4_0, R, 2 * k, 2)]) is None
    f = cpu_matmul.QuantMatrix(np.ones((R, k), np.float32), T.F32, R, k, "f")
    assert cpu_matmul.join_rows([f, f]) is None                                                 # float path
    assert cpu_matmul.join_rows([_matrix(T.Q4_0, R, k, 1)]) is None


def _compare_joined(path) -> int:
    """Logits and KV of the joined program against the traced one, on a prefill of two
    segments then a decode batch; returns the number of joined runs."""
    from aotx.engine.model.loader import load_model

    lm = load_model(path, device="cpu")
    joined = lm.model.compiled
    plain = CpuProgram(joined.traced, join=False)
    toks = np.random.default_rng(0).integers(0, lm.config.vocab_size, 23).astype(np.int32)
    got = []
    for prog in (joined, plain):
        kv = prog.new_kv_cache(3, 64)
        a = prog.forward(toks, BatchLayout.of([Segment(0, 0, 17, all_logits=True), Segment(2, 0, 6)]), kv)
        b = prog.forward(toks[:3], BatchLayout.of([Segment(0, 17, 1), Segment(1, 0, 1), Segment(2, 6, 1)]), kv)
        got.append((a, b, [x.copy() for x in kv.k], [x.copy() for x in kv.v]))
    (a1, b1, k1, v1), (a2, b2, k2, v2) = got
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_array_equal(b1, b2)
    for x, y in zip(k1 + v1, k2 + v2):
        np.testing.assert_array_equal(x, y)
    return joined.joined


@pytest.mark.parametrize("qtype,d,ffn", [(T.Q4_0, 64, 96), (T.Q8_0, 64, 96), (T.Q6_K, 256, 512)],
                         ids=["Q4_0", "Q8_0", "Q6_K"])
def test_joined_llama_program_equals_the_traced_one(tiny_gguf, tmp_path, qtype, d, ffn):
    p = tiny_gguf.write_tiny_llama(tmp_path / "t.gguf", qtype=qtype, d_model=d, n_heads=4, n_kv_heads=2,
                                   ffn=ffn, seed=3)
    assert _compare_joined(p) == 2 * 2          # q/k/v and gate/up in both layers


@pytest.mark.parametrize("name", ["qwen2", "phi3", "gemma3", "qwen3"])
def test_joined_architectures_equal_the_traced_ones(tiny_model_path, name):
    """qwen2 joins biased q/k/v; phi3's q/k/v is one tensor already; gemma3 and qwen3 have
    norms between the projections and attention."""
    _compare_joined(tiny_model_path(name))


def test_the_default_model_joins_every_block(default_model_path):
    from aotx.engine.model.loader import load_model

    lm = load_model(default_model_path, device="cpu")
    assert lm.model.compiled.joined == 2 * lm.config.n_layers
    n_linear = sum(n.op == "linear" for n in lm.model.compiled.program.nodes)
    assert n_linear == 4 * lm.config.n_layers + 1   # qkv, o, gate+up, down per block; the head


# ------------------------------------------------------------------ the K/V store

def _halves(x: np.ndarray) -> np.ndarray:
    """IEEE binary16 bits of x by Python's struct 'e' (round half to even); overflow is inf."""
    out = []
    for v in x.astype(np.float64):
        if np.isnan(v):
            out.append(0x7E00)
        elif abs(v) >= 65520:
            out.append(0xFC00 if v < 0 else 0x7C00)
        else:
            out.append(struct.unpack("<H", struct.pack("<e", float(v)))[0])
    return np.array(out, np.uint16)


def test_store_rows_rounds_to_nearest_even_like_struct():
    rng = np.random.default_rng(5)
    h = np.arange(0, 0x7BFF, 29, dtype=np.uint16)
    lo, hi = h.view(np.float16).astype(np.float64), (h + 1).view(np.float16).astype(np.float64)
    x = np.concatenate([((lo + hi) / 2).astype(np.float32),                  # exact ties
                        (rng.standard_normal(3000) * 10.0 ** rng.integers(-9, 6, 3000)).astype(np.float32),
                        np.float32([0.0, 6.1e-5, 2 ** -24, 2 ** -25, 3 * 2 ** -26, 2 ** -14, 65504, 65519.9,
                                    65520, 1e30, np.inf])])
    x = np.concatenate([x, -x])
    n = x.size
    kc = np.zeros((2, 1, n + 3, 1), np.uint16)
    vc = np.zeros_like(kc)
    rows = x.reshape(n, 1, 1)
    cpu_attention.store_rows(kc, vc, rows, -rows, np.ones(n, np.int32), np.arange(n, dtype=np.int32) + 2)
    want = _halves(x)
    np.testing.assert_array_equal(kc[1, 0, 2:n + 2, 0], want)
    np.testing.assert_array_equal(vc[1, 0, 2:n + 2, 0], _halves(-x))
    assert not kc[0].any() and not kc[1, 0, :2].any()
    nan = np.zeros((1, 1, 1), np.float32) + np.nan
    cpu_attention.store_rows(kc, vc, nan, nan, np.zeros(1, np.int32), np.zeros(1, np.int32))
    assert np.isnan(kc[0, 0, 0, 0:1].view(np.float16)).all()


def test_store_rows_float32_and_strided_rows():
    rng = np.random.default_rng(6)
    fused = rng.standard_normal((4, 3 * 2 * 8)).astype(np.float32)    # a joined qkv output
    k, v = fused[:, 16:32].reshape(4, 2, 8), fused[:, 32:].reshape(4, 2, 8)
    for dt in (np.float32, np.uint16):
        kc = np.zeros((2, 2, 10, 8), dt)
        vc = np.zeros_like(kc)
        cpu_attention.store_rows(kc, vc, k, v, np.array([1, 1, 0, 1], np.int32), np.array([3, 4, 0, 9], np.int32))
        for r, (s, p) in enumerate(((1, 3), (1, 4), (0, 0), (1, 9))):
            want_k = k[r] if dt == np.float32 else k[r].astype(np.float16).view(np.uint16)
            want_v = v[r] if dt == np.float32 else v[r].astype(np.float16).view(np.uint16)
            np.testing.assert_array_equal(kc[s, :, p], want_k)
            np.testing.assert_array_equal(vc[s, :, p], want_v)


def test_store_rows_refuses_a_position_outside_the_cache():
    kc = np.zeros((1, 1, 4, 2), np.uint16)
    row = np.ones((1, 1, 2), np.float32)
    for slot, pos in ((0, 4), (1, 0), (0, -1)):
        with pytest.raises(ValueError, match="outside the cache"):
            cpu_attention.store_rows(kc, kc.copy(), row, row, np.array([slot], np.int32), np.array([pos], np.int32))
    assert not kc.any()


def test_a_forward_past_the_cache_is_refused_before_any_store(tiny_gguf, tmp_path):
    from aotx.engine.model.loader import load_model

    lm = load_model(tiny_gguf.write_tiny_llama(tmp_path / "t.gguf", qtype=T.Q8_0), device="cpu")
    kv = lm.model.new_kv_cache(1, 8)
    with pytest.raises(ValueError, match="outside the KV cache"):
        lm.model.forward(np.zeros(2, np.int32), [Segment(0, 7, 2)], kv)
    assert not any(x.any() for x in kv.k)
