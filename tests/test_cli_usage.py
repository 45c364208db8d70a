"""The ``aotx`` command's argument checking: a bad command, option or value is one plain
line (``aotx: ...``, a "did you mean" where one is close, no internal names), exit code 2,
and nothing started or written; ``--version``; negative values read as values; engine
flags checked before an engine starts; ``aotx journal``'s actions named.

Runs the real CLI in a subprocess (``python -m aotx.engine.cli.commands``) with
``AOTX_HOME`` in a temporary folder.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from aotx.engine.cli.commands import join_negative_values
from tests import cli_support

aotx, one_line, usage_error = cli_support.aotx, cli_support.one_line, cli_support.usage_error


@pytest.mark.parametrize("argv,expected,absent", [
    (["rnu", "hi"], "aotx: unknown command 'rnu'; did you mean 'run'?", ["argument", "cmd"]),
    (["conversations", "shwo", "c1"], "aotx: unknown conversations command 'shwo'; did you mean 'show'?",
     ["argument", "ccmd"]),
    (["journal", "verfy"], "did you mean 'verify'?", ["jcmd"]),
    (["run", "--temprature", "0", "hi"], "aotx: run: unknown argument --temprature; did you mean --temperature?",
     []),
    (["run", "--device", "gpu", "hi"], "aotx: run: --device 'gpu' is not one of auto, cpu, cuda", ["argument"]),
    (["run", "--temperature", "hot", "hi"], "aotx: run: --temperature must be a number, got 'hot'", ["argument"]),
])
def test_usage_errors_are_one_plain_line(tmp_path, argv, expected, absent):
    """Regression: ``aotx: aotx: argument cmd: invalid choice: 'rnu'`` (doubled prefix,
    internal names, no suggestion)."""
    line = usage_error(aotx(tmp_path, *argv, timeout=120))
    assert line.startswith(expected) or expected in line, line
    for word in absent:
        assert word not in line, line


def test_version(tmp_path):
    r = aotx(tmp_path, "--version", timeout=120)
    assert r.returncode == 0 and r.stdout.strip().startswith("aotx 0."), (r.stdout, r.stderr)


@pytest.mark.parametrize("prompt,words", [("", "empty"), ("   \n\t", "blank (only whitespace)")])
def test_an_empty_or_blank_prompt_is_one_line_with_one_prefix(tmp_path, prompt, words):
    """Regression: `aotx run ""` said "aotx: aotx run: the prompt is empty"; a prompt of
    spaces was sent to the model."""
    r = aotx(tmp_path, "run", "--socket", str(tmp_path / "e.sock"), prompt, timeout=60)
    assert r.returncode == 2 and one_line(r) == f"aotx: run: the prompt is {words}"
    assert not (tmp_path / "engine.log").exists()  # refused before an engine was started


@pytest.mark.parametrize("port", ["99999", "65536", "-1"])
def test_gateway_port_out_of_range_is_a_usage_error(tmp_path, port):
    """Regression: `aotx gateway --port 99999` was accepted and served on another port.
    Now 0..65535 (0: a free port), else one line, exit 2, and no key file written."""
    r = aotx(tmp_path, "gateway", "--port", port, timeout=60)
    assert r.returncode == 2
    assert one_line(r) == f"aotx: gateway: --port must be between 0 and 65535, got {port}"
    assert not (tmp_path / "gateway").exists()


@pytest.mark.parametrize("flag,value,says", [
    ("--keep-alive", "banana", "--keep-alive: cannot read 'banana' as a duration"),
    ("--keep-alive", "-5m", "--keep-alive: cannot read '-5m' as a duration"),
    ("--memory-budget", "-4G", "--memory-budget: cannot read '-4G' as a size"),
    ("--mmproj", "/nonexistent/mmproj.gguf", "--mmproj /nonexistent/mmproj.gguf: no such file"),
])
def test_engine_flags_are_checked_in_one_line_before_an_engine_starts(tmp_path, flag, value, says):
    r = aotx(tmp_path, "run", flag, value, "--max-tokens", "2", "hi", timeout=60)
    assert r.returncode == 2 and says in one_line(r)       # not "started an engine" + its exit line


@pytest.mark.parametrize("argv,want", [
    (["run", "--memory-budget", "-4G", "hi"], ["run", "--memory-budget=-4G", "hi"]),
    (["run", "--temperature", "-.5"], ["run", "--temperature=-.5"]),
    (["run", "--json", "hi"], ["run", "--json", "hi"]),
    (["run", "--ctx=5", "-x"], ["run", "--ctx=5", "-x"]),
    (["run", "--", "-5"], ["run", "--", "-5"]),
])
def test_join_negative_values(argv, want):
    assert join_negative_values(argv) == want


@pytest.mark.parametrize("args,says", [
    (("--concurrency", "abc"), "--concurrency: 'abc' is not an integer"),
    (("--concurrency", "-1"), "--concurrency: -1 is outside 1..256"),
    (("--concurrency", "0"), "--concurrency: 0 is outside 1..256"),
    (("--concurrency", ","), "expected integers separated by commas"),
    (("--capsules", "0"), "--capsules: 0 is outside 16..131072"),
    (("--capsules", "x"), "--capsules: 'x' is not an integer"),
    (("--capsules", "-5"), "--capsules: -5 is outside 16..131072"),
])
def test_bench_bad_option_values_are_one_line_and_exit_2_not_a_traceback(tmp_path, args, says):
    r = aotx(tmp_path, "bench", "--quick", *args, timeout=120)
    assert r.returncode == 2 and says in one_line(r)


def test_bench_capsules_past_the_models_context_is_refused_before_running(tmp_path, default_model_path):
    r = aotx(tmp_path, "bench", "--quick", "--device", "cpu", "--capsules", "100000", timeout=120)
    assert r.returncode == 2
    assert "has a context of 8192 tokens" in one_line(r)


def test_journal_without_an_action_names_them_once_and_its_help_lists_them(tmp_path):
    """Regression: `aotx journal` printed "aotx: aotx journal: choose ..." and `aotx journal
    --help` listed no actions."""
    env = dict(os.environ, AOTX_HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", "journal"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "aotx: journal: choose verify, dump, repair or compact"
    h = subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", "journal", "--help"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert h.returncode == 0 and all(f"    {a} " in h.stdout for a in ("verify", "dump", "repair", "compact"))
