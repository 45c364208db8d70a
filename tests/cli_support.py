"""Running the ``aotx`` command in tests: one subprocess with its own data dir, and the one
error line a refusal must print (shared by the ``test_cli_*`` files)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def aotx(home: Path, *args: str, timeout: float = 300, env: dict | None = None, drop=()) -> subprocess.CompletedProcess:
    """``python -m aotx.engine.cli.commands ARGS`` with ``AOTX_HOME=home`` (``env`` added, ``drop`` removed)."""
    e = dict(os.environ, AOTX_HOME=str(home), **(env or {}))
    for k in drop:
        e.pop(k, None)
    return subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", *args], env=e, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def one_line(r: subprocess.CompletedProcess) -> str:
    """The single non-blank line of standard error (asserted: one, and no traceback)."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def usage_error(r: subprocess.CompletedProcess) -> str:
    """The one line of a refusal: exit code 2, no traceback, one line on standard error,
    starting ``aotx: `` once (never ``aotx: aotx:``)."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("aotx: ") and not lines[0].startswith("aotx: aotx:"), lines[0]
    return lines[0]
