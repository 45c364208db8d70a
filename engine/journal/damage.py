"""What a scan of the journal finds: records, where they lie, and what is wrong.

Owns: ``Entry`` (a decoded record and where it lies), ``SegmentInfo`` (one
segment file as the scan saw it), ``Problem`` and ``Damage`` (what a crash does
not explain: where, what was lost, why), resynchronisation (``find_frame``: the
next valid frame after bad bytes, as LevelDB's ``log_reader`` does) and
``read_what`` (what damaged bytes held, read past their failed CRC, for reports
only). Pure functions over bytes; no files. Leaves to others: walking the
segments (``segments.py``), ordering them (``chain.py``), acting on damage
(``salvage.py``, ``recovery.py``).
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import msgspec
import numpy as np

from aotx.engine.journal.records import (
    FRAME_OVERHEAD, RECORD_HEADER, RECORD_TYPES, FrameError, Record, SegmentHeader, decode_frame, peek_frame,
)

_MAX_TYPE = max(RECORD_TYPES)
_SEQ = struct.Struct("<Q")
_LEN = struct.Struct("<I")


class Problem(msgspec.Struct, frozen=True):
    """Something wrong in a journal: where (segment number, byte offset in that
    segment), what kind, and a message naming the bad value."""

    segment: int
    offset: int
    kind: str
    message: str

    def __str__(self) -> str:
        return f"segment {self.segment} offset {self.offset}: {self.message} ({self.kind})"


class Damage(msgspec.Struct):
    """Bytes ``[offset, end)`` of ``segment`` fail their checks and a crash does not
    explain them. Records ``first_lost .. last_lost`` are gone (none when
    ``last_lost < first_lost``); the valid records after ``end`` are kept.

    ``why``: why this is damage, not a torn tail; ``found``: what the bad bytes
    held as far as can still be read (maps of ``type``, ``seq``, ``conv_id``,
    ``msg_id``: read past a failed CRC, so a hint, never replayed); ``header``:
    the segment's header must be rewritten (``base_seq`` and ``flags`` are what it
    should say); ``missing``: the segment file itself is missing; ``prefix``: the
    lost records come before the segment's first record; ``opens_checkpoint``:
    the lost bytes opened a streamed checkpoint; ``path``: with kind ``misplaced``,
    the file that holds segment ``segment`` under another number's name (salvage
    renames it), with kind ``duplicate``, a file that repeats segment ``segment``
    (salvage moves it aside as a ``.damaged`` copy); no record is lost to either."""

    segment: int
    offset: int
    end: int
    first_lost: int
    last_lost: int
    kind: str
    message: str
    why: str = ""
    tick: int = 0
    found: list[dict[str, Any]] = []
    header: bool = False
    base_seq: int = 0
    flags: int = 0
    missing: bool = False
    through: int = 0  # with ``missing``: the last missing segment number
    prefix: bool = False
    opens_checkpoint: bool = False
    path: str = ""

    @property
    def n_lost(self) -> int:
        return max(0, self.last_lost - self.first_lost + 1)

    @property
    def problem(self) -> Problem:
        return Problem(self.segment, self.offset, self.kind, self.message)

    def lost_text(self) -> str:
        if not self.n_lost:
            return "no record lost"
        if self.n_lost == 1:
            return f"record seq {self.first_lost} lost"
        return f"records seq {self.first_lost}..{self.last_lost} lost"

    def __str__(self) -> str:
        where = (f"segment {self.segment} is missing" if self.missing and self.through <= self.segment else
                 f"segments {self.segment}..{self.through} are missing" if self.missing else
                 f"segment {self.segment}" if self.kind in ("misplaced", "duplicate") else
                 f"segment {self.segment} bytes {self.offset}..{self.end}")
        return f"{where}: {self.message} ({self.kind}; {self.why}); {self.lost_text()}"


class Entry(NamedTuple):
    """One decoded record and where it lies: bytes [offset, end) of ``segment``."""

    seq: int
    tick: int
    record: Record
    segment: int
    offset: int
    end: int


class SegmentInfo(msgspec.Struct):
    """One segment file. ``number``: the segment's number (its header's; the file
    name's when the header is unreadable); ``file_number``: the one in its name."""

    number: int
    path: str
    size: int  # bytes in the file
    header: SegmentHeader | None = None
    file_number: int = 0
    header_error: Any = None  # the FrameError its header failed with
    key: int = 0  # the seq it starts at (its header's base, or its first valid record's); 0: unknown
    valid_end: int = 0  # bytes of the file that hold good data (header + whole records)
    n_records: int = 0
    first_seq: int = 0
    last_seq: int = 0


def find_frame(data: bytes, origin: int, start: int, min_seq: int, *, unbounded: bool = False):
    """Resynchronise: the first offset ``p >= start`` (below ``end``) where a valid
    frame begins whose seq could follow damage that began at ``origin`` with the
    record ``min_seq``: ``min_seq <= seq <= min_seq + (p - origin) // 26``.

    ``unbounded``: any seq from ``min_seq`` on (a segment whose header is lost).
    Returns ``(p, record, tick, seq, frame_end)`` or None. Candidates are found with
    a vectorised test on the type field, then checked with the CRC32C."""
    n = len(data)
    chunk = 4 << 20
    c = start
    while c < n - RECORD_HEADER.size + 1:
        stop = min(n - RECORD_HEADER.size + 1, c + chunk)
        a = np.frombuffer(data, np.uint8, count=stop - c + 1, offset=c)
        hits = np.flatnonzero((a[:-1] >= 1) & (a[:-1] <= _MAX_TYPE) & (a[1:] == 0)) + c
        for p in hits.tolist():
            (seq,) = _SEQ.unpack_from(data, p + 10)
            if seq < min_seq or (not unbounded and seq > min_seq + (p - origin) // FRAME_OVERHEAD):
                continue
            (length,) = _LEN.unpack_from(data, p + 18)
            if p + FRAME_OVERHEAD + length > n:
                continue
            try:
                record, tick, seq2, fend = decode_frame(data, p)
            except FrameError:
                continue
            return p, record, tick, seq2, fend
        c = stop
    return None


def read_what(data: bytes, start: int, end: int) -> list[dict[str, Any]]:
    """What the damaged bytes [start, end) held, frame by frame, reading past the CRC."""
    out: list[dict[str, Any]] = []
    q = start
    while q < end and len(out) < 64:
        try:
            type_id, _tick, seq, fend, rec = peek_frame(data, q)
        except FrameError:
            break
        if rec is not None:
            d = {"type": type(rec).__name__, "seq": seq}
            for k in ("conv_id", "msg_id"):
                v = getattr(rec, k, None)
                if isinstance(v, str):
                    d[k] = v
            out.append(d)
        elif type_id in RECORD_TYPES and q + RECORD_HEADER.size < min(fend, end):
            # the payload does not decode as its type (a flipped bit in a key, say): read it
            # untyped and keep its short strings, which recovery matches to known ids
            try:
                raw = msgspec.msgpack.decode(data[q + RECORD_HEADER.size:min(fend, end) - 4])
            except (msgspec.DecodeError, ValueError):
                raw = None
            if isinstance(raw, dict):
                strings = [v for v in raw.values() if isinstance(v, str) and 0 < len(v) <= 64]
                d = {"type": RECORD_TYPES[type_id].__name__, "seq": seq, "strings": strings}
                for k in ("conv_id", "msg_id"):
                    if isinstance(raw.get(k), str):
                        d[k] = raw[k]
                out.append(d)
        if fend <= q or fend > end or type_id not in RECORD_TYPES:
            break
        q = fend
    return out

