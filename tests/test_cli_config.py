"""The config file of the ``aotx`` commands (TOML under ``$AOTX_HOME`` in tests) and the
shell completion script: defaults people set once, a flag still winning, one line for a
bad file, ``aotx config`` naming where each value came from."""

from __future__ import annotations

import subprocess
import sys

import pytest

from aotx.engine.cli.commands import build_parser
from aotx.engine.errors import UsageError
from aotx.engine.present import config as C


def _run(home, *args):
    env = {"AOTX_HOME": str(home), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", *args], capture_output=True, text=True,
                          env={**__import__("os").environ, **env}, timeout=120)


def test_the_file_sets_the_defaults_and_a_flag_still_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    (tmp_path / "config.toml").write_text('model = "tiny"\ndevice = "cpu"\nslots = 3\ncontext = 2048\n'
                                          'api_key_file = "/k"\n')
    ap = build_parser()
    settings, path = C.load()
    assert path == tmp_path / "config.toml"
    C.apply(ap, settings, path)
    a = ap.parse_args(["run", "hi"])
    assert (a.model, a.device, a.slots, a.context) == ("tiny", "cpu", 3, 2048)
    a = ap.parse_args(["run", "--slots", "5", "--device", "auto", "hi"])
    assert (a.slots, a.device) == (5, "auto")
    assert ap.parse_args(["gateway"]).api_key_file == "/k"
    # a remote server's --context is not the engine's
    r = _run(tmp_path, "config")
    assert r.returncode == 0 and "slots         3" in r.stdout and str(path) in r.stdout


@pytest.mark.parametrize("text,word", [
    ("slots = 'x'\n", "slots must be an integer"), ("colour = 1\n", "unknown key 'colour'"),
    ("device = 'tpu'\n", "is not one of"), ("slots = 0\n", "slots"), ("= =\n", "not TOML"),
])
def test_a_bad_file_is_one_line_naming_the_file_and_the_key(tmp_path, text, word):
    (tmp_path / "config.toml").write_text(text)
    r = _run(tmp_path, "config")
    assert r.returncode == 2 and word in r.stderr and "config.toml" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_no_file_is_no_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    assert C.load() == ({}, tmp_path / "config.toml")
    with pytest.raises(UsageError):
        C.load(tmp_path)  # a directory is not a file


def test_completion_script_names_the_commands_and_their_flags(tmp_path):
    pytest.importorskip("shtab")
    r = _run(tmp_path, "completion", "bash")
    assert r.returncode == 0 and "gateway" in r.stdout and "--cors-origin" in r.stdout and "complete" in r.stdout
    assert _run(tmp_path, "completion", "fish").returncode == 2
