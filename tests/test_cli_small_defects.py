"""Small CLI defects noted at the end of session 3: `conversations show` and `serve --memory-budget`."""

from __future__ import annotations

from types import SimpleNamespace

from aotx.engine.cli_local import print_conversation


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

    from aotx.engine import serve
    from aotx.engine.errors import UsageError
    from aotx.engine.model import loader

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flag was checked")

    monkeypatch.setattr(loader, "load_model", no_load)
    args = argparse.Namespace(device="cpu", keep_alive=None, draft_model=None, model="/nonexistent.gguf",
                              memory_budget="5X")
    with pytest.raises(UsageError, match=r"--memory-budget: cannot read '5X' as a size"):
        serve.build_engine(args)
