"""Export a conversation to Markdown or JSON: ``Ctrl+S`` in aotx-chat and
``aotx conversations export ID``.

Owns: the two formats and writing them. Markdown is for reading and sharing: the
title, the system prompt, each message under a ``### You`` / ``### Assistant`` heading
with what its attachments became (transcripts, OCR text) as quotes, and a one-line
italic note of where it stands (durable with its receipt, interrupted, cancelled).
JSON is for programs: the conversation as the engine shows it (``ConversationView``:
messages, token ids, receipts, sampling) under ``{"format": "aotx-conversation",
"version": 1, "exported_at", "conversation"}``. Files are written whole: a private
temporary file of a new name beside the target (never one that already exists, never
through a link), fsynced, given the user's umask only once it is complete (and never more than the
mode of the file it replaces: a private file stays private), then
renamed over the target; a crash leaves the old file or the new one. A target that
exists and is not a regular file (a device, a FIFO, a symbolic link, a folder) is
refused by name and left as it was.
Leaves to others: getting the conversation (the engine's ``show``, or the journal).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import stat
import tempfile
from pathlib import Path

import msgspec

from aotx.engine.units import plural
from aotx.engine.present.format import GLYPHS, history_media, media_text, position_of
from aotx.engine.errors import UsageError
from aotx.engine.fileio import file_kind
from aotx.engine import protocol as P

FORMATS = ("md", "json")


def _now(now: float | None) -> _dt.datetime:
    return _dt.datetime.fromtimestamp(now if now is not None else _dt.datetime.now().timestamp(), _dt.timezone.utc)


def _where(m: P.MessageView) -> str:
    pos = position_of(m)
    note = f"{GLYPHS.get(pos, '?')} {pos}"
    if m.finish_reason and m.finish_reason not in ("stop", pos):
        note += f" ({m.finish_reason})"
    if m.receipt is not None:
        r = m.receipt
        note += f", receipt segment {r.segment} offset {r.offset} seq {r.last_seq}"
    return note


def to_markdown(conv: P.ConversationView, now: float | None = None) -> str:
    """The conversation as Markdown (see the module docstring)."""
    out = [f"# {conv.title or 'Untitled conversation'}", ""]
    when = _now(now).strftime("%Y-%m-%d %H:%M UTC")
    out += [f"*Conversation {conv.conv_id}, {plural(len(conv.messages), 'message')}, exported from AOTX on {when}.*", ""]
    if conv.system_prompt:
        out += ["**System prompt:**", "", *[f"> {line}" for line in conv.system_prompt.splitlines()], ""]
    for m in conv.messages:
        who = {"user": "You", "assistant": "Assistant"}.get(m.role, m.role.capitalize())
        out += [f"### {who}", ""]
        text, infos = history_media(m) if m.role == "user" else (m.text, [])
        for a in m.attachments:
            out.append(f"*Attached {a.kind}: {a.name or a.path}*  ")
        for info in infos:
            head, _, body = media_text(info).partition("\n")
            out += ["", f"> {head}", *[f"> {line}" if line else ">" for line in body.splitlines()]]
        if m.attachments or infos:
            out.append("")
        out += [text.rstrip() if text.strip() else "*(no text)*", "", f"*{_where(m)}*", ""]
    return "\n".join(out).rstrip() + "\n"


def to_json(conv: P.ConversationView, now: float | None = None) -> str:
    """The conversation as JSON (see the module docstring), indented, UTF-8 text."""
    doc = {"format": "aotx-conversation", "version": 1, "exported_at": _now(now).isoformat(timespec="seconds"),
           "conversation": msgspec.to_builtins(conv)}
    return json.dumps(doc, ensure_ascii=False, indent=1) + "\n"


def render(conv: P.ConversationView, fmt: str, now: float | None = None) -> str:
    if fmt not in FORMATS:
        raise UsageError(f"export format {fmt!r}: choose md (Markdown) or json")
    return to_markdown(conv, now) if fmt == "md" else to_json(conv, now)


def format_of(path: str | os.PathLike[str]) -> str:
    """"json" for a ``.json`` file, else "md"."""
    return "json" if str(path).lower().endswith(".json") else "md"


def slug(title: str) -> str:
    """A file name stem from a title: ``What is 2+2?`` -> ``what-is-2-2``."""
    s = re.sub(r"[^\w]+", "-", title.lower(), flags=re.UNICODE).strip("-_")
    return s[:60].rstrip("-") or "conversation"


def default_path(conv: P.ConversationView, fmt: str = "md", folder: str | os.PathLike[str] | None = None) -> Path:
    """``<folder>/<title-slug>-<conversation id>.<fmt>`` (folder: the current directory)."""
    return Path(folder or Path.cwd()) / f"{slug(conv.title)}-{conv.conv_id}.{fmt}"


def _umask() -> int:
    """The process's umask, read without changing it (``os.umask`` would, for a moment,
    for every thread) where Linux says it; else set and restored."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_target(p: Path) -> int | None:
    """Refuse ``p`` when it exists and is not a regular file, saying what it is; the mode
    bits of the regular file it is (None when it does not exist)."""
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UsageError(f"cannot export to {p}: {e.strerror or e}") from None
    if stat.S_ISREG(st.st_mode):
        return stat.S_IMODE(st.st_mode)
    what = file_kind(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        what += f" (to {os.readlink(p)})"
    raise UsageError(f"cannot export to {p}: it is {what}, not a regular file; nothing was written (choose a "
                     "file name that is free or a regular file)")


def write_export(conv: P.ConversationView, path: str | os.PathLike[str], fmt: str | None = None) -> Path:
    """Write ``conv`` to ``path`` (format from ``fmt`` or the file's extension), whole:
    a private temporary file, fsync, the user's umask, rename. Returns the path. Raises
    UsageError naming the path when it cannot be written or is not a regular file."""
    p = Path(path).expanduser()
    text = render(conv, fmt or format_of(p))
    if not p.parent.is_dir():
        raise UsageError(f"cannot export to {p}: the folder {p.parent} does not exist")
    mode = check_target(p)
    tmp = None
    try:
        fd, name = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)  # 0600, O_EXCL
        tmp = Path(name)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
            # once complete: readable as the user's files are (the umask), and never more than
            # the file it replaces was (a private one stays private)
            os.fchmod(fh.fileno(), (0o666 & ~_umask()) & (mode if mode is not None else 0o777))
        check_target(p)  # it may have been replaced meanwhile
        os.replace(tmp, p)
        tmp = None
    except OSError as e:
        raise UsageError(f"cannot export to {p}: {e.strerror or e}") from None
    finally:
        if tmp is not None:
            try:
                tmp.unlink()
            except OSError:
                pass
    return p
