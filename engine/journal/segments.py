"""The read-only scan of a whole journal, record by record, across damage.

Owns: ``JournalScan``, which walks the live chain (``chain.py``: the segments in
the order their sequence numbers give) record by record, checking every header,
CRC and sequence number. Where a record fails its check the scan resynchronises
on the next valid frame (as LevelDB's ``log_reader`` does) and goes on, so every
valid record after damage is still read. Leaves to others: what to do about what
it finds (``recovery.py``, ``salvage.py``) and writing (``writer.py``). Nothing
here modifies a file; files are opened with O_NONBLOCK and anything that is not a
regular file is refused by name (a FIFO never hangs a scan).

What the scan tells apart, given the acknowledged mark (the last receipt issued,
kept in ``RECEIPT`` and ``RECEIPT.2``):

* a **torn tail**: bad bytes at the end of the last segment, with no valid
  record after them, all past the acknowledged mark, in a segment the mark does
  not reach. A crash leaves this; ``recovery`` cuts it off.
* **damage**: anything else: a bad record at or before the acknowledged mark, a
  bad record followed by valid records, a missing segment (in the middle, at the
  start, or at the end where the mark names later segments or records), a
  segment under another number's name or repeated in a second file, a bad header
  on a segment that holds records or that the mark reaches. A crash cannot
  explain it; ``recovery`` salvages (``Damage``), and every range of lost
  sequence numbers is named.

Problem kinds (the first one is ``problem``): ``torn`` (a record or header cut
short), ``zeros`` (zero-filled space where a record should be), ``corrupt``
(bad CRC, magic, length, type or payload), ``sequence`` (a sequence number out
of order), ``gap`` (segments or acknowledged records missing), ``misplaced`` (a
segment in a file named for another number), ``duplicate`` (a second file
holding a segment), ``version`` (a segment from a newer format version: always
refused, never salvaged).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from aotx.engine.journal.chain import plan_chain
from aotx.engine.journal.damage import Damage, Entry, Problem, SegmentInfo, find_frame, read_what
from aotx.engine.journal.records import (
    FORMAT_VERSION, HEADER_BYTES, Checkpoint, CheckpointEnd, CheckpointPart, FrameError, Gap, SegmentHeader, decode_frame, peek_frame,
)
from aotx.engine.journal.segment_files import (  # noqa: F401 (the names callers import from here)
    DAMAGED_SUFFIX, SEGMENT_RE, TMP_SUFFIX, fsync_dir, list_segments, read_acknowledged, read_segment,
    segment_name,
)


class JournalScan:
    """Read-only walk over the live chain of segments in ``directory``.

    After construction, ``segments`` is the chain (the newest complete checkpoint
    segment and all after it, or all segments when there is none) and
    ``superseded`` the numbers of older segments a checkpoint made redundant.
    ``acknowledged`` is the acknowledged mark ``(segment, offset, last_seq)`` or
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
        plan = plan_chain(self.directory)
        self.version_problem = plan.version_problem
        self.superseded, self.segments, self.newer = plan.superseded, plan.segments, plan.newer
        self.duplicates, self.misplaced = plan.duplicates, plan.misplaced

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
        for dup in self.duplicates:
            name = Path(dup.path).name
            self._damage(Damage(dup.number, 0, 0, dup.base_seq, dup.base_seq - 1, "duplicate",
                                f"file {name} {'repeats' if dup.identical else 'holds another copy of'} segment "
                                f"{dup.number} (from seq {dup.base_seq}), which {Path(dup.kept).name} holds",
                                "a crash never copies a segment", path=dup.path))
        prev_number: int | None = None
        for i, info in enumerate(chain):
            is_last = i == len(chain) - 1 and not self.newer
            if prev_number is not None and info.number > prev_number + 1:
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
            if h is None:  # a torn tail; under another segment's name, it is renamed before it is cut
                if info.path in self.misplaced:
                    self._misplaced_damage(info, expected or 1)
                break
            if expected is None:
                expected = h.base_seq
                if not h.checkpoint and h.base_seq != 1:
                    self._damage(self._missing_before(info, h))
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
            if info.path in self.misplaced:
                self._misplaced_damage(info, h.base_seq)
            if stop:
                break
        if self.version_problem is not None and self.problem is None:
            self.problem = self.version_problem
        if pending is not None:  # damage at the end of the last segment with later ones unreadable
            pending.last_lost = max(pending.last_lost, self.acked_seq)
        if (self.tail is None and not self.newer and self.acked_seq >= (expected or 1)
                and not (self.damage and self.damage[-1].last_lost >= self.acked_seq)):
            self._damage(self._missing_at_end(expected or 1))
        self.end_seq = max(expected or 1, (self.damage[-1].last_lost + 1) if self.damage else 1)

    def _misplaced_damage(self, info: SegmentInfo, base_seq: int) -> None:
        seqs = f"seq {info.first_seq}..{info.last_seq}" if info.n_records else f"from seq {base_seq}"
        self._damage(Damage(info.number, 0, 0, base_seq, base_seq - 1, "misplaced",
                            f"segment {info.number} ({seqs}) is in file {Path(info.path).name}, named for "
                            f"segment {info.file_number}", "a crash never renames a segment", path=info.path))

    def _missing_before(self, info: SegmentInfo, h: SegmentHeader) -> Damage:
        """The chain's first segment is not a checkpoint and does not start the history:
        the segments before it are missing (or a lost checkpoint that replaced them)."""
        why = "a crash never removes a segment"
        if info.number > 1:  # the missing records get a segment of their own, numbered just before
            what = (f"segment {info.number - 1} is missing" if info.number == 2 else
                    f"segments before {info.number} are missing (or the checkpoint that replaced them)")
            return Damage(info.number - 1, 0, 0, 1, h.base_seq - 1, "gap", f"{what}: segment {info.number} "
                          f"starts at seq {h.base_seq}", why, missing=True, through=info.number - 1)
        return Damage(info.number, HEADER_BYTES, HEADER_BYTES, 1, h.base_seq - 1, "gap",
                      f"segment {info.number} starts at seq {h.base_seq} and no checkpoint precedes it: earlier "
                      "segments are missing", why, prefix=True, base_seq=1, flags=h.flags)

    def _missing_at_end(self, expected: int) -> Damage:
        """The journal ends cleanly at ``expected - 1``, yet the acknowledged mark covers
        records after it: in segments after the last one (gone), or in the last one."""
        ack_segment, _, acked = self.acknowledged
        why = "acknowledged records are missing"
        if not self.segments:
            return Damage(ack_segment, 0, 0, 1, acked, "gap", f"no segment is left, but a receipt covered seq "
                          f"{acked} in segment {ack_segment}", why, missing=True, through=ack_segment)
        last = self.segments[-1]
        if ack_segment > last.number:
            what = (f"segment {last.number + 1} is missing" if ack_segment == last.number + 1 else
                    f"segments {last.number + 1}..{ack_segment} are missing")
            return Damage(last.number + 1, 0, 0, expected, acked, "gap", f"{what}: the journal ends at seq "
                          f"{expected - 1} in segment {last.number}, but a receipt covered seq {acked} in segment "
                          f"{ack_segment}", why, tick=self.last_tick, missing=True, through=ack_segment)
        return Damage(last.number, last.size, last.size, expected, acked, "gap",
                      f"the journal ends at seq {expected - 1}, but a receipt covered seq {acked}", why,
                      tick=self.last_tick)

    def _header(self, info: SegmentInfo, data: bytes, expected: int | None, is_last: bool) -> SegmentHeader | None:
        """The segment's header, or one rebuilt from its records when it is destroyed
        (recorded as ``Damage(header=True)``); None for a torn tail: the last segment,
        holding no records, that the acknowledged mark does not reach (a crash cut its
        creation short). Where the mark reaches it, its lost header is damage."""
        err = info.header_error
        if err is None:
            return info.header
        what = f"segment header: {err}"
        ack = self.acknowledged
        reached = ack is not None and (ack[0] >= info.number if expected is None else expected <= self.acked_seq)
        if is_last and len(data) <= HEADER_BYTES and not reached:
            self._tail_problem(info, 0, err.kind if err.kind != "corrupt" else "torn", what)
            info.valid_end = 0
            return None
        found = (find_frame(data, HEADER_BYTES, HEADER_BYTES, expected if expected is not None else 1,
                            unbounded=expected is None) if len(data) > HEADER_BYTES else None)
        # it opens a checkpoint when its first record is the Checkpoint, or, that record lost
        # too, a part or the end of one (a checkpoint lies whole in its own segment)
        cp = found is not None and (isinstance(found[1], (CheckpointPart, CheckpointEnd)) or (
            found[0] == HEADER_BYTES and isinstance(found[1], Checkpoint)))
        # the first segment read starts at its first valid record; when bytes before that
        # record are bad, at the seq the checkpoint's end names as its beginning, else at
        # least one record earlier (the bad bytes held one record or more)
        base = expected if expected is not None else (
            (_checkpoint_begin(data, found[0]) if cp and found[0] > HEADER_BYTES else None)
            or (found[3] - (found[0] > HEADER_BYTES) or 1) if found else 1)
        why = "records follow it" if found is not None else f"a receipt covered seq {self.acked_seq}"
        self._damage(Damage(info.number, 0, HEADER_BYTES, base, base - 1, err.kind, what, why, tick=self.last_tick,
                            header=True, base_seq=base, flags=1 if cp else 0))
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
                                tick=self.last_tick, found=read_what(data, off, p), opens_checkpoint=opens))
            return ("found", p, seq)
        if not is_last:
            d = Damage(info.number, off, n, expected, expected - 1, bad.kind, str(bad), "later segments follow it",
                       tick=self.last_tick, found=read_what(data, off, n), opens_checkpoint=opens)
            self._damage(d)
            return ("pending", d)
        if expected <= self.acked_seq:
            self._damage(Damage(info.number, off, n, expected, self.acked_seq, bad.kind, str(bad),
                                f"at or before the acknowledged seq {self.acked_seq}", tick=self.last_tick,
                                found=read_what(data, off, n), opens_checkpoint=opens))
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


def _checkpoint_begin(data: bytes, off: int) -> int | None:
    """The seq of the Checkpoint record that a ``CheckpointEnd`` at or after ``off`` in
    ``data`` names as its beginning (None when no valid end is found)."""
    while off < len(data):
        try:
            record, _, _, off = decode_frame(data, off)
        except FrameError:
            got = find_frame(data, off, off + 1, 1, unbounded=True)
            if got is None:
                return None
            off = got[0]
            continue
        if isinstance(record, CheckpointEnd):
            return record.begin_seq or None
    return None
