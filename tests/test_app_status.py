"""The status line says what is happening and which model answers.

* After switching conversations it kept the previous conversation's tok/s and context.
* It said "ready" while a message waited for its model to load (25 s), or for OCR and
  Whisper to read its attachments; and "writing" with nothing more before the first token.
* After a reply ran on another model than the conversation's (its model gone: the default
  answered), it still named the conversation's model."""

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
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))


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
