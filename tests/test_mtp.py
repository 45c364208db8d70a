"""The MTP drafter (``--speculative mtp``): the file's nextn block drafts, the verify window
checks, acceptance is exact.

The head (``TransformerModel.load_mtp``, qwen35's ``mtp_forward``) computes what
tests/program_reference.py's float64 interpreter says its Program means; the engine with
``speculative="mtp"`` gives plain greedy's tokens while drafting (the tiny file's random
head rarely guesses right, so drafts are mostly rejected: every rejection rolls the
recurrent state back); a model without nextn layers refuses the mode in one line.
"""

from __future__ import annotations

import numpy as np
import pytest

from aotx.engine import protocol as P
from aotx.engine.model.batch import Segment
from tests.fakes.sink import EventSink
from tests.program_reference import reference_logits


@pytest.fixture(scope="module")
def files(tiny_tokenizer, tmp_path_factory):
    from tests.models import qwen35

    root = tmp_path_factory.mktemp("mtp")
    return {"mtp": qwen35.write(root / "q35.gguf", tiny_tokenizer, pre="qwen2"),
            "plain": qwen35.write(root / "q35-no-mtp.gguf", tiny_tokenizer, pre="qwen2", nextn=0)}


@pytest.fixture(scope="module")
def q35(files):
    from aotx.engine.model.loader import load_model

    return load_model(files["mtp"])


def test_mtp_head_matches_the_float64_reference(files):
    from aotx.engine.model.loader import load_model

    lm = load_model(files["mtp"], int8_activations=False)
    head = lm.model.load_mtp()
    ids = np.arange(1000, 1030, dtype=np.int32)
    h = np.random.default_rng(0).standard_normal((30, lm.config.d_model)).astype(np.float32)
    kv = head.new_kv_cache(1, 32, "f32")
    got = head.forward(ids, [Segment(0, 0, 30, all_logits=True)], kv, h)
    want = reference_logits(head.program, ids, n_ctx=32, inputs={"h": h})
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def _generate(lm, text, mode, p_min=0.0, max_tokens=24, keep=None):
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store

    eng = Engine(lm, open_store(None), n_slots=2, n_ctx=256, speculative=mode)
    if eng.submitter.mtp is not None:
        eng.submitter.mtp.p_min = p_min
    eng.start()
    try:
        s = EventSink()
        eng.post(P.CreateConversation(id=1, title="t"), s)
        cid = s.wait().conversation.conv_id
        s = EventSink()
        eng.post(P.SubmitMessage(id=2, conv_id=cid, text=text, raw=True,
                                 sampling=P.SamplingParams(temperature=0.0, max_tokens=max_tokens, top_k=0, top_p=1.0,
                                                           min_p=0.0, repeat_penalty=1.0)), s)
        done = s.wait()
        if keep is not None:
            keep["mtp"], keep["prompt"] = eng.submitter.mtp, next(e for e in s.events if isinstance(e, P.Accepted))
        return [e.token_id for e in s.events if isinstance(e, P.Token)], done
    finally:
        eng.stop()


def test_mtp_drafting_is_token_identical_to_plain_greedy(q35):
    text = "The moon and the sea, the moon and the sea, the moon"
    plain, _ = _generate(q35, text, "off")
    mtp, done = _generate(q35, text, "mtp")
    assert isinstance(done, P.Committed), done
    assert mtp == plain
    assert done.timings["draft_tokens"] > 0


def test_the_head_follows_every_committed_token(q35):
    """After a reply, the head's KV cells of the committed positions are exactly those of one
    pass over (h_{t-1}, x_t) for the whole sequence: each prefill chunk and each verify
    window's accepted rows were paired with the right hidden state."""
    keep: dict = {}
    toks, _ = _generate(q35, "a b c a b c a b", "mtp", keep=keep)
    mtp = keep["mtp"]
    fed = list(keep["prompt"].prompt_ids) + toks[:-1]
    n = len(fed)
    kv = q35.model.new_kv_cache(1, 256)
    q35.model.forward(np.asarray(fed, np.int32), [Segment(0, 0, n, all_logits=True)], kv)
    h = q35.model.last_hidden()
    hin = np.concatenate([np.zeros((1, h.shape[1]), np.float32), h[:-1]])
    ref = mtp.head.new_kv_cache(1, 256)
    mtp.head.forward(np.asarray(fed, np.int32), [Segment(0, 0, n, logits=False)], ref, hin)
    slot = next(s for s in range(mtp.kv.n_slots) if mtp.kv.k[0][s, :, :n].any())
    assert np.array_equal(mtp.kv.k[0][slot, :, :n], ref.k[0][0, :, :n])
    assert np.array_equal(mtp.kv.v[0][slot, :, :n], ref.v[0][0, :, :n])


def test_mtp_is_refused_for_a_model_without_an_mtp_head(files):
    from aotx.engine.model.loader import load_model

    lm = load_model(files["plain"])
    assert not lm.model.has_mtp
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store

    eng = Engine(lm, open_store(None), n_slots=1, n_ctx=64)
    eng.start()
    try:
        s = EventSink()
        eng.post(P.CreateConversation(id=1, title="t"), s)
        cid = s.wait().conversation.conv_id
        s = EventSink()
        eng.post(P.SubmitMessage(id=2, conv_id=cid, text="hi", raw=True,
                                 sampling=P.SamplingParams(max_tokens=4, speculative="mtp")), s)
        err = s.wait()
        assert isinstance(err, P.Error) and "multi-token-prediction head" in err.message, err
    finally:
        eng.stop()


def test_a_hybrid_draft_model_is_refused(q35):
    """A draft model's slots are cut back to the committed tokens after every verify pass,
    which a recurrent state cannot follow: refused in one line, naming the way out."""
    from aotx.engine.errors import ModelError
    from aotx.engine.runtime.drafter import DraftModel

    with pytest.raises(ModelError, match="recurrent layers and cannot draft"):
        DraftModel(q35, 1, 64)
