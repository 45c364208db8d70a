"""The status bar: engine state (model, device, ready/loading) and the budget.

Owns: formatting what the app knows about the engine into one line (exact bytes
in its tooltip). Leaves polling the engine to the app.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Static

from aotx.app.format import fmt_bytes
from aotx.engine.ipc import protocol as P


class StatusBar(Horizontal):
    """One line: model · device · state (progress) · budget used / free."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model = ""  # the engine's default model
        self.conv_model = ""  # the open conversation's model ("": the default)
        self.device = ""
        self.state = "starting"
        self.detail = ""
        self.used = self.budget = 0

    def compose(self) -> ComposeResult:
        yield Static(self.line(), id="engine-status", markup=False)

    def line(self) -> str:
        parts = [self.conv_model or self.model or "no model yet", self.device or "?", self.state]
        if self.detail:
            parts[-1] += f" ({self.detail})"
        if self.budget:
            parts.append(f"budget {fmt_bytes(self.used)} used / {fmt_bytes(self.budget - self.used)} free")
        return " · ".join(parts)

    def set_state(self, state: str, detail: str = "") -> None:
        self.state, self.detail = state, detail
        self._refresh()

    def set_welcome(self, w: P.Welcome) -> None:
        self.model, self.device = w.model, w.device
        self._refresh()

    def set_status(self, s: P.StatusReply) -> None:
        self.model, self.device = s.model, s.device
        self.used, self.budget = s.used_bytes, s.budget_bytes
        self.state = "loading" if not s.ready else "DEGRADED" if s.degraded else "ready"
        self.detail = s.load_progress if not s.ready else s.degraded
        self._refresh()

    def set_conversation_model(self, model: str) -> None:
        self.conv_model = model
        self._refresh()

    def _refresh(self) -> None:
        if self.is_mounted:
            line = self.query_one("#engine-status", Static)
            line.update(self.line())
            if self.budget:
                line.tooltip = f"budget: {self.used} bytes used, {self.budget - self.used} bytes free"
