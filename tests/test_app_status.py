"""aotx-chat's status line: live speed and context while a reply streams, the engine's
own figures after it, and status replies that arrive while the app closes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, make_app, settle  # noqa: E402


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def history() -> FakeEngine:
    e = FakeEngine()
    e.add_conversation("Rust lifetimes", [("user", "what is 'a?"), ("assistant", "A **lifetime** names a borrow.")])
    e.add_conversation("Pasta recipe", [("user", "carbonara?"), ("assistant", "Eggs, guanciale, pecorino. No cream.")])
    e.add_conversation("Trip", [("user", "where to in May?"), ("assistant", "Lisbon: warm, and the jacaranda bloom.")])
    return e


async def test_status_line_shows_tokens_per_second_and_context_while_streaming():
    engine = FakeEngine(token_delay=0.01, reply=lambda t: "word " * 60, n_ctx=4096)
    app, _ = make_app(engine)
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        assert "replies run to the context (4096 tokens)" in app.status_bar.line()
        app.chat_input.insert("go")
        await pilot.press("enter")
        lines = []
        for _ in range(200):
            await pilot.pause(0.02)
            lines.append(str(app.query_one("#engine-status").render()))
            if app.active is None and app.status_bar.n_generated:
                break
        live = [ln for ln in lines if "tok/s" in ln and "writing" in ln]
        assert live, lines[-3:]
        assert "context " in live[-1] and "/4096" in live[-1]
        await settle(pilot)
        # after the reply: the engine's own figures (the fake says 250 tokens/s) and the context used
        final = str(app.query_one("#engine-status").render())
        used = app.status_bar.n_prompt + app.status_bar.n_generated
        assert "250.0 tok/s" in final and f"context {used}/4096" in final and "ready" in final


def test_status_bar_speed_counts_tokens_after_the_first():
    from aotx.app.widgets.status_bar import StatusBar

    bar = StatusBar()
    bar.n_ctx = 1000
    bar.reply_started(100)
    for i in range(11):
        bar.reply_token(now=10.0 + 0.05 * i)  # 20 tokens/s after the first
    assert abs(bar.tokens_per_s - 20.0) < 1e-6
    assert bar.speed_text() == "20.0 tok/s · context 111/1000"
    bar.max_tokens = 64
    bar.reply_finished()
    assert bar.speed_text() == "20.0 tok/s · context 111/1000"


async def test_a_status_reply_after_the_app_closed_does_not_fail_its_worker():
    """Regression (CI, 2026-12-06: test_sidebar_follows_a_conversation_another_client_added failed
    once): with a 0.05 s status poll, a status worker that ran while the app was closing found
    no StatusBar (textual's NoMatches) and the failed worker failed the app. Now the late
    reply is dropped."""
    app, _ = make_app(history())
    async with app.run_test() as pilot:
        await settle(pilot)
        client = app.client

    class Late:
        async def status(self):
            return await client.status()

    app.client = Late()
    await app._status_once()          # the widgets are gone: no NoMatches
