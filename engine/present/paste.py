"""Pasted text -> file paths and text: what a terminal sends when a file is dropped on it.

Owns: the pure parsing of a paste (no file system access), and ``split_paste``, which
decides what a paste becomes: attachments only when every path in it names an existing
file of an image or audio kind (a dropped file); anything else (an API path such as
``/api/v1/users``, ``/usr/bin/env``, a missing file) is text, inserted as typed. Terminals send a dropped
file as pasted text in many shapes: a plain path, a quoted one ('…' or "…", with the
POSIX ``'\\''`` idiom for a quote inside), one with backslash-escaped spaces and other
characters (also a relative name, ``Example\\ file.wav``), a ``file://`` URL
(percent-encoded), a Windows path (``C:\\Users\\me\\cat.png``, quoted by Windows
Terminal when it has spaces), several of these separated by spaces or newlines, with
trailing whitespace, or starting with ``~``. A user may type a question right after
the dropped path (``'/tmp/cat.jpg' describe this``).
Leaves to others: whether the files exist, their kind and hash, and reading a
Windows path through its WSL mount (``attach.py``).

The rules:

* a paste is paths only when every piece of it looks like a path (starts with ``/``,
  ``~``, ``./``, ``../``, ``file://`` or a drive letter, or is a quoted or escaped
  name with an image or audio extension);
* a paste that starts with dropped paths and goes on with text gives the paths and
  then one text item (the rest, as typed), but only when one of those paths carries a
  sign of a drop (quotes, backslash escapes, a ``file://`` URL or a Windows path):
  ``/usr/bin/foo is great`` stays text;
* a line that is, as a whole, an absolute path ending in a file extension (an
  unescaped path with spaces, which some terminals send) counts as one path;
* anything else stays one text item, unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from aotx.engine.present.attach import AUDIO_EXT, IMAGE_EXT, kind_of_extension, windows_to_wsl

MEDIA_EXT = IMAGE_EXT | AUDIO_EXT

_PATH_START = ("/", "~", "./", "../", "file://")
_RAW_PATH = re.compile(r"^(/|~/|file://)\S.*\.[A-Za-z0-9]{1,8}$")
_WINDOWS = re.compile(r"^(?:[A-Za-z]:[\\/]|\\\\[^\\\s]+\\)")


@dataclass(frozen=True)
class PastedItem:
    """One piece of a paste. kind: "path" (``value`` is an absolute or relative path,
    ``~`` expanded, URL decoded; a Windows path as it came) or "text" (``value`` is the
    text as it came)."""

    kind: str
    value: str


@dataclass(frozen=True)
class _Token:
    value: str
    end: int  # index in the line just after the token
    marked: bool  # quoted or backslash-escaped: how terminals write a dropped name


class _Unbalanced(ValueError):
    pass


def parse_pasted_paths(text: str, home: str | None = None) -> list[PastedItem]:
    """Split a paste into path items (and the text typed after them), or return it as
    one text item.

    ``home`` replaces ``~`` (default: the user's home directory). Empty or
    whitespace-only pastes give ``[]``. The result is path items, optionally followed
    by one text item, or a single text item holding the whole paste.
    """
    if not text.strip():
        return []
    home = home if home is not None else str(Path.home())
    lines = text.strip().splitlines()
    paths: list[str] = []
    strong = False
    for i, raw in enumerate(lines):
        line = raw.strip()
        if not line:
            continue
        whole = _path_line(line)
        if whole is not None:
            paths.extend(t.value for t in whole)
            strong = strong or any(_strong(t) for t in whole)
            continue
        # the rest is text: keep it only after paths that were clearly dropped
        lead = _leading_paths(line)
        strong = strong or any(_strong(t) for t in lead)
        if not strong or not (paths or lead):
            return [PastedItem("text", text)]
        paths.extend(t.value for t in lead)
        rest = "\n".join([line[lead[-1].end:].strip() if lead else line, *lines[i + 1:]]).strip()
        return [PastedItem("path", _normalize(p, home)) for p in paths] + ([PastedItem("text", rest)] if rest else [])
    if not paths:
        return [PastedItem("text", text)]
    return [PastedItem("path", _normalize(p, home)) for p in paths]


def is_windows_path(path: str) -> bool:
    return _WINDOWS.match(path) is not None


# ---- one line -------------------------------------------------------------------

def _path_line(line: str) -> list[_Token] | None:
    """The tokens of a line made only of paths, or None."""
    try:
        tokens = list(_tokens(line))
    except _Unbalanced:  # an apostrophe ("don't"), a stray '"'
        tokens = []
    if tokens and all(_looks_like_path(t) for t in tokens):
        return tokens
    if _RAW_PATH.match(line) and "'" not in line and '"' not in line and "\\" not in line:
        return [_Token(line, len(line), False)]
    return None


def _leading_paths(line: str) -> list[_Token]:
    """The path tokens at the start of ``line`` (the text after them may be anything)."""
    out: list[_Token] = []
    try:
        for t in _tokens(line):
            if not _looks_like_path(t):
                break
            out.append(t)
    except _Unbalanced:
        pass
    return out


def _tokens(line: str):
    """Shell-like words of ``line`` (lazily: an unbalanced quote raises only when reached).

    Single quotes keep everything; double quotes let ``\\`` escape only ``"`` ``\\`` ``$``
    and a backtick; outside quotes ``\\`` escapes the next character, except in a word
    that starts like a Windows path, whose backslashes are separators."""
    i, n = 0, len(line)
    while i < n:
        while i < n and line[i].isspace():
            i += 1
        if i >= n:
            return
        windows = _WINDOWS.match(line, i) is not None or (line[i] == '"' and _WINDOWS.match(line, i + 1) is not None)
        buf: list[str] = []
        marked = False
        while i < n and not line[i].isspace():
            c = line[i]
            if c == "'":
                j = line.find("'", i + 1)
                if j < 0:
                    raise _Unbalanced(line)
                buf.append(line[i + 1:j])
                marked, i = True, j + 1
            elif c == '"':
                i += 1
                while i < n and line[i] != '"':
                    if line[i] == "\\" and not windows and i + 1 < n and line[i + 1] in '"\\$`':
                        i += 1
                    buf.append(line[i])
                    i += 1
                if i >= n:
                    raise _Unbalanced(line)
                marked, i = True, i + 1
            elif c == "\\" and not windows and i + 1 < n:
                buf.append(line[i + 1])
                marked, i = True, i + 2
            else:
                buf.append(c)
                i += 1
        yield _Token("".join(buf), i, marked)


def _strong(t: _Token) -> bool:
    """A sign that the token is a dropped file rather than typed text."""
    return t.marked or t.value.startswith("file://") or is_windows_path(t.value)


def _looks_like_path(t: _Token) -> bool:
    piece = t.value
    if piece.startswith("file:"):
        return piece.startswith("file://")
    if "://" in piece:
        return False
    if is_windows_path(piece):
        return True
    if piece.startswith(_PATH_START) and len(piece) > 1:
        return True
    # a relative name of a media file, quoted or escaped by the terminal: 'my cat.png',
    # Example\ file.wav (a quoted word in prose has no such extension)
    return t.marked and Path(piece).suffix.lower() in MEDIA_EXT and not piece.startswith(("-", "#"))


def _normalize(piece: str, home: str) -> str:
    if piece.startswith("file://"):
        parts = urlsplit(piece)
        # file:///x and file://localhost/x both name /x; another host stays in the path
        host = parts.netloc if parts.netloc not in ("", "localhost") else ""
        return unquote(("//" + host if host else "") + parts.path)
    if piece == "~" or piece.startswith("~/"):
        return home.rstrip("/") + piece[1:]
    return piece


# ---- what a paste becomes (the one function here that reads the file system) -----------

@dataclass(frozen=True)
class PasteSplit:
    """What a paste becomes: ``paths`` to attach, ``text`` to insert at the cursor, and a
    ``note`` for the user ("" when there is nothing to say)."""

    paths: list[str]
    text: str
    note: str = ""


def split_paste(text: str, home: str | None = None) -> PasteSplit:
    """A paste -> attachments and text. The paths ``paste.parse_pasted_paths`` finds become
    attachments only when each names an existing regular file with an image or audio
    extension (through its WSL mount for a Windows path); otherwise the whole paste is text,
    exactly as pasted, as a terminal without AOTX would give it. A path with a media
    extension that cannot be attached (missing, a directory) gets a note saying it went in
    as text. Reads the file system (``stat`` only)."""
    items = parse_pasted_paths(text, home=home)
    paths = [i.value for i in items if i.kind == "path"]
    rest = "".join(i.value for i in items if i.kind == "text")
    if not paths:
        return PasteSplit([], rest)
    missing = []
    for p in paths:
        local = windows_to_wsl(p) or p
        if kind_of_extension(local) is None or not Path(local).expanduser().is_file():
            missing.append(p)
    if not missing:
        return PasteSplit(paths, rest)
    media = [p for p in missing if kind_of_extension(windows_to_wsl(p) or p) is not None]
    note = ""
    if media:
        local = Path(windows_to_wsl(media[0]) or media[0]).expanduser()
        why = "not a regular file" if local.exists() else "no such file"
        more = f" (and {len(media) - 1} more)" if len(media) > 1 else ""
        note = f"Not attached: {media[0]}: {why}{more}; pasted as text."
    return PasteSplit([], text, note)
