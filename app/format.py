"""Words and glyphs the app shows: message positions, notices, byte counts.

Owns: the mapping from protocol facts (a MessageView's status and receipt, a
Notice) to short plain-language text. Pure functions, no widgets.
"""

from __future__ import annotations

from aotx.engine.errors import ErrorCode
from aotx.engine.ipc import protocol as P
from aotx.engine.units import fmt_bytes

# position -> glyph. accepted/committed/durable are the design's three positions;
# the rest are how a message can end short of them.
GLYPHS: dict[str, str] = {
    "queued": "◌",       # typed here, not yet at the engine
    "accepted": "○",     # the engine has it (sequence number)
    "committed": "◐",    # produced on the device (streaming or finished)
    "durable": "●",      # on disk, with a receipt
    "interrupted": "◑",  # the engine stopped mid-reply; the durable part is kept
    "cancelled": "⊘",
    "failed": "✗",
}
LEGEND = "◌ queued  ○ accepted  ◐ committed  ● durable  ◑ interrupted  ✗ refused"

_COUNT_RESOURCES = {"slots": "slots", "context": "tokens", "queue": "requests"}


def position_of(m: P.MessageView) -> str:
    """Position of a message loaded from the engine (``show()``)."""
    if m.status in ("interrupted", "cancelled", "failed"):
        return m.status
    if m.receipt is not None and m.status == "complete":
        return "durable"
    if m.status in ("streaming", "complete"):
        return "committed"
    return "accepted"


def fmt_amount(resource: str, n: int) -> str:
    unit = _COUNT_RESOURCES.get(resource)
    if unit is None:
        return fmt_bytes(n)
    return f"{n} {unit[:-1] if n == 1 else unit}"


def capsule_text(n: P.Notice) -> str:
    """A ``capsule`` notice: how this turn's context was put back (restored from a
    capsule, or re-prefilled from the journal's tokens, and why)."""
    msg = n.message.strip().rstrip(".")
    if msg.startswith("restored"):
        return f"Context restored from a capsule: {msg} (no re-prefill)."
    return f"Context not restored from a capsule: {msg}." if msg else "Context re-prefilled from the journal."


def notice_text(n: P.Notice) -> str:
    """One plain sentence for an admission notice (or a capsule notice)."""
    if n.kind == "capsule":
        return capsule_text(n)
    head = {"held": "Held", "queued": "Queued", "refused": "Refused", "resumed": "Resumed"}.get(
        n.kind, n.kind.capitalize())
    parts = [f"{head}: {n.resource or 'resources'}"]
    if n.asked or n.free:
        parts.append(f"asked {fmt_amount(n.resource, n.asked)}, {fmt_amount(n.resource, n.free)} free")
    if n.kind == "queued" and n.position:
        parts.append(f"position {n.position} in the queue")
    text = " — ".join([parts[0], ", ".join(parts[1:])]) if len(parts) > 1 else parts[0]
    return f"{text}. {n.message}".strip() if n.message else text + "."


def error_text(e: P.Error) -> str:
    """A refused submit, by the engine's error code."""
    return refusal_text(e.code, e.message, "this message")


def refusal_text(code: str, message: str, what: str = "the request") -> str:
    """Plain words for an engine refusal, chosen by its error code (never by its wording)."""
    if code == ErrorCode.UNSUPPORTED_MEDIA:
        return f"The engine refused the attachment ({code}): {message}"
    if code == ErrorCode.BUSY:
        return f"A reply is still being written in this conversation: Esc cancels it first ({message})."
    if code == ErrorCode.NOT_FOUND:
        return f"Not found on the engine (it may have been deleted elsewhere): {message}"
    if code == ErrorCode.NOT_READY:
        return f"The engine is still loading the model: {message}"
    if code == ErrorCode.TOO_LONG:
        return f"Too long for the context ({code}): {message}"
    return f"The engine refused {what} ({code or 'error'}): {message}"


def shown_text(text: str) -> str:
    """A journaled user message as the chat shows it: the markers that stand for
    pictures given to a vision encoder (``aotx.media.markers``) are left out (the
    message lists its attachments), so a retry or an edit does not send them twice."""
    from aotx.media.markers import MARKER_RE

    if "<__image_" not in text:
        return text
    return MARKER_RE.sub("", text).strip("\n")


def media_text(m: P.MediaInfo) -> str:
    """What an attachment became, in plain words: the text the model received, and for
    images read by OCR that it saw text, not the picture; for images through the
    vision encoder, that it saw the picture."""
    if m.error:
        return f"Attachment {m.name} was not used: {m.error}"
    if m.route == "encoder":
        return f"Image {m.name} went to the model's vision encoder ({m.via}): the model sees the picture itself."
    if m.kind == "audio":
        head = f"Transcript of {m.name} ({m.via}), as the model received it:"
    else:
        head = (f"Text read from {m.name} by OCR ({m.via}); the model saw this text, not the picture:")
    return f"{head}\n{m.text or '(nothing recognized)'}"
