"""Media kinds: what an attachment is, from its name and from its first bytes.

The one table of the media AOTX takes (``EXTENSIONS``: extension -> kind and
format) and the content sniff (``sniff``). The media profile decides with them,
the app checks a dropped file with them, the CLI labels ``--attach`` with them and
the protocol's ``Attachment.kind`` is one of ``MediaKind``. A format is listed
only where a decoder here reads it (Pillow; libsndfile through soundfile, which
has no AAC, so no ``.m4a``).
"""

from __future__ import annotations

import enum
import os
from pathlib import Path


class MediaKind(enum.StrEnum):
    AUDIO = "audio"
    IMAGE = "image"


# extension -> (kind, format name as sniff() reports it)
EXTENSIONS: dict[str, tuple[MediaKind, str]] = {
    ".png": (MediaKind.IMAGE, "PNG"), ".jpg": (MediaKind.IMAGE, "JPEG"), ".jpeg": (MediaKind.IMAGE, "JPEG"),
    ".jpe": (MediaKind.IMAGE, "JPEG"), ".gif": (MediaKind.IMAGE, "GIF"), ".webp": (MediaKind.IMAGE, "WEBP"),
    ".bmp": (MediaKind.IMAGE, "BMP"), ".tif": (MediaKind.IMAGE, "TIFF"), ".tiff": (MediaKind.IMAGE, "TIFF"),
    ".wav": (MediaKind.AUDIO, "WAV"), ".wave": (MediaKind.AUDIO, "WAV"), ".flac": (MediaKind.AUDIO, "FLAC"),
    ".ogg": (MediaKind.AUDIO, "OGG"), ".oga": (MediaKind.AUDIO, "OGG"), ".opus": (MediaKind.AUDIO, "OGG"),
    ".mp3": (MediaKind.AUDIO, "MP3"), ".aif": (MediaKind.AUDIO, "AIFF"), ".aiff": (MediaKind.AUDIO, "AIFF"),
    ".aifc": (MediaKind.AUDIO, "AIFF"), ".au": (MediaKind.AUDIO, "AU"),
}


def kind_of_name(path: str | os.PathLike[str]) -> MediaKind | None:
    """The kind a file's extension names (``EXTENSIONS``), None for any other name."""
    named = EXTENSIONS.get(Path(path).suffix.lower())
    return named[0] if named else None


def sniff(head: bytes) -> tuple[MediaKind, str] | None:
    """``(kind, format)`` of a file from its first bytes (16 or more), None when unknown.

    Kinds: "image" (PNG, JPEG, GIF, WEBP, BMP, TIFF) and "audio" (WAV, FLAC,
    OGG, AIFF, MP3, AU)."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return MediaKind.IMAGE, "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return MediaKind.IMAGE, "JPEG"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return MediaKind.IMAGE, "GIF"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return MediaKind.IMAGE, "WEBP"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return MediaKind.IMAGE, "TIFF"
    if head[:2] == b"BM" and len(head) >= 14 and int.from_bytes(head[10:14], "little") < (1 << 20):
        return MediaKind.IMAGE, "BMP"
    if head[:4] in (b"RIFF", b"RF64", b"BW64") and head[8:12] == b"WAVE":
        return MediaKind.AUDIO, "WAV"
    if head[:4] == b"fLaC":
        return MediaKind.AUDIO, "FLAC"
    if head[:4] == b"OggS":
        return MediaKind.AUDIO, "OGG"
    if head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
        return MediaKind.AUDIO, "AIFF"
    if head[:4] == b".snd":
        return MediaKind.AUDIO, "AU"
    if head[:3] == b"ID3" or (len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0 and head[1] & 0x06):
        return MediaKind.AUDIO, "MP3"
    return None
