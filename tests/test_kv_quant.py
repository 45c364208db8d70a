"""Quantized KV caches on the CPU (engine/backend/cpu/kvquant.py): llama.cpp's q8_0 and q4_0
blocks, and everything that must keep working on them.

* the blocks: q4_0 bytes equal gguf-py's reference quantizer (a port of ggml-quants.c);
  q8_0 follows ggml-cpu's x86 quantizer (round half to even, 127 / amax), which differs from
  gguf-py's port of the scalar reference (roundf, 1 / d) by one step on rare elements; our
  dequantization equals gguf-py's on our bytes;
* llama.cpp's rotation of a quantized cache (a 64-point Walsh-Hadamard matrix on K and V
  where the head size is a multiple of 64, and on the queries; the output rotated back):
  orthonormal, its own inverse;
* attention over a quantized cache equals ``attention_rows`` over its dequantized values,
  bit for bit, in the rotated space where there is one (sliding windows, attention sinks,
  grouped heads, several slots, prefill blocks and decode rows);
* capsules of a quantized cache restore byte-exact and decode token-identically;
* speculative verify (prompt lookup) and prefix reuse on q8_0 give the tokens of plain
  greedy decoding on a fresh engine.
(Batch invariance per KV type: tests/test_batch_invariance.py samples q8_0 and q4_0 too;
against llama.cpp: tests/test_kv_quant_refs.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from aotx.engine.backend.cpu import attention as A
from aotx.engine.backend.cpu import kvquant as Q
from aotx.engine.model.batch import Segment
from aotx.engine.runtime.sampling import SamplerConfig, SamplerState, sample
from aotx.engine.state import capsule as C

GGML = {"q8_0": T.Q8_0, "q4_0": T.Q4_0}


def _values(rng, n: int, hd: int) -> np.ndarray:
    """Rows with the spread of real K/V: a few large outliers among small values, and an
    all-zero row."""
    x = (rng.standard_normal((n, hd)) * rng.choice([0.05, 1.0, 8.0], size=(n, 1))).astype(np.float32)
    x[0] = 0.0
    x[1, 5] = 40.0
    return x


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_blocks_match_ggufs_reference(kv_type):
    rng = np.random.default_rng(1)
    x = _values(rng, 256, 64)
    ours = Q.quantize(x, kv_type)
    assert ours.shape == (256, Q.row_bytes(kv_type, 64)) == (256, 2 * Q.BLOCK_BYTES[kv_type])
    ref = gq.quantize(x, GGML[kv_type])
    # gguf-py reads our bytes back to our values: the block layout is ggml's
    back = gq.dequantize(ours, GGML[kv_type]).astype(np.float32)
    np.testing.assert_array_equal(Q.dequantize(ours, kv_type, 64), back)
    if kv_type == "q4_0":
        np.testing.assert_array_equal(ours, ref)
        return
    ref_vals = gq.dequantize(ref, GGML[kv_type]).astype(np.float32)
    ours_vals = Q.dequantize(ours, kv_type, 64)
    d = np.repeat(np.abs(x).reshape(-1, 32).max(1) / 127, 32).reshape(x.shape)
    differ = ours_vals != ref_vals
    assert differ.mean() < 0.01 and np.all(np.abs(ours_vals - ref_vals)[differ] <= d[differ] * 1.01)


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_dequantized_values_are_within_half_a_step(kv_type):
    rng = np.random.default_rng(2)
    x = _values(rng, 64, 128)
    y = Q.dequantize(Q.quantize(x, kv_type), kv_type, 128)
    blocks = np.abs(x).reshape(-1, 32).max(1)
    step = blocks / (127 if kv_type == "q8_0" else 8)
    err = np.abs(x - y).reshape(-1, 32).max(1)
    # half a step (q4_0: one, as +8 steps clips to +7), plus float16's rounding of the step
    # (2^-11 of it) times the largest integer (127; 8)
    bound = step * (0.5 + 127 * 2 ** -11) if kv_type == "q8_0" else step * (1 + 8 * 2 ** -11)
    assert np.all(err <= bound * (1 + 1e-6))
    assert err.max() > 0.3 * bound.max()      # (a bound that could not fail would test nothing)


def test_a_head_size_off_the_block_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="head size of 80 is not a multiple of 32"):
        Q.row_bytes("q8_0", 80)


def _cache(rng, kv_type, n_slots, KV, n_ctx, hd, lengths, rotate=True):
    rb = Q.row_bytes(kv_type, hd)
    kc = np.zeros((n_slots, KV, n_ctx, rb), np.uint8)
    vc = np.zeros_like(kc)
    for s, n in enumerate(lengths):
        k = rng.standard_normal((n, KV, hd)).astype(np.float32)
        v = rng.standard_normal((n, KV, hd)).astype(np.float32)
        Q.store_q(kc, vc, k, v, np.full(n, s, np.int32), np.arange(n, dtype=np.int32), kv_type, rotate=rotate)
    return kc, vc


def test_the_rotations_are_llamacpps_orthonormal_hadamard_blocks():
    assert Q.rotations(96) is None and Q.rotations(32) is None
    rk, rv = Q.rotations(64)
    assert rk.shape == rv.shape == (64, 64)
    rk, rv = Q.rotations(192)          # K: the largest power of two from 64 dividing 192; V: 64
    assert rk.shape == (64, 64) and rv.shape == (64, 64)
    rk, rv = Q.rotations(256)
    assert rk.shape == (256, 256) and rv.shape == (64, 64)
    np.testing.assert_allclose(rk.astype(np.float64) @ rk, np.eye(256), atol=1e-6)
    np.testing.assert_array_equal(rk, rk.T)
    assert set(np.unique(np.abs(rv))) == {np.float32(0.125)}
    x = np.random.default_rng(9).standard_normal((3, 256)).astype(np.float32)
    np.testing.assert_allclose(Q.rotate(Q.rotate(x, rk), rk), x, atol=1e-5)


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
@pytest.mark.parametrize("window,sinks,rotate", [(0, False, True), (23, False, True), (0, True, True),
                                                 (0, False, False)])
def test_attention_is_attention_over_the_dequantized_cache_bit_for_bit(kv_type, window, sinks, rotate):
    rng = np.random.default_rng(3)
    KV, H, hd, n_ctx = 2, 6, 64, 160
    kc, vc = _cache(rng, kv_type, 3, KV, n_ctx, hd, [150, 77, 0], rotate)
    # slot 0: a prefill block of 40 rows (more than a row block) ending at 150; slot 1: a
    # decode row and a verify window; slot 2: one row at position 0
    slots = np.array([0] * 40 + [1] * 4 + [2], np.int32)
    lengths = np.array(list(range(111, 151)) + [74, 75, 76, 77] + [1], np.int32)
    q = rng.standard_normal((len(slots), H, hd)).astype(np.float32)
    sk = rng.standard_normal(H).astype(np.float32) if sinks else None
    got = Q.attention_q(q, kc, vc, slots, lengths, 0.125, window, np.empty((len(slots), H, hd), np.float32),
                        kv_type, sinks=sk, rotate=rotate)
    rk, rv = Q.rotations(hd) if rotate else (None, None)
    want = A.attention_rows(Q.rotate(q, rk) if rotate else q, Q.dequantize(kc, kv_type, hd),
                            Q.dequantize(vc, kv_type, hd), slots, lengths, 0.125, window,
                            np.empty((len(slots), H, hd), np.float32), sinks=sk)
    if rotate:
        want = Q.rotate(want, rv)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    if rotate:   # the rotation leaves the mathematics as it was: close to the float attention
        exact = A.attention_rows(q, Q.rotate(Q.dequantize(kc, kv_type, hd), rk), Q.rotate(Q.dequantize(vc, kv_type, hd),
                                 rv), slots, lengths, 0.125, window, np.empty((len(slots), H, hd), np.float32),
                                 sinks=sk)
        np.testing.assert_allclose(got, exact, atol=2e-4)


def test_the_store_writes_its_rows_and_nothing_else():
    rng = np.random.default_rng(4)
    kc = np.zeros((2, 2, 16, Q.row_bytes("q8_0", 64)), np.uint8)
    vc = np.zeros_like(kc)
    k = rng.standard_normal((2, 2, 64)).astype(np.float32)
    Q.store_q(kc, vc, k, -k, np.array([1, 0], np.int32), np.array([5, 9], np.int32), "q8_0")
    rk, rv = Q.rotations(64)           # (rotated first, as llama.cpp does for a head size of 64)
    np.testing.assert_array_equal(kc[1, :, 5], Q.quantize(Q.rotate(k[0], rk), "q8_0"))
    np.testing.assert_array_equal(vc[0, :, 9], Q.quantize(Q.rotate(-k[1], rv), "q8_0"))
    kc[1, :, 5] = 0
    kc[0, :, 9] = 0
    assert not kc.any()


# ---- the default model ------------------------------------------------------------------

PROMPT = "<|im_start|>user\nTell me about the moon.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def lm(loaded_model):
    return loaded_model


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_a_capsule_of_a_quantized_cache_restores_byte_exact_and_decodes_identically(lm, tmp_path, kv_type):
    m = lm.model
    assert m.kv_cache_bytes(1, 64, kv_type) * 64 == m.kv_cache_bytes(1, 64, "f16") * Q.BLOCK_BYTES[kv_type]
    prompt = lm.tokenizer.encode(PROMPT, parse_special=True)
    cfg = SamplerConfig(temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0)
    kv = m.new_kv_cache(2, 96, kv_type)

    def decode(slot, pos, tok, n):
        out = []
        for i in range(n):
            tok = sample(m.forward(np.asarray([tok], np.int32), [Segment(slot, pos + i, 1)], kv)[0].copy(), cfg,
                         SamplerState(seed=1))
            out.append(tok)
        return out

    lg = m.forward(np.asarray(prompt, np.int32), [Segment(0, 0, len(prompt))], kv)
    first = sample(lg[0].copy(), cfg, SamplerState(seed=1))
    cap = C.snapshot(kv, 0, prompt, fingerprint=lm.fingerprint, pending_token=first)
    assert cap.header.kv_type == kv_type and cap.k.dtype == np.uint8
    straight = decode(0, len(prompt), first, 8)
    C.save(cap, tmp_path / "q.caps")
    back = C.load(tmp_path / "q.caps")
    m.forward(np.asarray(list(range(200, 260)), np.int32), [Segment(1, 0, 60)], kv)   # the slot held others
    C.restore(back, kv, 1, fingerprint=lm.fingerprint)
    n = len(prompt)
    for li in range(len(kv.k)):
        assert kv.k[li][1, :, :n].tobytes() == cap.k[li].tobytes()
        assert kv.v[li][1, :, :n].tobytes() == cap.v[li].tobytes()
    assert decode(1, n, first, 8) == straight
    with pytest.raises(C.CapsuleError, match=f"capsule holds {kv_type} KV but this engine's KV cache is f16"):
        C.restore(back, m.new_kv_cache(1, 96, "f16"), 0, fingerprint=lm.fingerprint)


class _Sink:
    def __init__(self):
        import threading

        self.events, self.done = [], threading.Event()

    def send(self, m):
        from aotx.engine import protocol as P

        self.events.append(m)
        if isinstance(m, (P.Committed, P.Error, P.ConversationInfo)):
            self.done.set()

    def wait(self):
        assert self.done.wait(300), "no reply in time"
        return self.events[-1]


def _engine(lm, kv_type):
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store

    eng = Engine(lm, open_store(None), n_slots=2, n_ctx=512, prefill_chunk=64, device="cpu", kv_type=kv_type)
    eng.start()
    return eng


def _turn(eng, conv, text, *, speculative="off", n=32, ids=iter(range(1000, 10 ** 6))):
    from aotx.engine import protocol as P

    s = _Sink()
    eng.post(P.SubmitMessage(id=next(ids), conv_id=conv, text=text,
                             sampling=P.SamplingParams(temperature=0.0, repeat_penalty=1.0, max_tokens=n,
                                                       speculative=speculative)), s)
    end = s.wait()
    assert isinstance(end, P.Committed), end
    return [e.token_id for e in s.events if isinstance(e, P.Token)], end


def _conv(eng, ids=iter(range(10 ** 6, 2 * 10 ** 6))):
    from aotx.engine import protocol as P

    s = _Sink()
    eng.post(P.CreateConversation(id=next(ids)), s)
    return s.wait().conversation.conv_id


def test_speculative_verify_and_prefix_reuse_on_q8_0_give_plain_greedys_tokens(lm):
    code = ("def parse_config(path):\n    settings = {}\n    with open(path) as handle:\n        for line in handle:\n"
            "            key, _, value = line.partition('=')\n            settings[key.strip()] = value.strip()\n"
            "    return settings\n")
    ask = "Rewrite this Python code, renaming the function parse_config to read_config:\n\n" + code
    plain = _engine(lm, "q8_0")
    try:
        c = _conv(plain)
        want, _ = _turn(plain, c, ask)
        want2, _ = _turn(plain, c, "Now add a docstring.")
    finally:
        plain.stop()
    eng = _engine(lm, "q8_0")
    try:
        c = _conv(eng)
        got, end = _turn(eng, c, ask, speculative="ngram")
        assert got == want and end.timings["draft_accepted"] > 0     # the verify path really ran
        got2, end2 = _turn(eng, c, "Now add a docstring.")
        assert end2.timings["prompt_tokens_reused"] > 0 and got2 == want2   # the slot's prefix was reused
    finally:
        eng.stop()
