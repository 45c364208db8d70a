"""Markdown text of a reply, streamed at a cost proportional to the new text.

Owns: showing Markdown that grows. The text is kept as frozen chunks plus one live
tail. Each frame re-renders only the tail (Rich's Markdown, bounded by ``CHUNK``
characters plus one block); when the tail grows past ``CHUNK`` it is cut at the
last blank line outside a code fence and the part before becomes a frozen chunk,
never rendered again. ``finalize()`` re-renders the whole text once, as prose
chunks and one ``CodeBlock`` per fenced block (click one to copy its code).
The widget count stays ~len(text)/CHUNK + code blocks, so the chat's layout
does not grow with every paragraph.

Why not Textual's Markdown widget: it makes several widgets per block, and with a
10,000-token reply its append/update made the layout cost grow with the whole
reply (measured with ``bench_typing``: keystroke-to-screen p50 ~280 ms while
streaming, and a 17 s stall for the final render).
"""

from __future__ import annotations

from rich.markdown import Markdown as RichMarkdown
from rich.segment import Segment
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.geometry import Size
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Static

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

    def _render_at(self, width: int) -> list[Strip]:
        if width != self._width:
            console = self.app.console
            options = console.options.update(width=max(1, width), height=None)
            lines = console.render_lines(RichMarkdown(self.markdown, code_theme=self.code_theme), options,
                                         style=self.rich_style, pad=True)
            self._lines = [Strip(Segment.simplify(line), width) for line in lines]
            self._width = width
        return self._lines

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self._render_at(width))

    def render_line(self, y: int) -> Strip:
        lines = self._render_at(self.content_region.width or self.size.width)
        return lines[y] if 0 <= y < len(lines) else Strip.blank(self.size.width)


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
        self.tail = Static("", classes="stream-tail")

    def _md(self, text: str) -> RichMarkdown:
        return RichMarkdown(text, code_theme=self.code_theme)

    def _segment_widgets(self) -> list[Widget]:
        return [CodeBlock(md, code, self.code_theme) if kind == "code" else Rendered(md, self.code_theme, "prose")
                for kind, md, code in segments(self.text)]

    def compose(self) -> ComposeResult:
        if self.final:
            yield from self._segment_widgets()
        else:
            self.tail.update(self._md(self.text))
            yield self.tail

    async def append(self, delta: str) -> None:
        if self.final:
            raise RuntimeError("append after finalize()")
        self.text += delta
        tail = self.text[self.frozen:]
        if len(tail) > CHUNK:
            cut = safe_cut(tail)
            if cut:
                await self.mount(Rendered(tail[:cut], self.code_theme, "stream-chunk"), before=self.tail)
                self.frozen += cut
                tail = tail[cut:]
        self.tail.update(self._md(tail))

    async def finalize(self, text: str | None = None) -> None:
        """Render the whole text once (with click-to-copy code blocks)."""
        if text is not None:
            self.text = text
        self.final = True
        with self.app.batch_update():
            await self.remove_children()
            await self.mount_all(self._segment_widgets())
