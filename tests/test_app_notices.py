"""The line above the input: news goes, how things stand stays.

Old notices stayed on screen ("Saved the system prompt...", "The engine is back..."
minutes later). A plain piece of news now goes after a while; a refusal, the attachments
of the next message or edit mode stay while they hold. Ctrl+T (edit the last message)
left the cursor at the start of the text."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import make_app, settle  # noqa: E402


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))


def notice(app) -> str:
    return str(app.query_one("#input-notice").render())


async def test_news_goes_and_standing_notices_stay():
    app, _ = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        app.notice_ttl_s = 0.2
        app.show_notice("Saved the system prompt and sampling of this conversation.")
        assert notice(app).startswith("Saved")
        await pilot.pause(0.5)
        assert notice(app) == ""
        app.show_notice("Attached to the next message: cat.png", kind="attach")
        await pilot.pause(0.5)
        assert notice(app).startswith("Attached")
        # a newer notice is not cleared by an older one's timer
        app.show_notice("first")
        await pilot.pause(0.1)
        app.show_notice("Too long for the context: ...", kind="refusal")
        await pilot.pause(0.4)
        assert notice(app).startswith("Too long")


async def test_ctrl_t_puts_the_cursor_at_the_end_of_the_message():
    app, _ = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        app.chat_input.insert("first line\nsecond line")
        await pilot.press("enter")
        await settle(pilot)
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert app.chat_input.text == "first line\nsecond line"
        assert app.chat_input.cursor_location == (1, len("second line"))
        await pilot.press(*" more")
        assert app.chat_input.text == "first line\nsecond line more"
