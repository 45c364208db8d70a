"""``aotx conversations list|show|export|fork|delete``: read from the journal without
starting an engine when none runs (and said so when an engine holds the journal but does
not answer), asked of the engine when one runs; a cancelled reply printed once as
cancelled; an unknown id, one line.

Runs the real CLI in a subprocess (``python -m aotx.engine.cli.commands``) with
``AOTX_HOME`` in a temporary folder. The tests that need an engine share ``aotx serve`` on
the default model (2 slots, 512 tokens, CPU) on the default socket of their data dir.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from aotx.engine.cli.local import print_conversation
from tests import cli_support
from tests.gateway_support import start_engine, stop_engine

aotx, one_line, usage_error = cli_support.aotx, cli_support.one_line, cli_support.usage_error


# ---- without an engine: the journal on disk ---------------------------------------------

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


def test_conversations_show_reads_the_journal_without_starting_an_engine(journal_home):
    """Regression: ``aotx conversations show`` started a background engine just to read."""
    home, a, b = journal_home
    r = aotx(home, "conversations", "list", timeout=120)
    assert r.returncode == 0, r.stderr
    # a header, then newest first (with when, model and origin)
    assert [ln.split()[0] for ln in r.stdout.splitlines()] == ["ID", b, a]
    assert "Pasta recipe" in r.stdout
    r = aotx(home, "conversations", "show", a, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{a}  Pasta recipe\nsystem: Answer briefly.\n")
    assert "carbonara?" in r.stdout and "Eggs, guanciale, pecorino." in r.stdout
    assert "durable in segment" in r.stdout
    r = aotx(home, "conversations", "show", "--json", b, timeout=120)
    view = json.loads(r.stdout)
    assert [m["text"] for m in view["messages"]] == ["where to?", "Lisbon."]
    r = aotx(home, "conversations", "show", "c-nope", timeout=120)
    assert "no conversation 'c-nope'" in usage_error(r)
    assert no_engine_started(home), list(home.rglob("*"))


def test_conversations_list_on_an_empty_journal(tmp_path):
    r = aotx(tmp_path / "home", "conversations", "list", timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("no conversations yet"), (r.stdout, r.stderr)
    assert no_engine_started(tmp_path / "home")


def test_conversations_export_markdown_and_json(journal_home, tmp_path):
    home, a, _ = journal_home
    r = aotx(home, "conversations", "export", a, timeout=120)
    assert r.returncode == 0, r.stderr
    md = r.stdout
    assert md.startswith("# Pasta recipe\n")
    assert "**System prompt:**\n\n> Answer briefly." in md
    assert "### You\n\ncarbonara?" in md and "### Assistant\n\nEggs, guanciale, pecorino." in md
    out = tmp_path / "pasta.json"
    r = aotx(home, "conversations", "export", a, "-o", str(out), timeout=120)
    assert r.returncode == 0 and str(out) in r.stderr and "JSON" in r.stderr, r.stderr
    doc = json.loads(out.read_text())
    assert doc["format"] == "aotx-conversation" and doc["conversation"]["conv_id"] == a
    assert [m["role"] for m in doc["conversation"]["messages"]] == ["user", "assistant"]
    r = aotx(home, "conversations", "export", a, "-o", str(tmp_path / "missing" / "x.md"), timeout=120)
    assert "does not exist" in usage_error(r)
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
        r = aotx(home, "conversations", "show", a, timeout=120)
    finally:
        lock.release()
    assert r.returncode == 0, r.stderr
    assert "an engine holds the journal but no engine answers" in r.stderr
    assert "carbonara?" in r.stdout
    assert no_engine_started(home)


def _msg(msg_id, status, finish, text="hi"):
    return SimpleNamespace(role="assistant", msg_id=msg_id, status=status, finish_reason=finish, text=text,
                           token_ids=[], receipt=None)


def test_a_cancelled_reply_says_cancelled_once(capsys):
    """Regression: a cancelled reply printed as [cancelled, cancelled]."""
    conv = SimpleNamespace(conv_id="c1", title="t", system_prompt="",
                           messages=[_msg(1, "cancelled", "cancelled"), _msg(2, "complete", "stop"),
                                     _msg(3, "pending", None)])
    assert print_conversation(conv, as_json=False) == 0
    out = capsys.readouterr().out
    assert "[cancelled] not durable" in out and "cancelled, cancelled" not in out
    assert "[complete, stop]" in out
    assert "--- assistant 3 [pending] not durable" in out


# ---- against a running engine -------------------------------------------------------------

@pytest.fixture(scope="module")
def home(tmp_path_factory):
    h = tmp_path_factory.mktemp("cli-conversations")
    (h / "run").mkdir(mode=0o700)
    return h


@pytest.fixture(scope="module")
def engine(home, default_model_path):
    proc, sock = start_engine(home, None, slots=2, context=512, timeout=180,
                              sock=home / "run" / "engine.sock")      # the default socket under AOTX_HOME
    yield sock
    stop_engine(proc)


def _last_reply_conv(home: Path, sock: Path) -> str:
    listed = json.loads(aotx(home, "conversations", "list", "--socket", str(sock), "--json").stdout)
    return max(listed, key=lambda c: c["created_at"])["id"]


@pytest.mark.parametrize("cmd", ["show", "export"])
def test_conversations_of_an_unknown_id_is_one_line_while_an_engine_runs(home, engine, cmd):
    """Regression: ``conversations show`` of an unknown id printed two contradictory lines
    while an engine ran."""
    r = aotx(home, "conversations", cmd, "nope", timeout=120)
    assert r.returncode == 2
    assert one_line(r) == "aotx: no conversation 'nope'; see `aotx conversations list`"


@pytest.mark.realmodel
def test_fork_of_one_message_says_message_not_messages(home, engine):
    """Regression: "forked from c… with 1 messages"."""
    r = aotx(home, "run", "--socket", str(engine), "--json", "--max-tokens", "1", "--temperature", "0", "hi")
    conv = next(e for e in map(json.loads, r.stdout.splitlines()) if e["event"] == "done")["conversation"]
    shown = json.loads(aotx(home, "conversations", "show", conv, "--socket", str(engine), "--json").stdout)
    first = shown["messages"][0]["msg_id"]
    f = aotx(home, "conversations", "fork", conv, "--at", first, "--socket", str(engine))
    assert f.returncode == 0, f.stderr
    assert f"forked from {conv} with 1 message; continue" in f.stdout, f.stdout


def test_conversations_delete_from_the_cli(home, engine):
    """Regression: `aotx conversations delete ID` was "unknown conversations command
    'delete'" (only F8 in aotx-chat deleted)."""
    r = aotx(home, "run", "--socket", str(engine), "--max-tokens", "1", "--temperature", "0", "Delete me later.")
    assert r.returncode == 0, r.stderr
    conv = _last_reply_conv(home, engine)
    d = aotx(home, "conversations", "delete", conv, "--socket", str(engine))
    assert d.returncode == 0 and d.stdout.startswith(f"deleted {conv}  “Delete me later.”"), d.stdout + d.stderr
    listed = json.loads(aotx(home, "conversations", "list", "--socket", str(engine), "--json").stdout)
    assert conv not in {c["id"] for c in listed}
    again = aotx(home, "conversations", "delete", conv, "--socket", str(engine))
    assert again.returncode == 2 and conv in one_line(again)
