"""Audio decoding and normalization: any file people have -> mono float32 at 16 kHz.

Owns: reading an audio file with soundfile (libsndfile: WAV with 8/16/24/32-bit
integer, float and extensible headers, FLAC, OGG/Vorbis and Opus, AIFF, MP3 where
the libsndfile build has it), checking it is whole and not empty, downmixing the
channel axis and resampling with soxr. Leaves to others: what the samples mean
(``whisper.py`` turns them into text) and deciding which attachment is audio
(``profile.py``).

Every problem becomes a ``MediaError`` that names the file and what is wrong;
nothing from libsndfile or soxr reaches a user.

Limits said plainly: the whole file is decoded into memory (``max_seconds``
bounds it, 10 minutes by default: 38 MB as 16 kHz float32 after resampling);
WAV files are checked for a truncated data chunk and Ogg files for a cut last
page (libsndfile reads what is there without complaint); FLAC and the others
report truncation through libsndfile.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aotx.engine.errors import MediaError

TARGET_RATE = 16_000
"""Sample rate every decoded clip is brought to (Hz): what Whisper expects."""

MAX_SECONDS = 600.0
"""Default longest clip accepted (seconds of audio, before resampling)."""


@dataclass(frozen=True)
class Audio:
    """A decoded clip: ``samples`` is ``(n,)`` float32 in [-1, 1] at ``rate`` Hz (mono).

    ``source_rate``, ``source_channels`` and ``source_format`` describe the file
    as it was (``source_format`` is libsndfile's, e.g. ``"WAV/PCM_24"``)."""

    samples: np.ndarray
    rate: int
    source_rate: int
    source_channels: int
    source_format: str

    @property
    def seconds(self) -> float:
        """Duration in seconds."""
        return len(self.samples) / self.rate


def downmix(x: np.ndarray) -> np.ndarray:
    """``(frames, channels)`` or ``(frames,)`` samples -> ``(frames,)`` float32 mono.

    The mean over the channel axis (axis 1): the sum scaled by 1/channels, so a
    full-scale stereo clip stays within [-1, 1]."""
    x = np.asarray(x)
    if x.ndim == 1:
        return x.astype(np.float32, copy=False)
    if x.ndim != 2:
        raise ValueError(f"expected (frames, channels) samples, got shape {x.shape}")
    return x.mean(axis=1, dtype=np.float64).astype(np.float32)


def resample(x: np.ndarray, rate: int, target: int = TARGET_RATE) -> np.ndarray:
    """``(n,)`` float32 at ``rate`` Hz -> ``(round(n * target / rate),)`` float32 at ``target`` Hz.

    soxr at its "HQ" quality (a band-limited polyphase resampler: no aliasing of
    content above the new Nyquist frequency into the speech band)."""
    if rate <= 0:
        raise ValueError(f"sample rate must be positive, got {rate}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if rate == target or len(x) == 0:
        return x
    import soxr

    return soxr.resample(x, rate, target, quality="HQ").astype(np.float32, copy=False)


def check_wav_complete(path: Path) -> None:
    """Raise MediaError when a RIFF/WAVE file's ``data`` chunk declares more bytes
    than the file holds (libsndfile would quietly read the part that is there).

    Files that are not RIFF/WAVE are left alone; RF64 declares its size elsewhere
    and is not checked."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(12)
        if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            return
        pos = 12
        while pos + 8 <= size:
            fh.seek(pos)
            cid, clen = struct.unpack("<4sI", fh.read(8))
            if cid == b"data":
                have = size - (pos + 8)
                if clen != 0xFFFFFFFF and clen > have:
                    raise MediaError(f"{path}: truncated WAV: its header declares {clen:,} bytes of audio, "
                                     f"the file holds {have:,}; re-export or re-copy the file")
                return
            pos += 8 + clen + (clen & 1)
    raise MediaError(f"{path}: truncated or malformed WAV: no 'data' chunk")


def check_ogg_complete(path: Path) -> None:
    """Raise MediaError when an Ogg file's last page is cut short (libsndfile then
    reports a truncated Vorbis stream as 0 samples, which would read as "empty").

    Walks the page headers (RFC 3533: ``OggS``, 27-byte header, segment table,
    body); files that are not Ogg are left alone."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        pos = 0
        while pos < size:
            fh.seek(pos)
            head = fh.read(27)
            if head[:4] != b"OggS":
                if pos == 0:
                    return
                raise MediaError(f"{path}: corrupt Ogg stream: no page header at byte {pos:,}")
            if len(head) < 27:
                break
            table = fh.read(head[26])
            if len(table) < head[26]:
                break
            end = pos + 27 + head[26] + sum(table)
            if end > size:
                break
            pos = end
        else:
            return
    raise MediaError(f"{path}: truncated Ogg audio: the page at byte {pos:,} is cut short by the end of the file "
                     f"({size:,} bytes); re-export or re-copy the file")


def load_audio(path: str | os.PathLike[str], *, target_rate: int = TARGET_RATE,
               max_seconds: float = MAX_SECONDS) -> Audio:
    """Decode ``path`` to mono float32 at ``target_rate`` Hz.

    Integer PCM is scaled to [-1, 1) by libsndfile (int8/uint8, 16, 24, 32 bit);
    float files are taken as they are. Raises MediaError for: a missing or
    unreadable file, a format libsndfile does not know, a truncated or corrupt
    stream, zero-length audio, a clip longer than ``max_seconds``."""
    import soundfile as sf

    p = Path(path)
    if not p.is_file():
        raise MediaError(f"{p}: no such audio file")
    if p.stat().st_size == 0:
        raise MediaError(f"{p}: the file is empty (0 bytes), not audio")
    check_wav_complete(p)
    check_ogg_complete(p)
    try:
        info = sf.info(str(p))
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise MediaError(f"{p}: not a readable audio file ({_sndfile_reason(e)}); "
                         "AOTX reads WAV, FLAC, OGG/Vorbis, Opus, AIFF and MP3") from None
    fmt = f"{info.format}/{info.subtype}"
    if info.samplerate <= 0 or info.channels <= 0:
        raise MediaError(f"{p}: {fmt} header has sample rate {info.samplerate} and {info.channels} channels")
    if info.frames <= 0:
        raise MediaError(f"{p}: zero-length audio ({fmt}, 0 samples)")
    seconds = info.frames / info.samplerate
    if seconds > max_seconds:
        raise MediaError(f"{p}: {seconds:.0f} s of audio, longer than the {max_seconds:.0f} s AOTX transcribes; "
                         "cut the clip")
    try:
        data, rate = sf.read(str(p), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError) as e:
        raise MediaError(f"{p}: truncated or corrupt {fmt} audio ({_sndfile_reason(e)})") from None
    if data.shape[0] == 0:
        raise MediaError(f"{p}: zero-length audio ({fmt}, no samples decoded)")
    if not np.isfinite(data).all():
        data = np.nan_to_num(data, nan=0.0, posinf=1.0, neginf=-1.0)
    mono = resample(downmix(data), rate, target_rate)
    return Audio(mono, target_rate, int(rate), int(info.channels), fmt)


def _sndfile_reason(e: Exception) -> str:
    """libsndfile's own message without the "Error opening '<path>': " prefix."""
    msg = str(e)
    if "': " in msg:
        msg = msg.split("': ", 1)[1]
    return msg.strip().rstrip(".") or type(e).__name__
