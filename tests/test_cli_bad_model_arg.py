"""A fresh user's bad ``--model``: one line, exit code 2, nothing started or written.

Bugs named here: aotx-chat opened the TUI and never exited for a missing model file;
``--model README.md`` (an existing file without a "/") was read as a catalog name;
``aotx run`` and ``aotx serve`` worded a missing path differently; a refused
``aotx run`` left an empty conversation behind; ``aotx serve`` announced an engine
before refusing its model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def aotx(tmp_path, *args: str, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, AOTX_HOME=str(tmp_path / "home"), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", *args], capture_output=True, text=True,
                          env=env, timeout=120, cwd=cwd, stdin=subprocess.DEVNULL)


def one_line(r: subprocess.CompletedProcess, prefix: str = "aotx: ") -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(prefix), lines[0]
    return lines[0]


@pytest.fixture
def text_file(tmp_path):
    p = tmp_path / "README.md"
    p.write_text("# AOTX\nnot a model\n")
    return p


def test_bug_run_bare_existing_file_is_a_path_not_a_name(tmp_path, text_file):
    bare = one_line(aotx(tmp_path, "run", "--model", "README.md", "hi", cwd=tmp_path))
    dotted = one_line(aotx(tmp_path, "run", "--model", "./README.md", "hi", cwd=tmp_path))
    assert "no model named" not in bare
    assert "is not a GGUF file" in bare and "b'# AO'" in bare, bare
    assert "is not a GGUF file" in dotted


def test_bug_run_and_serve_word_a_missing_path_alike(tmp_path):
    missing = str(tmp_path / "does-not-exist.gguf")
    run = one_line(aotx(tmp_path, "run", "--model", missing, "hi"))
    serve = one_line(aotx(tmp_path, "serve", "--model", missing))
    want = f"aotx: {missing}: no such model file (looked at the path and in "
    assert run.startswith(want), run
    assert serve.startswith(want), serve  # and no "aotx engine pid N, socket ..." line before it
    assert "engine pid" not in serve
    bare = one_line(aotx(tmp_path, "run", "--model", "nosuch.gguf", "hi"))
    assert "no such model file" in bare, bare


def test_bug_serve_bad_file_gives_only_the_error_line(tmp_path, text_file):
    line = one_line(aotx(tmp_path, "serve", "--model", str(text_file)))
    assert "is not a GGUF file" in line, line


def test_bug_refused_run_leaves_no_empty_conversation(tmp_path, text_file):
    for bad in (str(text_file), str(tmp_path / "does-not-exist.gguf"), str(tmp_path)):
        one_line(aotx(tmp_path, "run", "--model", bad, "hi"))
    r = aotx(tmp_path, "conversations", "list", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout or "[]") == [], r.stdout


@pytest.mark.parametrize("kind", ["missing", "text"])
def test_bug_aotx_chat_refuses_bad_model_before_the_tui(tmp_path, text_file, monkeypatch, capsys, kind):
    from aotx.app import app as app_mod
    from aotx.app import main as chat_main

    monkeypatch.setenv("AOTX_HOME", str(tmp_path / "home"))

    def no_tui(*a, **k):
        raise AssertionError("the TUI was opened for a bad --model")

    monkeypatch.setattr(app_mod, "ChatApp", no_tui)
    arg = str(tmp_path / "does-not-exist.gguf") if kind == "missing" else str(text_file)
    assert chat_main.main(["--model", arg]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("aotx-chat: "), err
    assert ("no such model file" if kind == "missing" else "is not a GGUF file") in err[0]
    assert not (tmp_path / "home").exists() or not any((tmp_path / "home").rglob("*.sock"))


def test_catalog_resolves_an_existing_file_as_a_path(tmp_path, text_file, monkeypatch):
    from aotx.engine.errors import NotFound
    from aotx.engine.runtime.catalog import Catalog

    (tmp_path / "models").mkdir()
    cat = Catalog(tmp_path / "models")
    monkeypatch.chdir(tmp_path)
    e = cat.resolve("README.md")
    assert e.path is not None and e.path.resolve() == text_file.resolve()
    with pytest.raises(NotFound, match="no such model file"):
        cat.resolve(str(tmp_path / "does-not-exist.gguf"))
    with pytest.raises(NotFound, match="no model named"):
        cat.resolve("nosuch")


@pytest.mark.parametrize("argv, line", [
    (["--modle", "x"], "aotx-chat: unknown argument --modle; did you mean --model? (see `aotx-chat --help`)"),
    (["--device", "gpu"], "aotx-chat: --device 'gpu' is not one of auto, cpu, cuda; did you mean 'cpu'?"),
])
def test_bug_aotx_chat_flag_typo_is_one_line_with_a_did_you_mean(argv, line, capsys):
    """Regression: a mistyped aotx-chat flag printed argparse's
    usage block and "unrecognized arguments", with no suggestion (`aotx` itself suggests)."""
    from aotx.app import main as chat_main

    with pytest.raises(SystemExit) as ex:
        chat_main.parse_args(argv)
    err = capsys.readouterr().err
    assert ex.value.code == 2
    assert err.strip() == line and "usage:" not in err


def test_bug_run_with_an_unknown_model_name_starts_no_engine(tmp_path, default_model_path):
    """Regression: with no engine, `aotx run --model NAME` for a
    name nothing knows started an engine (loading the default model) and then refused the
    name; it is refused at once now, in the engine's words, and no engine is started."""
    r = aotx(tmp_path, "run", "--model", "qwen-coder", "hi")
    line = one_line(r)
    assert "no model named 'qwen-coder'" in line and "aotx models" in line
    assert "started an engine" not in r.stderr
    assert not (tmp_path / "home" / "engine.log").exists()
