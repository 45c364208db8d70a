"""Segment files: names, listing and a read-only scan of the whole journal.

Owns: how segment files are named (``0000000001.seg``), which segments form the
live chain (from the newest checkpoint segment on), and ``JournalScan``, which
walks that chain record by record, checking every header, CRC and sequence
number, and stops at the first problem with its segment and offset. Leaves to
others: deciding what to do about a problem (``recovery.py``) and writing
(``writer.py``). Nothing here modifies a file.

Problem kinds: ``torn`` (a record or header cut short), ``zeros`` (zero-filled
space where a record should be), ``corrupt`` (bad CRC, magic, length, type or
payload), ``sequence`` (a sequence number out of order), ``gap`` (a segment
missing), ``version`` (a segment from a newer format version).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterator, NamedTuple

import msgspec

from aotx.engine.journal.records import (
    FORMAT_VERSION, HEADER_BYTES, Checkpoint, FrameError, Record, SegmentHeader, decode_frame,
    decode_segment_header,
)

SEGMENT_RE = re.compile(r"^(\d{10})\.seg$")
TMP_SUFFIX = ".tmp"
DAMAGED_SUFFIX = ".damaged"


def segment_name(number: int) -> str:
    return f"{number:010d}.seg"


def list_segments(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(number, path)`` of every segment file in ``directory``, by number."""
    d = Path(directory)
    out = []
    if d.is_dir():
        for p in d.iterdir():
            m = SEGMENT_RE.match(p.name)
            if m:
                out.append((int(m.group(1)), p))
    out.sort()
    return out


def fsync_dir(directory: str | os.PathLike) -> None:
    """fsync a directory so that creates, renames and unlinks in it are durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Problem(msgspec.Struct, frozen=True):
    """The first thing wrong in a journal: where (segment number, byte offset in
    that segment), what kind, and a message naming the bad value."""

    segment: int
    offset: int
    kind: str
    message: str

    def __str__(self) -> str:
        return f"segment {self.segment} offset {self.offset}: {self.message} ({self.kind})"


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


class JournalScan:
    """Read-only walk over the live chain of segments in ``directory``.

    After construction, ``segments`` is the chain (the newest checkpoint segment
    and all after it, or all segments when there is no checkpoint) and
    ``superseded`` the numbers of older segments a checkpoint made redundant.
    ``entries()`` yields every good record in sequence order. When it ends,
    ``problem`` is the first problem in journal order (or None), ``problem_index``
    the index in ``segments`` of the segment it lies in (``len(segments)`` for a
    gap or a newer-version segment after the chain), ``later`` the numbers of the
    segments after the problem, ``last_seq``/``last_tick`` describe the last
    good record and each ``SegmentInfo`` has its ``valid_end``."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.problem: Problem | None = None
        self.problem_index = 0
        self.last_seq = 0
        self.last_tick = 0
        self.n_records = 0
        self.superseded: list[int] = []
        self.later: list[int] = []
        self.segments: list[SegmentInfo] = []
        self._after: Problem | None = None  # a gap or newer version after the chain
        self._after_numbers: list[int] = []
        self._header_errors: dict[int, FrameError] = {}
        self._plan()

    def _plan(self) -> None:
        infos: list[SegmentInfo] = []
        for number, path in list_segments(self.directory):
            info = SegmentInfo(number, str(path), path.stat().st_size)
            with open(path, "rb") as f:
                head = f.read(HEADER_BYTES)
            try:
                info.header = decode_segment_header(head)
            except FrameError as e:
                self._header_errors[number] = e
            infos.append(info)
        for i, info in enumerate(infos):  # a newer format version anywhere is refused
            h = info.header
            if h is not None and h.version > FORMAT_VERSION:
                self._after = Problem(info.number, 0, "version",
                                      f"segment {info.number} has format version {h.version}; this AOTX reads "
                                      f"version {FORMAT_VERSION} (upgrade AOTX, or move {info.path} aside)")
                self._after_numbers = [x.number for x in infos[i:]]
                infos = infos[:i]
                break
        start = 0
        for i, info in enumerate(infos):
            if info.header is not None and info.header.checkpoint:
                start = i
        self.superseded = [x.number for x in infos[:start]]
        chain = infos[start:]
        for i in range(1, len(chain)):
            prev, cur = chain[i - 1], chain[i]
            if cur.number != prev.number + 1:
                self._after = Problem(prev.number, prev.size, "gap",
                                      f"segment {prev.number + 1} is missing (next present is {cur.number})")
                self._after_numbers = [x.number for x in chain[i:]] + self._after_numbers
                chain = chain[:i]
                break
        self.segments = chain

    def _inner(self, index: int, problem: Problem) -> None:
        self.problem = problem
        self.problem_index = index
        self.later = [s.number for s in self.segments[index + 1:]] + self._after_numbers

    def entries(self) -> Iterator[Entry]:
        """Yield every good record of the chain in order, stopping at the first problem."""
        expected = 0
        last = len(self.segments) - 1
        for i, info in enumerate(self.segments):
            h = info.header
            err = self._header_errors.get(info.number)
            if err is not None:
                kind = err.kind
                if i == last and not self._after_numbers and info.size <= HEADER_BYTES:
                    kind = "torn"  # a crash cut the segment's creation short: it holds no records
                self._inner(i, Problem(info.number, 0, kind, f"segment header: {err}"))
                return
            if h.number != info.number:
                self._inner(i, Problem(info.number, 0, "corrupt",
                                       f"header names segment {h.number}, the file is {info.path}"))
                return
            if i == 0 and not h.checkpoint and h.base_seq != 1:
                self._inner(i, Problem(info.number, 0, "gap", f"segment {info.number} starts at seq "
                                       f"{h.base_seq} and no checkpoint precedes it: earlier segments are missing"))
                return
            if i and h.base_seq != expected:
                self._inner(i, Problem(info.number, 0, "sequence",
                                       f"segment {info.number} starts at seq {h.base_seq}, expected {expected}"))
                return
            expected = h.base_seq
            data = Path(info.path).read_bytes()
            offset = info.valid_end = HEADER_BYTES
            n = len(data)
            while offset < n:
                try:
                    record, tick, seq, end = decode_frame(data, offset)
                except FrameError as e:
                    self._inner(i, Problem(info.number, e.offset, e.kind, str(e)))
                    return
                if seq != expected:
                    self._inner(i, Problem(info.number, offset, "sequence",
                                           f"record at offset {offset} has seq {seq}, expected {expected}"))
                    return
                is_cp = isinstance(record, Checkpoint)
                if is_cp != (h.checkpoint and offset == HEADER_BYTES):
                    what = ("a Checkpoint record may only open a checkpoint segment" if is_cp
                            else "a checkpoint segment must open with a Checkpoint record")
                    self._inner(i, Problem(info.number, offset, "corrupt", f"record at offset {offset}: {what}"))
                    return
                if not info.n_records:
                    info.first_seq = seq
                info.n_records += 1
                info.last_seq = seq
                info.valid_end = end
                self.last_seq = seq
                self.last_tick = tick
                self.n_records += 1
                expected = seq + 1
                yield Entry(seq, tick, record, info.number, offset, end)
                offset = end
            if h.checkpoint and info.n_records == 0:
                self._inner(i, Problem(info.number, HEADER_BYTES, "torn",
                                       "checkpoint segment holds no Checkpoint record"))
                return
        if self._after is not None:
            self.problem = self._after
            self.problem_index = len(self.segments)
            self.later = list(self._after_numbers)

    @property
    def next_seq(self) -> int:
        """The sequence number the next record appended after the chain must carry."""
        if self.last_seq:
            return self.last_seq + 1
        return self.segments[0].header.base_seq if self.segments and self.segments[0].header else 1

    @property
    def problem_at_tail(self) -> bool:
        """True when the problem lies in the last segment and no segment follows:
        what a crash leaves (a torn append), which recovery cuts off."""
        return (self.problem is not None and self.problem.kind in ("torn", "zeros", "corrupt", "sequence")
                and self.problem_index == len(self.segments) - 1 and not self.later)
