"""Words and glyphs the app shows: message positions, notices, byte counts.

Owns: the mapping from protocol facts (a MessageView's status and receipt, a
Notice) to short plain-language text. Pure functions, no widgets.
"""

from __future__ import annotations

from aotx.engine.ipc import protocol as P

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


def fmt_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'; exact bytes below 1 KiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def fmt_amount(resource: str, n: int) -> str:
    unit = _COUNT_RESOURCES.get(resource)
    if unit is None:
        return fmt_bytes(n)
    return f"{n} {unit[:-1] if n == 1 else unit}"


def notice_text(n: P.Notice) -> str:
    """One plain sentence for an admission notice."""
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
    if e.code in ("unsupported_media", "bad_request") and "media" in e.message.lower():
        return f"The engine refused the attachment ({e.code}): {e.message}"
    return f"The engine refused this message ({e.code}): {e.message}"
