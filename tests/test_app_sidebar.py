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
from aotx.app.widgets.sidebar import ConversationItem  # noqa: E402


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
