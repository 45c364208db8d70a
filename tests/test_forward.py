"""The llama forward pass against a float64 numpy reference, and its batching rules.

The reference below is written from the papers and ggml's conventions, not from the
engine: weights dequantized by ``gguf.quants.dequantize``, RMSNorm (Zhang & Sennrich
2019), RoPE on adjacent pairs (x[2j], x[2j+1]) with theta_j = base^(-2j/rope_dim)
(ggml's GGML_ROPE_TYPE_NORM, which llama GGUFs use, base from the metadata), causal
grouped-query attention (query head h reads KV head h // (n_heads / n_kv_heads)),
SwiGLU, a final RMSNorm and the output head (tied to the token embedding when the
file has no ``output.weight``).

Tolerances: the engine computes in float32 (with a float32 KV cache: ``"f32"`` below; the
f16 default is checked separately) against float64 here, so logits must agree
to max|diff| / max|ref| < 1e-4 (observed 4e-7 .. 9e-7 for every type). Batching consistency compares the
engine with itself across code paths (GEMV for <= 4 rows, dequantize + BLAS above),
so it allows float32 rounding: 1e-4 relative.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from aotx.engine.backend.cpu.backend import CpuBackend
from aotx.engine.model.architectures import llama
from aotx.engine.model.batch import Segment
from aotx.engine.model.config import ModelConfig
from aotx.engine.model.gguf_file import GGUFFile
from aotx.engine.model.loader import load_model

REL_TOL_REF = 1e-4
REL_TOL_SELF = 1e-4


# ------------------------------------------------------------------ float64 reference

def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, positions: np.ndarray, base: float, rope_dim: int) -> np.ndarray:
    """x (n, heads, hd): rotate pairs (2j, 2j+1), j < rope_dim/2, by pos * base^(-2j/rope_dim)."""
    x = x.copy()
    j = np.arange(rope_dim // 2)
    ang = positions[:, None].astype(np.float64) * base ** (-2.0 * j / rope_dim)[None, :]  # (n, rope_dim/2)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[:, :, 0:rope_dim:2].copy(), x[:, :, 1:rope_dim:2].copy()
    x[:, :, 0:rope_dim:2] = a * c - b * s
    x[:, :, 1:rope_dim:2] = a * s + b * c
    return x


def reference_logits(W: dict[str, np.ndarray], meta: dict, tokens: list[int]) -> np.ndarray:
    """(n, vocab) float64 logits of every position of ``tokens`` (one sequence from 0)."""
    n_layers = meta["llama.block_count"]
    H, KV = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    d = meta["llama.embedding_length"]
    hd = d // H
    eps = meta["llama.attention.layer_norm_rms_epsilon"]
    base = meta["llama.rope.freq_base"]
    rope_dim = meta.get("llama.rope.dimension_count", hd)
    n = len(tokens)
    pos = np.arange(n)
    x = W["token_embd.weight"][np.asarray(tokens)]
    causal = np.tril(np.ones((n, n), bool))
    for i in range(n_layers):
        p = f"blk.{i}."
        h = rms_norm(x, W[p + "attn_norm.weight"], eps)
        q = rope((h @ W[p + "attn_q.weight"].T).reshape(n, H, hd), pos, base, rope_dim)
        k = rope((h @ W[p + "attn_k.weight"].T).reshape(n, KV, hd), pos, base, rope_dim)
        v = (h @ W[p + "attn_v.weight"].T).reshape(n, KV, hd)
        att = np.empty((n, H, hd))
        for hh in range(H):
            g = hh // (H // KV)
            s = q[:, hh] @ k[:, g].T / np.sqrt(hd)
            s = np.where(causal, s, -np.inf)
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            att[:, hh] = s @ v[:, g]
        x = x + att.reshape(n, H * hd) @ W[p + "attn_output.weight"].T
        h = rms_norm(x, W[p + "ffn_norm.weight"], eps)
        gate = h @ W[p + "ffn_gate.weight"].T
        up = h @ W[p + "ffn_up.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ W[p + "ffn_down.weight"].T
    x = rms_norm(x, W["output_norm.weight"], eps)
    return x @ W.get("output.weight", W["token_embd.weight"]).T


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))


# ------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def models(tiny_gguf, tmp_path_factory):
    """Loaded tiny models by key, written on first use."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("forward")

    def get(key: str, **kw):
        if key not in cache:
            p = tiny_gguf.write_tiny_llama(root / f"{key}.gguf", **kw)
            # float activations: this file checks the float path to 1e-4 of float64
            lm = load_model(p, int8_activations=False) if key == "Q8_0" else quick_load(p)
            cache[key] = (lm, tiny_gguf.weights(p), lm.gguf.metadata)
        return cache[key]

    return get


@dataclass
class Loaded:
    gguf: GGUFFile
    config: ModelConfig
    model: object


def quick_load(path) -> Loaded:
    """The weights-only part of load_model (no tokenizer, fingerprint or warm-up)."""
    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    return Loaded(gf, cfg, llama.build(cfg, gf, CpuBackend()))


def run_engine(lm, tokens: list[int], all_logits: bool = True) -> np.ndarray:
    kv = lm.model.new_kv_cache(1, len(tokens), "f32")
    return lm.model.forward(np.asarray(tokens, np.int32), [Segment(0, 0, len(tokens), all_logits=all_logits)], kv)


TOKENS = [1, 272, 261, 268, 114, 299, 0, 35, 200, 2, 150]


# ------------------------------------------------------------------ against the reference

@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
                                   T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda q: q.name)
def test_logits_match_float64_reference(models, qtype):
    lm, W, meta = models(qtype.name, qtype=qtype, seed=int(qtype))
    ref = reference_logits(W, meta, TOKENS)
    got = run_engine(lm, TOKENS)                      # prefill path (11 rows: dequantize + BLAS)
    assert got.shape == ref.shape and got.dtype == np.float32
    assert rel_err(got, ref) < REL_TOL_REF
    kv = lm.model.new_kv_cache(1, len(TOKENS), "f32")  # decode path (1 row: GEMV kernels)
    for i, t in enumerate(TOKENS[:2]):
        row = lm.model.forward(np.array([t], np.int32), [Segment(0, i, 1)], kv)
        assert rel_err(row[0], ref[i]) < REL_TOL_REF


@pytest.mark.parametrize("kw", [
    dict(n_heads=4, n_kv_heads=4),                 # multi-head
    dict(n_heads=8, n_kv_heads=1),                 # multi-query
    dict(tied=False),                              # separate output.weight
    dict(rope_base=500000.0, norm_eps=1e-6),       # metadata's RoPE base and epsilon are used
    dict(n_layers=3, d_model=96, n_heads=3, n_kv_heads=1, ffn=160),
], ids=["mha", "mqa", "untied", "rope-base", "odd-dims"])
def test_variants_match_reference(models, kw):
    key = "var-" + "-".join(f"{k}{v}" for k, v in kw.items())
    lm, W, meta = models(key, qtype=T.Q8_0, **kw)
    assert rel_err(run_engine(lm, TOKENS), reference_logits(W, meta, TOKENS)) < REL_TOL_REF


def test_reference_is_sensitive_to_rope_base(models):
    """Guards the test itself: a wrong theta base must be visible at this tolerance."""
    lm, W, meta = models("var-rope_base500000.0-norm_eps1e-06", qtype=T.Q8_0, rope_base=500000.0, norm_eps=1e-6)
    wrong = dict(meta, **{"llama.rope.freq_base": 10000.0})
    assert rel_err(run_engine(lm, TOKENS), reference_logits(W, wrong, TOKENS)) > 10 * REL_TOL_REF


# ------------------------------------------------------------------ batching consistency

@pytest.fixture(scope="module", params=[T.Q8_0, T.Q4_K], ids=lambda q: q.name)
def lm(request, models):
    return models(request.param.name, qtype=request.param, seed=int(request.param))[0]


def test_prefill_chunked_and_decode_agree(lm):
    n = len(TOKENS)
    one = run_engine(lm, TOKENS, all_logits=True)
    # chunked prefill over several ticks: 5 + 4 + 2 tokens, logits only at the end
    kv = lm.model.new_kv_cache(1, n, "f32")
    out = None
    for a, b in [(0, 5), (5, 9), (9, 11)]:
        out = lm.model.forward(np.asarray(TOKENS[a:b], np.int32), [Segment(0, a, b - a, logits=b == n)], kv)
        assert out.shape[0] == (1 if b == n else 0)
    assert rel_err(out[0], one[-1]) < REL_TOL_SELF
    # token by token
    kv = lm.model.new_kv_cache(1, n, "f32")
    for i, t in enumerate(TOKENS):
        row = lm.model.forward(np.array([t], np.int32), [Segment(0, i, 1)], kv)
        assert rel_err(row[0], one[i]) < REL_TOL_SELF
    # last-row-only prefill equals the last row of all_logits
    last = run_engine(lm, TOKENS, all_logits=False)
    assert last.shape == (1, one.shape[1]) and rel_err(last[0], one[-1]) < REL_TOL_SELF


def alone(lm, tokens: list[int]) -> np.ndarray:
    """All logits of ``tokens`` run alone in slot 0 of a fresh cache."""
    return run_engine(lm, tokens, all_logits=True)


def test_mixed_batch_equals_each_slot_alone(lm):
    a = TOKENS            # slot 2: a prompt whose second chunk is prefilled in the mixed batch
    b = [5, 6, 7, 8, 9, 10, 11]  # slot 0: decoding its last token in the mixed batch
    c = [42, 43, 44]      # slot 1: a fresh prompt of 3 tokens in the same batch
    ref_a, ref_b, ref_c = alone(lm, a), alone(lm, b), alone(lm, c)
    kv = lm.model.new_kv_cache(3, 16, "f32")
    lm.model.forward(np.asarray(a[:6], np.int32), [Segment(2, 0, 6, logits=False)], kv)
    lm.model.forward(np.asarray(b[:6], np.int32), [Segment(0, 0, 6, logits=False)], kv)
    toks = np.asarray(a[6:] + [b[6]] + c, np.int32)
    out = lm.model.forward(toks, [Segment(2, 6, len(a) - 6), Segment(0, 6, 1), Segment(1, 0, 3, all_logits=True)],
                           kv)
    assert out.shape[0] == 1 + 1 + 3
    assert rel_err(out[0], ref_a[-1]) < REL_TOL_SELF
    assert rel_err(out[1], ref_b[-1]) < REL_TOL_SELF
    assert rel_err(out[2:], ref_c) < REL_TOL_SELF
    # then two decodes in one batch, slots in reverse order
    out = lm.model.forward(np.array([3, 4], np.int32), [Segment(1, 3, 1), Segment(0, 7, 1)], kv)
    assert rel_err(out[0], alone(lm, c + [3])[-1]) < REL_TOL_SELF
    assert rel_err(out[1], alone(lm, b + [4])[-1]) < REL_TOL_SELF


def test_kv_of_different_slots_never_mixes(lm):
    cfg = lm.config
    kv = lm.model.new_kv_cache(4, 16, "f32")
    lm.model.forward(np.asarray(TOKENS[:8], np.int32), [Segment(1, 0, 8)], kv)
    before = [k[1].copy() for k in kv.k] + [v[1].copy() for v in kv.v]
    # a batch over slots 0 and 3 (prefill and decode) must not touch slot 1 or slot 2
    lm.model.forward(np.asarray([9, 9, 9, 9, 9, 7], np.int32), [Segment(0, 0, 5), Segment(3, 0, 1)], kv)
    lm.model.forward(np.asarray([8], np.int32), [Segment(3, 1, 1)], kv)
    after = [k[1] for k in kv.k] + [v[1] for v in kv.v]
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x, y)
    for li in range(cfg.n_layers):
        assert not kv.k[li][2].any() and not kv.v[li][2].any()
        assert not kv.k[li][3, :, 2:].any()      # slot 3 wrote positions 0 and 1 only
        assert not kv.k[li][0, :, 5:].any()
    # slot 1 continues exactly as if it had been alone
    out = lm.model.forward(np.asarray([TOKENS[8]], np.int32), [Segment(1, 8, 1)], kv)
    assert rel_err(out[0], alone(lm, TOKENS[:9])[-1]) < REL_TOL_SELF
    # and a slot's KV equals the KV of the same tokens run alone in slot 0
    kv1 = lm.model.new_kv_cache(1, 16, "f32")
    lm.model.forward(np.asarray([9, 9, 9, 9, 9], np.int32), [Segment(0, 0, 5)], kv1)
    for li in range(cfg.n_layers):
        np.testing.assert_allclose(kv.k[li][0, :, :5], kv1.k[li][0, :, :5], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ op edge cases

def test_rms_norm_zero_row_and_nan_do_not_raise():
    """Bug guard: numba's Python error model raised ZeroDivisionError inside rms_norm on
    a NaN row (fuzzed weights) or a zero row with eps 0; it must return, not raise."""
    from aotx.engine.backend.cpu.ops import rms_norm

    x = np.zeros((3, 8), np.float32)
    x[1] = np.nan
    x[2] = 1.0
    out = np.empty_like(x)
    rms_norm(x, np.ones(8, np.float32), 0.0, out)
    assert not out[0].any()
    np.testing.assert_allclose(out[2], 1.0, rtol=1e-6)
