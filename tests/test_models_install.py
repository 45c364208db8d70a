"""A local GGUF file becomes an installed model: ``aotx models add NAME PATH`` (as ``ollama
create`` does, without copying the file), or by being opened by path. Regression: the
Qwen file a user assembled as the README says was not "installed" (``aotx models`` and
Ctrl+O did not list it, ``aotx models add`` took only URLs), and a conversation on a
model passed by relative path said it "is not installed any more" after a restart
although the file had not moved (the path was known only to the engine that opened it).

No engine runs here: the catalog and the command line against the models folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def aotx(home: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, AOTX_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", *args], env=env, capture_output=True,
                          text=True, timeout=120, cwd=cwd)


@pytest.fixture
def files(tmp_path, tiny_gguf):
    where = tmp_path / "downloads"
    where.mkdir()
    a = tiny_gguf.write_tiny_llama(where / "qwen-like.gguf", seed=1)
    b = tiny_gguf.write_tiny_llama(where / "other.gguf", seed=2)
    (where / "notes.txt").write_text("not a model")
    return tmp_path / "home", where, Path(a), Path(b)


def listed(home: Path) -> dict:
    r = aotx(home, "models", "--json")
    assert r.returncode == 0, r.stderr
    return {m["name"]: m for m in json.loads(r.stdout)["models"]}


def test_models_add_name_path_installs_a_file_by_absolute_path(files):
    home, where, a, _ = files
    r = aotx(home, "models", "add", "coder", "qwen-like.gguf", cwd=where)      # a relative path
    assert r.returncode == 0, r.stderr
    assert f"installed coder -> {a}" in r.stdout and "served with" in r.stdout
    m = listed(home)["coder"]
    assert m["path"] == str(a) and m["arch"] == "llama" and not m.get("error")
    assert m["n_ctx_train"] > 0
    text = aotx(home, "models").stdout
    assert "coder" in text and str(a) in text        # where it lives, since it is not in the folder
    # the same file again: said, not refused; another name for a taken one: refused, nothing written
    assert aotx(home, "models", "add", "coder", str(a)).returncode == 0
    r = aotx(home, "models", "add", "coder", str(files[3]))
    assert r.returncode == 2 and "exists" in r.stderr and "--replace" in r.stderr
    assert listed(home)["coder"]["path"] == str(a)
    assert aotx(home, "models", "add", "coder", str(files[3]), "--replace").returncode == 0
    assert listed(home)["coder"]["path"] == str(files[3])
    # removed: the name goes, the file stays
    r = aotx(home, "models", "remove", "coder")
    assert r.returncode == 0 and "file itself is kept" in r.stdout
    assert "coder" not in listed(home) and files[3].exists()


@pytest.mark.parametrize("what,says", [("notes.txt", "cannot be installed"), ("missing.gguf", "no such file")])
def test_models_add_refuses_what_it_cannot_run_and_writes_nothing(files, what, says):
    home, where, _, _ = files
    r = aotx(home, "models", "add", "x", str(where / what))
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1
    assert not list((home / "models").glob("*.json")) if (home / "models").exists() else True


def test_models_add_needs_a_path_or_a_url(files):
    home, where, a, _ = files
    for args in (["add", "x"], ["add", "x", str(a), "--url", "http://h:8000/v1"]):
        r = aotx(home, "models", *args)
        assert r.returncode == 2 and "aotx models add NAME PATH" in r.stderr, r.stderr


def test_a_file_opened_by_path_resolves_by_name_after_a_restart(files, monkeypatch):
    """The engine resolves ``--model PATH`` (a conversation records the name): a new
    catalog, as a restarted engine has, from another directory, still finds it."""
    home, where, a, _ = files
    monkeypatch.setenv("AOTX_HOME", str(home))
    from aotx.engine.runtime.catalog import Catalog

    monkeypatch.chdir(where)
    name = Catalog().resolve("qwen-like.gguf").name
    monkeypatch.chdir(home.parent)
    e = Catalog().resolve(name)
    assert e.path == a and not e.error


def test_an_installed_file_that_now_holds_another_model_is_not_loaded(files, monkeypatch, tiny_gguf):
    home, where, a, b = files
    monkeypatch.setenv("AOTX_HOME", str(home))
    from aotx.engine.runtime.catalog import Catalog

    Catalog().resolve(str(a))
    os.replace(b, a)            # the same path, another model
    e = Catalog().entries()["qwen-like"]
    assert "now holds another model" in e.error and "aotx models add qwen-like" in e.error
    a.unlink()
    assert f"its file {a} is gone" in Catalog().entries()["qwen-like"].error


def test_the_context_shown_is_the_one_the_engine_serves(files, monkeypatch):
    """The picker showed 32768 (the file's trained context) for a model that runs at 4096:
    an engine lists a model it has not loaded with the context it would serve it with."""
    home, where, a, _ = files
    monkeypatch.setenv("AOTX_HOME", str(home))
    from aotx.app.screens.model_picker import model_row
    from aotx.engine.runtime.catalog import Catalog
    from aotx.engine.runtime.models import ModelSet

    cat = Catalog()
    cat.resolve(str(a))
    ms = ModelSet(cat, total=1 << 30)
    ms.context = 64
    info = next(i for i in ms.infos() if i.name == "qwen-like")
    assert info.n_ctx_train > 64 and info.n_ctx == 64
    assert model_row(info, current="")[4] == "64"
