"""Speculative decoding with a draft model, and the drafter's state in capsules.

Tiny llama GGUFs from ``tiny_gguf``: the target (2 layers), the same file loaded
again as its own draft, its first layer alone (same seed, 1 layer: a smaller
model that agrees with the target part of the time), and an unrelated random
model with other dimensions. Checks: an identical draft is accepted 100% under
greedy; greedy output equals plain greedy with every draft; the p_min threshold
stops drafting; speculative sampling with a real q keeps the target's
distribution (chi-square over many seeds, and a control that shows the test can
fail); a vocabulary mismatch is refused with one line and exit code 2; capsules
carry the drafter state through park, restore and a restart.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from aotx.engine import protocol as P
from aotx.engine.model.batch import Segment
from aotx.engine.runtime.sampling import SamplerConfig, SamplerState, distribution
from aotx.engine.runtime.speculative import verify
from aotx.engine.state import capsule as C
from tests.fakes.sink import EventSink


@pytest.fixture(scope="module")
def models(tiny_gguf, tmp_path_factory):
    """name -> LoadedModel: target, same (the target's file loaded again), first_layer
    (the target's seed with 1 layer), other (seed 11, d_model 32, 1 layer)."""
    from aotx.engine.model.loader import load_model

    d = tmp_path_factory.mktemp("draft")
    target = tiny_gguf.write_tiny_llama(d / "target.gguf", seed=3)
    return {
        "target": load_model(target),
        "same": load_model(target),
        "first_layer": load_model(tiny_gguf.write_tiny_llama(d / "first_layer.gguf", seed=3, n_layers=1)),
        "other": load_model(tiny_gguf.write_tiny_llama(d / "other.gguf", seed=11, n_layers=1, d_model=32, ffn=64)),
    }


def _engine(lm, draft=None, *, p_min=0.0, speculative="off", n_slots=2, home=None):
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store
    from aotx.engine.state.cache import CapsuleCache

    caps = None
    store = open_store(home / "journal" if home else None)
    if home is not None:
        caps = CapsuleCache(home / "capsules", host_bytes=64 << 20, fingerprint=lm.fingerprint)
    eng = Engine(lm, store, n_slots=n_slots, n_ctx=256, speculative=speculative, draft_lm=draft,
                 draft_p_min=p_min, capsules=caps)
    eng.start()
    return eng, store


def _create(eng):
    s = EventSink()
    eng.post(P.CreateConversation(id=1, title="t"), s)
    return s.wait().conversation.conv_id


def _say(eng, cid, text, *, speculative="", temperature=0.0, seed=0, max_tokens=40, raw=True, rid=2):
    s = EventSink()
    eng.post(P.SubmitMessage(id=rid, conv_id=cid, text=text, raw=raw,
                             sampling=P.SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                                                       top_k=0, top_p=1.0, min_p=0.0, speculative=speculative,
                                                       repeat_penalty=1.0)), s)
    done = s.wait()
    assert isinstance(done, P.Committed), done
    return [e.token_id for e in s.events if isinstance(e, P.Token)], done


def _generate(lm, text, draft=None, **kw):
    eng, store = _engine(lm, draft, p_min=kw.pop("p_min", 0.0))
    try:
        return _say(eng, _create(eng), text, **kw)
    finally:
        eng.stop()
        store.close()


PROMPTS = ["abc abc abc abc", "hello world hello world", "the cat the cat the", "1 2 3 1 2 3 1 2", "xyzzy",
           "a b c d e f g a b c d"]


@pytest.fixture(scope="module")
def plain(models):
    return {t: _generate(models["target"], t)[0] for t in PROMPTS}


@pytest.mark.parametrize("text", PROMPTS)
def test_identical_draft_is_fully_accepted_under_greedy(models, plain, text):
    got, done = _generate(models["target"], text, models["same"], speculative="draft")
    assert got == plain[text]
    assert done.timings["draft_tokens"] >= 10
    assert done.timings["draft_accepted"] == done.timings["draft_tokens"], "a draft identical to the target is " \
                                                                           "accepted 100% under greedy"


def test_greedy_with_other_drafts_is_token_identical(models, plain):
    totals = {}
    for name in ("first_layer", "other"):
        drafted = accepted = 0
        for text in PROMPTS:
            got, done = _generate(models["target"], text, models[name], speculative="draft")
            assert got == plain[text], f"draft model {name}, prompt {text!r}"
            drafted += done.timings["draft_tokens"]
            accepted += done.timings["draft_accepted"]
        totals[name] = (drafted, accepted)
    # the first layer alone agrees with the target part of the time: accepts and rejections both happen
    d, a = totals["first_layer"]
    assert d > 100 and 0.1 * d < a < 0.9 * d, totals
    assert totals["other"][0] > 100, totals


def test_p_min_stops_drafting(models, plain):
    text = PROMPTS[0]
    _, all_in = _generate(models["target"], text, models["same"], speculative="draft", p_min=0.0)
    got, none = _generate(models["target"], text, models["same"], speculative="draft", p_min=1.01)
    assert got == plain[text]
    assert none.timings["draft_tokens"] == 0 and all_in.timings["draft_tokens"] > 0
    # the tiny target is far from confident: a middling threshold drafts fewer tokens
    _, some = _generate(models["target"], text, models["first_layer"], speculative="draft", p_min=0.05)
    _, more = _generate(models["target"], text, models["first_layer"], speculative="draft", p_min=0.0)
    assert some.timings["draft_tokens"] < more.timings["draft_tokens"]


def test_draft_mode_without_a_draft_model_is_refused(models):
    eng, store = _engine(models["target"])
    try:
        cid = _create(eng)
        s = EventSink()
        eng.post(P.SubmitMessage(id=2, conv_id=cid, text="hi", raw=True,
                                 sampling=P.SamplingParams(speculative="draft")), s)
        err = s.wait()
        assert isinstance(err, P.Error) and err.code == "bad_request"
        assert "--draft-model" in err.message
    finally:
        eng.stop()
        store.close()


def test_sampling_with_a_draft_is_reproducible(models):
    a, da = _generate(models["target"], "abc", models["first_layer"], speculative="draft", temperature=1.0, seed=5)
    b, _ = _generate(models["target"], "abc", models["first_layer"], speculative="draft", temperature=1.0, seed=5)
    c, _ = _generate(models["target"], "abc", models["first_layer"], speculative="draft", temperature=1.0, seed=6)
    assert a == b and a != c
    assert 0 < da.timings["draft_accepted"] < da.timings["draft_tokens"]


# ---- speculative sampling keeps the target's distribution -------------------------------

def _two_token_counts(target, draft, prompt, cfg, seeds, *, one_hot_q=False):
    """Emulate the engine's decode loop (propose, one verify window, roll back) from the
    pending token after ``prompt`` until two tokens are out; count the pairs."""
    from aotx.engine.runtime.drafter import DraftDrafter, DraftModel

    dm = DraftModel(draft, 1, 64, p_min=0.0)
    kv = target.model.new_kv_cache(1, 64)
    target.model.forward(np.asarray(prompt[:-1], np.int32), [Segment(0, 0, len(prompt) - 1)], kv)
    counts: dict[tuple[int, int], int] = {}
    accepted = rejected = 0

    class Req:
        slot = type("S", (), {"index": 0})()
        sampler = cfg

    for seed in seeds:
        req = Req()
        req.sampler_state = SamplerState(seed=seed)
        drafter = DraftDrafter(draft=dm, window=3)
        drafter.bind(req)
        tokens = list(prompt)  # the last one is pending (sampled, not fed to the target)
        out: list[int] = []
        while len(out) < 2:
            drafts = drafter.propose(tokens, 8)
            pos = len(tokens) - 1
            rows = target.model.forward(np.asarray([tokens[-1]] + drafts, np.int32),
                                        [Segment(0, pos, 1 + len(drafts), all_logits=True)], kv)
            got = verify(rows.copy(), drafts, cfg, req.sampler_state, q=None if one_hot_q else drafter.q)
            drafter.update(len(drafts), len(got) - 1)
            accepted += len(got) - 1
            rejected += len(drafts) - (len(got) - 1)
            tokens += got
            out += got
        key = (out[0], out[1])
        counts[key] = counts.get(key, 0) + 1
    return counts, accepted, rejected


def _exact_pairs(target, prompt, cfg):
    """The target's own distribution of the next two tokens after ``prompt``."""
    kv = target.model.new_kv_cache(1, 64)
    lg = target.model.forward(np.asarray(prompt, np.int32), [Segment(0, 0, len(prompt))], kv)[0]
    ids, p = distribution(lg.copy(), cfg)
    out = {}
    for a, pa in zip(ids.tolist(), p.tolist()):
        lg2 = target.model.forward(np.asarray([a], np.int32), [Segment(0, len(prompt), 1)], kv)[0]
        ids2, p2 = distribution(lg2.copy(), cfg)
        for b, pb in zip(ids2.tolist(), p2.tolist()):
            out[(a, b)] = pa * pb
    return out


def _chi2(counts, exact, n):
    keys = [k for k, v in exact.items() if v * n >= 5]
    rest = 1.0 - sum(exact[k] for k in keys)
    obs = [counts.get(k, 0) for k in keys] + [n - sum(counts.get(k, 0) for k in keys)]
    exp = [exact[k] * n for k in keys] + [rest * n]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    return chi2, len(keys)


def test_speculative_sampling_with_a_draft_model_keeps_the_distribution(models):
    """Chi-square over 1,000 seeds: the first two tokens out of the draft-model path
    (drafts sampled from q, accepted with min(1, p/q), residual max(p - q, 0)) follow
    the target's own joint distribution (top-k 4, temperature 1: 16 cells), and not the
    draft's (so the test can tell the two apart: a rule that leaked q would fail)."""
    target, draft = models["target"], models["first_layer"]
    cfg = SamplerConfig(repeat_penalty=1.0, temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)
    prompt = target.tokenizer.encode("the cat")
    n = 1000
    counts, acc, rej = _two_token_counts(target, draft, prompt, cfg, range(n))
    assert acc > 200 and rej > 200, (acc, rej)  # both branches of the acceptance test ran
    chi2, cells = _chi2(counts, _exact_pairs(target, prompt, cfg), n)
    # 99.9th percentile of chi-square with 16 degrees of freedom: 39.3
    assert cells >= 8 and chi2 < 39.3, f"chi-square {chi2:.1f} over {cells + 1} cells"
    assert _chi2(counts, _exact_pairs(draft, prompt, cfg), n)[0] > 100, "the draft's distribution must differ"
    again, _, _ = _two_token_counts(target, draft, prompt, cfg, range(20))
    first, _, _ = _two_token_counts(target, draft, prompt, cfg, range(20))
    assert again == first, "a seed reproduces the draws"


def test_verify_with_q_residual():
    """One fixed draft d = 3 with q(3) = 0.9, q(0) = 0.1 against p = (0.1, 0.2, 0.3, 0.4):
    accepted with probability min(1, p(3)/q(3)) = 0.444; on rejection the token comes
    from max(p - q, 0) = (0, 0.2, 0.3, 0) normalized: never 0 (p(0) = q(0)) nor 3."""
    vocab = 6
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.4, 1e-9, 1e-9], np.float32))
    cfg = SamplerConfig(repeat_penalty=1.0, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    q = (np.array([3, 0]), np.array([0.9, 0.1]))
    n, acc = 4000, 0
    firsts = np.zeros(vocab)
    for seed in range(n):
        got = verify(np.stack([logits, logits]), [3], cfg, SamplerState(seed=seed), q=[q])
        acc += got[0] == 3 and len(got) == 2
        firsts[got[0]] += 1
    assert abs(acc / n - 0.4 / 0.9) < 0.03
    assert firsts[3] == acc and firsts[0] == 0 and firsts[4] + firsts[5] <= 1
    assert abs(firsts[1] / (n - acc) - 0.4) < 0.05  # 0.2 / (0.2 + 0.3)


# ---- vocabulary ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mismatched(tiny_gguf, tmp_path_factory, models):
    d = tmp_path_factory.mktemp("vocab")
    bigger = tiny_gguf.write_tiny_llama(d / "bigger.gguf", seed=4, vocab=310)
    tokens, _, _ = tiny_gguf.vocabulary(300)
    tokens = list(tokens)
    tokens[280] = "zz-not-the-same"
    renamed = tiny_gguf.write_tiny_llama(d / "renamed.gguf", seed=4,
                                         metadata={"tokenizer.ggml.tokens": tokens})
    return {"bigger": bigger, "renamed": renamed, "target": models["target"].path}


def test_vocabulary_mismatch_is_refused(mismatched, models, tmp_path, monkeypatch, capsys):
    from aotx.app.main import main as chat_main
    from aotx.engine.cli.commands import main
    from aotx.engine.errors import ModelError
    from aotx.engine.model.loader import load_model
    from aotx.engine.runtime.drafter import DraftModel, check_vocabulary_files

    target = str(mismatched["target"])
    with pytest.raises(ModelError, match="310 tokens, the model's has 300"):
        check_vocabulary_files(target, mismatched["bigger"])
    with pytest.raises(ModelError, match="token 280 is 'zz-not-the-same'"):
        check_vocabulary_files(target, mismatched["renamed"])
    with pytest.raises(ModelError, match="vocabulary"):
        DraftModel.check_vocabulary(models["target"], load_model(mismatched["renamed"]))
    DraftModel.check_vocabulary(models["target"], models["other"])  # same vocabulary, other dimensions
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    sock = str(tmp_path / "e.sock")
    for argv in (["serve", "--model", target, "--draft-model", str(mismatched["bigger"]), "--device", "cpu",
                  "--socket", sock, "--no-journal"],
                 ["run", "--model", target, "--draft-model", str(mismatched["renamed"]), "--socket", sock, "hi"]):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "a draft model must share the model's vocabulary" in err, err
    assert chat_main(["--model", target, "--draft-model", str(mismatched["bigger"]), "--socket", sock]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "310 tokens" in err, err


# ---- capsules carry the drafter state --------------------------------------------------------

def test_capsule_file_keeps_drafter_state(models, tmp_path):
    from aotx.engine.runtime.drafter import DraftModel

    target, draft = models["target"], models["first_layer"]
    ids = target.tokenizer.encode("hello world hello")
    kv = target.model.new_kv_cache(1, 32)
    target.model.forward(np.asarray(ids, np.int32), [Segment(0, 0, len(ids))], kv)
    dm = DraftModel(draft, 2, 32)
    dm.catch_up(0, ids + [5])
    cap = C.snapshot(kv, 0, ids, fingerprint=target.fingerprint, drafter=dm.state(0))
    assert cap.header.drafter["n_tokens"] == len(ids) + 1
    C.save(cap, tmp_path / "d.caps")
    back = C.load(tmp_path / "d.caps")
    assert back.draft_k.tobytes() == cap.draft_k.tobytes() and back.draft_tokens.tolist() == ids + [5]
    assert back.nbytes == cap.nbytes > cap.k.nbytes + cap.v.nbytes + cap.tokens.nbytes
    # restore into the other draft slot: byte-exact, up to the prefix shared with the prompt
    assert dm.restore(back, 1, ids + [7, 8]) == len(ids)
    assert dm.tokens[1] == ids
    for li in range(len(dm.kv.k)):
        assert dm.kv.k[li][1, :, :len(ids)].tobytes() == dm.kv.k[li][0, :, :len(ids)].tobytes()
    # a capsule without drafter state (as written before drafters existed) still loads
    plain = C.snapshot(kv, 0, ids, fingerprint=target.fingerprint)
    C.save(plain, tmp_path / "p.caps")
    old = C.load(tmp_path / "p.caps")
    assert old.draft_k is None and dm.restore(old, 1, ids) == 0
    # another draft model's state is not restored
    other = DraftModel(models["other"], 1, 32)
    assert other.restore(back, 0, ids) == 0
    # a flipped bit in the drafter buffers is caught
    data = bytearray((tmp_path / "d.caps").read_bytes())
    data[-(back.draft_tokens.nbytes + 8)] ^= 0x10
    (tmp_path / "flip.caps").write_bytes(bytes(data))
    with pytest.raises(C.CapsuleError, match="drafter checksum"):
        C.load(tmp_path / "flip.caps")


def _turns(eng, cid, texts, seed0=40):
    return [_say(eng, cid, t, speculative="draft", temperature=0.9, seed=seed0 + i, max_tokens=24, raw=False,
                 rid=10 + i)[0] for i, t in enumerate(texts)]


TURNS = ["hello there, tell me about the cat", "and the other one?", "one more time"]


def test_park_restore_and_resume_keep_the_drafter_state(models, tmp_path):
    """Sampled decode with a draft model after the conversation was parked (its slot taken
    by another), and after an engine restart (capsule on disk), is identical to decode
    that never stopped; the draft KV comes back from the capsule."""
    target, draft = models["target"], models["first_layer"]
    eng, store = _engine(target, draft, n_slots=1, home=tmp_path / "straight")
    try:
        straight = _turns(eng, _create(eng), TURNS)
    finally:
        eng.stop()
        store.close()
    home = tmp_path / "parked"
    eng, store = _engine(target, draft, n_slots=1, home=home)
    restored: list[int] = []
    try:
        real = eng.draft.restore
        eng.draft.restore = lambda cap, slot, prompt: restored.append(real(cap, slot, prompt)) or restored[-1]
        a = _create(eng)
        first = _turns(eng, a, TURNS[:1])
        b = _create(eng)
        _turns(eng, b, ["a different conversation that takes the only slot"], seed0=99)
        second = _turns(eng, a, TURNS[1:2], seed0=41)
        time.sleep(0.5)  # the reply's capsule reaches disk in the background
    finally:
        eng.stop()
        store.close()
    assert restored and restored[0] > 20, "a's draft KV should come back from its parked capsule"
    assert first + second == straight[:2]
    eng, store = _engine(target, draft, n_slots=1, home=home)
    restored.clear()
    try:
        real2 = eng.draft.restore
        eng.draft.restore = lambda cap, slot, prompt: restored.append(real2(cap, slot, prompt)) or restored[-1]
        third = _turns(eng, a, TURNS[2:], seed0=42)
    finally:
        eng.stop()
        store.close()
    assert restored and restored[0] > 40, "after a restart the draft KV comes back from the capsule on disk"
    assert third == straight[2:]


# ---- admission and status ----------------------------------------------------------------------

def test_admission_counts_the_draft_model_and_status_shows_it(models, tmp_path, monkeypatch):
    import argparse

    from aotx.engine.errors import AdmissionError
    from aotx.engine.cli.serve import build_engine

    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    target, draft = models["target"], models["other"]
    args = argparse.Namespace(model=str(target.path), device="cpu", slots=3, context=128, memory_budget="4G",
                              no_journal=True, draft_model=str(draft.path), speculative=None, draft_p_min=None)
    eng, store = build_engine(args)
    try:
        terms = dict(eng.budget.terms)
        cfg = draft.config
        # its own KV: K and V, float16 (the default KV type), for every layer, slot and position
        assert terms["draft kv cache"] == 2 * cfg.n_layers * 3 * cfg.n_kv_heads * 128 * cfg.head_dim * 2
        assert terms["draft weights"] == draft.model.weight_bytes > 0
        assert terms["draft working"] > 0
        assert eng.speculative == "draft", "with --draft-model the engine drafts by default"
        assert eng.draft.kv.k[0].shape == (3, cfg.n_kv_heads, 128, cfg.head_dim)
        st = eng.status_reply(1)
        assert st.draft_model == "other" and st.draft_model_path == str(draft.path)
        assert {"draft weights", "draft kv cache", "draft working"} <= {b.name for b in st.budget}
    finally:
        store.close()
    # admission adds the draft's terms to the rest: one byte short of them is refused
    from aotx.engine.runtime import admission
    from aotx.engine.runtime.drafter import DraftModel

    plain = admission.plan(target.config, target.model.weight_bytes, target.model.kv_cache_bytes(3, 128), 3, 128,
                           256, 8 << 20, 1 << 40)
    extra = DraftModel.budget_terms(draft, 3, 128)
    need = plain.used + sum(v for _, v in extra)
    assert admission.plan(target.config, target.model.weight_bytes, target.model.kv_cache_bytes(3, 128), 3, 128,
                          256, 8 << 20, need, draft_terms=extra).free == 0
    with pytest.raises(AdmissionError, match="draft kv cache"):
        admission.plan(target.config, target.model.weight_bytes, target.model.kv_cache_bytes(3, 128), 3, 128,
                       256, 8 << 20, need - 1, draft_terms=extra)
