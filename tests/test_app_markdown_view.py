"""MarkdownView: cutting points, segments, and the bounded widget count while streaming."""

from __future__ import annotations

import asyncio
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


async def test_streaming_keeps_widget_count_proportional_to_chunks(monkeypatch) -> None:
    """The widget count while streaming stays ~len(text)/CHUNK (+ code blocks), and the
    frozen chunks survive finalize(). The test paces the stream: the fake engine sends
    token i only once the tokens before it are on screen, so every token goes through
    its own MarkdownView.append, observed there, however fast or slow the machine is
    (a loop polling the view raced the stream: on a fast machine it ended first and the
    test failed with ``assert 0 < peak``)."""
    text, step = long_reply(3000), 60
    n_tokens = -(-len(text) // step)
    seen: list[tuple[int, int, object]] = []  # (text shown, children, first child once frozen) per append
    appended = asyncio.Event()
    real_append = MarkdownView.append

    async def spy(self, delta: str) -> None:
        await real_append(self, delta)
        seen.append((len(self.text), len(self.children), self.children[0] if self.frozen else None))
        appended.set()

    async def gate(i: int) -> None:  # token i waits until tokens 0..i-1 reached the screen
        while i and (not seen or seen[-1][0] < i * step):
            appended.clear()
            await asyncio.wait_for(appended.wait(), 60)  # a deadline only against a hang, never reached

    monkeypatch.setattr(MarkdownView, "append", spy)
    app, _ = make_app(FakeEngine(reply=lambda _t: text, chars_per_token=step, token_gate=gate))
    async with app.run_test() as pilot:
        await settle(pilot)
        app.chat_input.insert("go")
        await pilot.press("enter")
        await settle(pilot)
        while app.active is not None:
            await pilot.pause(0.01)
        await settle(pilot)
        # tokens 0..n-2 each had an append of their own (the last one may go with finish())
        assert [shown for shown, _, _ in seen[:n_tokens - 1]] == [step * (i + 1) for i in range(n_tokens - 1)]
        peak = max(n for _, n, _ in seen)
        first = next((f for _, _, f in seen if f is not None), None)
        assert 0 < peak <= len(text) // (CHUNK // 2) + 2 + 2 * text.count("```python")
        view = app.query(MarkdownView).last()
        assert view.final and len(view.query(CodeBlock)) == text.count("```python")
        assert first is not None and first in view.children  # finalize() kept the frozen part
        assert app.messages()[-1].text == text
        shown = "".join(w.markdown for w in view.children)
        assert shown.split() == text.split()  # all the text, once (blank lines between blocks aside)


HAIKU = "An old silent pond\nA frog jumps into the pond\nSplash! Silence again"


async def test_single_line_breaks_of_a_reply_stay_line_breaks():
    """A haiku showed as one run-on line (CommonMark joins a paragraph's lines; the
    export kept them apart). Its three lines are three lines on screen, and the reply's
    text (copied, exported) is unchanged."""
    app, _ = make_app(FakeEngine(reply=lambda t: HAIKU))
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        app.chat_input.insert("a haiku please")
        await pilot.press("enter")
        await settle(pilot)
        reply = app.messages()[-1]
        assert reply.text == HAIKU
        view = reply.query_one(MarkdownView)
        shown = [line.text.strip() for w in view.query("*") if hasattr(w, "_lines") for line in w._lines]
        assert [s for s in shown if s] == HAIKU.split("\n"), shown


@pytest.mark.parametrize("text,kept", [
    ("a\nb", "a  \nb"),
    ("- one\n- two", "- one\n- two"),
    ("para\n\n# Head\ntext", "para\n\n# Head  \ntext"),
    ("```\nx\ny\n```\nafter", "```\nx\ny\n```\nafter"),
    ("| a | b |\n|---|---|\n| 1 | 2 |", "| a | b |\n|---|---|\n| 1 | 2 |"),
])
def test_hard_breaks_keeps_blocks_as_they_are(text, kept):
    from aotx.app.widgets.markdown_view import hard_breaks

    assert hard_breaks(text) == kept
