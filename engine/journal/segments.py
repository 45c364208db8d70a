"""Segment files: names, listing and a read-only scan of the whole journal.

Owns: how segment files are named (``0000000001.seg``), which segments form the
live chain (from the newest *complete* checkpoint segment on), and
``JournalScan``, which walks that chain record by record, checking every
header, CRC and sequence number. Where a record fails its check the scan
resynchronises on the next valid frame (as LevelDB's ``log_reader`` does) and
goes on, so every valid record after damage is still read. Leaves to others:
what to do about what it finds (``recovery.py``) and writing (``writer.py``).
Nothing here modifies a file; files are opened with O_NONBLOCK and anything
that is not a regular file is refused by name (a FIFO never hangs a scan).

What the scan tells apart, given the acknowledged point (the journal's
``RECEIPT`` file: the last receipt issued):

* a **torn tail**: bad bytes at the end of the last segment, with no valid
  record after them, all past the acknowledged point. A crash leaves this;
  ``recovery`` cuts it off.
* **damage**: anything else: a bad record at or before the acknowledged
  point, a bad record followed by valid records, a missing segment, a bad
  header on a segment that holds records, acknowledged records missing at the
  end. A crash cannot explain it; ``recovery`` salvages (``Damage``).

Problem kinds (the first one is ``problem``): ``torn`` (a record or header cut
short), ``zeros`` (zero-filled space where a record should be), ``corrupt``
(bad CRC, magic, length, type or payload), ``sequence`` (a sequence number out
of order), ``gap`` (segments or acknowledged records missing), ``version`` (a
segment from a newer format version: always refused, never salvaged).
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import msgspec
import numpy as np

from aotx.engine.errors import JournalError
from aotx.engine.fileio import OS, FileIO, NotRegularFile, describe_os_error, read_regular
from aotx.engine.journal.records import (
    FORMAT_VERSION, FRAME_OVERHEAD, HEADER_BYTES, RECEIPT_FILE, RECORD_HEADER, RECORD_TYPES, Checkpoint,
    CheckpointEnd, FrameError, Gap, Record, SegmentHeader, decode_frame, decode_receipt, decode_segment_header,
    peek_frame,
)

SEGMENT_RE = re.compile(r"^(\d{10})\.seg$")
TMP_SUFFIX = ".tmp"
DAMAGED_SUFFIX = ".damaged"
_MAX_TYPE = max(RECORD_TYPES)
_SEQ = struct.Struct("<Q")
_LEN = struct.Struct("<I")


def segment_name(number: int) -> str:
    return f"{number:010d}.seg"


def list_segments(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(number, path)`` of every segment file in ``directory``, by number."""
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
    """``(segment, offset, last_seq)`` of the last receipt the writer recorded in the
    journal's ``RECEIPT`` file, or None (no file, or it fails its check)."""
    try:
        return decode_receipt(read_regular(Path(directory) / RECEIPT_FILE, 64))
    except OSError:
        return None


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
    the lost bytes opened a streamed checkpoint."""

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
    number: int
    path: str
    size: int  # bytes in the file
    header: SegmentHeader | None = None
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


def _read_what(data: bytes, start: int, end: int) -> list[dict[str, Any]]:
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


class JournalScan:
    """Read-only walk over the live chain of segments in ``directory``.

    After construction, ``segments`` is the chain (the newest complete checkpoint
    segment and all after it, or all segments when there is none) and
    ``superseded`` the numbers of older segments a checkpoint made redundant.
    ``acknowledged`` is the ``RECEIPT`` file's ``(segment, offset, last_seq)`` or
    None; pass ``acknowledged=`` to override it. ``entries()`` yields every valid
    record in sequence order, across damage. When it ends: ``damage`` lists what a
    crash does not explain, ``tail`` is a torn tail (or None), ``problem`` the
    first of them as a ``Problem``, ``gaps`` the ``Gap`` records an earlier
    salvage wrote, ``last_seq``/``last_tick`` describe the last good record, and
    each ``SegmentInfo`` has its ``valid_end``.

    Raises ``JournalError`` at construction when a segment file cannot be read or
    is not a regular file."""

    def __init__(self, directory: str | os.PathLike, *, acknowledged: tuple[int, int, int] | None | bool = True):
        self.directory = Path(directory)
        self.acknowledged = read_acknowledged(self.directory) if acknowledged is True else (acknowledged or None)
        self.acked_seq = self.acknowledged[2] if self.acknowledged else 0
        self.problem: Problem | None = None
        self.damage: list[Damage] = []
        self.tail: Problem | None = None
        self.gaps: list[Entry] = []
        self.version_problem: Problem | None = None
        self.last_seq = 0
        self.last_tick = 0
        self.n_records = 0
        self.superseded: list[int] = []
        self.segments: list[SegmentInfo] = []
        self.newer: list[int] = []  # segments of a newer format version (left alone)
        self.end_seq: int | None = None  # set by entries(): the seq after everything read or lost
        self._header_errors: dict[int, FrameError] = {}
        self._plan()

    # ---- which segments form the chain ----------------------------------------------

    def _plan(self) -> None:
        infos: list[SegmentInfo] = []
        for number, path in list_segments(self.directory):
            head = read_segment(path, HEADER_BYTES)
            info = SegmentInfo(number, str(path), os.stat(path).st_size)
            try:
                info.header = decode_segment_header(head)
            except FrameError as e:
                self._header_errors[number] = e
            infos.append(info)
        for i, info in enumerate(infos):  # a newer format version anywhere is refused
            h = info.header
            if h is not None and h.version > FORMAT_VERSION:
                self.version_problem = Problem(
                    info.number, 0, "version", f"segment {info.number} has format version {h.version}; this AOTX "
                    f"reads versions up to {FORMAT_VERSION} (upgrade AOTX, or move {info.path} aside)")
                self.newer = [x.number for x in infos[i:]]
                infos = infos[:i]
                break
        start = self._start(infos)
        self.superseded = [x.number for x in infos[:start]]
        self.segments = infos[start:]

    def _start(self, infos: list[SegmentInfo]) -> int:
        """Index of the chain's first segment: the newest checkpoint segment whose
        checkpoint is complete; else the first segment when it begins the history
        (seq 1); else the newest checkpoint segment (damaged: salvage reads it)."""
        cps = [i for i, x in enumerate(infos) if x.header is not None and x.header.checkpoint]
        for i in reversed(cps):
            if self._checkpoint_complete(infos[i]):
                return i
        if infos and infos[0].header is not None and infos[0].header.base_seq == 1 and not infos[0].header.checkpoint:
            return 0
        return cps[-1] if cps else 0

    @staticmethod
    def _checkpoint_complete(info: SegmentInfo) -> bool:
        data = read_segment(info.path)
        try:
            record, _, seq, off = decode_frame(data, HEADER_BYTES)
        except FrameError:
            return False
        if not isinstance(record, Checkpoint):
            return False
        if not record.streamed:
            return True
        while off < len(data):
            try:
                r, _, _, off = decode_frame(data, off)
            except FrameError:
                return False
            if isinstance(r, CheckpointEnd) and r.begin_seq == seq:
                return True
        return False

    # ---- the walk -------------------------------------------------------------------

    def _damage(self, d: Damage) -> None:
        self.damage.append(d)
        if self.problem is None:
            self.problem = d.problem

    def entries(self) -> Iterator[Entry]:
        """Yield every valid record of the chain in order, resynchronising after damage."""
        expected: int | None = None  # seq the next record must carry (None: the first segment says)
        pending: Damage | None = None  # damage whose lost range ends where the next segment begins
        chain = self.segments
        prev_number: int | None = None
        for i, info in enumerate(chain):
            is_last = i == len(chain) - 1 and not self.newer
            if prev_number is not None and info.number != prev_number + 1:
                d = Damage(prev_number + 1, 0, 0, expected, expected - 1, "gap",
                           f"segment {prev_number + 1} is missing (next present is {info.number})"
                           if info.number == prev_number + 2 else
                           f"segments {prev_number + 1}..{info.number - 1} are missing", "a crash never removes "
                           "a segment", tick=self.last_tick, missing=True, through=info.number - 1)
                self._damage(d)
                pending = d
            prev_number = info.number
            data = read_segment(info.path)
            n = info.size = len(data)
            h = self._header(info, data, expected, is_last)
            if h is None:
                break
            if expected is None:
                expected = h.base_seq
                if not h.checkpoint and h.base_seq != 1:
                    self._damage(Damage(info.number, HEADER_BYTES, HEADER_BYTES, 1, h.base_seq - 1, "gap",
                                        f"segment {info.number} starts at seq {h.base_seq} and no checkpoint precedes "
                                        "it: earlier segments are missing", "a crash never removes a segment",
                                        prefix=True, base_seq=1, flags=h.flags))
            elif h.base_seq > expected:
                if pending is not None:
                    pending.last_lost = h.base_seq - 1  # the lost records end where this segment begins
                else:
                    self._damage(Damage(info.number, HEADER_BYTES, HEADER_BYTES, expected, h.base_seq - 1,
                                        "sequence", f"segment {info.number} starts at seq {h.base_seq}, expected "
                                        f"{expected}", "records before it are missing", tick=self.last_tick,
                                        prefix=True, base_seq=expected, flags=h.flags))
                expected = h.base_seq
            elif h.base_seq < expected:  # a header naming an older seq: trust the records, rewrite it
                d = Damage(info.number, 0, HEADER_BYTES, expected, expected - 1, "sequence",
                           f"segment {info.number} header says base seq {h.base_seq}, expected {expected}",
                           "records follow it", tick=self.last_tick, header=True, base_seq=expected, flags=h.flags)
                self._damage(d)
                h = SegmentHeader(h.version, h.flags, h.number, expected)
            pending = None
            info.header = h
            off = info.valid_end = HEADER_BYTES
            stop = False
            while off < n:
                try:
                    record, tick, seq, end = decode_frame(data, off)
                    bad = None
                    if seq != expected:
                        bad = FrameError("sequence", off, f"record at offset {off} has seq {seq}, expected {expected}")
                    elif isinstance(record, Checkpoint) and not (h.checkpoint and off == HEADER_BYTES):
                        bad = FrameError("corrupt", off, f"record at offset {off}: a Checkpoint record may only "
                                         "open a checkpoint segment")
                    elif h.checkpoint and off == HEADER_BYTES and not isinstance(record, (Checkpoint, Gap)):
                        bad = FrameError("corrupt", off, f"record at offset {off}: a checkpoint segment must open "
                                         "with a Checkpoint record")
                except FrameError as e:
                    bad = e
                if bad is not None:
                    res = self._resync(info, data, off, expected, bad, is_last)
                    if res[0] == "found":
                        _, off, expected = res
                        continue
                    if res[0] == "pending":
                        pending = res[1]
                    stop = res[0] == "stop"
                    break
                if isinstance(record, Gap):
                    self.gaps.append(Entry(seq, tick, record, info.number, off, end))
                if not info.n_records:
                    info.first_seq = seq
                info.n_records += 1
                info.last_seq = seq
                info.valid_end = end
                self.last_seq = record.last_seq if isinstance(record, Gap) else seq
                self.last_tick = tick
                self.n_records += 1
                expected = self.last_seq + 1
                yield Entry(seq, tick, record, info.number, off, end)
                off = end
            if stop:
                break
        if self.version_problem is not None and self.problem is None:
            self.problem = self.version_problem
        if pending is not None:  # damage at the end of the last segment with later ones unreadable
            pending.last_lost = max(pending.last_lost, self.acked_seq)
        if (self.tail is None and chain and expected is not None and self.acked_seq >= expected
                and not (self.damage and self.damage[-1].last_lost >= self.acked_seq)):
            last = chain[-1]  # the journal ends cleanly, yet a receipt covered records after its end
            self._damage(Damage(last.number, last.size, last.size, expected, self.acked_seq, "gap",
                                f"the journal ends at seq {expected - 1}, but a receipt covered seq "
                                f"{self.acked_seq}", "acknowledged records are missing", tick=self.last_tick))
        self.end_seq = max(expected or 1, (self.damage[-1].last_lost + 1) if self.damage else 1)

    def _header(self, info: SegmentInfo, data: bytes, expected: int | None, is_last: bool) -> SegmentHeader | None:
        """The segment's header, or one rebuilt from its records when it is damaged
        (recorded as ``Damage(header=True)``); None for a torn tail (a segment whose
        creation a crash cut short, holding no records)."""
        err = self._header_errors.get(info.number)
        h = info.header
        if err is None and h.number == info.number:
            return h
        what = f"segment header: {err}" if err is not None else f"header names segment {h.number}, the file is {info.path}"
        if is_last and len(data) <= HEADER_BYTES and (expected is None or expected > self.acked_seq):
            self._tail_problem(info, 0, err.kind if err is not None and err.kind != "corrupt" else "torn", what)
            info.valid_end = 0
            return None
        found = (find_frame(data, HEADER_BYTES, HEADER_BYTES, expected if expected is not None else 1,
                            unbounded=expected is None) if len(data) > HEADER_BYTES else None)
        base = expected if expected is not None else (found[3] if found else 1)
        cp = found is not None and found[0] == HEADER_BYTES and isinstance(found[1], Checkpoint)
        self._damage(Damage(info.number, 0, HEADER_BYTES, base, base - 1, err.kind if err else "corrupt", what,
                            "records follow it", tick=self.last_tick, header=True, base_seq=base,
                            flags=1 if cp else 0))
        return SegmentHeader(FORMAT_VERSION, 1 if cp else 0, info.number, base)

    def _resync(self, info: SegmentInfo, data: bytes, off: int, expected: int, bad: FrameError, is_last: bool):
        """After a bad frame at ``off``: find the next valid one. Returns ("found",
        offset, its seq), ("pending", damage) when none follows in this segment but
        later segments do, or ("stop",) (a torn tail, or acknowledged records lost
        at the end of the journal)."""
        n = len(data)
        found = None
        if bad.kind == "sequence":
            _, _, seq, end = decode_frame(data, off)
            if seq > expected:  # records are missing before a valid one
                found = (off, None, 0, seq, end)
            else:  # a stale or repeated record: skip it
                found = find_frame(data, off, end, expected)
        else:
            try:  # the header may be intact (a flipped payload bit): the next frame starts where it says
                _, _, _, end, _ = peek_frame(data, off)
                if off < end < n:
                    got = find_frame(data, off, end, expected)
                    found = got if got is not None and got[0] == end else None
            except FrameError:
                pass
            if found is None:
                found = find_frame(data, off, off + 1, expected)
        opens = bool(info.header and info.header.checkpoint and off == HEADER_BYTES)
        if found is not None:
            p, _, _, seq, _ = found
            self._damage(Damage(info.number, off, p, expected, seq - 1, bad.kind, str(bad), "valid records follow it",
                                tick=self.last_tick, found=_read_what(data, off, p), opens_checkpoint=opens))
            return ("found", p, seq)
        if not is_last:
            d = Damage(info.number, off, n, expected, expected - 1, bad.kind, str(bad), "later segments follow it",
                       tick=self.last_tick, found=_read_what(data, off, n), opens_checkpoint=opens)
            self._damage(d)
            return ("pending", d)
        if expected <= self.acked_seq:
            self._damage(Damage(info.number, off, n, expected, self.acked_seq, bad.kind, str(bad),
                                f"at or before the acknowledged seq {self.acked_seq}", tick=self.last_tick,
                                found=_read_what(data, off, n), opens_checkpoint=opens))
        else:
            self._tail_problem(info, off, bad.kind, str(bad))
        return ("stop",)

    def _tail_problem(self, info: SegmentInfo, off: int, kind: str, message: str) -> None:
        self.tail = Problem(info.number, off, kind, message)
        if self.problem is None:
            self.problem = self.tail

    # ---- summaries ------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        """The sequence number the next record appended after the chain must carry
        (after ``entries()`` has run): past every record read and every seq lost."""
        return self.end_seq or (self.last_seq + 1)
