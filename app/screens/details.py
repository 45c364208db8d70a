"""The details view of one message: its position and, once durable, its receipt."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

from aotx.engine.present.format import FINISH_WORDS, GLYPHS, POSITION_MEANINGS, TIMING_WORDS


def details_lines(w) -> list[tuple[str, str]]:
    """(label, value) rows for a MessageWidget ``w``."""
    rows = [("message id", w.msg_id or "(not yet accepted)"), ("role", w.role),
            ("where it stands", f"{GLYPHS.get(w.position, '?')} {w.position}: "
                                f"{POSITION_MEANINGS.get(w.position, w.position)}")]
    if w.seq:
        rows.append(("sequence", str(w.seq)))
    if w.role == "assistant":
        rows.append(("tokens", str(w.n_tokens)))
        if w.token_seqs and w.receipt is None:
            rows.append(("durable tokens", f"{w.durable_tokens} of {len(w.token_seqs)} streamed"))
        if w.finish_reason:
            rows.append(("how it ended", "ended by the model" if w.finish_reason == "stop"
                         else FINISH_WORDS.get(w.finish_reason, w.finish_reason)))
        cut = getattr(w, "context", None)
        if cut is not None:
            rows.append(("context cut", f"{cut.n_messages} earlier messages ({cut.n_tokens:,} tokens) left the prompt, "
                                        f"{cut.n_out} out in all (policy {cut.policy}"
                                        f"{', during the reply' if cut.during_reply else ''})"))
    if w.receipt is not None:
        r = w.receipt
        rows += [("receipt segment", str(r.segment)), ("receipt offset", f"{r.offset} B"),
                 ("receipt up to seq", str(r.last_seq))]
    else:
        rows.append(("receipt", "none yet: not durable"))
    for a in w.attachments:
        rows.append(("attachment", f"{a.kind} {a.name} sha256 {a.sha256[:16]}…"))
    for k, v in sorted(w.timings.items()):
        label, fmt = TIMING_WORDS.get(k, (k.replace("_", " "), "{:g}"))
        rows.append((label, fmt.format(v)))
    return rows


class DetailsScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,i,q", "dismiss", "Close")]

    def __init__(self, widget) -> None:
        super().__init__()
        self.rows = details_lines(widget)

    def compose(self) -> ComposeResult:
        with Vertical(id="details-box", classes="dialog"):
            yield Static("Message details", classes="dialog-title")
            width = max(len(k) for k, _ in self.rows)
            yield Static("\n".join(f"{k:<{width}}  {v}" for k, v in self.rows), id="details-body", markup=False)
            yield Static("Esc closes this view.", classes="dialog-note")
