"""Turning pasted or typed paths into message attachments.

Owns: checking a path (exists, readable, a regular file), telling its kind from the
extension and a magic-bytes sniff, hashing it (sha256) and building the protocol's
``Attachment``. Each failure is a one-line reason a user can act on.
Leaves to others: parsing pastes (``paste.py``), decoding media (the engine's
media profiles).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from aotx.engine.ipc.protocol import Attachment
from aotx.media import kinds

# the media profile's table (aotx.media.kinds): a chip only for what the engine decodes
IMAGE_EXT = {e for e, (k, _) in kinds.EXTENSIONS.items() if k is kinds.MediaKind.IMAGE}
AUDIO_EXT = {e for e, (k, _) in kinds.EXTENSIONS.items() if k is kinds.MediaKind.AUDIO}
MAX_BYTES = 512 << 20


@dataclass(frozen=True)
class AttachResult:
    """Either ``attachment`` (accepted) or ``problem`` (a sentence saying why not)."""

    path: str
    attachment: Attachment | None = None
    problem: str = ""


def sniff(head: bytes) -> str | None:
    """Media kind ("image" | "audio") from a file's first 16 bytes, or None (``kinds.sniff``)."""
    found = kinds.sniff(head)
    return found[0].value if found else None


def kind_of_extension(path: str) -> str | None:
    kind = kinds.kind_of_name(path)
    return kind.value if kind else None


def make_attachment(path: str) -> AttachResult:
    """Check ``path`` and build its Attachment; never raises for a bad file."""
    p = Path(path).expanduser()
    ext_kind = kind_of_extension(str(p))
    if ext_kind is None:
        return AttachResult(path, problem=f"{p.name or path}: not an image or audio file "
                            f"(known: {', '.join(sorted(IMAGE_EXT | AUDIO_EXT))})")
    try:
        if not p.exists():
            return AttachResult(path, problem=f"{path}: no such file")
        if not p.is_file():
            return AttachResult(path, problem=f"{path}: not a regular file")
        size = p.stat().st_size
        if size > MAX_BYTES:
            return AttachResult(path, problem=f"{p.name}: {size} bytes is over the {MAX_BYTES} byte limit")
        h = hashlib.sha256()
        with open(p, "rb") as fh:
            head = fh.read(16)
            h.update(head)
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    except PermissionError:
        return AttachResult(path, problem=f"{path}: not readable (permission denied)")
    except OSError as e:
        return AttachResult(path, problem=f"{path}: cannot be read ({e.strerror or e})")
    magic = sniff(head)
    if magic != ext_kind:
        found = f"looks like {magic}" if magic else "its bytes match no known format"
        return AttachResult(path, problem=f"{p.name}: named as {ext_kind} but {found}")
    return AttachResult(path, Attachment(path=str(p.resolve()), kind=ext_kind, sha256=h.hexdigest(), name=p.name))
