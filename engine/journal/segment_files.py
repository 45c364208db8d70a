"""The journal directory's files, by name: segments, their copies, the acknowledged mark.

Owns: how segment files are named (``0000000001.seg``) and listed, the names of
temporary files and of the byte-exact copies salvage keeps (``.damaged``),
reading a segment without ever blocking on a FIFO or a device, and reading the
acknowledged mark back: the last receipt the writer issued, kept in two files
(``records.RECEIPT_FILES``), the higher of the valid copies wins. Leaves to others:
which segments form the journal and in what order (``chain.py``, by their headers
and sequence numbers, never by these names alone), writing (``appender.py``,
``salvage.py``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from aotx.engine.errors import JournalError
from aotx.engine.fileio import OS, FileIO, NotRegularFile, describe_os_error, read_regular
from aotx.engine.journal.records import RECEIPT_FILES, decode_receipt

SEGMENT_RE = re.compile(r"^(\d{10})\.seg$")
TMP_SUFFIX = ".tmp"
DAMAGED_SUFFIX = ".damaged"


def segment_name(number: int) -> str:
    return f"{number:010d}.seg"


def list_segments(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(number, path)`` of every segment file in ``directory``, by the number in its name."""
    d = Path(directory)
    out = []
    try:
        names = os.listdir(d) if d.is_dir() else []
    except OSError as e:
        raise JournalError(f"cannot list the journal directory {d}: {describe_os_error(e)}") from None
    for name in names:
        m = SEGMENT_RE.match(name)
        if m:
            out.append((int(m.group(1)), d / name))
    out.sort()
    return out


def fsync_dir(directory: str | os.PathLike, fs: FileIO = OS) -> None:
    """fsync a directory so that creates, renames and unlinks in it are durable."""
    fs.fsync_dir(directory)


def read_segment(path: str | os.PathLike, limit: int | None = None) -> bytes:
    """The bytes of segment file ``path``. Raises ``JournalError`` naming the file
    when it cannot be read or is not a regular file (a FIFO, a directory, ...)."""
    try:
        return read_regular(path, limit)
    except NotRegularFile as e:
        raise JournalError(f"{e}: a journal segment must be a regular file; move it out of "
                           f"{Path(path).parent}") from None
    except OSError as e:
        raise JournalError(f"cannot read journal segment {path}: {describe_os_error(e)}"
                           + (" (check its owner and mode)" if e.errno in (1, 13) else "")) from None


def read_acknowledged(directory: str | os.PathLike) -> tuple[int, int, int] | None:
    """``(segment, offset, last_seq)`` of the last receipt the writer recorded: the
    highest of its copies that passes its check, or None (no copy, or none checks).
    A copy never runs ahead of the data (each is written after the fsync it names),
    so the highest is as safe as either and survives the loss of the other."""
    best = None
    for name in RECEIPT_FILES:
        try:
            got = decode_receipt(read_regular(Path(directory) / name, 64))
        except OSError:
            continue
        if got is not None and (best is None or got[2] > best[2]):
            best = got
    return best
