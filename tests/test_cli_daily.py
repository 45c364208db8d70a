"""The ``aotx`` command line as a daily driver (issue 17, defect 9 and point 12).

Runs the real CLI in a subprocess (``python -m aotx.engine.cli.commands``) with ``AOTX_HOME``
in a temporary folder: one-line errors without internal names and with a "did you
mean", ``--version``, ``conversations list|show|export`` read from the journal without
starting an engine, and the gateway key file's first line being the key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aotx.engine.gateway import auth as A


def aotx(home: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, AOTX_HOME=str(home), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", *args], capture_output=True, text=True,
                          env=env, timeout=120, input=stdin)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("aotx: ") and not lines[0].startswith("aotx: aotx:"), lines[0]
    return lines[0]


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
def test_defect9_usage_errors_are_one_plain_line(tmp_path, argv, expected, absent):
    """Regression: ``aotx: aotx: argument cmd: invalid choice: 'rnu'`` (doubled prefix,
    internal names, no suggestion)."""
    line = one_line_error(aotx(tmp_path, *argv))
    assert line.startswith(expected) or expected in line, line
    for word in absent:
        assert word not in line, line


def test_defect9_version(tmp_path):
    r = aotx(tmp_path, "--version")
    assert r.returncode == 0 and r.stdout.strip().startswith("aotx 0."), (r.stdout, r.stderr)


@pytest.fixture
def journal_home(tmp_path):
    """A journal with two conversations, written by the engine's own store (no engine runs)."""
    home = tmp_path / "home"
    env_before = os.environ.get("AOTX_HOME")
    os.environ["AOTX_HOME"] = str(home)
    try:
        from aotx.engine import paths
        from aotx.engine.runtime.store import open_store

        store = open_store(paths.journal_dir())
        a = store.create("Pasta recipe", "Answer briefly.", None,
                         messages=[("user", "carbonara?"), ("assistant", "Eggs, guanciale, pecorino.")])
        b = store.create("Trip", None, None, messages=[("user", "where to?"), ("assistant", "Lisbon.")])
        store.close()
    finally:
        if env_before is None:
            os.environ.pop("AOTX_HOME", None)
        else:
            os.environ["AOTX_HOME"] = env_before
    return home, a.conv_id, b.conv_id


def no_engine_started(home: Path) -> bool:
    return not (home / "engine.log").exists() and not list(home.rglob("*.sock"))


def test_defect9_conversations_show_reads_the_journal_without_starting_an_engine(journal_home):
    """Regression: ``aotx conversations show`` started a background engine just to read."""
    home, a, b = journal_home
    r = aotx(home, "conversations", "list")
    assert r.returncode == 0, r.stderr
    assert [ln.split()[0] for ln in r.stdout.splitlines()] == [a, b]
    assert "Pasta recipe" in r.stdout
    r = aotx(home, "conversations", "show", a)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{a}  Pasta recipe\nsystem: Answer briefly.\n")
    assert "carbonara?" in r.stdout and "Eggs, guanciale, pecorino." in r.stdout
    assert "durable in segment" in r.stdout
    r = aotx(home, "conversations", "show", "--json", b)
    view = json.loads(r.stdout)
    assert [m["text"] for m in view["messages"]] == ["where to?", "Lisbon."]
    r = aotx(home, "conversations", "show", "c-nope")
    assert "no conversation 'c-nope'" in one_line_error(r)
    assert no_engine_started(home), list(home.rglob("*"))


def test_conversations_list_on_an_empty_journal(tmp_path):
    r = aotx(tmp_path / "home", "conversations", "list")
    assert r.returncode == 0 and r.stdout.startswith("no conversations yet"), (r.stdout, r.stderr)
    assert no_engine_started(tmp_path / "home")


def test_conversations_export_markdown_and_json(journal_home, tmp_path):
    home, a, _ = journal_home
    r = aotx(home, "conversations", "export", a)
    assert r.returncode == 0, r.stderr
    md = r.stdout
    assert md.startswith("# Pasta recipe\n")
    assert "**System prompt:**\n\n> Answer briefly." in md
    assert "### You\n\ncarbonara?" in md and "### Assistant\n\nEggs, guanciale, pecorino." in md
    out = tmp_path / "pasta.json"
    r = aotx(home, "conversations", "export", a, "-o", str(out))
    assert r.returncode == 0 and str(out) in r.stderr and "JSON" in r.stderr, r.stderr
    doc = json.loads(out.read_text())
    assert doc["format"] == "aotx-conversation" and doc["conversation"]["conv_id"] == a
    assert [m["role"] for m in doc["conversation"]["messages"]] == ["user", "assistant"]
    r = aotx(home, "conversations", "export", a, "-o", str(tmp_path / "missing" / "x.md"))
    assert "does not exist" in one_line_error(r)
    assert no_engine_started(home)


def test_conversations_while_an_engine_holds_the_journal_are_asked_of_it(journal_home):
    """The lock held (an engine writing) and nothing answering on the socket: the CLI
    says so and shows the journal as it is on disk, still without starting an engine."""
    home, a, _ = journal_home
    os.environ["AOTX_HOME"] = str(home)
    try:
        from aotx.engine import paths
        from aotx.engine.journal.directory import DirLock

        lock = DirLock(paths.journal_dir())
    finally:
        os.environ.pop("AOTX_HOME", None)
    try:
        r = aotx(home, "conversations", "show", a)
    finally:
        lock.release()
    assert r.returncode == 0, r.stderr
    assert "an engine holds the journal but no engine answers" in r.stderr
    assert "carbonara?" in r.stdout
    assert no_engine_started(home)


def test_defect9_gateway_key_file_first_line_is_the_key(tmp_path):
    """Regression: the first line was a comment, so ``head -1 api_keys`` gave no key."""
    path = tmp_path / "gateway" / "api_keys"
    key = A.generate_key_file(path)
    first = path.read_text().splitlines()[0]
    assert first == key and first.startswith("sk-aotx-")
    assert A.read_key_file(path) == [key]
    head = subprocess.run(["head", "-1", str(path)], capture_output=True, text=True)
    assert head.stdout.strip() == key


def test_defect7_aotx_run_says_capsule_notices_in_the_users_words_and_only_when_continuing():
    """Regression (issue 17, defect 7): ``aotx run`` printed "restored 29 tokens of context
    from a parked capsule (host memory) (no re-prefill)" on stderr for a brand-new chat."""
    from aotx.engine.cli.client import capsule_words
    from aotx.engine import protocol as P

    picked = P.Notice(id=1, kind="capsule", resource="capsule", asked=29,
                      message="picked up where this conversation left off (29 tokens of context kept, not read again)")
    assert capsule_words(picked, continuing=False) == ""  # a new chat's shared start is no news
    assert capsule_words(picked, continuing=True) == "picked up where this conversation left off"
    again = P.Notice(id=1, kind="capsule", resource="capsule",
                     message="reading this conversation's earlier messages again: its saved state could not be used "
                             "(it was made by another model)")
    words = capsule_words(again, continuing=True)
    assert words.startswith("reading") and "capsule" not in words and "prefill" not in words
