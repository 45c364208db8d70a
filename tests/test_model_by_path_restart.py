"""A conversation on a model loaded by path comes back on it after a restart (defect:
"a conversation loses its model after an engine restart although the file is still there").

The engine that wrote the conversation ran on a tiny llama file loaded by path (outside
the models folder, as ``aotx run --model ./file.gguf`` does); the engine after the
restart runs on the default model and has never heard of that name. The reply records
the file's absolute path and fingerprint, and the restarted engine loads it from there
when the fingerprint still matches; a file that is gone or holds another model falls
back on the default with the notice.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aotx.engine import protocol as P
from aotx.engine.model.loader import file_fingerprint, load_model
from tests.fakes.inproc import Client, make_engine, stop


@pytest.fixture
def setup(loaded_model, tmp_path, monkeypatch, tiny_gguf):
    """(home, the tiny file outside the models folder, the two conversation ids: one
    created naming the file, one created on the engine's default, which was that file)."""
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    monkeypatch.setenv("AOTX_HOME", str(home))
    work = tmp_path / "work"
    work.mkdir()
    path = tiny_gguf.write_tiny_llama(work / "tiny-q.gguf", seed=3)
    eng = make_engine(load_model(path, device="cpu"), home)  # `aotx run --model tiny-q.gguf` started it
    try:
        c = Client(eng)
        a = c.create(model=str(path)).conv_id
        b = c.create().conv_id  # the second conversation: on the engine's default, the file
        for cid in (a, b):
            _, end = c.run(cid, "hello", n=2)
            assert isinstance(end, P.Committed), end
            view = c.call(P.ShowConversation, P.ConversationInfo, conv_id=cid).conversation
            assert view.model == "tiny-q" and view.messages[-1].model == "tiny-q"
        conv = eng.store.get(a)
        assert conv.model_path == str(Path(path).resolve()) and conv.model_fingerprint == file_fingerprint(path)
    finally:
        stop(eng)
    return home, Path(path), a, b


def model_notices(c: Client, rid: int) -> list[str]:
    return [n.message for n in c.sink.of(P.Notice, rid) if n.kind == "model"]


def test_restart_loads_a_model_loaded_by_path_from_its_recorded_file(setup, loaded_model):
    home, path, a, b = setup
    eng = make_engine(loaded_model, home)  # restarted on the default model; the name is not installed
    try:
        c = Client(eng)
        for cid in (a, b):
            rid, end = c.run(cid, "after restart", n=2)
            assert isinstance(end, P.Committed), end
            notes = model_notices(c, rid)
            assert not any("not installed any more" in n for n in notes), notes
            assert max(c.sink.of(P.Accepted, rid)[0].prompt_ids) < 300  # the tiny file's vocabulary
            view = c.call(P.ShowConversation, P.ConversationInfo, conv_id=cid).conversation
            assert view.model == "tiny-q" and view.messages[-1].model == "tiny-q", (cid, view.model)
        assert "tiny-q" in eng.models.loaded
    finally:
        stop(eng)


def test_restart_falls_back_when_the_recorded_file_holds_another_model(setup, loaded_model, tiny_gguf):
    home, path, a, _ = setup
    tiny_gguf.write_tiny_llama(path, seed=9, n_layers=3)  # same path, other weights
    eng = make_engine(loaded_model, home)
    try:
        c = Client(eng)
        rid, end = c.run(a, "after restart", n=2)
        assert isinstance(end, P.Committed), end
        notes = model_notices(c, rid)
        # the file was installed under its name when it was opened by path: the name is known,
        # its file is not that model any more
        assert any("ran on tiny-q, which cannot be loaded any more" in n and "now holds another model" in n
                   and loaded_model.name in n for n in notes), notes
        assert "tiny-q" not in eng.models.loaded
    finally:
        stop(eng)


def test_restart_falls_back_when_the_recorded_file_is_gone(setup, loaded_model):
    home, path, a, _ = setup
    path.unlink()
    eng = make_engine(loaded_model, home)
    try:
        c = Client(eng)
        rid, end = c.run(a, "after restart", n=2)
        assert isinstance(end, P.Committed), end
        notes = model_notices(c, rid)
        assert any("cannot be loaded any more" in n and f"its file {path.resolve()} is gone" in n for n in notes), notes
    finally:
        stop(eng)


def test_only_the_engines_default_is_marked_default(loaded_model, tmp_path, monkeypatch, tiny_gguf):
    """Defect: ``/v1/models`` marked both models ``"default": true`` when the engine ran on
    a file loaded by path: the wheel's model kept its catalog ``default`` flag."""
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    monkeypatch.setenv("AOTX_HOME", str(home))
    path = tiny_gguf.write_tiny_llama(tmp_path / "tiny-q.gguf", seed=3)
    eng = make_engine(load_model(path, device="cpu"), home)
    try:
        models = Client(eng).call(P.ListModels, P.ModelList).models
        assert {m.name: m.default for m in models} == {loaded_model.name: False, "tiny-q": True}
    finally:
        stop(eng)


def test_a_running_engine_falls_back_when_the_file_went_away_while_it_ran(loaded_model, tmp_path, monkeypatch,
                                                                          tiny_gguf):
    """Regression: on an engine that is still running, a conversation whose model
    (loaded by path, then unloaded) lost its file failed with exit 2 ("No such file or
    directory"); after a restart the same case fell back. Now both fall back with the notice."""
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    monkeypatch.setenv("AOTX_HOME", str(home))
    path = tiny_gguf.write_tiny_llama(tmp_path / "tiny-q.gguf", seed=3)
    eng = make_engine(loaded_model, home)
    try:
        c = Client(eng)
        a = c.create(model=str(path)).conv_id
        _, end = c.run(a, "hello", n=2)
        assert isinstance(end, P.Committed), end
        c.call(P.UnloadModel, P.Ok, model="tiny-q")
        path.unlink()
        rid, end = c.run(a, "and now?", n=2)
        assert isinstance(end, P.Committed), end
        notes = model_notices(c, rid)
        assert any("ran on tiny-q, which cannot be loaded any more" in n and loaded_model.name in n
                   for n in notes), notes
        assert max(c.sink.of(P.Accepted, rid)[0].prompt_ids) >= 300   # the default model's vocabulary
    finally:
        stop(eng)
