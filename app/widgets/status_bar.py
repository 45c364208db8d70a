"""The status bar: engine state (model, device, ready/loading), the budget, and while a
reply streams its speed and the context it uses.

Owns: formatting what the app knows into one line (exact bytes in its tooltip). While
a reply streams: ``12.3 tok/s · context 812/4096`` (decode tokens per second since the
first token; the conversation's prompt plus the reply so far against the slot's
context); after it, the last reply's figures stay until the next. Before any reply it
says how long a reply may run: to the end of the context by default (there is no
shorter default length limit), or the conversation's own max_tokens. Leaves polling the
engine and counting tokens to the app.
"""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Static

from aotx.engine.present.format import ellipsize, fmt_bytes
from aotx.engine import protocol as P

REDRAW_S = 0.25  # how often the line is redrawn while a reply streams
MIN_MODEL = 12  # the fewest characters of the model's name kept beside the state
# what the app is doing for a message, kept while the engine's status says "ready": the
# engine is ready, the message is not answered yet (its attachments are read, its model loads)
WORKING = ("writing", "sending", "reading attachments", "loading model")


class StatusBar(Horizontal):
    """One line: model · device · state (progress) · speed and context · budget used / free."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model = ""  # the engine's default model
        self.conv_model = ""  # the open conversation's model ("": the default)
        self.device = ""
        self.state = "starting"
        self.detail = ""
        self.used = self.budget = 0
        self.n_ctx = 0
        self.max_tokens: int | None = None  # the open conversation's reply limit (None: the default)
        # the reply streaming now (or the last one)
        self.streaming = False
        self.n_prompt = 0
        self.n_generated = 0
        self.first_token_at = 0.0
        self.tokens_per_s = 0.0
        self._timer = None

    def compose(self) -> ComposeResult:
        yield Static(self.line(), id="engine-status", markup=False)

    # ---- the line ----------------------------------------------------------

    def speed_text(self) -> str:
        """``12.3 tok/s · context 812/4096`` (or "" before any reply)."""
        if not (self.streaming or self.n_generated):
            if not self.n_ctx:
                return ""
            if self.n_prompt:  # a conversation opened with its history: the context it holds
                return f"context {self.n_prompt}/{self.n_ctx}"
            if self.max_tokens is not None and self.max_tokens < self.n_ctx:
                return f"replies up to {self.max_tokens} tokens"
            return f"replies run to the context ({self.n_ctx} tokens)"
        parts = []
        if self.tokens_per_s > 0:
            parts.append(f"{self.tokens_per_s:.1f} tok/s")
        if self.n_ctx:
            used = self.n_prompt + self.n_generated
            parts.append(f"context {used}/{self.n_ctx}")
        return " · ".join(parts)

    def line(self, width: int | None = None) -> str:
        """The status line; with ``width``, shortened to fit by dropping the least useful
        first: the budget loses its words, then goes; then the device, the speed and
        context, the state's detail; then the model's name is shortened with an ellipsis
        (the name and the state stay to the end: which model answers, and whether it is
        ready)."""
        state = self.state + (f" ({self.detail})" if self.detail else "")
        speed = self.speed_text() if self.state in ("ready", "writing") else ""
        free = fmt_bytes(self.budget - self.used)
        budgets = ([f"budget {fmt_bytes(self.used)} used / {free} free", f"{free} free", ""] if self.budget
                   else [""])
        model = self.conv_model or self.model or "no model yet"
        device = self.device or "?"
        tries = ([(device, speed, state, b) for b in budgets]
                 + [("", speed, state, ""), ("", "", state, ""), ("", "", self.state, "")])
        for d, sp, st, b in tries:
            line = " · ".join(x for x in (model, d, st, sp, b) if x)
            if width is None or len(line) <= width:
                return line
        room = width - len(" · " + self.state)
        if room >= MIN_MODEL:
            return f"{ellipsize(model, room)} · {self.state}"
        return ellipsize(f"{model} · {self.state}", width)

    # ---- engine state ------------------------------------------------------

    def set_state(self, state: str, detail: str = "") -> None:
        self.state, self.detail = state, detail
        self._refresh()

    def set_welcome(self, w: P.Welcome) -> None:
        self.model, self.device = w.model, w.device
        self._refresh()

    def set_conversation_model(self, model: str) -> None:
        self.conv_model = model
        self._refresh()

    def set_status(self, s: P.StatusReply) -> None:
        self.model, self.device = s.model, s.device
        self.used, self.budget = s.used_bytes, s.budget_bytes
        self.n_ctx = s.n_ctx
        if self.state not in WORKING or not s.ready or s.degraded:
            self.state = "loading" if not s.ready else "DEGRADED" if s.degraded else "ready"
            self.detail = s.load_progress if not s.ready else s.degraded
        self._refresh()

    def conversation_opened(self, n_tokens: int = 0) -> None:
        """Another conversation is open: the last reply's speed and context were the other
        conversation's; ``n_tokens`` is the context this one holds (0: not known)."""
        self.streaming, self.n_prompt, self.n_generated = False, n_tokens, 0
        self.first_token_at, self.tokens_per_s = 0.0, 0.0
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        self._refresh()

    # ---- a streaming reply -------------------------------------------------

    def reply_started(self, n_prompt: int) -> None:
        """A reply was accepted: ``n_prompt`` tokens of context before it."""
        self.streaming, self.n_prompt, self.n_generated = True, n_prompt, 0
        self.first_token_at, self.tokens_per_s = 0.0, 0.0
        self.state, self.detail = "writing", "reading the prompt"  # until the first token
        self._refresh()

    def reply_token(self, now: float | None = None) -> None:
        """One more token of the streaming reply (tokens/s over the tokens after the
        first). The line is redrawn a few times a second, not per token."""
        now = time.monotonic() if now is None else now
        self.n_generated += 1
        if self.first_token_at == 0.0:
            self.first_token_at = now
            self.detail = ""
        elif now > self.first_token_at:
            self.tokens_per_s = (self.n_generated - 1) / (now - self.first_token_at)
        if self._timer is None and self.is_mounted:
            self._timer = self.set_interval(REDRAW_S, self._refresh)

    def reply_finished(self, n_prompt: int = 0, n_completion: int = 0, tokens_per_s: float = 0.0) -> None:
        """The reply ended: the engine's own figures replace the estimate when it sent them."""
        self.streaming = False
        if n_prompt:
            self.n_prompt = n_prompt
        if n_completion:
            self.n_generated = n_completion
        if tokens_per_s > 0:
            self.tokens_per_s = tokens_per_s
        if self.state in WORKING:
            self.state, self.detail = "ready", ""
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        self._refresh()

    def on_resize(self) -> None:
        self._refresh()

    def _refresh(self) -> None:
        if self.is_mounted:
            line = self.query_one("#engine-status", Static)
            width = line.content_region.width or self.size.width - 2
            line.update(self.line(width if width > 0 else None))
            if self.budget:
                line.tooltip = f"budget: {self.used} bytes used, {self.budget - self.used} bytes free"
