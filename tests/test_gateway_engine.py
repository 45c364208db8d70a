"""Constrained decoding, logprobs and forked choices inside the engine (no HTTP).

The host sampler's mask (an id the bitmask forbids is never picked; greedy takes the
best allowed id; speculative verification rejects a forbidden draft, greedy or
sampled), the grammar state through a capsule on disk (restored, it gives the same
masks and continues the same constraint), and an in-process engine on the default
model: a JSON-schema reply is valid and token-identical with prompt-lookup drafts on
and off (drafts the grammar forbids are rejected, never emitted), n = 3 constrained
choices are all valid while the prompt is prefilled once, and logprobs are the log
softmax of the model's own logits for the prompt's last row.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from aotx.engine import protocol as P
from aotx.engine.runtime.sampling import SamplerConfig, SamplerState, apply_mask, log_softmax, sample
from aotx.engine.runtime.speculative import verify
from aotx.engine.state import capsule as C
from tests.fakes.sink import EventSink

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")


def _mask(vocab: int, allowed) -> np.ndarray:
    bits = np.zeros(((vocab + 31) // 32) * 32, bool)
    bits[list(allowed)] = True
    return np.packbits(bits, bitorder="little").view(np.int32)


def test_host_mask_forbids_and_greedy_takes_the_best_allowed():
    rng = np.random.default_rng(1)
    V = 1000
    logits = rng.standard_normal(V).astype(np.float32)
    allowed = [3, 77, 500, 999]
    m = _mask(V, allowed)
    x = logits.copy()
    apply_mask(x, m)
    assert np.isneginf(x[[i for i in range(V) if i not in allowed]]).all() and np.isfinite(x[allowed]).all()
    assert sample(logits.copy(), SamplerConfig(temperature=0.0), SamplerState(0), m) == allowed[
        int(np.argmax(logits[allowed]))]
    for seed in range(200):
        t = sample(logits.copy(), SamplerConfig(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0), SamplerState(seed), m)
        assert t in allowed


def test_verify_rejects_a_draft_the_mask_forbids():
    V = 50
    rows = np.zeros((3, V), np.float32)
    rows[:, 7] = 40.0  # the model is sure of 7 everywhere
    rows[:, 8] = 5.0
    drafts = [7, 7]
    masks = np.stack([_mask(V, range(V)), _mask(V, [8, 9]), _mask(V, [8])])  # row 1 forbids 7
    assert verify(rows.copy(), drafts, SamplerConfig(temperature=0.0), SamplerState(0)) == [7, 7, 7]
    assert verify(rows.copy(), drafts, SamplerConfig(temperature=0.0), SamplerState(0), masks=masks) == [7, 8]
    for seed in range(50):  # sampling: the forbidden draft has p = 0 and is always rejected
        out = verify(rows.copy(), drafts, SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
                     SamplerState(seed), masks=masks)
        assert out[0] == 7 and out[1] in (8, 9) and len(out) == 2


@pytest.fixture(scope="module")
def compiler(loaded_model):
    from aotx.engine.runtime.constraints import Compiler

    return Compiler(loaded_model.tokenizer)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                    "maxItems": 2}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


def test_grammar_state_through_a_capsule_on_disk(loaded_model, compiler, tmp_path):
    from aotx.engine.runtime.constraints import GrammarError, GrammarState

    tok = loaded_model.tokenizer
    g = compiler.compile("json_schema", json.dumps(SCHEMA), "response_format")
    half = tok.encode('{"name": "Ada", "age": 3')
    assert g.consume(half)
    kv = loaded_model.model.new_kv_cache(1, 64)
    cap = C.snapshot(kv, 0, half, fingerprint=loaded_model.fingerprint, grammar=g.snapshot())
    C.save(cap, tmp_path / "c.caps")
    back = C.load(tmp_path / "c.caps")
    g2 = GrammarState.restore(compiler, back.header.grammar)
    assert g2.consumed == half and (g2.mask() == g.mask()).all()
    rest = tok.encode('6, "pets": ["cat"]}')
    assert g2.consume(rest) and g2.done and g.consume(rest) and g.done
    fork = compiler.compile("json_schema", json.dumps(SCHEMA)).fork()
    assert fork.consumed == [] and not fork.done
    with pytest.raises(GrammarError):
        GrammarState.restore(compiler, {"grammar": g.text, "consumed": tok.encode("not json")})


@pytest.fixture()
def engine(loaded_model):
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store

    eng = Engine(loaded_model, open_store(None), n_slots=4, n_ctx=512, prefill_chunk=64, device="cpu")
    eng.start()
    yield eng
    eng.stop()


def _conv(eng) -> str:
    s = EventSink()
    eng.post(P.CreateConversation(id=1, title="t"), s)
    return s.wait().conversation.conv_id


def _run(eng, **fields) -> EventSink:
    s = EventSink()
    eng.post(P.SubmitMessage(id=2, conv_id=_conv(eng), **fields), s)
    n = fields.get("n", 1)
    while len(s.all(P.Committed)) < n:
        ev = s.wait(300)
        assert not isinstance(ev, P.Error), ev
    return s


def test_constrained_reply_is_valid_and_the_same_with_drafts_on_and_off(engine):
    c = P.Constraint(kind="json_schema", grammar=json.dumps(SCHEMA), field="response_format")
    texts = {}
    for mode in ("off", "ngram"):
        s = _run(engine, text="Describe a person with pets as JSON.", constraint=c,
                 sampling=P.SamplingParams(temperature=0.0, max_tokens=80, speculative=mode))
        (done,) = s.all(P.Committed)
        assert done.finish_reason == "stop", done.text
        jsonschema.validate(json.loads(done.text), SCHEMA)
        texts[mode] = ([t.token_id for t in s.all(P.Token)], done.timings)
    assert texts["ngram"][0] == texts["off"][0]
    assert texts["ngram"][1]["draft_tokens"] > 0, "prompt lookup proposed no draft: the test shows nothing"


def test_three_constrained_choices_from_one_prefill(engine):
    c = P.Constraint(kind="json_schema", grammar=json.dumps(SCHEMA), field="response_format")
    before = engine.executor.prefill_tokens
    s = _run(engine, text="A person as JSON.", constraint=c, n=3, logprobs=2,
             sampling=P.SamplingParams(temperature=0.9, seed=4, max_tokens=80))
    acc = s.all(P.Accepted)
    assert sorted(a.choice for a in acc) == [0, 1, 2] and len({a.conv_id for a in acc}) == 3
    assert engine.executor.prefill_tokens - before == len(acc[0].prompt_ids)
    for done in s.all(P.Committed):
        jsonschema.validate(json.loads(done.text), SCHEMA)
    first = {t.choice: t for t in reversed(s.all(P.Token))}
    for t in first.values():  # every choice's first token was drawn from the same prefill row
        assert t.logprob is not None and len(t.top) == 2 and t.top[0][0] == first[0].top[0][0]


def test_logprobs_are_the_log_softmax_of_the_models_logits(engine, loaded_model):
    from aotx.engine.model.batch import Segment

    s = _run(engine, text="The capital of France is", raw=True, logprobs=3,
             sampling=P.SamplingParams(temperature=0.0, max_tokens=1))
    (tok,) = s.all(P.Token)
    ids = s.one(P.Accepted).prompt_ids
    kv = loaded_model.model.new_kv_cache(1, len(ids) + 1)
    logits = loaded_model.model.forward(np.asarray(ids, np.int32), [Segment(0, 0, len(ids))], kv)[-1]
    lp = log_softmax(logits)
    assert tok.token_id == int(np.argmax(logits))
    assert abs(tok.logprob - lp[tok.token_id]) < 1e-3
    assert [i for i, _, _ in tok.top] == list(np.argsort(-lp, kind="stable")[:3])
    assert tok.piece == loaded_model.tokenizer.token_bytes(tok.token_id)


def test_a_grammar_llguidance_cannot_compile_is_refused_and_writes_nothing(engine):
    s = EventSink()
    conv = _conv(engine)
    engine.post(P.SubmitMessage(id=3, conv_id=conv, text="x", constraint=P.Constraint(
        kind="json_schema", grammar='{"type": "strin"}', field="response_format.json_schema.schema")), s)
    err = s.wait()
    assert isinstance(err, P.Error) and err.code == "bad_request"
    assert err.message.startswith("response_format.json_schema.schema:") and "strin" in err.message
    engine.post(P.ShowConversation(id=4, conv_id=conv), s)
    assert s.wait().conversation.messages == []
    assert copy.copy(engine.ready)
