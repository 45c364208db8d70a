"""``aotx serve`` refuses what needs no weights before it reads any, and says when it
clamps ``--context``.

It loaded the model (seconds; minutes for a big one) before refusing a journal another
engine holds or a --slots x --context that could never fit the budget; and it clamped
``--context 10000000`` to the model's trained context with only a log line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.realmodel


def serve(home: Path, *args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, AOTX_HOME=str(home))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", "serve", "--socket", str(home / "e.sock"),
                        *args], env=env, capture_output=True, text=True, timeout=timeout)
    return r, time.monotonic() - t0


def test_a_configuration_over_the_budget_is_refused_before_the_load(tmp_path, default_model_path):
    r, _ = serve(tmp_path, "--slots", "64", "--context", "8192", "--memory-budget", "1G")
    assert r.returncode == 2, r.stderr
    assert "does not fit" in r.stderr and "nothing was loaded" in r.stderr and "kv cache" in r.stderr
    assert "load weights" not in r.stderr          # the weights were never read


def test_a_journal_in_use_is_refused_before_the_load(tmp_path, default_model_path):
    from aotx.engine.journal.directory import DirLock

    (tmp_path / "journal").mkdir(parents=True)
    held = DirLock(tmp_path / "journal")      # as a running engine holds it
    try:
        r, _ = serve(tmp_path)
    finally:
        held.release()
    assert r.returncode == 2 and "in use by another process" in r.stderr, r.stderr
    assert "load weights" not in r.stderr


def test_served_context_is_capped_at_the_trained_one():
    from aotx.engine.cli.serve import served_context

    assert served_context(None, 8192) == 4096 and served_context(10_000_000, 8192) == 8192
    assert served_context(None, 2048) == 2048 and served_context(512, 0) == 512
