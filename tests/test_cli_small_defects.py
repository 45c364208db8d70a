"""Small CLI defects: session 3's notes (`conversations show`, `serve --memory-budget`) and session 4's new-user trial (several `aotx run` starting engines at once)."""

from __future__ import annotations

from types import SimpleNamespace

from aotx.engine.cli.local import print_conversation


def _msg(msg_id, status, finish, text="hi"):
    return SimpleNamespace(role="assistant", msg_id=msg_id, status=status, finish_reason=finish, text=text,
                           token_ids=[], receipt=None)


def test_a_cancelled_reply_says_cancelled_once(capsys):
    """Regression (session 3's notes): a cancelled reply printed as [cancelled, cancelled]."""
    conv = SimpleNamespace(conv_id="c1", title="t", system_prompt="",
                           messages=[_msg(1, "cancelled", "cancelled"), _msg(2, "complete", "stop"),
                                     _msg(3, "pending", None)])
    assert print_conversation(conv, as_json=False) == 0
    out = capsys.readouterr().out
    assert "[cancelled] not durable" in out and "cancelled, cancelled" not in out
    assert "[complete, stop]" in out
    assert "--- assistant 3 [pending] not durable" in out


def test_serve_refuses_an_unreadable_memory_budget_before_loading(monkeypatch):
    """Regression (session 3's notes): `aotx serve --memory-budget 5X` loaded the model
    (seconds, gigabytes) and only then refused the size."""
    import argparse

    import pytest

    from aotx.engine.cli import serve
    from aotx.engine.errors import UsageError
    from aotx.engine.model import loader

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flag was checked")

    monkeypatch.setattr(loader, "load_model", no_load)
    args = argparse.Namespace(device="cpu", keep_alive=None, draft_model=None, model="/nonexistent.gguf",
                              memory_budget="5X")
    with pytest.raises(UsageError, match=r"--memory-budget: cannot read '5X' as a size"):
        serve.build_engine(args)


def test_three_aotx_run_started_together_share_one_engine(tmp_path, default_model_path):
    """Regression (new-user trial, session 4): `for i in 1 2 3; do aotx run ... & done` with
    no engine: each started one; the two that lost the socket's lock exited, and their
    clients gave up ("the engine exited with code 2 before answering: another engine is
    already serving ...") while the winner was still loading. They now wait for it."""
    import os
    import subprocess
    import sys

    sock = f"/tmp/aotx-three-{os.getpid()}.sock"
    env = dict(os.environ, AOTX_HOME=str(tmp_path))
    cmd = [sys.executable, "-m", "aotx.engine.cli.commands", "run", "--socket", sock, "--max-tokens", "2", "--temperature", "0"]
    procs = [subprocess.Popen([*cmd, f"Say hello {i}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, text=True) for i in range(3)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0], [o[1][-400:] for o in outs]
        assert sum("started an engine" in o[1] for o in outs) >= 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        subprocess.run([*cmd[:3], "stop", "--socket", sock], env=env, capture_output=True, timeout=60)


def test_journal_without_an_action_names_them_once_and_its_help_lists_them(tmp_path):
    """Regression (new-user trial, session 4): `aotx journal` printed "aotx: aotx journal:
    choose ..." and `aotx journal --help` listed no actions."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, AOTX_HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", "journal"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "aotx: journal: choose verify, dump, repair or compact"
    h = subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", "journal", "--help"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert h.returncode == 0 and all(f"    {a} " in h.stdout for a in ("verify", "dump", "repair", "compact"))


def test_an_engine_refusal_that_lists_items_keeps_them(tmp_path):
    """Regression (new-user trial, session 4): `aotx run --memory-budget 10M hi` ended with a
    dangling colon: "...the budget is 10.0 MiB (10,485,760 bytes): (details in ...)"."""
    from aotx.engine.ipc.client import _tail

    log = tmp_path / "engine.log"
    log.write_text("starting\naotx: the model does not fit: the budget is 10.0 MiB (10,485,760 bytes):\n"
                   "  weights 98.4 MiB\n  KV cache 96.0 MiB\n")
    assert _tail(log) == ("the model does not fit: the budget is 10.0 MiB (10,485,760 bytes): weights 98.4 MiB; "
                          "KV cache 96.0 MiB")
    log.write_text("aotx: plain refusal\n")
    assert _tail(log) == "plain refusal"
