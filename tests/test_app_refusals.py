"""How aotx-chat shows a message the engine refused before accepting it.

A model load that does not fit the memory budget was shown three times (about 20 lines:
the refused notice under the message, the error under it again, prefixed "A reply is
still being written in this conversation" although none was, and the line above the
input plus a toast). Now the reason is said once, above the input, in the words of what
is short (memory), and the message says only what kind of refusal it was."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, make_app, settle  # noqa: E402

WHY = ("model qwen2.5-coder-0.5b-instruct-q4_k_m does not fit the memory budget: it needs 2.1 GiB, 1.2 GiB of "
       "3.0 GiB is free; lower --slots or --context, or raise --memory-budget")


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))


async def test_a_refused_model_load_is_said_once_without_a_busy_reply_prefix():
    engine = FakeEngine()
    engine.refuse = ("memory", "busy", WHY)
    app, _ = make_app(engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        app.chat_input.insert("hello")
        await pilot.press("enter")
        await settle(pilot)
        user = app.messages()[-1]
        assert user.position == "failed"
        above_input = str(app.query_one("#input-notice").render())
        on_screen = [above_input, *user.notices(), *(str(n) for n in app._notifications)]
        assert sum(WHY in s for s in on_screen) == 1, on_screen
        assert above_input.startswith("Not enough memory: model qwen2.5")
        assert "back in the input" in above_input and app.chat_input.text == "hello"
        assert user.notices() == ["Not sent: Not enough memory. The reason is above the input."]
        assert not any("reply is still being written" in s for s in on_screen)
