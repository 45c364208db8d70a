"""aotx-chat's sidebar: the open conversation highlighted, conversations other clients add
or delete followed, fork titles that tell forks apart, and one legend of message glyphs
that the sidebar, the help and the CLI all word alike."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, make_app, settle, until  # noqa: E402

from aotx.engine.present.format import LEGEND, LEGEND_ITEMS, GLYPHS  # noqa: E402
from aotx.app.widgets.sidebar import ConversationItem, OneShotsItem  # noqa: E402


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


async def test_open_conversation_is_highlighted():
    app, _ = make_app(history())
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        current = [i for i in app.sidebar.query(ConversationItem) if i.has_class("-current")]
        assert [i.conv_id for i in current] == [app.conv_id]
        assert str(current[0].query_one(".conv-title").render()).startswith("▸ ")
        app.sidebar.query_one("ListView").index = 2
        app.sidebar.query_one("ListView").action_select_cursor()
        await settle(pilot)
        current = [i.title for i in app.sidebar.query(ConversationItem) if i.has_class("-current")]
        assert current == [app.conv_view.title] == ["Rust lifetimes"]


async def test_sidebar_follows_a_conversation_another_client_added():
    engine = history()
    app, _ = make_app(engine, status_poll_s=0.05)
    async with app.run_test() as pilot:
        await settle(pilot)
        assert "Sourdough" not in app.sidebar.visible()
        other = await engine.connect()
        conv = await other.create_conversation(title="Sourdough")
        async for _ in other.submit(conv.conv_id, "how long to proof the starter?"):
            pass
        await until(pilot, lambda: "Sourdough" in app.sidebar.visible())
        # and its text is searchable here
        await until(pilot, lambda: any(h.conv_id == conv.conv_id for h in app.index.search("starter")))
        await other.delete(conv.conv_id)
        await until(pilot, lambda: "Sourdough" not in app.sidebar.visible())


async def test_fork_titles_tell_forks_apart():
    from aotx.engine.present.format import fork_title

    assert fork_title("Trip", []) == "Trip (fork 1)"
    assert fork_title("Trip", ["Trip (fork 1)"]) == "Trip (fork 2)"
    assert fork_title("Trip (fork 1)", ["Trip (fork 1)"]) == "Trip (fork 1.1)"
    assert fork_title("Trip (fork)", []) == "Trip (fork 1)"  # the engine's own suffix
    app, engine = make_app(history())
    async with app.run_test() as pilot:
        await settle(pilot)
        await pilot.press("ctrl+g")
        await settle(pilot)
        await until(pilot, lambda: app.conv_view is not None and app.conv_view.title == "Trip (fork 1)")
        await pilot.press("ctrl+g")  # a fork of the fork
        await settle(pilot)
        await until(pilot, lambda: app.conv_view.title == "Trip (fork 1.1)")
        titles = app.sidebar.visible()
        assert {"Trip", "Trip (fork 1)", "Trip (fork 1.1)"} <= set(titles)
        assert len(titles) == len(set(titles))


def test_legend_words_agree_everywhere():
    """Regression: the help said "✗ refused" and had no ⊘, the sidebar said "failed" and
    "cancelled"; one legend now names every glyph the same way."""
    assert LEGEND == "  ".join(LEGEND_ITEMS)
    assert "⊘ cancelled" in LEGEND and "✗ failed" in LEGEND and "refused" not in LEGEND
    assert [item.split()[0] for item in LEGEND_ITEMS] == list(GLYPHS.values())


async def test_help_and_sidebar_show_the_same_legend():
    app, _ = make_app()
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        assert str(app.sidebar.query_one("#legend").render()).split("\n") == list(LEGEND_ITEMS)
        await pilot.press("f1")
        await pilot.pause()
        notes = " ".join(str(s.render()) for s in app.screen.query(".dialog-note"))
        assert LEGEND in notes


# ---- The sidebar's list: one-shot conversations folded, titles cut at a word ----------
#
# Every one-shot ``aotx run "..."`` became a sidebar entry (and the newest, so aotx-chat
# opened on it). They are kept in the journal; the sidebar folds them into one line at the
# end that Enter opens and closes, a search still finds them, and aotx-chat opens on the
# newest chat. A title made from a long first message was cut mid-word.


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


async def test_a_search_without_hits_says_so():
    """A search that matched nothing showed an empty list, as if the list were broken."""
    from aotx.app.widgets.sidebar import NoHitsItem

    app, _ = make_app(history())
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        await pilot.press("f3")
        await pilot.press(*"zebra")
        await settle(pilot)
        assert app.sidebar.visible() == []
        said = app.sidebar.query_one(NoHitsItem)
        assert "No conversation has “zebra”" in str(said.query_one("Label").render())
        await pilot.press("enter")          # nothing to open: nothing happens
        await settle(pilot)
        assert app.conv_view.title == "Trip"


async def test_a_long_title_ends_in_an_ellipsis_in_the_sidebar():
    """A title longer than the sidebar was cut at its edge in the middle of a word
    ("Write a haiku about the s"): it ends in an ellipsis."""
    e = FakeEngine()
    e.add_conversation("Write a haiku about the sea and the wind over it", [("user", "x"), ("assistant", "y")])
    app, _ = make_app(e)
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        label = app.sidebar.query_one(ConversationItem).query_one(".conv-title")
        shown = "".join(s.text for s in label.render_lines(label.region.reset_offset)[0]).rstrip()
        assert shown.endswith("…") and shown.startswith("▸ Write a haiku"), shown
