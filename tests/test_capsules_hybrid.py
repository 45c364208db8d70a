"""Capsules of a hybrid model (the tiny qwen35: gated DeltaNet layers beside attention):
the recurrent and convolution state is part of the slot's closed set of buffers.

Snapshot, restore and the disk round trip are byte-exact for KV and state alike, and the
state is under the checksum; the ablation the capsule paper reports: restoring KV alone
(the state fresh) makes greedy output diverge, while the full restore stays token-identical;
a hybrid capsule restores whole, never a prefix; and in the engine, a parked conversation
resumes from its capsule with the reply it would have had without capsules, and
speculative decoding (prompt lookup, a drafter always wrong, a perfect one) is
token-identical to plain greedy, rejected drafts rolling the state back.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from aotx.engine import protocol as P
from aotx.engine.model.batch import Segment
from aotx.engine.state import capsule as C
from tests.fakes.sink import EventSink

RAW = "<|im_start|>user\nTell me about the moon and the sea, in a few words.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def q35(tiny_tokenizer, tmp_path_factory):
    """The tiny qwen35 file, loaded as the engine loads it (int8 activations)."""
    from tests.models import qwen35

    from aotx.engine.model.loader import load_model

    path = qwen35.write(tmp_path_factory.mktemp("q35caps") / "qwen35.gguf", tiny_tokenizer, pre="qwen2")
    return load_model(path)


def _greedy(lm, kv, slot, pos, tok, n):
    out = []
    for i in range(n):
        lg = lm.model.forward(np.asarray([tok], np.int32), [Segment(slot, pos + i, 1)], kv)
        tok = int(np.argmax(lg[0]))
        out.append(tok)
    return out


def _prefill(lm, kv, slot, ids):
    lg = lm.model.forward(np.asarray(ids, np.int32), [Segment(slot, 0, len(ids))], kv)
    return int(np.argmax(lg[0]))


def test_snapshot_restore_and_disk_are_byte_exact_with_the_state(q35, tmp_path):
    ids = q35.tokenizer.encode(RAW, parse_special=True)
    kv = q35.model.new_kv_cache(2, 128)
    _prefill(q35, kv, 0, ids)
    cap = C.snapshot(kv, 0, ids, fingerprint=q35.fingerprint)
    assert cap.header.state == list(kv.state.names) == ["conv.0", "delta.1"]
    C.save(cap, tmp_path / "h.caps")
    back = C.load(tmp_path / "h.caps")
    _prefill(q35, kv, 1, list(range(300, 340)))        # slot 1 holds something else first
    C.restore(back, kv, 1, fingerprint=q35.fingerprint)
    again = C.snapshot(kv, 1, ids, fingerprint=q35.fingerprint)
    for name in cap.header.state:
        assert again.state[name].tobytes() == cap.state[name].tobytes()
    assert again.k.tobytes() == cap.k.tobytes() and again.v.tobytes() == cap.v.tobytes()
    assert back.header == cap.header
    # the state is under the checksum: a flipped bit in the last buffer is found
    data = bytearray((tmp_path / "h.caps").read_bytes())
    data[-5] ^= 0x10
    (tmp_path / "flip.caps").write_bytes(bytes(data))
    with pytest.raises(C.CapsuleError, match="checksum"):
        C.load(tmp_path / "flip.caps")


def test_kv_alone_diverges_the_full_restore_is_token_identical(q35):
    """The ablation: the recurrent state is load-bearing."""
    ids = q35.tokenizer.encode(RAW, parse_special=True)
    kv = q35.model.new_kv_cache(2, 128)
    first = _prefill(q35, kv, 0, ids)
    straight = [first] + _greedy(q35, kv, 0, len(ids), first, 23)
    kv = q35.model.new_kv_cache(2, 128)
    first = _prefill(q35, kv, 0, ids)
    head = [first] + _greedy(q35, kv, 0, len(ids), first, 3)
    fed = ids + head[:-1]
    cap = C.snapshot(kv, 0, fed, fingerprint=q35.fingerprint, pending_token=head[-1])
    _prefill(q35, kv, 1, list(range(500, 560)))
    C.restore(cap, kv, 1, fingerprint=q35.fingerprint)
    full = _greedy(q35, kv, 1, cap.n_tokens, head[-1], 20)
    assert head + full == straight
    # KV alone: every attention layer's K/V back, the recurrent state fresh at that position
    kv.restore_slot(1, cap.k, cap.v, cap.n_tokens)
    for b in kv.state.buffers:
        b[1] = 0.0
    kv.state.pos[1] = cap.n_tokens
    kv_only = _greedy(q35, kv, 1, cap.n_tokens, head[-1], 20)
    assert head + kv_only != straight
    assert sum(a != b for a, b in zip(kv_only, full)) > 5, (kv_only, full)


def test_a_hybrid_capsule_restores_whole(q35):
    ids = q35.tokenizer.encode(RAW, parse_special=True)
    kv = q35.model.new_kv_cache(2, 128)
    _prefill(q35, kv, 0, ids)
    cap = C.snapshot(kv, 0, ids, fingerprint=q35.fingerprint)
    assert C.restorable(cap, len(ids)) and not C.restorable(cap, len(ids) - 3)
    assert C.usable_prefix(cap, ids + [5, 6]) == len(ids)
    assert C.usable_prefix(cap, ids[:-2] + [7, 8, 9]) == 0      # shares a prefix, but the state stands past it
    with pytest.raises(C.CapsuleError, match="restores whole"):
        C.restore(cap, kv, 1, fingerprint=q35.fingerprint, n=len(ids) - 3)
    with pytest.raises(C.CapsuleError, match="stands at position"):
        C.snapshot(kv, 0, ids[:-1], fingerprint=q35.fingerprint)


def test_a_checkpoint_restores_the_state_of_its_position(q35, tmp_path):
    """A capsule keeps the state at the end of the prompt as a checkpoint: restored there
    (through the disk), decoding goes on exactly as after prefilling that prompt alone."""
    ids = q35.tokenizer.encode(RAW, parse_special=True)
    n = len(ids)
    kv = q35.model.new_kv_cache(2, 128)
    first = _prefill(q35, kv, 0, ids)
    ckpt = {n: kv.state.snapshot(0, n)}
    reply = [first] + _greedy(q35, kv, 0, n, first, 6)
    cap = C.snapshot(kv, 0, ids + reply[:-1], fingerprint=q35.fingerprint, checkpoints=ckpt)
    assert cap.header.checkpoints == [n] and C.restorable(cap, n) and not C.restorable(cap, n - 1)
    assert C.usable_prefix(cap, ids + [11, 12, 13]) == n
    C.save(cap, tmp_path / "c.caps")
    back = C.load(tmp_path / "c.caps")
    C.restore(back, kv, 1, fingerprint=q35.fingerprint, n=n)
    assert kv.state.position(1) == n
    again = _greedy(q35, kv, 1, n, first, 6)
    assert [first] + again == reply


# ---- the engine ------------------------------------------------------------------------

def _engine(lm, home, n_slots, capsules=True, speculative="off"):
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store
    from aotx.engine.state.cache import CapsuleCache

    store = open_store(home / "journal" if home else None)
    caps = CapsuleCache(home / "capsules", host_bytes=256 << 20, fingerprint=lm.fingerprint) if capsules else None
    eng = Engine(lm, store, n_slots=n_slots, n_ctx=512, capsules=caps, speculative=speculative)
    eng.start()
    return eng, store


def _create(eng, title):
    s = EventSink()
    eng.post(P.CreateConversation(id=1, title=title), s)
    return s.wait().conversation.conv_id


def _turn(eng, conv_id, text, max_tokens=12):
    s = EventSink()
    eng.post(P.SubmitMessage(id=5, conv_id=conv_id, text=text,
                             sampling=P.SamplingParams(repeat_penalty=1.0, temperature=0.0, max_tokens=max_tokens)),
             s)
    done = s.wait()
    assert isinstance(done, P.Committed), done
    time.sleep(0.3)
    return done, [e.token_id for e in s.events if isinstance(e, P.Token)]


def test_parked_hybrid_conversation_resumes_with_the_same_reply(q35, tmp_path):
    """One slot, two conversations: a's state is parked as a capsule when b takes the slot;
    a's next turn restores it (recurrent state included) and replies exactly as an engine
    without capsules, which prefills the whole history again."""
    texts = ("Name a planet.", "Name a color.", "Name another one.")
    eng, store = _engine(q35, tmp_path / "with", n_slots=1)
    try:
        a, b = _create(eng, "a"), _create(eng, "b")
        _turn(eng, a, texts[0])
        _turn(eng, b, texts[1])
        done, with_caps = _turn(eng, a, texts[2])
        assert done.timings["prompt_tokens_reused"] > 20
    finally:
        eng.stop()
        store.close()
    eng, store = _engine(q35, tmp_path / "without", n_slots=1, capsules=False)
    try:
        a, b = _create(eng, "a"), _create(eng, "b")
        _turn(eng, a, texts[0])
        _turn(eng, b, texts[1])
        done, plain = _turn(eng, a, texts[2])
        assert done.timings["prompt_tokens_reused"] == 0
    finally:
        eng.stop()
        store.close()
    assert with_caps == plain


def test_the_next_turn_resumes_at_the_prompt_checkpoint(q35, tmp_path):
    """The reply is rendered into the next prompt by the template, not as the tokens fed
    (a hybrid slot cannot cut its state back to where they diverge): the slot's
    checkpoint at the end of the previous prompt is reused, and the reply is the one a
    fresh prefill of the whole history gives."""
    eng, store = _engine(q35, tmp_path / "with", n_slots=1)
    try:
        a = _create(eng, "a")
        first, _ = _turn(eng, a, "Name a planet.")
        done, with_ckpt = _turn(eng, a, "Name another one.")
        assert done.timings["prompt_tokens_reused"] >= first.timings["prompt_tokens"]
    finally:
        eng.stop()
        store.close()
    eng, store = _engine(q35, tmp_path / "plain", n_slots=1, capsules=False)
    try:
        a, b = _create(eng, "a"), _create(eng, "b")
        _turn(eng, a, "Name a planet.")
        _turn(eng, b, "Name a color.")       # takes a's slot: a's next turn prefills anew
        done, plain = _turn(eng, a, "Name another one.")
        assert done.timings["prompt_tokens_reused"] == 0
    finally:
        eng.stop()
        store.close()
    assert with_ckpt == plain


class _Wrong:
    """A drafter whose drafts are always rejected."""

    def __new__(cls):
        from aotx.engine.runtime.speculative import PromptLookup

        class Wrong(PromptLookup):
            def propose(self, tokens, limit):
                k = min(self.window - 1, limit)
                return [(tokens[-1] + 7 + i) % 1000 for i in range(max(0, k))]
        return Wrong()


def _generate(lm, text, drafter_factory=None, max_tokens=32):
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store

    eng = Engine(lm, open_store(None), n_slots=2, n_ctx=256, speculative="off")
    if drafter_factory is not None:
        eng.submitter._drafter = lambda sp: drafter_factory()
    eng.start()
    try:
        cid = _create(eng, "t")
        s = EventSink()
        eng.post(P.SubmitMessage(id=2, conv_id=cid, text=text, raw=True,
                                 sampling=P.SamplingParams(temperature=0.0, max_tokens=max_tokens, top_k=0,
                                                           top_p=1.0, min_p=0.0, repeat_penalty=1.0)), s)
        done = s.wait()
        assert isinstance(done, P.Committed), done
        return [e.token_id for e in s.events if isinstance(e, P.Token)], done
    finally:
        eng.stop()


@pytest.mark.parametrize("text", ["the cat the cat the cat the", "1 2 3 1 2 3 1 2 3 1"])
def test_speculative_greedy_is_token_identical_on_a_hybrid_model(q35, text):
    """Rejected drafts restore the recurrent and convolution state exactly: prompt lookup,
    an always-wrong drafter and a perfect one all give plain greedy's tokens."""
    from aotx.engine.runtime.speculative import PromptLookup

    plain, _ = _generate(q35, text)
    lookup, _ = _generate(q35, text, PromptLookup)
    assert lookup == plain
    wrong, done = _generate(q35, text, _Wrong)
    assert wrong == plain
    assert done.timings["draft_tokens"] > 0 and done.timings["draft_accepted"] == 0

    class Oracle(PromptLookup):
        def propose(self, tokens, limit):
            k = min(self.window - 1, limit)
            done_n = len(tokens) - n_prompt
            return list(plain[done_n:done_n + max(0, k)])

    n_prompt = len(q35.tokenizer.encode(text, parse_special=True))
    oracle, done = _generate(q35, text, Oracle)
    assert oracle == plain
    assert done.timings["draft_accepted"] == done.timings["draft_tokens"] > 0
