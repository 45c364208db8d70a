"""Pasted text -> file paths or plain text: what a terminal sends when a file is dropped on it.

Owns: the pure parsing of a paste (no file system access). Terminals send a dropped
file as pasted text in many shapes: a plain path, a quoted one ('…' or "…"), one with
backslash-escaped spaces and other characters, a ``file://`` URL (percent-encoded),
several of these separated by spaces or newlines, with trailing whitespace, or
starting with ``~``.
Leaves to others: whether the files exist, their kind and hash (``attach.py``).

The rule: a paste is paths only when every piece of it looks like a path (starts
with ``/``, ``~``, ``./``, ``../`` or ``file://``); otherwise the whole paste stays one
text item, unchanged. A line that does not split into paths but is, as a whole, an
absolute path ending in a file extension (an unescaped path with spaces, which some
terminals send) counts as one path.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

_PATH_START = ("/", "~", "./", "../", "file://")
_RAW_PATH = re.compile(r"^(/|~/|file://)\S.*\.[A-Za-z0-9]{1,8}$")


@dataclass(frozen=True)
class PastedItem:
    """One piece of a paste. kind: "path" (``value`` is an absolute or relative path,
    ``~`` expanded, URL decoded) or "text" (``value`` is the paste as it came)."""

    kind: str
    value: str


def parse_pasted_paths(text: str, home: str | None = None) -> list[PastedItem]:
    """Split a paste into path items, or return it as one text item.

    ``home`` replaces ``~`` (default: the user's home directory). Empty or
    whitespace-only pastes give ``[]``.
    """
    if not text.strip():
        return []
    home = home if home is not None else str(Path.home())
    paths: list[str] = []
    for line in text.strip().splitlines():
        line = line.strip()
        if not line:
            continue
        pieces = _split_line(line)
        if pieces is None:
            return [PastedItem("text", text)]
        paths.extend(pieces)
    if not paths:
        return [PastedItem("text", text)]
    return [PastedItem("path", _normalize(p, home)) for p in paths]


def _split_line(line: str) -> list[str] | None:
    """Path pieces of one line, or None when the line is not (only) paths."""
    try:
        pieces = shlex.split(line, posix=True)
    except ValueError:  # unbalanced quote: "don't", a stray '"'
        pieces = None
    if pieces and all(_looks_like_path(p) for p in pieces):
        return pieces
    if _RAW_PATH.match(line) and "'" not in line and '"' not in line and "\\" not in line:
        return [line]
    return None


def _looks_like_path(piece: str) -> bool:
    if piece.startswith("file:"):
        return piece.startswith("file://")
    return piece.startswith(_PATH_START) and len(piece) > 1 and "://" not in piece


def _normalize(piece: str, home: str) -> str:
    if piece.startswith("file://"):
        parts = urlsplit(piece)
        # file:///x and file://localhost/x both name /x; another host stays in the path
        host = parts.netloc if parts.netloc not in ("", "localhost") else ""
        return unquote(("//" + host if host else "") + parts.path)
    if piece == "~" or piece.startswith("~/"):
        return home.rstrip("/") + piece[1:]
    return piece
