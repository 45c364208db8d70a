"""Words and glyphs the app shows: message positions, notices, byte counts.

Owns: the mapping from protocol facts (a MessageView's status and receipt, a
Notice) to short plain-language text. Pure functions, no widgets.
"""

from __future__ import annotations

import re

from aotx.engine.errors import ErrorCode
from aotx.engine import protocol as P
from aotx.engine.units import fmt_bytes

# position -> (glyph, word). accepted/committed/durable are the design's three
# positions; the rest are how a message can end short of them. The sidebar's legend,
# the help screen and the message headers all take their words from here.
POSITIONS: dict[str, tuple[str, str]] = {
    "queued": ("◌", "queued"),            # typed here, not yet at the engine
    "accepted": ("○", "accepted"),        # the engine has it (sequence number)
    "committed": ("◐", "committed"),      # produced on the device (streaming or finished)
    "durable": ("●", "durable"),          # on disk, with a receipt
    "interrupted": ("◑", "interrupted"),  # the engine stopped mid-reply; the durable part is kept
    "cancelled": ("⊘", "cancelled"),      # Esc, or Ctrl-C in aotx run
    "failed": ("✗", "failed"),            # refused or failed: the notice under it says why
}
GLYPHS: dict[str, str] = {k: g for k, (g, _) in POSITIONS.items()}
LEGEND_ITEMS: tuple[str, ...] = tuple(f"{g} {w}" for g, w in POSITIONS.values())
LEGEND = "  ".join(LEGEND_ITEMS)
# what each position means, for the details view
POSITION_MEANINGS: dict[str, str] = {
    "queued": "not at the engine yet (it is sent when the engine is ready)",
    "accepted": "the engine has it",
    "committed": "written by the model; not on disk yet",
    "durable": "on disk, it survives a crash",
    "interrupted": "the engine stopped while writing it; the part on disk is kept",
    "cancelled": "cancelled before it ended",
    "failed": "refused or failed (the notice under it says why)",
}
# a reply's timings (Committed.timings) as a person reads them: key -> (label, format)
TIMING_WORDS: dict[str, tuple[str, str]] = {
    "ttft_s": ("first token after", "{:.2f} s"), "ttft_ms": ("first token after", "{:.0f} ms"),
    "prompt_tokens": ("prompt", "{:.0f} tokens"), "prompt_tokens_reused": ("prompt reused", "{:.0f} tokens"),
    "prompt_tokens_per_s": ("prompt speed", "{:.1f} tok/s"), "completion_tokens": ("reply", "{:.0f} tokens"),
    "decode_tokens_per_s": ("reply speed", "{:.1f} tok/s"), "tokens_per_s": ("reply speed", "{:.1f} tok/s"),
}
# a reply's finish reason as a person reads it ("stop": it ended by itself, said nowhere)
FINISH_WORDS: dict[str, str] = {
    "length": "cut at its token limit", "context": "cut at the end of the context",
    "cancelled": "cancelled", "error": "failed", "interrupted": "interrupted",
}

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


def capsule_text(n: P.Notice, had_history: bool = True) -> str:
    """A ``capsule`` notice in the user's words, or "" when it would not help.

    The engine sends one when a turn's context came back from a saved state (no
    re-reading of the earlier messages) or could not (a saved state from another model
    or damaged: the earlier messages are read again). Only a conversation with earlier
    messages has anything to pick up: a new one's shared start (the system prompt) is
    no news, and says nothing."""
    msg = n.message.strip().rstrip(".")
    if not had_history:
        return ""
    if msg.startswith(("restored", "picked up")):
        return "Picked up where this conversation left off."
    if not msg:
        return ""
    if "belongs to model" in msg or "another model" in msg:
        return "Read the earlier messages again: the saved state was made by another model."
    return "Read the earlier messages again: the saved state could not be used."


ADMISSION_KINDS = frozenset({"held", "queued", "refused", "resumed"})


def cut_marker(cut: P.ContextCut) -> str:
    """The marker a transcript shows on the reply whose prompt left earlier messages out."""
    n = cut.n_messages
    what = "message" if n == 1 else "messages"
    when = "The reply reached the end of the context: " if cut.during_reply else ""
    return (f"✂ {when}{n} earlier {what} ({cut.n_tokens:,} tokens) left the prompt here, {cut.n_out} in all; the "
            f"journal keeps them (context policy {cut.policy}).")


def notice_text(n: P.Notice, had_history: bool = True) -> str:
    """One plain sentence for an admission notice (or a capsule notice; "" when that
    would not help)."""
    if n.kind == "capsule":
        return capsule_text(n, had_history)
    if n.kind == "context":
        return cut_marker(n.cut) if n.cut is not None else (n.message[:1].upper() + n.message[1:]).rstrip(".") + "."
    if n.kind not in ADMISSION_KINDS and not (n.asked or n.free):
        # a notice that is a sentence already ("model": loading model X, unloaded the idle model Y)
        msg = n.message.strip()
        return (msg[:1].upper() + msg[1:]).rstrip(".") + "." if msg else ""
    head = {"held": "Held", "queued": "Queued", "refused": "Refused", "resumed": "Resumed"}.get(
        n.kind, n.kind.capitalize())
    parts = [f"{head}: {n.resource or 'resources'}"]
    if n.asked or n.free:
        parts.append(f"asked {fmt_amount(n.resource, n.asked)}, {fmt_amount(n.resource, n.free)} free")
    if n.kind == "queued" and n.position:
        parts.append(f"position {n.position} in the queue")
    text = " — ".join([parts[0], ", ".join(parts[1:])]) if len(parts) > 1 else parts[0]
    return f"{text}. {n.message}".strip() if n.message else text + "."


def error_text(e: P.Error, refusal: P.Notice | None = None) -> str:
    """A refused submit, by the engine's error code; ``refusal``: the ``refused`` notice
    that came before it (its resource names what is short)."""
    return refusal_text(e.code, e.message, "this message", resource=refusal.resource if refusal else "")


# what is short, by the refused notice's resource: the head of the refusal's sentence
_SHORT = {"memory": "Not enough memory", "slots": "No free slot", "journal": "The journal's buffers are full",
          "media": "An attachment cannot be used"}


def refusal_head(code: str, resource: str = "") -> str:
    """The kind of a refusal in a few words ("Too long for the context", "Not enough
    memory"), as the head of ``refusal_text``'s sentence."""
    if resource in _SHORT:
        return _SHORT[resource]
    return {ErrorCode.UNSUPPORTED_MEDIA: "The engine refused the attachment",
            ErrorCode.BUSY: "The engine is busy", ErrorCode.NOT_FOUND: "Not found on the engine",
            ErrorCode.NOT_READY: "The engine is still loading the model",
            ErrorCode.TOO_LONG: "Too long for the context"}.get(code, "The engine refused it")


def refusal_text(code: str, message: str, what: str = "the request", resource: str = "") -> str:
    """Plain words for an engine refusal, chosen by its error code and, when the engine sent
    a ``refused`` notice first, its resource (never by its wording). The code itself
    (``too_long``, ``busy``) is a protocol word: it is not shown."""
    if resource in _SHORT:
        return f"{_SHORT[resource]}: {message}"
    if code == ErrorCode.UNSUPPORTED_MEDIA:
        return f"The engine refused the attachment: {message}"
    if code == ErrorCode.BUSY:
        return f"The engine is busy: {message}"
    if code == ErrorCode.NOT_FOUND:
        return f"Not found on the engine (it may have been deleted elsewhere): {message}"
    if code == ErrorCode.NOT_READY:
        return f"The engine is still loading the model: {message}"
    if code == ErrorCode.TOO_LONG:
        return f"Too long for the context: {message}"
    return f"The engine refused {what}: {message}"


def shown_text(text: str) -> str:
    """A journaled user message as the chat shows it: the markers that stand for
    pictures given to a vision encoder (``aotx.media.markers``) are left out (the
    message lists its attachments), so a retry or an edit does not send them twice."""
    from aotx.media.markers import MARKER_RE

    if "<__image_" not in text:
        return text
    return MARKER_RE.sub("", text).strip("\n")


# The blocks ``media.profile.render_for_prompt`` puts before the user's words (the
# journal keeps the message as the model received it).
_MEDIA_BLOCKS: tuple[tuple[re.Pattern, str, str, bool], ...] = (
    (re.compile(r"^\[Audio transcript of (.+)\]$"), "audio", "specialist", True),
    (re.compile(r"^\[Audio (.+): no speech was recognized in it\]$"), "audio", "specialist", False),
    (re.compile(r"^\[Text read from image (.+) by OCR - the model sees this text, not the picture\]$"),
     "image", "specialist", True),
    (re.compile(r"^\[Image (.+): OCR found no text in it - the model cannot see the picture\]$"),
     "image", "specialist", False),
    (re.compile(r"^\[Attachment (.+?) could not be used: (.*)\]$"), "", "refused", False),
)


def history_media(m: P.MessageView) -> tuple[str, list[P.MediaInfo]]:
    """A journaled user message with attachments -> (the user's own words, what each
    attachment became), so a reopened conversation shows its transcripts and OCR text
    as notices, as they were shown live, and a retry or an edit sends only the words
    (not the transcript block the journal keeps). Messages without attachments come back unchanged."""
    text = m.text
    if not m.attachments:
        return text, []
    from aotx.media.markers import MARKER_RE

    infos: list[P.MediaInfo] = []
    blocks = text.split("\n\n")
    while blocks and blocks[0].startswith("[") and len(infos) < len(m.attachments) + 4:
        head, _, body = blocks[0].partition("\n")
        for pattern, kind, route, has_body in _MEDIA_BLOCKS:
            match = pattern.match(head)
            if match is None:
                continue
            if route == "refused":
                infos.append(P.MediaInfo(id=0, kind=kind, route=route, name=match.group(1), error=match.group(2)))
            else:
                infos.append(P.MediaInfo(id=0, kind=kind, route=route, name=match.group(1),
                                         text=body if has_body else ""))
            break
        else:
            break
        blocks.pop(0)
    rest = "\n\n".join(blocks)
    images = [a for a in m.attachments if a.kind == "image"]
    for i, _key in enumerate(MARKER_RE.findall(rest)):
        name = images[i].name if i < len(images) else "an image"
        infos.append(P.MediaInfo(id=0, kind="image", route="encoder", name=name))
    return shown_text(rest), infos


def media_text(m: P.MediaInfo) -> str:
    """What an attachment became, in plain words: the text the model received, and for
    images read by OCR that it saw text, not the picture; for images through the
    vision encoder, that it saw the picture. ``via`` (the specialist's name) is
    left out when unknown (a message reopened from the journal)."""
    via = f" ({m.via})" if m.via else ""
    if m.error:
        return f"Attachment {m.name} was not used: {m.error}"
    if m.route == "encoder":
        return f"Image {m.name} went to the model's vision encoder{via}: the model sees the picture itself."
    if m.kind == "audio":
        head = f"Transcript of {m.name}{via}, as the model received it:"
    else:
        head = f"Text read from {m.name} by OCR{via}; the model saw this text, not the picture:"
    return f"{head}\n{m.text or '(nothing recognized)'}"


def fork_title(parent: str, existing: list[str]) -> str:
    """The title of a new fork of a conversation titled ``parent``: ``Trip (fork 1)``,
    then ``Trip (fork 2)``; a fork of ``Trip (fork 1)`` is ``Trip (fork 1.1)``, so a fork
    is told from its original and from its siblings. The engine's own ``… (fork)``
    suffix is taken off first."""
    base = parent.removesuffix(" (fork)") or "Conversation"
    m = re.match(r"^(.*) \(fork ([\d.]+)\)$", base)
    root, prefix = (m.group(1), m.group(2) + ".") if m else (base, "")
    taken = set(existing)
    k = 1
    while f"{root} (fork {prefix}{k})" in taken:
        k += 1
    return f"{root} (fork {prefix}{k})"


def progress_bar(done: int, total: int, width: int = 12) -> str:
    """``▕██████░░░░░░▏``: ``done`` of ``total`` in ``width`` cells (eighths of a cell)."""
    if total <= 0:
        return ""
    eighths = round(8 * width * max(0, min(done, total)) / total)
    full, part = divmod(eighths, 8)
    bar = "█" * full + ("▏▎▍▌▋▊▉"[part - 1] if part else "")
    return "▕" + bar + "░" * (width - len(bar)) + "▏"


def startup_text(p: dict) -> str:
    """What a starting engine says (``ipc.client.read_progress``) in one line:
    "compiling kernels (first start only) ▕████░░░░░░░░▏ 1 of 3: matmul Q4_1",
    "reading the weights"."""
    stage = p.get("stage", "")
    if p.get("total"):
        detail = f": {p['detail']}" if p.get("detail") else ""
        return (f"{stage} (first start only) {progress_bar(p.get('done', 0), p['total'])} "
                f"{min(p.get('done', 0), p['total'])} of {p['total']}{detail}")
    return stage


def fmt_when(ts: float, now: float | None = None) -> str:
    """When something happened, as ``ollama list`` says it: "just now", "5 minutes ago",
    "3 hours ago", "yesterday", "4 days ago", then the date ("2025-11-02"); "-" for 0."""
    import time

    if not ts:
        return "-"
    now = time.time() if now is None else now
    s = max(0.0, now - ts)
    if s < 60:
        return "just now"
    for unit, n in (("minute", 60), ("hour", 3600), ("day", 86400)):
        if s < n * (60 if unit == "minute" else 24 if unit == "hour" else 7):
            k = int(s // n)
            if unit == "day" and k == 1:
                return "yesterday"
            return f"{k} {unit}{'' if k == 1 else 's'} ago"
    return time.strftime("%Y-%m-%d", time.localtime(ts))


ORIGIN_WORDS = {"run": "aotx run", "gateway": "API"}  # ConversationView.origin as a person reads it


def ellipsize(text: str, width: int) -> str:
    """``text`` cut to at most ``width`` characters, its last one an ellipsis when cut
    ("" for a width under 1)."""
    if len(text) <= width:
        return text
    return text[:width - 1] + "…" if width > 0 else ""
