"""The sidebar's list: one-shot conversations folded, titles cut at a word.

Every one-shot ``aotx run "..."`` became a sidebar entry (and the newest, so aotx-chat
opened on it). They are kept in the journal; the sidebar folds them into one line at the
end that Enter opens and closes, a search still finds them, and aotx-chat opens on the
newest chat. A title made from a long first message was cut mid-word."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, make_app, settle  # noqa: E402

from aotx.app.widgets.sidebar import OneShotsItem  # noqa: E402


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))


def engine_with_runs() -> FakeEngine:
    engine = FakeEngine()
    engine.add_conversation("Trip to Lisbon", [("user", "plan it"), ("assistant", "sure")])
    engine.add_conversation("Rust lifetimes", [("user", "explain"), ("assistant", "ok")])
    for q in ("What is 2+2?", "Capital of France?", "Translate hello"):
        c = engine.add_conversation(q, [("user", q), ("assistant", "answer")])
        c.origin = "run"
    return engine


async def test_one_shot_runs_are_folded_into_one_line():
    engine = engine_with_runs()
    app, _ = make_app(engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        assert app.conv_view.title == "Rust lifetimes"      # the newest chat, not the newest run
        assert app.sidebar.visible() == ["Rust lifetimes", "Trip to Lisbon"]
        fold = app.sidebar.query_one(OneShotsItem)
        assert fold.n == 3 and "3 one-shot runs" in str(fold.query_one("Label").render())
        lv = app.sidebar.query_one("#conversations")
        lv.focus()
        lv.index = len(lv.children) - 1
        await pilot.press("enter")
        await settle(pilot)
        assert app.sidebar.visible() == ["Rust lifetimes", "Trip to Lisbon", "Translate hello", "Capital of France?",
                                         "What is 2+2?"]
        assert "(hide)" in str(app.sidebar.query_one(OneShotsItem).query_one("Label").render())
        assert app.conv_view.title == "Rust lifetimes"      # the fold line opens nothing


async def test_a_search_finds_one_shot_runs_and_an_open_one_is_listed():
    engine = engine_with_runs()
    app, _ = make_app(engine)
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        await pilot.press("f3")
        await pilot.press(*"capital")
        await settle(pilot)
        assert app.sidebar.visible() == ["Capital of France?"]
        await pilot.press("enter")
        await settle(pilot)
        assert app.conv_view.title == "Capital of France?"
        app.sidebar.query_one("#search").value = ""
        await settle(pilot)
        # the open one-shot conversation is listed with the chats; the other two stay folded
        assert "Capital of France?" in app.sidebar.visible()
        assert app.sidebar.query_one(OneShotsItem).n == 2


async def test_a_long_first_message_titles_the_conversation_at_a_word():
    app, engine = make_app()
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        app.chat_input.insert("Please explain how the borrow checker decides lifetimes in nested closures")
        await pilot.press("enter")
        await settle(pilot)
        title = app.conv_view.title
        assert len(title) <= 48 and title == "Please explain how the borrow checker decides", title
