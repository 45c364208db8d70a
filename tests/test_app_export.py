"""Exporting a conversation from aotx-chat (Ctrl+S): Markdown and JSON with their
receipts, and an existing file kept unless the user says to replace it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from textual.widgets import Input

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, make_app, notice, settle, until  # noqa: E402


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
