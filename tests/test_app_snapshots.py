"""Snapshot tests (pytest-textual-snapshot) at 80x24 and 150x45: the main screen in
three themes (AOTX dark and light, Textual's nord), the help screen, the details view,
the F4 settings dialog and search hits.

Update after an intended change with ``pytest tests/test_app_snapshots.py --snapshot-update``
and look at the SVGs in ``tests/__snapshots__/``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, make_app, settle  # noqa: E402

from aotx.engine import protocol as P  # noqa: E402

SIZES = {"80x24": (80, 24), "150x45": (150, 45)}


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))


def demo_app(theme: str = "dark"):
    engine = FakeEngine(notices=[P.Notice(id=0, kind="queued", resource="slots", message="waiting for a free slot",
                                          asked=1, free=0, position=1)])
    engine.add_conversation("Pasta recipe", [("user", "carbonara?"), ("assistant", "Eggs, guanciale, pecorino.")])
    engine.add_conversation("Rust lifetimes", [("user", "what is 'a?"),
                                               ("assistant", "A *lifetime* name:\n\n```rust\nfn f<'a>(x: &'a str) {}\n```")])
    app, _ = make_app(engine, theme=theme)
    return app


async def _prepare(pilot, send: str | None = "Show me a loop") -> None:
    await settle(pilot)
    pilot.app.chat_input.cursor_blink = False
    if send:
        pilot.app.chat_input.insert(send)
        await pilot.press("enter")
        await settle(pilot)
    await pilot.pause()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("theme", ["dark", "light", "nord"])
def test_main_screen(snap_compare, theme, size):
    assert snap_compare(demo_app(theme), terminal_size=SIZES[size], run_before=_prepare)


@pytest.mark.parametrize("size", SIZES)
def test_help_screen(snap_compare, size):
    async def run_before(pilot):
        await _prepare(pilot, send=None)
        await pilot.press("f1")
        await pilot.pause()

    assert snap_compare(demo_app(), terminal_size=SIZES[size], run_before=run_before)


@pytest.mark.parametrize("size", SIZES)
def test_details_view(snap_compare, size):
    async def run_before(pilot):
        await _prepare(pilot)
        await pilot.press("f7")
        await pilot.pause()

    assert snap_compare(demo_app(), terminal_size=SIZES[size], run_before=run_before)


@pytest.mark.parametrize("size", SIZES)
def test_settings_dialog(snap_compare, size):
    async def run_before(pilot):
        await _prepare(pilot, send=None)
        await pilot.press("f4")  # its worker waits for the dialog: no settle() here
        for _ in range(100):
            if pilot.app.screen.query("#system-prompt"):
                break
            await pilot.pause(0.02)
        pilot.app.screen.query_one("#system-prompt").cursor_blink = False
        await pilot.pause()

    assert snap_compare(demo_app(), terminal_size=SIZES[size], run_before=run_before)


@pytest.mark.parametrize("size", SIZES)
def test_search_hits(snap_compare, size):
    async def run_before(pilot):
        await _prepare(pilot, send=None)
        await pilot.press("f3")
        await pilot.press(*"guanc")
        pilot.app.sidebar.query_one("#search").cursor_blink = False
        await pilot.pause()

    assert snap_compare(demo_app(), terminal_size=SIZES[size], run_before=run_before)
