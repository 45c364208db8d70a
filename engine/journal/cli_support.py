"""Plain-dict answers for the journal's CLI commands; no printing, no argv.

Owns: what ``aotx journal verify|dump|repair|compact`` and ``aotx conversations
list|show`` report, as JSON-ready dicts, plus a one-line text form of each
record for the non-JSON dump. Leaves to others: argument parsing, printing and
exit codes (``engine/cli/commands.py``: a ``JournalError`` becomes one line, exit 2).

``verify``, ``dump`` and the conversation commands only read (no lock, no file
or directory created or changed), so they work while an engine runs and on a
read-only data dir, but then they may see a tail
still being written, and a reply in flight shows as interrupted: with an
engine running, ask it over the socket instead. ``repair`` and ``compact`` take
the journal's lock and raise ``JournalError`` while an engine runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import msgspec

from aotx.engine.errors import JournalError
from aotx.engine.journal.compaction import compact
from aotx.engine.journal.damage import Entry
from aotx.engine.journal.reading import dump, read_table, verify
from aotx.engine.journal.recovery import recover


def _dir(directory: str | os.PathLike | None, create: bool = True) -> Path:
    if directory is not None:
        return Path(directory)
    from aotx.engine.paths import journal_dir

    return journal_dir(create=create)


def verify_cmd(directory: str | os.PathLike | None = None) -> dict[str, Any]:
    """``aotx journal verify``: ``{"ok", "segments", "superseded", "records", "last_seq",
    "bytes", "problem": {"segment", "offset", "kind", "message"} | None, "directory"}``.
    The CLI should exit non-zero when ``ok`` is false."""
    d = _dir(directory, create=False)
    return verify(d).to_dict() | {"directory": str(d)}


def entry_dict(e: Entry) -> dict[str, Any]:
    """One record as ``{"seq", "tick", "segment", "offset", "type", ...fields}``."""
    return {"seq": e.seq, "tick": e.tick, "segment": e.segment, "offset": e.offset,
            "type": type(e.record).__name__} | msgspec.to_builtins(e.record)


def entry_line(e: Entry) -> str:
    """One record as a line of text: ``seq tick segment:offset Type field=value ...``;
    a Checkpoint shows only its size, TokensCommitted its token ids and text."""
    fields = msgspec.to_builtins(e.record)
    if "conversations" in fields:
        fields["conversations"] = f"<{len(fields['conversations'])} conversations>"
    body = " ".join(f"{k}={v!r}" for k, v in fields.items())
    return f"{e.seq:>8} {e.tick:>8} {e.segment}:{e.offset} {type(e.record).__name__} {body}"


def dump_cmd(directory: str | os.PathLike | None = None) -> Iterator[dict[str, Any]]:
    """``aotx journal dump --json``: every good record in order, one dict each
    (print one JSON object per line). Stops at the first problem; run verify."""
    for e in dump(_dir(directory, create=False)):
        yield entry_dict(e)


def dump_lines(directory: str | os.PathLike | None = None) -> Iterator[str]:
    """``aotx journal dump``: every good record as a line of text."""
    for e in dump(_dir(directory, create=False)):
        yield entry_line(e)


def repair_cmd(directory: str | os.PathLike | None = None) -> dict[str, Any]:
    """``aotx journal repair``: recovery as the engine runs it at start: a torn tail
    is cut; damage is salvaged (a byte-exact copy of each damaged segment kept as
    ``*.damaged``, every valid record after the damage kept, a ``Gap`` record in
    place of what was lost). ``notices`` says what each damage affected."""
    rep = recover(_dir(directory), repair=True)
    return rep.to_dict() | {"notices": rep.notices()}


def compact_cmd(directory: str | os.PathLike | None = None) -> dict[str, Any]:
    """``aotx journal compact``: the ``CompactReport`` as a dict."""
    return compact(_dir(directory)).to_dict()


def conversations_list_cmd(directory: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """``aotx conversations list`` from the journal on disk: live conversations
    without their messages, oldest first."""
    return read_table(_dir(directory, create=False))[0].to_dict(messages=False)


def conversation_show_cmd(conv_id: str, directory: str | os.PathLike | None = None) -> dict[str, Any]:
    """``aotx conversations show ID``: the conversation with its messages, token
    ids and the receipt each message is durable under. ``JournalError`` when
    there is no live conversation ``conv_id``."""
    table = read_table(_dir(directory, create=False))[0]
    c = table.get(conv_id)
    if c is None:
        known = ", ".join(x.conv_id for x in table.live()[:10]) or "none"
        raise JournalError(f"no conversation {conv_id!r} in the journal (known: {known}); "
                           "see `aotx conversations list`")
    return c.to_dict(messages=True)
