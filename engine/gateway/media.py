"""Pictures and audio in API requests: content parts -> files the engine attaches.

Owns: the media parts of a request (OpenAI's ``image_url`` and ``input_audio``,
Anthropic's ``image`` with a base64 ``source``): decoding data URLs and base64 (with
a size limit per part), ``file://`` URLs (only under the directories the request's
API key may read, never an arbitrary server path), a first check of the content
(``media.kinds.sniff``: an image part must hold an image, an audio part audio), and
writing each part once, by content hash, into ``<data dir>/gateway/uploads``
(0700 directory, 0600 files; the engine runs as the same user and journals the
path, so earlier turns' pictures can be read again). The engine then runs the
same media profile as the TUI (``SubmitMessage.strict_media``: a part it cannot
use refuses the request instead of being left out). Leaves HTTP to ``core.py``.

A part's ``where`` (``messages[1].content[0].image_url``) names it in every error.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from aotx.engine import protocol as P
from aotx.media.kinds import EXTENSIONS, MediaKind, sniff

MAX_PART_BYTES = 20 << 20  # OpenAI's limit for one image
_DATA_URL = re.compile(r"^data:([\w.+-]+/[\w.+-]+)?((?:;[\w.+-]+=[\w.+-]+)*)(;base64)?,", re.I)
_AUDIO_FORMATS = {"wav": ".wav", "mp3": ".mp3", "flac": ".flac", "ogg": ".ogg", "opus": ".opus"}
_EXT_OF_FORMAT = {fmt: ext for ext, (_, fmt) in sorted(EXTENSIONS.items(), reverse=True)}


class MediaRefusal(Exception):
    """A media part the gateway refuses: ``status`` 400 (not media, malformed), 403
    (a file the key may not read) or 413 (too large); ``where`` names the field."""

    def __init__(self, status: int, where: str, message: str):
        super().__init__(f"{where}: {message}")
        self.status = status
        self.where = where
        self.message = f"{where}: {message}"


@dataclass(frozen=True)
class MediaPart:
    """One part, not yet written: ``data`` (decoded bytes) or ``path`` (a file:// file)."""

    kind: str  # MediaKind
    where: str
    data: bytes | None = None
    path: str | None = None
    ext: str = ""


def decode_b64(text: str, where: str, limit: int = MAX_PART_BYTES) -> bytes:
    """Base64 text -> bytes; MediaRefusal 413 past ``limit`` decoded bytes, 400 when not base64."""
    if len(text) * 3 // 4 > limit:
        raise MediaRefusal(413, where, f"{len(text) * 3 // 4:,} bytes of data; the limit is {limit:,} bytes per part")
    try:
        return base64.b64decode(text.strip(), validate=False)
    except (binascii.Error, ValueError) as e:
        raise MediaRefusal(400, where, f"the data is not base64 ({e})") from None


def image_url_part(url: str, where: str, file_roots: tuple[Path, ...], limit: int = MAX_PART_BYTES) -> MediaPart:
    """An ``image_url`` part's URL: a data URL or a ``file://`` path under ``file_roots``
    (the key's). Raises MediaRefusal naming ``where``."""
    if not isinstance(url, str) or not url:
        raise MediaRefusal(400, where, "the url must be a non-empty string")
    m = _DATA_URL.match(url)
    if m:
        if not m.group(3):
            raise MediaRefusal(400, where, "only base64 data URLs are taken (data:image/png;base64,...)")
        return MediaPart(MediaKind.IMAGE, where, data=decode_b64(url[m.end():], where, limit))
    u = urlparse(url)
    if u.scheme == "file":
        return MediaPart(MediaKind.IMAGE, where, path=str(_allowed_file(u, where, file_roots, limit)))
    if u.scheme in ("http", "https"):
        raise MediaRefusal(400, where, "this server does not fetch URLs; send the image as a data URL "
                                       "(data:image/png;base64,...)")
    raise MediaRefusal(400, where, f"not a data URL or file:// URL ({url[:40]!r})")


def _allowed_file(u, where: str, roots: tuple[Path, ...], limit: int) -> Path:
    if u.netloc not in ("", "localhost"):
        raise MediaRefusal(400, where, f"file://{u.netloc}/...: only local files")
    if not roots:
        raise MediaRefusal(403, where, "this API key may not read server files; send the image as a data URL "
                                       "(a key line in the key file with allow-files=DIR lets it read DIR)")
    p = Path(unquote(u.path))
    try:
        real = p.resolve(strict=True)
    except (OSError, RuntimeError):
        raise MediaRefusal(400, where, f"{p}: no such file") from None
    if not any(real == r or r in real.parents for r in roots):
        raise MediaRefusal(403, where, f"{p} is outside the directories this API key may read")
    if not real.is_file():
        raise MediaRefusal(400, where, f"{p}: not a regular file")
    if real.stat().st_size > limit:
        raise MediaRefusal(413, where, f"{p} is {real.stat().st_size:,} bytes; the limit is {limit:,} bytes per part")
    return real


def audio_part(data: str, fmt: str, where: str, limit: int = MAX_PART_BYTES) -> MediaPart:
    """An ``input_audio`` part: base64 ``data`` in ``fmt`` (wav, mp3, flac, ogg, opus)."""
    if not isinstance(data, str) or not data:
        raise MediaRefusal(400, where, "'data' must be base64 text")
    ext = _AUDIO_FORMATS.get(str(fmt).lower())
    if ext is None:
        raise MediaRefusal(400, where, f"format {fmt!r} is not one of {', '.join(_AUDIO_FORMATS)}")
    return MediaPart(MediaKind.AUDIO, where, data=decode_b64(data, where, limit), ext=ext)


def check(part: MediaPart) -> tuple[str, str]:
    """(kind, extension) of a part by its content. MediaRefusal 400 when it is not the
    kind its part says (an image part that holds no image)."""
    if part.data is not None:
        head = part.data[:64]
    else:
        with open(part.path, "rb") as fh:
            head = fh.read(64)
    if not head:
        raise MediaRefusal(400, part.where, "the data is empty")
    got = sniff(head)
    if got is None or got[0] != part.kind:
        what = f"{got[1]} {got[0]} data" if got else "data of no image or audio format AOTX reads"
        raise MediaRefusal(400, part.where, f"an {part.kind} part holds {what}")
    return got[0], part.ext or _EXT_OF_FORMAT.get(got[1], "")


def uploads_dir() -> Path:
    from aotx.engine import paths

    return paths.data_dir() / "gateway" / "uploads"


def attach(part: MediaPart, directory: Path | None = None) -> P.Attachment:
    """The engine's ``Attachment`` for a checked part: a data part is written once by
    its SHA-256 (0600, fsynced, renamed into place); a file part is attached as is."""
    kind, ext = check(part)
    if part.path is not None:
        data = Path(part.path).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        return P.Attachment(path=part.path, kind=kind, sha256=digest, name=part.where)
    digest = hashlib.sha256(part.data).hexdigest()
    d = directory or uploads_dir()
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = d / f"{digest}{ext}"
    if not path.exists():
        tmp = d / f".{digest}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, part.data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    return P.Attachment(path=str(path), kind=kind, sha256=digest, name=part.where)


# ---- naming the field of an oversized body ------------------------------------------------

def open_field(prefix: bytes) -> str | None:
    """The JSON path (``messages[0].content[1].image_url.url``) of the string that is still
    open at the end of ``prefix``, the first bytes of a body cut at the size limit; None
    when no string is open there or the prefix is not JSON-shaped. A pure scan: keys and
    indices are tracked, values are skipped."""
    stack: list[list] = []  # [kind, key or index, expecting_key]
    i, n = 0, len(prefix)
    key: str | None = None
    while i < n:
        c = prefix[i]
        if c in b" \t\r\n":
            i += 1
            continue
        if c == ord("{"):
            stack.append(["o", None, True])
            i += 1
        elif c == ord("["):
            stack.append(["a", 0, False])
            i += 1
        elif c in (ord("}"), ord("]")):
            if not stack:
                return None
            stack.pop()
            i += 1
        elif c == ord(","):
            if stack:
                top = stack[-1]
                if top[0] == "a":
                    top[1] += 1
                else:
                    top[2] = True
            i += 1
        elif c == ord(":"):
            if stack and stack[-1][0] == "o":
                stack[-1][1] = key
                stack[-1][2] = False
            i += 1
        elif c == ord('"'):
            j = i + 1
            esc = False
            while j < n:
                b = prefix[j]
                if esc:
                    esc = False
                elif b == ord("\\"):
                    esc = True
                elif b == ord('"'):
                    break
                j += 1
            if j >= n:  # the string runs past the cut: this is the field
                path = _path(stack)
                if stack and stack[-1][0] == "o" and stack[-1][2]:
                    return path or None  # an open key: name the object
                return path or None
            text = prefix[i + 1:j].decode("utf-8", "replace")
            if stack and stack[-1][0] == "o" and stack[-1][2]:
                key = text
            i = j + 1
        else:
            i += 1  # numbers, true, false, null
    return None


def _path(stack: list[list]) -> str:
    out = ""
    for kind, k, _ in stack:
        if kind == "a":
            out += f"[{k}]"
        elif k is not None:
            out += f".{k}" if out else str(k)
    return out
