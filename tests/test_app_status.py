"""aotx-chat's status line: live speed and context while a reply streams, the engine's
own figures after it, and status replies that arrive while the app closes."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, make_app, settle  # noqa: E402

from aotx.engine import protocol as P  # noqa: E402


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


# ---- The status line says what is happening and which model answers ----------
#
# * After switching conversations it kept the previous conversation's tok/s and context.
# * It said "ready" while a message waited for its model to load (25 s), or for OCR and
#   Whisper to read its attachments; and "writing" with nothing more before the first token.
# * After a reply ran on another model than the conversation's (its model gone: the default
#   answered), it still named the conversation's model.


def line(app) -> str:
    return app.status_bar.line()


async def test_switching_conversations_drops_the_last_ones_figures():
    engine = FakeEngine(n_ctx=2048)
    other = engine.add_conversation("Other", [("user", "hi"), ("assistant", "hello")])
    other.messages[0].token_ids = list(range(30))
    other.messages[1].token_ids = list(range(12))
    app, _ = make_app(engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        await app.open_conversation(None)
        app.chat_input.insert("a question that gets a long answer")
        await pilot.press("enter")
        await settle(pilot)
        assert "tok/s" in line(app) and "context " in line(app)
        before = line(app)
        await app.open_conversation(other.conv_id)
        await settle(pilot)
        assert "tok/s" not in line(app), line(app)
        assert "context 42/2048" in line(app) and line(app) != before


async def test_the_status_line_says_what_a_message_waits_for():
    engine = FakeEngine()
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    engine.accept_gate = hold
    engine.before_accept = [P.Notice(id=0, kind="model", resource="model",
                                     message="loading model qwen2.5-coder (468 MiB, qwen2 Q4_K_M)")]
    app, _ = make_app(engine, status_poll_s=0.05)
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        app.chat_input.insert("hi")
        await pilot.press("enter")
        for _ in range(50):
            await pilot.pause(0.02)
            if app.status_bar.state == "loading model":
                break
        await pilot.pause(0.2)  # several status polls: the engine says "ready", the line does not
        assert app.status_bar.state == "loading model" and "qwen2.5-coder" in line(app), line(app)
        assert "ready" not in line(app)
        gate.set()
        await settle(pilot)
        assert app.status_bar.state == "ready"


async def test_attachments_being_read_show_on_the_status_line(tmp_path):
    from fakes.media_files import write_png

    engine = FakeEngine(media_text=lambda a: "TEXT")
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    engine.accept_gate = hold
    app, _ = make_app(engine, status_poll_s=0.05)
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        app.attach_paths([str(write_png(tmp_path / "shot.png"))])
        await settle(pilot)
        app.chat_input.insert("what does it say?")
        await pilot.press("enter")
        await pilot.pause(0.3)
        assert app.status_bar.state == "reading attachments" and "shot.png" in line(app), line(app)
        gate.set()
        await settle(pilot)
        assert app.status_bar.state == "ready"


async def test_the_status_line_names_the_model_that_answered():
    engine = FakeEngine()
    conv = engine.add_conversation("On qwen", [("user", "hi"), ("assistant", "hello")])
    conv.model = "qwen2.5-coder-0.5b-instruct-q4_k_m"
    engine.answer_model = engine.model   # its model is gone: the default answers
    app, _ = make_app(engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        await app.open_conversation(conv.conv_id)
        assert line(app).startswith("qwen2.5-coder")
        app.chat_input.insert("again")
        await pilot.press("enter")
        await settle(pilot)
        assert line(app).startswith(engine.model), line(app)
