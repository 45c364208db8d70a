"""Turning pasted or typed paths into message attachments.

Owns: checking a path (exists, readable, a regular file), telling its kind from the
extension and a magic-bytes sniff, checking at attach time the limit the engine would
refuse it for (an image's pixel count from its header, a clip's duration: the media
profiles' own limits, so a chip is never one the engine will refuse), hashing it
(sha256) and building the protocol's ``Attachment``. A Windows path (a drop from
Windows Terminal into WSL) is read through its WSL mount. Each failure is a one-line
reason a user can act on.
Leaves to others: parsing pastes (``paste.py``), decoding media (the engine's
media profiles).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from aotx.engine.protocol import Attachment
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


def windows_to_wsl(path: str, mount_root: str = "/mnt") -> str | None:
    """``C:\\Users\\me\\a b.png`` -> ``/mnt/c/Users/me/a b.png`` (where WSL mounts a
    drive); None when ``path`` is not a drive-letter path."""
    m = re.match(r"^([A-Za-z]):[\\/](.*)$", path)
    if m is None:
        return None
    return f"{mount_root.rstrip('/')}/{m.group(1).lower()}/{m.group(2).replace(chr(92), '/')}"


def probe_media(path: Path, kind: str) -> str:
    """The reason the engine would refuse this file, read from its header alone
    ("" when it would take it, or when the media extra is not installed: the engine
    then says what to install). Images: the pixel limit (``media.image.MAX_PIXELS``);
    audio: the duration limit (``media.audio.MAX_SECONDS``)."""
    try:
        if kind == "image":
            from aotx.media.image import open_image

            open_image(path).close()
        else:
            import soundfile as sf

            from aotx.media.audio import MAX_SECONDS, check_wav_complete

            check_wav_complete(path)
            try:
                info = sf.info(str(path))
            except (sf.LibsndfileError, RuntimeError, TypeError) as e:
                return f"{path.name}: not a readable audio file ({str(e).split(': ')[-1].strip()})"
            seconds = info.frames / info.samplerate if info.samplerate > 0 else 0.0
            if seconds > MAX_SECONDS:
                return (f"{path.name}: {seconds:,.0f} s of audio, longer than the {MAX_SECONDS:.0f} s AOTX "
                        "transcribes; cut the clip")
    except ImportError:
        return ""
    except Exception as e:  # noqa: BLE001 - MediaError names the file; a decoder's own failure too
        return str(e)
    return ""


def make_attachment(path: str) -> AttachResult:
    """Check ``path`` and build its Attachment; never raises for a bad file."""
    wsl = windows_to_wsl(path)
    if wsl is not None:
        if not Path(wsl).exists():
            return AttachResult(path, problem=f"{path}: a Windows path; no such file at {wsl}, where WSL would "
                                              "mount it (copy the file into this system, or give its path here)")
        path = wsl
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
    problem = probe_media(p, ext_kind)
    if problem:
        return AttachResult(path, problem=problem)
    return AttachResult(path, Attachment(path=str(p.resolve()), kind=ext_kind, sha256=h.hexdigest(), name=p.name))
