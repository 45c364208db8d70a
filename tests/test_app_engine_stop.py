"""aotx-chat when the engine is stopped (``aotx stop``) rather than crashed.

A stop sticks: the app says the engine was stopped and starts none until the user sends
the next message (or presses Enter in the empty input, as the screen says), and then
with the stopped engine's own flags (its Welcome's ``engine_args``), not the app's. A
crash still brings the engine back at once (test_app_chat)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, make_app, settle  # noqa: E402


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    return tmp_path


async def wait_for(pilot, cond, rounds: int = 100) -> None:
    for _ in range(rounds):
        if cond():
            return
        await pilot.pause(0.02)


async def test_a_stopped_engine_is_not_restarted_until_the_next_message():
    """`aotx stop` with aotx-chat open: the app restarted the engine within a second, with
    its own arguments (the default model), so the stop did not stick."""
    engine = FakeEngine()
    engine.engine_args = ["--model", "/models/qwen.gguf", "--context", "4096"]
    app, _ = make_app(engine, status_poll_s=0.05)
    async with app.run_test() as pilot:
        await settle(pilot)
        pilot.app.chat_input.insert("first")
        await pilot.press("enter")
        await settle(pilot)
        engine.stop()
        await wait_for(pilot, lambda: app.engine_stopped)
        await pilot.pause(0.4)          # several status polls later: still stopped, nothing started
        assert app.engine_stopped and engine.connects == 1 and engine.spawned_with == []
        assert app.status_bar.state == "engine stopped"
        notice = str(app.query_one("#input-notice").render())
        assert "was stopped" in notice and "next message starts it" in notice
        pilot.app.chat_input.insert("second")
        await pilot.press("enter")
        await wait_for(pilot, lambda: engine.submitted and engine.submitted[-1][1] == "second")
        await settle(pilot)
        # the engine started again with the stopped one's flags, and the message went to it
        assert engine.spawned_with == [["--model", "/models/qwen.gguf", "--context", "4096"]]
        assert [t for _, t, _ in engine.submitted] == ["first", "second"]
        assert app.messages()[-1].position == "durable"
        assert not app.engine_stopped and app.ready


async def test_enter_in_the_empty_input_starts_a_stopped_engine():
    """The stopped screen names a key (Enter) that starts the engine without a message."""
    app, engine = make_app(status_poll_s=0.05)
    async with app.run_test() as pilot:
        await settle(pilot)
        engine.stop()
        await wait_for(pilot, lambda: app.engine_stopped)
        assert "press Enter" in str(app.query_one("#input-notice").render())
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.ready)
        await settle(pilot)
        assert engine.spawned_with == [list(engine.engine_args)]
        assert app.ready and not app.engine_stopped
        assert engine.submitted == []       # nothing was sent


async def test_a_crash_still_restarts_the_engine_at_once():
    """A crash (no stop notice before the connection closed) is recovered as before."""
    app, engine = make_app(status_poll_s=0.05)
    async with app.run_test() as pilot:
        await settle(pilot)
        engine.crash()
        await wait_for(pilot, lambda: engine.connects >= 2 and app.ready)
        assert engine.connects == 2 and not app.engine_stopped
