"""MarkdownView: cutting points, segments, and the bounded widget count while streaming."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, make_app, settle  # noqa: E402

from tests.tools.bench_typing import long_reply  # noqa: E402
from aotx.app.widgets.markdown_view import CHUNK, CodeBlock, MarkdownView, safe_cut, segments  # noqa: E402


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))


@pytest.mark.parametrize("text,cut", [
    ("one paragraph", 0),
    ("a\n\nb", 3),
    ("a\n\nb\n\nc", 6),
    ("a\n\n```\nx\n\ny\n", 3),          # the blank line inside an open fence is no cut
    ("```\nx\n\n```\n\nafter", 12),
    ("~~~\n\n~~~\n", 0),
])
def test_safe_cut(text: str, cut: int) -> None:
    assert safe_cut(text) == cut


def test_segments_split_code_blocks_and_keep_all_text() -> None:
    text = "intro\n\n```python\nprint(1)\n```\nmid\n\n~~~\nraw\n~~~\n\nend\n```sh\nunterminated"
    segs = segments(text)
    assert [k for k, _, _ in segs] == ["prose", "code", "prose", "code", "prose", "code"]
    assert [c for k, _, c in segs if k == "code"] == ["print(1)", "raw", "unterminated"]
    assert "".join(md for _, md, _ in segs) == text


async def test_streaming_keeps_widget_count_proportional_to_chunks() -> None:
    text = long_reply(3000)
    app, _ = make_app(FakeEngine(reply=lambda _t: text, chars_per_token=40, token_delay=0.003))
    async with app.run_test() as pilot:
        await settle(pilot)
        app.chat_input.insert("go")
        await pilot.press("enter")
        peak, first = 0, None
        while app.active is not None:
            await pilot.pause(0.01)
            views = app.query(MarkdownView)
            if views and not views.last().final:
                peak = max(peak, len(views.last().children))
                if first is None and views.last().frozen:
                    first = views.last().children[0]
        await settle(pilot)
        # frozen chunks are cut into prose and code blocks once, when they freeze
        assert 0 < peak <= len(text) // (CHUNK // 2) + 2 + 2 * text.count("```python")
        view = app.query(MarkdownView).last()
        assert view.final and len(view.query(CodeBlock)) == text.count("```python")
        assert first is not None and first in view.children  # finalize() kept the frozen part
        assert app.messages()[-1].text == text
        shown = "".join(w.markdown for w in view.children)
        assert shown.split() == text.split()  # all the text, once (blank lines between blocks aside)
