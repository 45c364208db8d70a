"""Speculative decoding: greedy output is token-identical with any drafter, a perfect
drafter is fully accepted, and speculative sampling keeps the model's distribution."""

from __future__ import annotations


import numpy as np
import pytest

from aotx.engine import protocol as P
from aotx.engine.runtime.sampling import SamplerConfig, SamplerState, distribution
from aotx.engine.runtime.speculative import PromptLookup, verify
from tests.fakes.sink import EventSink


class WrongDrafter(PromptLookup):
    """Always proposes tokens the model will not pick (vocab id 3 then 5 ...)."""

    def propose(self, tokens, limit):
        k = min(self.window - 1, limit)
        return [(tokens[-1] + 7 + i) % 250 for i in range(max(0, k))]


class Oracle(PromptLookup):
    """Proposes exactly the plain greedy continuation (as a draft model identical to
    the target would)."""

    def __init__(self, prompt_len, reference):
        super().__init__()
        self.prompt_len = prompt_len
        self.reference = reference

    def propose(self, tokens, limit):
        done = len(tokens) - self.prompt_len
        k = min(self.window - 1, limit)
        return list(self.reference[done:done + max(0, k)])


@pytest.fixture(scope="module")
def tiny_lm(tiny_gguf, tmp_path_factory):
    from aotx.engine.model.loader import load_model

    path = tiny_gguf.write_tiny_llama(tmp_path_factory.mktemp("spec") / "t.gguf", seed=3)
    return load_model(path)


def _generate(lm, text, *, drafter_factory=None, temperature=0.0, seed=0, max_tokens=40):
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store

    eng = Engine(lm, open_store(None), n_slots=2, n_ctx=256, speculative="off")
    if drafter_factory is not None:
        eng.submitter._drafter = lambda sp: drafter_factory()
    eng.start()
    try:
        s = EventSink()
        eng.post(P.CreateConversation(id=1, title="t"), s)
        assert s.done.wait(30)
        cid = s.events[0].conversation.conv_id
        s = EventSink()
        eng.post(P.SubmitMessage(id=2, conv_id=cid, text=text, raw=True,
                                 sampling=P.SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                                                           top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)), s)
        assert s.done.wait(120)
        acc = next(e for e in s.events if isinstance(e, P.Accepted))
        done = next(e for e in s.events if isinstance(e, P.Committed))
        return [e.token_id for e in s.events if isinstance(e, P.Token)], done, acc.prompt_ids
    finally:
        eng.stop()


PROMPTS = ["abc abc abc abc", "hello world hello world", "the cat the cat the", "1 2 3 1 2 3 1 2",
           "xyzzy", "a b c d e f g a b c d"]


@pytest.mark.parametrize("text", PROMPTS)
def test_greedy_is_token_identical_with_every_drafter(tiny_lm, text):
    plain, _, prompt = _generate(tiny_lm, text)
    lookup, done, _ = _generate(tiny_lm, text, drafter_factory=PromptLookup)
    assert lookup == plain
    wrong, done_w, _ = _generate(tiny_lm, text, drafter_factory=WrongDrafter)
    assert wrong == plain, "a drafter that is always wrong must still give exact output"
    assert done_w.timings["draft_accepted"] == 0 and done_w.timings["draft_tokens"] > 0
    oracle, done_o, _ = _generate(tiny_lm, text, drafter_factory=lambda: Oracle(len(prompt), plain))
    assert oracle == plain
    assert done_o.timings["draft_tokens"] > 0
    assert done_o.timings["draft_accepted"] == done_o.timings["draft_tokens"], "a perfect drafter is fully accepted"


def test_first_draft_token_is_verified():
    rows = np.zeros((3, 10), np.float32)
    rows[0, 4] = 5.0  # the model wants 4 first
    rows[1, 6] = 5.0
    out = verify(rows.copy(), [7, 6], SamplerConfig(repeat_penalty=1.0, temperature=0.0), SamplerState(seed=0))
    assert out == [4], "a wrong first draft is rejected and replaced by the model's token"
    out = verify(rows.copy(), [4, 6], SamplerConfig(repeat_penalty=1.0, temperature=0.0), SamplerState(seed=0))
    assert out[:2] == [4, 6] and len(out) == 3


def test_speculative_sampling_keeps_the_distribution():
    """Chi-square: the first token out of a verify pass with a fixed one-hot draft
    follows the model's own distribution p (not the draft)."""
    rng = np.random.default_rng(0)
    vocab = 12
    logits = rng.normal(size=vocab).astype(np.float32) * 1.5
    cfg = SamplerConfig(repeat_penalty=1.0, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    ids, p = distribution(logits.copy(), cfg)
    probs = np.zeros(vocab)
    probs[ids] = p
    draft = int(np.argsort(probs)[vocab // 2])  # a middling draft token
    n = 6000
    counts = np.zeros(vocab)
    for seed in range(n):
        rows = np.stack([logits, logits]).copy()
        tok = verify(rows, [draft], cfg, SamplerState(seed=seed))[0]
        counts[tok] += 1
    expected = probs * n
    mask = expected > 5
    chi2 = float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())
    dof = int(mask.sum()) - 1
    # 99.9th percentile of chi-square with <= 11 degrees of freedom is < 32
    assert chi2 < 32, f"chi-square {chi2:.1f} with {dof} dof: speculative sampling changed the distribution"
    # and a seed reproduces the draw
    a = verify(np.stack([logits, logits]).copy(), [draft], cfg, SamplerState(seed=5))
    b = verify(np.stack([logits, logits]).copy(), [draft], cfg, SamplerState(seed=5))
    assert a == b


def test_prompt_lookup_proposes_the_continuation():
    d = PromptLookup(window=4)
    assert d.propose([1, 2, 3, 4, 5, 2, 3], 10) == [4, 5, 2]
    assert d.propose([9, 8, 7], 10) == []
    assert d.propose([5, 6, 7, 5, 6], 1) == [7]
    d.update(3, 3)
    assert d.window == 5
    d.update(3, 0)
    assert d.window == 4
