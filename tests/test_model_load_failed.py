"""A model whose load failed is not listed as installed (defect: after
``aotx run --model trunc.gguf`` failed with a clear error, ``aotx models`` listed
``trunc ... not loaded`` as if usable, until the engine restarted).

A truncated file's header reads fine (the catalog's look at it passes); its tensors
run past the file's end, which only the load finds. A file loaded by path leaves the
catalog; a file of the models folder stays listed with the load's error.
"""

from __future__ import annotations

from aotx.engine import protocol as P
from tests.fakes.inproc import Client, answer, make_engine, stop


def _truncated(tiny_gguf, path):
    tiny_gguf.write_tiny_llama(path, seed=4)
    tiny_gguf.truncate(path, tiny_gguf.layout(path)["data_start"] + 100)
    return path


def _models(c: Client) -> dict[str, P.ModelInfo]:
    return {m.name: m for m in c.call(P.ListModels, P.ModelList).models}


def test_a_file_loaded_by_path_that_failed_is_not_listed(loaded_model, tmp_path, monkeypatch, tiny_gguf):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    monkeypatch.setenv("AOTX_HOME", str(home))
    trunc = _truncated(tiny_gguf, tmp_path / "trunc.gguf")
    eng = make_engine(loaded_model, home)
    try:
        c = Client(eng)
        rid = c.post(lambda i: P.LoadModel(id=i, model=str(trunc)))
        err = answer(c.sink, rid, P.ModelLoaded)
        assert isinstance(err, P.Error) and "past the end of the file" in err.message, err
        assert set(_models(c)) == {loaded_model.name}  # no "trunc ... not loaded"
        assert "trunc" not in eng.catalog.extra
        # asked again: the same error, not a stale entry
        rid = c.post(lambda i: P.LoadModel(id=i, model=str(trunc)))
        err = answer(c.sink, rid, P.ModelLoaded)
        assert isinstance(err, P.Error) and "past the end of the file" in err.message, err
    finally:
        stop(eng)


def test_a_folder_file_that_failed_is_listed_with_its_error(loaded_model, tmp_path, monkeypatch, tiny_gguf):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    monkeypatch.setenv("AOTX_HOME", str(home))
    _truncated(tiny_gguf, home / "models" / "trunc.gguf")
    eng = make_engine(loaded_model, home)
    try:
        c = Client(eng)
        assert _models(c)["trunc"].error == ""  # the header alone looks fine
        rid = c.post(lambda i: P.LoadModel(id=i, model="trunc"))
        err = answer(c.sink, rid, P.ModelLoaded)
        assert isinstance(err, P.Error) and "past the end of the file" in err.message, err
        info = _models(c)["trunc"]
        assert "past the end of the file" in info.error and not info.loaded
    finally:
        stop(eng)
