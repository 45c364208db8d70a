"""Several models in one engine: load, switch, unload, admission.

An Engine runs in-process on the default model (SmolLM2, loaded once per session) with
tiny random-weight llama files of other shapes in its models folder (another
vocabulary, other layer counts and contexts, another tensor type), so that nothing
here waits on the model layer's architectures. Every reply is greedy, so a model's
tokens are a function of its prompt: a stream run beside other models must equal the
same prompt run on an engine holding that model alone.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from aotx.engine.errors import NotFound
from aotx.engine import protocol as P
from aotx.engine.runtime.admission import Budget
from aotx.engine.runtime.catalog import Catalog, close_matches
from tests.fakes.inproc import Client, answer, make_engine, reply, stop


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory, tiny_gguf):
    """Two tiny llama files unlike the default model and unlike each other."""
    from gguf import GGMLQuantizationType as T

    d = tmp_path_factory.mktemp("tinyfiles")
    a = tiny_gguf.write_tiny_llama(d / "tiny-a.gguf", qtype=T.Q8_0, n_layers=2, seed=1, context_length=256)
    b = tiny_gguf.write_tiny_llama(d / "tiny-b.gguf", qtype=T.Q4_0, n_layers=3, seed=2, vocab=320,
                                   context_length=128)
    return {"tiny-a": a, "tiny-b": b}


@pytest.fixture
def home(tmp_path, monkeypatch, tiny_files):
    """AOTX_HOME with the tiny files in its models folder."""
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    models = tmp_path / "models"
    models.mkdir()
    for name, p in tiny_files.items():
        (models / f"{name}.gguf").write_bytes(Path(p).read_bytes())
    return tmp_path


def solo_tokens(lm_or_path, text: str, home: Path, n: int = 6) -> list[int]:
    """Greedy tokens of ``text`` on an engine holding only that model."""
    from aotx.engine.model.loader import load_model

    lm = lm_or_path if not isinstance(lm_or_path, Path) else load_model(lm_or_path)
    eng = make_engine(lm, home, journal=f"solo-{time.monotonic_ns()}")
    try:
        c = Client(eng)
        conv = c.create()
        rid, end = c.run(conv.conv_id, text, n=n)
        assert isinstance(end, P.Committed), end
        return c.tokens(rid)
    finally:
        stop(eng)


# ---- 1. three models, each its own configuration, slots and KV, in one tick loop ----------------

def test_three_models_run_side_by_side_each_exactly_as_alone(loaded_model, home, tiny_files):
    texts = {"": "The capital of France is", "tiny-a": "hello there", "tiny-b": "the hello world"}
    eng = make_engine(loaded_model, home)
    try:
        c = Client(eng)
        convs = {m: c.create(model=m) for m in texts}
        default = loaded_model.name
        assert convs[""].model == default and convs["tiny-a"].model == "tiny-a"
        rids = {m: c.submit(convs[m].conv_id, t, n=12) for m, t in texts.items()}
        ends = {m: reply(c.sink, rid) for m, rid in rids.items()}
        assert all(isinstance(e, P.Committed) for e in ends.values()), ends
        loaded = c.call(P.ListModels, P.ModelList).models
        assert {m.name for m in loaded if m.loaded} == {default, "tiny-a", "tiny-b"}
        # each model tokenized with its own vocabulary: the tiny ones have 300 and 320 tokens
        acc = {m: c.sink.of(P.Accepted, rid)[0] for m, rid in rids.items()}
        assert max(acc["tiny-a"].prompt_ids) < 300 and max(acc["tiny-b"].prompt_ids) < 320
        assert max(acc[""].prompt_ids) >= 320
        # each model its own slots and context: tiny-b's context is its trained 128 tokens
        st = eng.status_reply(0)
        by_model = {}
        for s in st.slots:
            by_model.setdefault(s.model, []).append(s.slot)
        assert by_model == {default: [0, 1], "tiny-a": [0, 1], "tiny-b": [0, 1]}
        assert eng.models.get("tiny-b").n_ctx == 128 and eng.models.get("tiny-a").n_ctx == 256
        # the three replies shared ticks: the tick loop ran each model's batch in the same ticks
        ticks = {m: {e.tick for e in c.sink.of(P.Token, rid)} for m, rid in rids.items()}
        assert ticks[""] & ticks["tiny-a"] or ticks[""] & ticks["tiny-b"], ticks
        got = {m: c.tokens(rid) for m, rid in rids.items()}
        # a reply's model is journaled with it
        view = c.call(P.ShowConversation, P.ConversationInfo, conv_id=convs["tiny-b"].conv_id).conversation
        assert [m.model for m in view.messages if m.role == "assistant"] == ["tiny-b"]
    finally:
        stop(eng)
    # nothing one model set leaked into another: each alone gives the same tokens
    assert got[""] == solo_tokens(loaded_model, texts[""], home, n=12)
    assert got["tiny-a"] == solo_tokens(tiny_files["tiny-a"], texts["tiny-a"], home, n=12)
    assert got["tiny-b"] == solo_tokens(tiny_files["tiny-b"], texts["tiny-b"], home, n=12)


def test_a_prompt_too_long_for_one_model_still_fits_another(loaded_model, home):
    eng = make_engine(loaded_model, home)
    try:
        c = Client(eng)
        b = c.create(model="tiny-b")
        a = c.create(model="tiny-a")
        text = " ".join(["hello"] * 150)  # about 150 tokens: over tiny-b's 128, under tiny-a's 256
        _, end_b = c.run(b.conv_id, text)
        assert isinstance(end_b, P.Error) and end_b.code == "too_long" and "128" in end_b.message
        _, end_a = c.run(a.conv_id, text, n=2)
        assert isinstance(end_a, P.Committed), end_a
    finally:
        stop(eng)


# ---- 2. admission across models ----------------------------------------------------------------

def _budget_for(eng_terms: tuple, extra: int) -> Budget:
    return Budget(sum(v for _, v in eng_terms) + extra, eng_terms)


def test_over_budget_load_is_refused_with_the_numbers_and_evict_idle_makes_room(loaded_model, home):
    from aotx.engine.runtime.models import local_terms

    base = local_terms(loaded_model, 2, 256, 64) + (("journal buffers", 8 << 20),)
    # room for one tiny model beside the default, not two
    probe = make_engine(loaded_model, home, journal="probe")
    try:
        need_a = sum(v for _, v in probe._estimate(probe.catalog.resolve("tiny-a")))
        need_b = sum(v for _, v in probe._estimate(probe.catalog.resolve("tiny-b")))
    finally:
        stop(probe)
    eng = make_engine(loaded_model, home, budget=_budget_for(base, max(need_a, need_b) + (need_a + need_b) // 4))
    try:
        c = Client(eng)
        ok = c.call(P.LoadModel, P.ModelLoaded, model="tiny-a")
        assert isinstance(ok, P.ModelLoaded) and ok.model.loaded and ok.model.needs_bytes > 0
        rid = c.post(lambda i: P.LoadModel(id=i, model="tiny-b"))
        err = answer(c.sink, rid)
        assert isinstance(err, P.Error) and err.code == "busy", err
        notice = [n for n in c.sink.of(P.Notice, rid) if n.kind == "refused"][0]
        assert notice.resource == "memory" and notice.asked > notice.free
        # the numbers: what it needs, what is free, the idle models and what each frees
        assert "tiny-b" in err.message and "idle models: " in err.message
        assert "tiny-a frees" in err.message and loaded_model.name in err.message, err.message
        assert "--evict-idle" in err.message
        assert eng.models.get("tiny-b") is None  # a refused load loads nothing
        # evict_idle: the least recently used idle model goes (the default ran last, so tiny-a)
        conv = c.create()
        c.run(conv.conv_id, "Hi", n=2)
        ok = c.call(P.LoadModel, P.ModelLoaded, model="tiny-b", evict_idle=True)
        assert isinstance(ok, P.ModelLoaded), ok
        assert ok.unloaded == ["tiny-a"]
        assert set(eng.models.loaded) == {loaded_model.name, "tiny-b"}
        used = eng.budget.used
        assert used <= eng.budget.total
        assert any(n.startswith("tiny-b: ") for n, _ in eng.budget.terms)
    finally:
        stop(eng)


def test_keep_alive_unloads_idle_models_but_not_the_default(loaded_model, home):
    eng = make_engine(loaded_model, home, keep_alive_s=0.6)
    try:
        c = Client(eng)
        conv = c.create(model="tiny-a")
        _, end = c.run(conv.conv_id, "hello", n=2)
        assert isinstance(end, P.Committed)
        assert eng.models.get("tiny-a") is not None
        deadline = time.monotonic() + 20
        while eng.models.get("tiny-a") is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert eng.models.get("tiny-a") is None
        assert eng.models.get(loaded_model.name) is not None
        # its conversation keeps its model and loads it again
        rid, end = c.run(conv.conv_id, "hello again", n=2)
        assert isinstance(end, P.Committed), end
        assert any(n.kind == "model" and "loading model tiny-a" in n.message for n in c.sink.of(P.Notice, rid))
    finally:
        stop(eng)


def test_unload_refuses_a_busy_model_and_names_the_loaded_ones(loaded_model, home):
    eng = make_engine(loaded_model, home)
    try:
        c = Client(eng)
        err = c.call(P.UnloadModel, P.Ok, model="tiny-a")
        assert isinstance(err, P.Error) and err.code == "not_found" and loaded_model.name in err.message
        conv = c.create(model="tiny-a")
        rid = c.submit(conv.conv_id, "hello " * 20, n=40)
        c.sink.until(lambda e: isinstance(e, P.Token) and e.id == rid)
        busy = c.call(P.UnloadModel, P.Ok, model="tiny-a")
        assert isinstance(busy, P.Error) and busy.code == "busy", busy
        reply(c.sink, rid)
        ok = c.call(P.UnloadModel, P.Ok, model="tiny-a")
        assert isinstance(ok, P.Ok), ok
        assert "tiny-a" not in eng.models.loaded
    finally:
        stop(eng)


# ---- 3. names: unknown ones list the close matches ---------------------------------------------

def test_unknown_model_names_the_close_matches(loaded_model, home):
    eng = make_engine(loaded_model, home)
    try:
        c = Client(eng)
        conv = c.create()
        rid = c.submit(conv.conv_id, "Hi", model="tiny-c")
        err = answer(c.sink, rid)
        assert isinstance(err, P.Error) and err.code == "not_found"
        assert "(did you mean tiny-b or tiny-a?)" in err.message, err.message
        # nothing was written: the conversation is as it was
        view = c.call(P.ShowConversation, P.ConversationInfo, conv_id=conv.conv_id).conversation
        assert view.messages == [] and view.model == loaded_model.name
    finally:
        stop(eng)


@pytest.mark.parametrize("name, names, want", [
    ("qwen2.5-0.5b", ["qwen2.5-0.5b-instruct-q4_k_m", "gemma-3-270m"], ["qwen2.5-0.5b-instruct-q4_k_m"]),
    ("gema-3-270m", ["qwen2.5-0.5b-instruct-q4_k_m", "gemma-3-270m"], ["gemma-3-270m"]),
    ("SMOLLM2", ["SmolLM2-135M-Instruct.Q4_1"], ["SmolLM2-135M-Instruct.Q4_1"]),
    ("llama-70b", ["gemma-3-270m"], []),
])
def test_close_matches(name, names, want):
    assert close_matches(name, names) == want


def test_catalog_resolves_names_files_and_paths(home, tiny_files):
    cat = Catalog(home / "models")
    assert cat.resolve("tiny-a").path == home / "models" / "tiny-a.gguf"
    assert cat.resolve("tiny-a.gguf").name == "tiny-a"
    e = cat.resolve(str(tiny_files["tiny-b"]))  # a path outside the folder: the folder's copy is another file
    assert e.path == Path(tiny_files["tiny-b"]).resolve() and e.arch == "llama" and e.quant == "Q4_0"
    assert e.n_ctx_train == 128
    with pytest.raises(NotFound, match="did you mean"):
        cat.resolve("tiny")


# ---- 4. the journal names each conversation's model; a restart comes back on it ------------------

def test_restart_brings_each_conversation_back_on_its_model(loaded_model, home):
    eng = make_engine(loaded_model, home)
    c = Client(eng)
    conv_a = c.create(model="tiny-a")
    conv_d = c.create()
    rid_a, _ = c.run(conv_a.conv_id, "hello", n=3)
    first = c.tokens(rid_a)
    stop(eng)

    eng = make_engine(loaded_model, home)  # the same journal
    try:
        assert set(eng.models.loaded) == {loaded_model.name}  # nothing loaded until it is needed
        c = Client(eng)
        views = {v.conv_id: v for v in c.call(P.ListConversations, P.ConversationList).conversations}
        assert views[conv_a.conv_id].model == "tiny-a" and views[conv_d.conv_id].model == loaded_model.name
        rid, end = c.run(conv_a.conv_id, "hello", n=3)
        assert isinstance(end, P.Committed), end
        assert any("loading model tiny-a" in n.message for n in c.sink.of(P.Notice, rid))
        assert max(c.sink.of(P.Accepted, rid)[0].prompt_ids) < 300  # tiny-a's vocabulary
        assert first  # its first reply came from tiny-a too
    finally:
        stop(eng)

    (home / "models" / "tiny-a.gguf").unlink()  # the file is gone
    eng = make_engine(loaded_model, home)
    try:
        c = Client(eng)
        rid, end = c.run(conv_a.conv_id, "Hello", n=2, raw=False)
        assert isinstance(end, P.Committed), end
        notes = [n.message for n in c.sink.of(P.Notice, rid) if n.kind == "model"]
        assert any("ran on tiny-a, which is not installed any more" in n and loaded_model.name in n for n in notes), \
            notes
        view = c.call(P.ShowConversation, P.ConversationInfo, conv_id=conv_a.conv_id).conversation
        assert view.messages[-1].model == loaded_model.name and view.model == loaded_model.name
    finally:
        stop(eng)


def test_a_journal_without_model_fields_reads_as_the_default(tmp_path):
    """Journals written before several models have no model fields: they decode, and the
    conversations run on the engine's default."""
    import msgspec

    from aotx.engine.journal import records as R
    from aotx.engine.journal.conversations import ConversationTable

    class OldCreated(msgspec.Struct, omit_defaults=True):  # the record as version 1 wrote it
        conv_id: str
        title: str = ""

    payload = msgspec.msgpack.encode(OldCreated(conv_id="c1", title="old"))
    rec = msgspec.msgpack.Decoder(R.ConversationCreated).decode(payload)
    t = ConversationTable()
    t.apply(rec, 1)
    assert t.get("c1").model == "" and t.get("c1").title == "old"
    # and the new field does not disturb an old reader that ignores unknown fields
    new = R.encode_payload(R.ConversationCreated(conv_id="c2", model="qwen"))
    assert msgspec.msgpack.Decoder(OldCreated).decode(new).conv_id == "c2"


# ---- 5. switching mid-conversation keeps the history ------------------------------------------------

def test_switching_models_mid_conversation_keeps_the_history(loaded_model, home):
    eng = make_engine(loaded_model, home)
    try:
        c = Client(eng)
        conv = c.create()
        rid1, end1 = c.run(conv.conv_id, "Say hi", raw=False, n=4)
        assert isinstance(end1, P.Committed)
        n_first = len(c.sink.of(P.Accepted, rid1)[0].prompt_ids)
        # the next message on tiny-a: it prefills the whole history, with a notice
        rid2, end2 = c.run(conv.conv_id, "hello", model="tiny-a", raw=False, n=3)
        assert isinstance(end2, P.Committed), end2
        notes = [n.message for n in c.sink.of(P.Notice, rid2) if n.kind == "model"]
        assert any(f"switched this conversation from {loaded_model.name} to tiny-a" in n for n in notes), notes
        acc2 = c.sink.of(P.Accepted, rid2)[0]
        view = c.call(P.ShowConversation, P.ConversationInfo, conv_id=conv.conv_id).conversation
        assert view.model == "tiny-a" and [m.model for m in view.messages if m.role == "assistant"] == \
            [loaded_model.name, "tiny-a"]
        hist = eng.models.get("tiny-a").lm.tokenizer.decode(acc2.prompt_ids)
        assert "Say hi" in hist and view.messages[1].text in hist  # the earlier turn is in tiny-a's prompt
        assert end2.timings["prompt_tokens_reused"] == 0  # tiny-a had nothing of it
        # back on the default: its slot still holds its own state of the conversation
        rid3, end3 = c.run(conv.conv_id, "And again", model=loaded_model.name, raw=False, n=2)
        assert isinstance(end3, P.Committed), end3
        assert end3.timings["prompt_tokens_reused"] >= n_first - 1, end3.timings
    finally:
        stop(eng)


def test_switch_model_operation_is_journaled_and_refused_while_busy(loaded_model, home):
    eng = make_engine(loaded_model, home)
    try:
        c = Client(eng)
        conv = c.create()
        view = c.call(P.SwitchModel, P.ConversationInfo, conv_id=conv.conv_id, model="tiny-b").conversation
        assert view.model == "tiny-b"
        err = c.call(P.SwitchModel, P.ConversationInfo, conv_id=conv.conv_id, model="nope")
        assert isinstance(err, P.Error) and err.code == "not_found"
    finally:
        stop(eng)
    eng = make_engine(loaded_model, home)
    try:
        c = Client(eng)
        assert c.call(P.ShowConversation, P.ConversationInfo, conv_id=conv.conv_id).conversation.model == "tiny-b"
    finally:
        stop(eng)


def test_list_models_describes_every_installed_model(loaded_model, home):
    eng = make_engine(loaded_model, home)
    try:
        c = Client(eng)
        ml = c.call(P.ListModels, P.ModelList)
        by = {m.name: m for m in ml.models}
        assert by[loaded_model.name].loaded and by[loaded_model.name].default
        a = by["tiny-a"]
        assert not a.loaded and a.arch == "llama" and a.quant == "Q8_0" and a.n_ctx_train == 256
        assert a.size_bytes == (home / "models" / "tiny-a.gguf").stat().st_size and a.needs_bytes > a.size_bytes
        assert by["tiny-b"].quant == "Q4_0" and by["tiny-b"].n_ctx_train == 128
    finally:
        stop(eng)


# ---- 6. real files of other architectures (qwen2, gemma3), once the model layer runs them ----------

def test_three_real_models_in_one_engine(loaded_model, home, qwen2_model_path, gemma3_model_path):
    """Several models with real files: SmolLM2 (llama), Qwen2.5-Coder-0.5B (qwen2) and
    Gemma 3 270M (gemma3) loaded together, each answering in its own vocabulary."""
    from aotx.engine.model.architectures import REGISTRY

    missing = [a for a in ("qwen2", "gemma3") if a not in REGISTRY]
    if missing:
        pytest.skip(f"the model layer does not run {', '.join(missing)} yet")
    for name, p in (("qwen2", qwen2_model_path), ("gemma3", gemma3_model_path)):
        (home / "models" / f"{name}.gguf").symlink_to(p)
    eng = make_engine(loaded_model, home, context=512)
    try:
        c = Client(eng)
        convs = {m: c.create(model=m) for m in ("", "qwen2", "gemma3")}
        rids = {m: c.submit(cv.conv_id, "The capital of France is", n=4) for m, cv in convs.items()}
        ends = {m: reply(c.sink, rid, ) for m, rid in rids.items()}
        assert all(isinstance(e, P.Committed) and e.n_completion >= 1 for e in ends.values()), ends
        assert set(eng.models.loaded) == {loaded_model.name, "qwen2", "gemma3"}
        vocab = {m: eng.models.get(m or loaded_model.name).lm.config.vocab_size for m in convs}
        assert len(set(vocab.values())) == 3
    finally:
        stop(eng)


# ---- a mixture of experts beside the default --------------------------------------------------

def test_a_mixture_of_experts_model_runs_beside_the_default_exactly_as_alone(loaded_model, home, tiny_models,
                                                                           tiny_tokenizer):
    path = tiny_models.olmoe.write(home / "models" / "tiny-moe.gguf", tiny_tokenizer)
    eng = make_engine(loaded_model, home)
    try:
        c = Client(eng)
        moe, dense = c.create(model="tiny-moe"), c.create()
        r_moe = c.submit(moe.conv_id, "hello there", n=8)
        r_dense = c.submit(dense.conv_id, "The capital of France is", n=8)
        assert isinstance(reply(c.sink, r_moe), P.Committed) and isinstance(reply(c.sink, r_dense), P.Committed)
        got = c.tokens(r_moe)
        assert {m.name for m in c.call(P.ListModels, P.ModelList).models if m.loaded} == {loaded_model.name,
                                                                                          "tiny-moe"}
    finally:
        stop(eng)
    assert got == solo_tokens(path, "hello there", home, n=8)
