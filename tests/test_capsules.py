"""Execution-state capsules: byte-exact restore, token-identical decode, the ablation,
and their uses in the engine (parking, fork, resume after a restart)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from aotx.engine import protocol as P
from aotx.engine.model.batch import Segment
from aotx.engine.runtime.sampling import SamplerConfig, SamplerState, sample
from aotx.engine.state import capsule as C
from tests.fakes.sink import EventSink

PROMPT = "<|im_start|>user\nTell me about the moon.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def lm(loaded_model):
    return loaded_model


def _ids(lm):
    return lm.tokenizer.encode(PROMPT, parse_special=True)


def _decode(lm, kv, slot, pos, tok, n, cfg, st):
    """Feed ``tok`` at ``pos`` and sample n tokens; returns them."""
    out = []
    for i in range(n):
        lg = lm.model.forward(np.asarray([tok], np.int32), [Segment(slot, pos + i, 1)], kv)
        tok = sample(lg[0].copy(), cfg, st)
        out.append(tok)
    return out


def _run(lm, kv, slot, prompt, n, cfg, seed):
    """Prefill + n tokens without stopping; returns the tokens."""
    st = SamplerState(seed=seed)
    lg = lm.model.forward(np.asarray(prompt, np.int32), [Segment(slot, 0, len(prompt))], kv)
    first = sample(lg[0].copy(), cfg, st)
    return [first] + _decode(lm, kv, slot, len(prompt), first, n - 1, cfg, st)


def _stop_at(lm, kv, slot, prompt, k, cfg, seed):
    """Prefill + k tokens, then snapshot (KV of prompt + k-1 fed tokens, pending token, sampler)."""
    st = SamplerState(seed=seed)
    lg = lm.model.forward(np.asarray(prompt, np.int32), [Segment(slot, 0, len(prompt))], kv)
    toks = [sample(lg[0].copy(), cfg, st)]
    toks += _decode(lm, kv, slot, len(prompt), toks[0], k - 1, cfg, st)
    fed = prompt + toks[:-1]
    cap = C.snapshot(kv, slot, fed, fingerprint=lm.fingerprint, pending_token=toks[-1], sampler=st)
    return toks, cap


def _resume(lm, kv, slot, cap, n, cfg):
    C.restore(cap, kv, slot, fingerprint=lm.fingerprint)
    h = cap.header
    st = SamplerState(seed=h.seed, step=h.step, history=list(h.history))
    return _decode(lm, kv, slot, cap.n_tokens, h.pending_token, n, cfg, st)


def _clobber(lm, kv, slot):
    junk = list(range(200, 260))
    lm.model.forward(np.asarray(junk, np.int32), [Segment(slot, 0, len(junk))], kv)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decode_after_restore_is_identical(lm, tmp_path, temperature):
    cfg = SamplerConfig(temperature=temperature, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1)
    prompt = _ids(lm)
    kv = lm.model.new_kv_cache(3, 128)
    straight = _run(lm, kv, 0, prompt, 16, cfg, seed=7)
    toks, cap = _stop_at(lm, kv, 1, prompt, 6, cfg, seed=7)
    assert toks == straight[:6]
    # same slot after the slot was reused, another slot, and a round trip through disk
    _clobber(lm, kv, 1)
    assert toks + _resume(lm, kv, 1, cap, 10, cfg) == straight
    assert toks + _resume(lm, kv, 2, cap, 10, cfg) == straight
    C.save(cap, tmp_path / "c.caps")
    back = C.load(tmp_path / "c.caps")
    _clobber(lm, kv, 1)
    assert toks + _resume(lm, kv, 1, back, 10, cfg) == straight


def test_restore_is_byte_exact(lm, tmp_path):
    prompt = _ids(lm)
    kv = lm.model.new_kv_cache(2, 96)
    lm.model.forward(np.asarray(prompt, np.int32), [Segment(0, 0, len(prompt))], kv)
    cap = C.snapshot(kv, 0, prompt, fingerprint=lm.fingerprint)
    C.save(cap, tmp_path / "x.caps")
    back = C.load(tmp_path / "x.caps")
    C.restore(back, kv, 1, fingerprint=lm.fingerprint)
    n = len(prompt)
    for li in range(len(kv.k)):
        assert kv.k[li][1, :, :n].tobytes() == kv.k[li][0, :, :n].tobytes()
        assert kv.v[li][1, :, :n].tobytes() == kv.v[li][0, :, :n].tobytes()
    assert back.header == cap.header
    assert back.tokens.tolist() == prompt


def test_ablation_each_part_is_needed(lm):
    """KV alone is not the state: without positions, or without the sampler state,
    the continuation changes."""
    cfg = SamplerConfig(repeat_penalty=1.0, temperature=0.9, top_k=0, top_p=1.0, min_p=0.0)
    prompt = _ids(lm)
    kv = lm.model.new_kv_cache(2, 128)
    straight = _run(lm, kv, 0, prompt, 14, cfg, seed=11)
    toks, cap = _stop_at(lm, kv, 1, prompt, 4, cfg, seed=11)
    h = cap.header
    # KV restored, but decode resumes at the wrong position (positions not restored)
    C.restore(cap, kv, 1, fingerprint=lm.fingerprint)
    st = SamplerState(seed=h.seed, step=h.step, history=list(h.history))
    wrong_pos = _decode(lm, kv, 1, 8, h.pending_token, 10, cfg, st)
    # KV and positions restored, sampler state not (a fresh Philox counter)
    C.restore(cap, kv, 1, fingerprint=lm.fingerprint)
    fresh = _decode(lm, kv, 1, cap.n_tokens, h.pending_token, 10, cfg, SamplerState(seed=h.seed))
    full = _resume(lm, kv, 1, cap, 10, cfg)
    assert toks + full == straight
    assert toks + wrong_pos != straight
    assert toks + fresh != straight


def test_bad_capsules_are_refused(lm, tmp_path):
    prompt = _ids(lm)
    kv = lm.model.new_kv_cache(1, 64)
    lm.model.forward(np.asarray(prompt, np.int32), [Segment(0, 0, len(prompt))], kv)
    cap = C.snapshot(kv, 0, prompt, fingerprint=lm.fingerprint)
    p = tmp_path / "c.caps"
    C.save(cap, p)
    data = bytearray(p.read_bytes())
    data[-100] ^= 0x40
    (tmp_path / "flip.caps").write_bytes(bytes(data))
    with pytest.raises(C.CapsuleError, match="checksum"):
        C.load(tmp_path / "flip.caps")
    (tmp_path / "cut.caps").write_bytes(bytes(data[:1000]))
    with pytest.raises(C.CapsuleError, match="truncated"):
        C.load(tmp_path / "cut.caps")
    with pytest.raises(C.CapsuleError, match="cannot restore into model"):
        C.restore(cap, kv, 0, fingerprint="someoneelse")


# ---- the engine's uses -------------------------------------------------------------

def _engine(lm, home, n_slots):
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store
    from aotx.engine.state.cache import CapsuleCache

    store = open_store(home / "journal")
    caps = CapsuleCache(home / "capsules", host_bytes=256 << 20, fingerprint=lm.fingerprint)
    eng = Engine(lm, store, n_slots=n_slots, n_ctx=512, capsules=caps)
    eng.start()
    return eng, store


def _turn(eng, conv_id, text, rid=5):
    s = EventSink()
    eng.post(P.SubmitMessage(id=rid, conv_id=conv_id, text=text,
                             sampling=P.SamplingParams(repeat_penalty=1.0, temperature=0.0, max_tokens=12)), s)
    done = s.wait()
    assert isinstance(done, P.Committed), done
    # wait for the reply's capsule to reach disk
    time.sleep(0.3)
    return done, [e for e in s.events if isinstance(e, P.Notice)]


def _create(eng, title):
    s = EventSink()
    eng.post(P.CreateConversation(id=1, title=title), s)
    return s.wait().conversation.conv_id


def test_parking_fork_and_resume_reuse_state(lm, tmp_path):
    eng, store = _engine(lm, tmp_path, n_slots=1)
    try:
        a = _create(eng, "a")
        b = _create(eng, "b")
        _turn(eng, a, "Name a planet.")
        _turn(eng, b, "Name a color.")  # takes the only slot: a's state is parked
        done, notes = _turn(eng, a, "Name another one.")
        assert done.timings["prompt_tokens_reused"] > 20, "a's context should come back from its parked capsule"
        assert any("picked up where this conversation left off" in n.message for n in notes)
        # fork a: the fork's next turn starts from a's state, not from scratch
        s = EventSink()
        eng.post(P.ForkConversation(id=2, conv_id=a), s)
        fork = s.wait().conversation
        assert fork.n_messages == 4
        done, _ = _turn(eng, fork.conv_id, "And a third?")
        assert done.timings["prompt_tokens_reused"] >= done.timings["prompt_tokens"] - 20  # the new turn + the reply end
    finally:
        eng.stop()
        store.close()
    # restart: the next turn restores a's capsule from disk
    eng, store = _engine(lm, tmp_path, n_slots=1)
    try:
        done, notes = _turn(eng, a, "One more?")
        assert any("picked up where this conversation left off" in n.message for n in notes), \
            [n.message for n in notes]
        assert done.timings["prompt_tokens_reused"] > 20
    finally:
        eng.stop()
        store.close()
