"""Markdown text of a reply, streamed at a cost proportional to the new text.

Owns: showing Markdown that grows. The text is kept as frozen chunks plus one live
tail (``StreamTail``). The tail keeps the lines of its ended blocks (cut at the last
blank line outside a code fence) and each frame renders only the block still being
written; a frame asks Textual for a layout only when the tail's height changed.
When the ended blocks pass ``CHUNK`` characters their lines move into a frozen
chunk widget, never rendered again (at the same width). ``finalize()`` re-renders the whole text once, as prose
chunks and one ``CodeBlock`` per fenced block (click one to copy its code).
The widget count stays ~len(text)/CHUNK + code blocks, so the chat's layout
does not grow with every paragraph.

Why not Textual's Markdown widget: it makes several widgets per block, and with a
10,000-token reply its append/update made the layout cost grow with the whole
reply (measured with ``tests/tools/bench_typing.py``: keystroke-to-screen p50 ~280 ms while
streaming, and a 17 s stall for the final render).
"""

from __future__ import annotations

import re

from rich.markdown import Markdown as RichMarkdown
from rich.segment import Segment
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.geometry import Size
from textual.strip import Strip
from textual.widget import Widget

CHUNK = 1500  # characters
_FENCES = ("```", "~~~")


def safe_cut(text: str) -> int:
    """Index just after the last blank line of ``text`` outside a code fence (0: none)."""
    cut, pos, in_fence = 0, 0, False
    for line in text.splitlines(keepends=True):
        pos += len(line)
        stripped = line.strip()
        if stripped.startswith(_FENCES):
            in_fence = not in_fence
        elif not stripped and not in_fence:
            cut = pos
    return cut


_BLOCK_START = re.compile(r"^\s*(?:[-*+]\s|\d+[.)]\s|#|>|\||```|~~~|$)")


def hard_breaks(text: str) -> str:
    """Single line breaks inside a paragraph kept as line breaks (a haiku's lines, an
    address), as chat apps show a model's reply: CommonMark would join them into one line.
    A line followed by another line of the same paragraph gets Markdown's hard break (two
    trailing spaces); code fences, tables, and lines before a blank line or a new block
    (a list item, a heading, a quote) are left as they are. For rendering only: the text
    kept, copied and exported is the reply as written."""
    lines = text.split("\n")
    out, in_fence = [], False
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith(_FENCES):
            in_fence = not in_fence
            out.append(line)
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if (not in_fence and stripped and not stripped.startswith("|") and not line.endswith("  ")
                and i + 1 < len(lines) and not _BLOCK_START.match(nxt)):
            line += "  "
        out.append(line)
    return "\n".join(out)


def segments(text: str) -> list[tuple[str, str, str]]:
    """Split Markdown into ("prose", markdown, "") and ("code", fenced markdown, code)
    pieces, prose pieces cut at blank lines to about CHUNK characters."""
    out: list[tuple[str, str, str]] = []
    prose: list[str] = []
    fence: list[str] | None = None

    def flush_prose() -> None:
        if "".join(prose).strip():
            out.append(("prose", "".join(prose), ""))
        prose.clear()

    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if fence is not None:
            fence.append(line)
            if stripped.startswith(_FENCES) and len(fence) > 1:
                out.append(("code", "".join(fence), "".join(fence[1:-1]).rstrip("\n")))
                fence = None
        elif stripped.startswith(_FENCES):
            flush_prose()
            fence = [line]
        else:
            prose.append(line)
            if not stripped and sum(map(len, prose)) > CHUNK:
                flush_prose()
    if fence is not None:  # unterminated fence: still code
        out.append(("code", "".join(fence), "".join(fence[1:]).rstrip("\n")))
    flush_prose()
    return out


class Rendered(Widget):
    """Markdown rendered to lines once per width and kept (Textual's line API): a
    frozen chunk costs nothing per frame, however often the layout around it moves."""

    DEFAULT_CSS = "Rendered { height: auto; }"

    def __init__(self, markdown: str, code_theme: str, classes: str = "") -> None:
        super().__init__(classes=classes)
        self.markdown, self.code_theme = markdown, code_theme
        self._width = -1
        self._lines: list[Strip] = []

    def _md_lines(self, markdown: str, width: int) -> list[Strip]:
        if not markdown.strip():
            return []
        console = self.app.console
        options = console.options.update(width=max(1, width), height=None)
        lines = console.render_lines(RichMarkdown(hard_breaks(markdown), code_theme=self.code_theme), options,
                                     style=self.rich_style, pad=True)
        return [Strip(Segment.simplify(line), width) for line in lines]

    def _render_at(self, width: int) -> list[Strip]:
        if width != self._width:
            self._lines = self._md_lines(self.markdown, width)
            self._width = width
        return self._lines

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self._render_at(width))

    def render_line(self, y: int) -> Strip:
        lines = self._render_at(self.content_region.width or self.size.width)
        return lines[y] if 0 <= y < len(lines) else Strip.blank(self.size.width)


class StreamTail(Rendered):
    """The live end of a streaming reply. Blocks that have ended (up to the last blank
    line outside a code fence) are rendered once and kept as lines; a frame renders
    only the block still being written, and asks for a layout only when the height
    changed (most frames add no line). ``take_settled()`` hands the kept lines to a
    frozen chunk, so freezing renders nothing again."""

    def __init__(self, text: str, code_theme: str) -> None:
        super().__init__(text, code_theme, classes="stream-tail")
        self.settled, self.live = "", text
        self._settled_lines: list[Strip] = []
        self._settled_width = -1

    def _render_at(self, width: int) -> list[Strip]:
        if width != self._width:
            if width != self._settled_width:
                self._settled_lines = self._md_lines(self.settled, width)
                self._settled_width = width
            live = self._md_lines(self.live, width)
            gap = [Strip.blank(width)] if self._settled_lines and live else []
            self._lines = self._settled_lines + gap + live
            self._width = width
        return self._lines

    def set_text(self, text: str) -> None:
        cut = safe_cut(text)
        if cut < len(self.settled) or not text.startswith(self.settled):
            self.settled, self._settled_lines, self._settled_width = "", [], -1
        if cut > len(self.settled):
            if self._settled_width > 0:  # render only the blocks that just ended
                more = self._md_lines(text[len(self.settled):cut], self._settled_width)
                gap = [Strip.blank(self._settled_width)] if self._settled_lines and more else []
                self._settled_lines = self._settled_lines + gap + more
            self.settled = text[:cut]
        self.markdown, self.live = text, text[cut:]
        height = len(self._lines) if self._width >= 0 else -1
        width, self._width = self._width, -1
        if width > 0:
            self._render_at(width)
        self.refresh(layout=len(self._lines) != height or width <= 0)

    def take_settled(self) -> tuple[str, list[Strip], int]:
        """(markdown, lines, width) of the ended blocks; the tail keeps only the live block."""
        out = (self.settled, self._settled_lines, self._settled_width)
        self.settled, self._settled_lines = "", []
        return out


class CodeBlock(Rendered):
    """A fenced code block; ``code`` is its text without the fences."""

    def __init__(self, markdown: str, code: str, code_theme: str) -> None:
        super().__init__(markdown, code_theme, classes="code-block")
        self.code = code
        self.tooltip = "click to copy"


class MarkdownView(Vertical):
    """Frozen chunks followed by one live tail while streaming; segments when final."""

    def __init__(self, text: str = "", code_theme: str = "monokai", final: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.text = text
        self.frozen = 0
        self.code_theme = code_theme
        self.final = final
        self.tail = StreamTail("", code_theme)

    def _segment_widgets(self, text: str | None = None) -> list[Widget]:
        return [CodeBlock(md, code, self.code_theme) if kind == "code" else Rendered(md, self.code_theme, "prose")
                for kind, md, code in segments(self.text if text is None else text)]

    def compose(self) -> ComposeResult:
        if self.final:
            yield from self._segment_widgets()
        else:
            self.tail.markdown = self.tail.live = self.text
            yield self.tail

    async def append(self, delta: str) -> None:
        if self.final:
            raise RuntimeError("append after finalize()")
        self.text += delta
        tail = self.text[self.frozen:]
        self.tail.set_text(tail)
        if len(self.tail.settled) > CHUNK:  # freeze the ended blocks: their lines move, nothing re-renders
            markdown, lines, width = self.tail.take_settled()
            if any(kind == "code" for kind, _, _ in segments(markdown)):
                chunks = self._segment_widgets(markdown)  # final form now: finalize() keeps them
            else:
                chunk = Rendered(markdown, self.code_theme, "stream-chunk")
                if width > 0:
                    chunk._lines, chunk._width = lines, width
                chunks = [chunk]
            self.frozen += len(markdown)
            with self.app.batch_update():
                self.tail.set_text(self.text[self.frozen:])
                await self.mount_all(chunks, before=self.tail)

    async def finalize(self, text: str | None = None) -> None:
        """The final form (with click-to-copy code blocks): frozen chunks stay as they
        are (they end at a block boundary and have their code blocks already); only
        the tail is rendered again, unless the final text differs from what streamed."""
        frozen = self.text[:self.frozen]
        if text is not None:
            self.text = text
        self.final = True
        with self.app.batch_update():
            if self.frozen and self.text.startswith(frozen) and self.tail.parent is self:
                await self.tail.remove()
                await self.mount_all(self._segment_widgets(self.text[self.frozen:]))
            else:
                await self.remove_children()
                await self.mount_all(self._segment_widgets())
