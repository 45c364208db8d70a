"""The per-conversation form: system prompt, sampling parameters and context policy."""

from __future__ import annotations

import msgspec
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static, TextArea

from aotx.engine import protocol as P

_HINTS = (("temperature", "0 = greedy"), ("top_k", "0 = off"), ("top_p", "1 = off"), ("min_p", "0 = off"),
          ("repeat_penalty", "1 = off"), ("max_tokens", "empty = to the context"), ("seed", "empty = random"))
# (name, type, hint): the types and ranges are the protocol's (SAMPLING_LIMITS)
FIELDS: tuple[tuple[str, type, str], ...] = tuple(
    (name, int if P.SAMPLING_LIMITS[name].integer else float, hint) for name, hint in _HINTS)

# SamplingParams.speculative: "" leaves it to the engine (prompt lookup where it pays)
SPECULATIVE: tuple[tuple[str, str], ...] = (
    ("engine default", ""),
    ("ngram (prompt lookup)", "ngram"),
    ("draft model (engine's --draft-model)", "draft"),
    ("off", "off"),
)


# ConversationView.context: what the conversation does once its history outgrows the context
CONTEXT: tuple[tuple[str, str], ...] = (
    ("engine default", ""),
    ("rolling: older turns leave the prompt", "rolling"),
    ("middle: the first exchange stays too", "middle"),
    ("stop: refuse once the context is full", "stop"),
)


def parse_sampling(values: dict[str, str], base: P.SamplingParams) -> P.SamplingParams:
    """Form strings -> SamplingParams. Raises ValueError naming the bad field."""
    changes = {}
    if "speculative" in values:
        mode = values["speculative"] or ""
        if mode not in {v for _, v in SPECULATIVE}:
            raise ValueError(f"speculative: {mode!r} is not one of engine default, ngram, draft, off")
        changes["speculative"] = mode
    defaults = P.SamplingParams()
    for name, kind, hint in FIELDS:
        raw = values.get(name, "").strip()
        if raw == "" and name == "seed":
            changes[name] = None
            continue
        if raw == "" and name == "max_tokens":
            changes[name] = P.UNTIL_CONTEXT
            continue
        if raw == "":  # an emptied field: the engine's default, as for a new conversation
            changes[name] = getattr(defaults, name)
            continue
        try:
            changes[name] = kind(raw)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise ValueError(f"{name.replace('_', ' ')} must be {what} ({hint}; empty for the default), not "
                             f"“{raw}”") from None
    sp = msgspec.structs.replace(base, **changes)
    why = P.sampling_problem(sp)  # what the engine would refuse, refused here with its words
    if why:
        raise ValueError(why)
    return sp


class SettingsScreen(ModalScreen[tuple[str | None, P.SamplingParams, str] | None]):
    """Returns (system_prompt, sampling, context policy) or None when cancelled."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, system_prompt: str | None, sampling: P.SamplingParams | None, context: str = "") -> None:
        super().__init__()
        self.system_prompt = system_prompt or ""
        self.sampling = sampling or P.SamplingParams()
        self.context = context if context in {v for _, v in CONTEXT} else ""

    def compose(self) -> ComposeResult:
        with Vertical(id="settings-box", classes="dialog"):
            yield Static("System prompt and sampling of this conversation", classes="dialog-title")
            # the form scrolls, the buttons stay on screen (at 80x24 too)
            with VerticalScroll(id="settings-body"):
                yield TextArea(self.system_prompt, id="system-prompt")
                with Grid(id="sampling-grid"):
                    for name, _, hint in FIELDS:
                        value = getattr(self.sampling, name)
                        if name == "max_tokens" and value >= P.UNTIL_CONTEXT:
                            value = None  # no limit short of the context
                        yield Label(f"{name} ({hint})")
                        yield Input("" if value is None else str(value), id=f"f-{name}")
                    yield Label("speculative decoding")
                    current = (self.sampling.speculative if self.sampling.speculative in {v for _, v in SPECULATIVE}
                               else "")
                    yield Select(SPECULATIVE, value=current, allow_blank=False, id="f-speculative")
                    yield Label("when the context is full")
                    yield Select(CONTEXT, value=self.context, allow_blank=False, id="f-context")
            yield Static("", id="settings-error", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save (ctrl+s)", id="save", variant="primary")
                yield Button("Cancel (esc)", id="cancel")
                yield Button("Model… (ctrl+o)", id="pick-model")  # the picker opens over this dialog

    def on_mount(self) -> None:
        # the first field has the focus, so keys typed right after F4 go into it, not nowhere
        self.query_one("#system-prompt", TextArea).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        elif event.button.id == "pick-model":
            self.app.action_pick_model()
        else:
            self.dismiss(None)

    def action_save(self) -> None:
        values = {name: self.query_one(f"#f-{name}", Input).value for name, _, _ in FIELDS}
        values["speculative"] = self.query_one("#f-speculative", Select).value
        try:
            sampling = parse_sampling(values, self.sampling)
        except ValueError as e:
            self.query_one("#settings-error", Static).update(str(e))
            return
        prompt = self.query_one("#system-prompt", TextArea).text.strip() or None
        self.dismiss((prompt, sampling, self.query_one("#f-context", Select).value or ""))
