"""Search in aotx-chat (F3): the full-text query never passes FTS syntax through, the index
finds message text and follows the engine's table, and Enter opens the first hit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, make_app, settle  # noqa: E402

from aotx.app.search import SearchIndex, fts_query  # noqa: E402
from aotx.app.widgets.message import MessageWidget  # noqa: E402
from aotx.app.widgets.sidebar import ConversationItem  # noqa: E402
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
