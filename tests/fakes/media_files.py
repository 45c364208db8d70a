"""Small real media files for app tests: a valid PNG, a valid WAV, and files whose
headers declare what the engine refuses (a 12000 x 12000 picture, a 1-hour clip),
written without decoding libraries (zlib, struct, a sparse file)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path


def png_bytes(width: int = 2, height: int = 2, idat: bytes | None = None) -> bytes:
    """A grayscale 8-bit PNG of ``width`` x ``height`` black pixels (``idat``: other
    compressed data, e.g. a few bytes for a header-only file)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    if idat is None:
        idat = zlib.compress(b"".join(b"\0" + b"\0" * width for _ in range(height)))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def wav_header(n_frames: int, rate: int = 8000, bits: int = 8) -> bytes:
    data = n_frames * bits // 8
    return (b"RIFF" + struct.pack("<I", 36 + data) + b"WAVEfmt " +
            struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * bits // 8, bits // 8, bits) +
            b"data" + struct.pack("<I", data))


def write_wav(path: Path, seconds: float, rate: int = 8000) -> Path:
    """A mono 8-bit WAV of ``seconds`` of silence; long clips are sparse files (the
    data chunk is all there, as zeros the file system does not store)."""
    n = int(seconds * rate)
    with open(path, "wb") as fh:
        fh.write(wav_header(n, rate))
        fh.truncate(44 + n)
    return path


def write_png(path: Path, width: int = 2, height: int = 2) -> Path:
    """A PNG file; past a few thousand pixels a side only its header is real (enough
    for a size check, which never decodes pixels)."""
    big = width * height > 4_000_000
    path.write_bytes(png_bytes(width, height, idat=zlib.compress(b"\0" * 64) if big else None))
    return path
