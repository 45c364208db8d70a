"""Recovery, verification, dump and offline compaction of a journal directory.

Owns: what happens to a journal at start (``recover``: replay every good
record into a ``ConversationTable``, cut a torn tail, refuse damage it cannot
explain), the read-only checks behind ``aotx journal verify`` and ``dump``,
and ``compact`` (a Checkpoint of the live conversations replaces the older
segments). Leaves to others: the scan itself (``segments.py``), appending
(``writer.py``).

Policy. A problem in the last segment with nothing after it (a torn, zeroed
or corrupt tail, or a segment whose header a crash cut short) is what a crash
leaves: ``recover`` cuts it off (truncate + fsync) and says so in the report.
Anything else (damage before the last segment, a missing segment, a broken
checkpoint) is not explained by a crash; ``recover`` raises ``JournalError``
naming segment and offset and changes nothing, unless ``repair=True``: then it
cuts the journal at the problem and renames every file it would lose to
``*.damaged`` (nothing is deleted). A segment of a newer format version is
always refused.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import msgspec

from aotx.engine.errors import JournalError
from aotx.engine.journal.conversations import ConversationTable, Receipt
from aotx.engine.journal.directory import DirLock, remove_older_segments
from aotx.engine.journal.records import (
    FLAG_CHECKPOINT, HEADER_BYTES, Checkpoint, encode_frame, encode_segment_header,
)
from aotx.engine.journal.segments import (
    DAMAGED_SUFFIX, TMP_SUFFIX, Entry, JournalScan, Problem, fsync_dir, list_segments, segment_name,
)


@dataclass
class RecoveryReport:
    """What ``recover`` found and did. ``segments``: numbers of the live chain,
    ``next_seq``: the seq the next record gets; ``bytes_dropped``: bytes cut off
    the tail; ``problem``: one line describing what was cut or moved aside, or
    None for a clean journal; ``records``: the entries, when asked for."""

    table: ConversationTable
    n_records: int = 0
    last_seq: int = 0
    last_tick: int = 0
    next_seq: int = 1
    segments: list[int] = field(default_factory=list)
    superseded: list[int] = field(default_factory=list)
    bytes_dropped: int = 0
    problem: str | None = None
    detail: Problem | None = None
    moved_aside: list[str] = field(default_factory=list)
    interrupted: list[str] = field(default_factory=list)  # msg_ids marked interrupted
    records: list[Entry] = field(default_factory=list)

    def summary(self) -> str:
        """One line for the engine's log."""
        s = (f"journal: {len(self.table.live())} conversations, {self.n_records} records up to seq "
             f"{self.last_seq} from {len(self.segments)} segment(s)")
        if self.interrupted:
            s += f"; {len(self.interrupted)} interrupted repl{'y' if len(self.interrupted) == 1 else 'ies'}"
        if self.bytes_dropped:
            s += f"; dropped {self.bytes_dropped} bytes"
        if self.problem:
            s += f" ({self.problem})"
        return s

    def to_dict(self) -> dict[str, Any]:
        return {"conversations": len(self.table.live()), "records": self.n_records, "last_seq": self.last_seq,
                "last_tick": self.last_tick, "next_seq": self.next_seq, "segments": self.segments,
                "superseded": self.superseded, "bytes_dropped": self.bytes_dropped, "problem": self.problem,
                "detail": msgspec.to_builtins(self.detail), "moved_aside": self.moved_aside,
                "interrupted": self.interrupted}


def recover(directory: str | os.PathLike, *, repair: bool = False, keep_records: bool = False) -> RecoveryReport:
    """Recover the journal in ``directory`` (see the module docstring for the policy).

    Takes the directory lock (``JournalError`` while an engine holds it).
    ``keep_records`` fills ``report.records`` with every entry (memory grows with
    the journal; for tests and tools). Raises ``JournalError`` for damage a crash
    does not explain (unless ``repair``) and for a newer format version."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    lock = DirLock(d)
    try:
        return recover_locked(d, repair=repair, keep_records=keep_records)
    finally:
        lock.release()


def _move_aside(path: Path) -> str:
    dest = path.with_name(f"{path.name}.{int(time.time())}{DAMAGED_SUFFIX}")
    os.rename(path, dest)
    return dest.name


def recover_locked(d: Path, *, repair: bool = False, keep_records: bool = False) -> RecoveryReport:
    """``recover`` for a caller that already holds the directory lock."""
    changed = False
    for p in d.iterdir():  # a compaction that crashed before its rename
        if p.name.endswith(".seg" + TMP_SUFFIX):
            p.unlink()
            changed = True
    scan = JournalScan(d)
    table = ConversationTable()
    records: list[Entry] = []
    for e in scan.entries():
        table.apply(e.record, e.seq, e.tick)
        table.note_receipt(Receipt(e.segment, e.end, e.seq))
        if keep_records:
            records.append(e)
    report = RecoveryReport(table=table, n_records=scan.n_records, last_seq=scan.last_seq,
                            last_tick=scan.last_tick, superseded=scan.superseded, records=records)
    segs = list(scan.segments)
    p = scan.problem
    if p is not None:
        report.detail = p
        if p.kind == "version":
            raise JournalError(f"journal {d}: {p}")
        seg = segs[scan.problem_index] if scan.problem_index < len(segs) else None
        broken_checkpoint = (seg is not None and seg.header is not None and seg.header.checkpoint
                             and p.offset <= HEADER_BYTES)
        if scan.problem_at_tail and not broken_checkpoint and (p.offset > 0 or p.kind == "torn"):
            report.bytes_dropped = _cut(d, seg, p)
            if p.offset == 0:
                segs.pop()
            report.problem = f"cut a {p.kind} tail at {p}; {report.bytes_dropped} bytes dropped"
            changed = True
        elif not repair:
            later = f"; segments after it: {scan.later}" if scan.later else ""
            raise JournalError(
                f"journal {d}: {p}{later}. A crash does not explain this, so nothing was changed. "
                "Inspect with `aotx journal verify`; recovery with repair=True (`aotx journal repair`) cuts the "
                "journal there and keeps every file it would lose as *.damaged")
        else:
            segs = segs[:scan.problem_index + 1]
            if seg is not None:
                if p.offset == 0 or broken_checkpoint:
                    report.moved_aside.append(_move_aside(Path(seg.path)))
                    report.bytes_dropped += seg.size
                    segs.pop()
                else:
                    copy = Path(seg.path).with_name(f"{Path(seg.path).name}.{int(time.time())}{DAMAGED_SUFFIX}")
                    shutil.copyfile(seg.path, copy)
                    report.moved_aside.append(copy.name)
                    report.bytes_dropped += _cut(d, seg, p)
            for n in scan.later:
                path = d / segment_name(n)
                report.bytes_dropped += path.stat().st_size
                report.moved_aside.append(_move_aside(path))
            report.problem = f"repaired at {p}; moved aside: {', '.join(report.moved_aside)}"
            changed = True
            if broken_checkpoint:  # the segments the checkpoint superseded form the journal again
                fsync_dir(d)
                again = recover_locked(d, repair=True, keep_records=keep_records)
                again.moved_aside[:0] = report.moved_aside
                again.bytes_dropped += report.bytes_dropped
                again.problem = report.problem + (f"; then {again.problem}" if again.problem else "")
                again.detail = again.detail or report.detail
                return again
    if changed:
        fsync_dir(d)
    report.segments = [s.number for s in segs]
    report.next_seq = scan.next_seq if segs else scan.last_seq + 1
    if segs and not scan.last_seq and segs[0].header is not None:
        report.next_seq = segs[0].header.base_seq
    report.interrupted = [m.msg_id for m in table.finish_recovery()]
    return report


def _cut(d: Path, seg, p: Problem) -> int:
    """Truncate ``seg`` where its good data ends (unlink it when its header is bad); fsync."""
    path = Path(seg.path)
    if p.offset == 0:
        path.unlink()
        return seg.size
    end = seg.valid_end
    with open(path, "r+b") as f:
        f.truncate(end)
        f.flush()
        os.fsync(f.fileno())
    return seg.size - end


# ---- read-only tools -------------------------------------------------------------------

@dataclass
class VerifyReport:
    """Result of ``verify``: ``ok`` when every record of every live segment checks."""

    ok: bool
    segments: list[int]
    superseded: list[int]
    n_records: int
    last_seq: int
    bytes: int  # total size of the live segments
    problem: Problem | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "segments": self.segments, "superseded": self.superseded,
                "records": self.n_records, "last_seq": self.last_seq, "bytes": self.bytes,
                "problem": msgspec.to_builtins(self.problem)}


def verify(directory: str | os.PathLike) -> VerifyReport:
    """Check every header, record CRC and sequence number; report the first problem
    with its segment and byte offset. Reads only; never raises for damage."""
    scan = JournalScan(directory)
    for _ in scan.entries():
        pass
    return VerifyReport(ok=scan.problem is None, segments=[s.number for s in scan.segments],
                        superseded=scan.superseded, n_records=scan.n_records, last_seq=scan.last_seq,
                        bytes=sum(s.size for s in scan.segments), problem=scan.problem)


def read_table(directory: str | os.PathLike) -> tuple[ConversationTable, Problem | None]:
    """Replay the good records into a new table without changing any file or
    taking the lock (for tools). Unfinished replies are marked interrupted, which
    is only true when no engine is running. Returns the table and the first
    problem (None for a clean journal)."""
    scan = JournalScan(directory)
    table = ConversationTable()
    for e in scan.entries():
        table.apply(e.record, e.seq, e.tick)
        table.note_receipt(Receipt(e.segment, e.end, e.seq))
    table.finish_recovery()
    return table, scan.problem


def dump(directory: str | os.PathLike) -> Iterator[Entry]:
    """Every good record of the live chain in order, stopping silently at the first
    problem (``verify`` reports it). Reads only."""
    yield from JournalScan(directory).entries()


# ---- offline compaction --------------------------------------------------------------

@dataclass
class CompactReport:
    segment: int | None  # the new checkpoint segment, None when there was nothing to compact
    covers_seq: int
    conversations: int  # live conversations kept
    dropped: int  # deleted conversations dropped
    removed: list[int]  # segment numbers removed
    bytes_before: int
    bytes_after: int
    recovery: str  # the recovery summary

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def compact(directory: str | os.PathLike) -> CompactReport:
    """Replace the journal by one checkpoint segment holding the live conversations.

    Runs recovery first (same policy and errors), then writes the checkpoint to
    ``NNN.seg.tmp``, fsyncs it, renames it into place, fsyncs the directory,
    and only then removes the older segments (fsync again). A crash at any
    point leaves a journal that recovers to the same conversations. Takes the
    directory lock: ``JournalError`` while an engine runs (use
    ``Journal.checkpoint`` there)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    lock = DirLock(d)
    try:
        rep = recover_locked(d)
        before = sum(p.stat().st_size for _, p in list_segments(d))
        table = rep.table
        dropped = sum(1 for c in table.conversations.values() if c.deleted)
        if not rep.n_records:
            return CompactReport(None, rep.last_seq, 0, 0, [], before, before, rep.summary())
        number = max(n for n, _ in list_segments(d)) + 1
        seq = rep.next_seq
        cp = Checkpoint(covers_seq=seq - 1, conversations=table.snapshot(), created_at=time.time())
        final = d / segment_name(number)
        tmp = final.with_name(final.name + TMP_SUFFIX)
        with open(tmp, "wb") as f:
            f.write(encode_segment_header(number, seq, FLAG_CHECKPOINT))
            f.write(encode_frame(cp, rep.last_tick, seq))
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
        fsync_dir(d)
        removed = remove_older_segments(d, number)
        return CompactReport(number, seq - 1, len(cp.conversations), dropped, removed, before,
                             final.stat().st_size, rep.summary())
    finally:
        lock.release()
