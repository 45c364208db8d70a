"""aotx-chat as a daily driver (issue 17, points 11-14): live speed and context in the
status line, export, search across message text, the open conversation highlighted,
fork titles, a sidebar that follows other clients, arrow keys between messages, help
that fits 80 columns, the 80x24 layout, one legend, reopened attachments, themes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from textual.widgets import Button, DataTable, Input

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, make_app, settle  # noqa: E402
from fakes.media_files import write_wav  # noqa: E402
from fakes.terminal import bracketed_paste  # noqa: E402

from aotx.engine.present.format import LEGEND, LEGEND_ITEMS, GLYPHS  # noqa: E402
from aotx.app.search import SearchIndex, fts_query  # noqa: E402
from aotx.app.widgets.message import MessageWidget  # noqa: E402
from aotx.app.widgets.sidebar import ConversationItem  # noqa: E402
from aotx.engine import protocol as P  # noqa: E402


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


async def until(pilot, cond, tries: int = 150) -> None:
    for _ in range(tries):
        if cond():
            return
        await pilot.pause(0.02)
    raise AssertionError("condition not reached")


def notice(app) -> str:
    return str(app.query_one("#input-notice").render())


def history() -> FakeEngine:
    e = FakeEngine()
    e.add_conversation("Rust lifetimes", [("user", "what is 'a?"), ("assistant", "A **lifetime** names a borrow.")])
    e.add_conversation("Pasta recipe", [("user", "carbonara?"), ("assistant", "Eggs, guanciale, pecorino. No cream.")])
    e.add_conversation("Trip", [("user", "where to in May?"), ("assistant", "Lisbon: warm, and the jacaranda bloom.")])
    return e


# ---- 11. live speed and context -------------------------------------------------

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


# ---- 12. export -----------------------------------------------------------------

async def test_export_from_the_tui_to_markdown_and_json(tmp_path):
    app, engine = make_app(history())
    async with app.run_test() as pilot:
        await settle(pilot)
        assert app.conv_view.title == "Trip"
        for name in ("trip.md", "trip.json"):
            await pilot.press("ctrl+s")
            await until(pilot, lambda: app.screen.query("#prompt-input"))
            box = app.screen.query_one("#prompt-input", Input)
            assert box.value.endswith(".md") and "trip" in box.value
            box.value = str(tmp_path / name)
            await pilot.press("enter")
            await settle(pilot)
            assert str(tmp_path / name) in notice(app)
        md = (tmp_path / "trip.md").read_text()
        assert md.startswith("# Trip\n")
        assert "### You\n\nwhere to in May?" in md and "### Assistant\n\nLisbon: warm" in md
        assert "receipt segment 1" in md
        doc = json.loads((tmp_path / "trip.json").read_text())
        assert doc["format"] == "aotx-conversation" and doc["version"] == 1
        msgs = doc["conversation"]["messages"]
        assert [m["text"] for m in msgs] == ["where to in May?", "Lisbon: warm, and the jacaranda bloom."]
        assert msgs[0]["receipt"]["segment"] == 1
        # exporting over an existing file asks first; "n" keeps the old one
        (tmp_path / "trip.md").write_text("keep me")
        await pilot.press("ctrl+s")
        await until(pilot, lambda: app.screen.query("#prompt-input"))
        app.screen.query_one("#prompt-input", Input).value = str(tmp_path / "trip.md")
        await pilot.press("enter")
        await pilot.pause()
        await pilot.press("n")
        await settle(pilot)
        assert (tmp_path / "trip.md").read_text() == "keep me"


# ---- 13. search, highlight, forks, other clients, arrows -------------------------

@pytest.mark.parametrize("typed,query", [
    ("lisbon", '"lisbon"*'), ("don't", '"don" "t"*'), ('C++ "x', '"C" "x"*'), ("NOT", '"NOT"*'), ("  ", ""),
])
def test_fts_query_never_passes_syntax_through(typed, query):
    assert fts_query(typed) == query


def test_search_index_finds_message_text_and_keeps_in_step():
    ix = SearchIndex()
    conv = P.ConversationView(conv_id="c1", title="Pasta", updated_at=1.0, messages=[
        P.MessageView(msg_id="m1", role="user", text="carbonara?"),
        P.MessageView(msg_id="m2", role="assistant", text="Eggs, guanciale, pecorino. Don't add cream.")])
    ix.put(conv)
    assert [(h.conv_id, h.msg_id) for h in ix.search("guanc")] == [("c1", "m2")]
    assert ix.search("don't")[0].msg_id == "m2"
    assert ix.search("pasta")[0].msg_id == ""  # a title hit
    assert ix.search("nothing here") == []
    # the engine's table moved on: c1 changed, c2 is new, nothing is gone
    assert ix.stale([P.ConversationView(conv_id="c1", updated_at=2.0), P.ConversationView(conv_id="c2")]) == (
        ["c1", "c2"], [])
    assert ix.stale([]) == ([], ["c1"])
    ix.drop("c1")
    assert ix.search("guanc") == []


async def test_search_across_message_text_and_enter_opens_the_first_hit():
    app, engine = make_app(history())
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        await pilot.press("f3")
        await pilot.press(*"guanc")
        await pilot.pause()
        items = list(app.sidebar.query(ConversationItem))
        assert [i.title for i in items] == ["Pasta recipe"]  # found in a reply, not the title
        assert "guanciale" in items[0].hit.snippet
        await pilot.press("enter")
        await settle(pilot)
        assert app.conv_view.title == "Pasta recipe"
        assert isinstance(app.focused, MessageWidget) and "guanciale" in app.focused.text


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


async def test_bug_a_status_reply_after_the_app_closed_does_not_fail_its_worker():
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


async def test_arrow_keys_move_between_messages():
    app, _ = make_app(history())
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        ms = app.messages()
        assert app.chat_input.has_focus and app.chat_input.text == ""
        await pilot.press("up")  # from the empty input: the last message
        assert app.focused is ms[-1]
        await pilot.press("up")
        assert app.focused is ms[-2]
        await pilot.press("up")  # the first stays the first
        assert app.focused is ms[0]
        await pilot.press("down")
        assert app.focused is ms[1]
        await pilot.press("down")  # past the last: back to the input
        assert app.chat_input.has_focus


# ---- 14. help at 80 columns, the 80x24 layout, one legend, reopened media, themes ---

async def test_help_rows_fit_80_columns():
    app, _ = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.press("f1")
        await pilot.pause()
        table = app.screen.query_one(DataTable)
        assert table.virtual_size.width <= table.scrollable_content_region.width, (
            table.virtual_size, table.scrollable_content_region)
        assert table.row_count >= 25
        box = app.screen.query_one("#help-box")
        assert box.region.right <= 80 and box.region.bottom <= 24


async def test_80x24_layout_sidebar_narrows_and_f4_buttons_are_on_screen():
    app, _ = make_app(history())
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert app.screen.has_class("-narrow") and app.screen.has_class("-short")
        assert app.sidebar.region.width <= 24
        assert not app.sidebar.query_one("#legend").display
        assert app.chat_input.region.bottom <= 23 and app.chat_input.region.height >= 3
        await pilot.press("f4")
        await until(pilot, lambda: app.screen.query("#save"))
        await pilot.pause()
        for bid in ("save", "cancel"):
            b = app.screen.query_one(f"#{bid}", Button)
            assert 0 <= b.region.y and b.region.bottom <= 24 and b.region.right <= 80, (bid, b.region)
    app, _ = make_app(history())
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        assert app.screen.has_class("-wide") and app.sidebar.region.width == 30
        assert app.sidebar.query_one("#legend").display


def test_legend_words_agree_everywhere():
    """Regression (issue 17, point 14): the help said "✗ refused" and had no ⊘, the
    sidebar said "failed" and "cancelled"."""
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


async def test_reopened_conversation_shows_attachments_as_it_did_live(tmp_path):
    engine = FakeEngine(media_text=lambda a: "the quick brown fox")
    app, _ = make_app(engine)
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        bracketed_paste(app, str(write_wav(tmp_path / "clip.wav", 0.3)))
        await settle(pilot)
        app.chat_input.insert("what is said?")
        await pilot.press("enter")
        await settle(pilot)
        live = app.messages()[0]
        live_view = (live.text, live.notices(), [a.name for a in live.attachments])
        assert live_view[0] == "what is said?" and live_view[2] == ["clip.wav"]
        assert "the quick brown fox" in live_view[1][0]
        conv = app.conv_id
    app2, _ = make_app(engine)
    async with app2.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        assert app2.conv_id == conv
        again = app2.messages()[0]
        assert again.text == "what is said?"  # not the transcript block the journal keeps
        assert [a.name for a in again.attachments] == ["clip.wav"]
        assert again.notices() == ["Transcript of clip.wav, as the model received it:\nthe quick brown fox"]
        assert live_view[1][0] == "Transcript of clip.wav (fake-specialist), as the model received it:\n" \
                                  "the quick brown fox"
        # a retry sends the words, with the file, not the block again
        await pilot.press("ctrl+r")
        await settle(pilot)
        assert engine.submitted[-1][1] == "what is said?" and [a.name for a in engine.submitted[-1][2]] == ["clip.wav"]


async def test_more_than_two_themes_from_textual_and_all_remembered(home):
    from aotx.app.theming import THEMES

    assert {"dark", "light", "nord", "gruvbox", "tokyo-night", "dracula"} <= set(THEMES)
    app, _ = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        seen = []
        for _ in range(3):
            await pilot.press("f6")
            seen.append((app.theme_name, app.theme))
        assert seen[0] == ("light", "textual-light")
        assert seen[1][0] == seen[1][1] and seen[1][0] not in ("dark", "light")  # a Textual theme by its name
        app.theme = "nord"  # Textual's own "Change theme" command sets this
        await pilot.pause()
        assert app.theme_name == "nord" and app.has_class("theme-textual") and not app.has_class("theme-dark")
    assert json.loads((home / "app_state.json").read_text())["theme"] == "nord"
    app2, _ = make_app()
    async with app2.run_test() as pilot:
        await settle(pilot)
        assert app2.theme_name == "nord" and app2.theme == "nord"
