"""Recovery, verification, dump and offline compaction of a journal directory.

Owns: what happens to a journal at start (``recover``: replay every valid
record into a ``ConversationTable``, cut a torn tail, salvage damage), the
read-only checks behind ``aotx journal verify`` and ``dump``, and ``compact``
(a streamed checkpoint of the live conversations replaces the older segments).
Leaves to others: the scan and the tail-versus-damage rule (``segments.py``),
appending (``writer.py``).

Policy. A torn tail (bad bytes at the end of the last segment, none valid after
them, all past the acknowledged point in the ``RECEIPT`` file) is what a crash
leaves: ``recover`` cuts it off (truncate + fsync) and says so. Damage (a bad
record at or before the acknowledged point, a bad record followed by valid
records, a missing segment, a bad header on a segment that holds records) is not
explained by a crash, and acknowledged data is never truncated: ``recover``
keeps a byte-exact copy of each damaged segment (``<segment>.<time>.damaged``,
fsynced), rewrites the segment with a ``Gap`` record in place of the bad bytes
(padded to their length where it fits, so every later record keeps its offset),
keeps every valid record after them, and reports which conversations and
messages the lost records touched (``RecoveryReport.damage``, ``notices()``).
Then the engine starts. A segment of a newer format version is refused and
nothing is changed. ``repair=True`` (``aotx journal repair``) salvages the same
way; it exists for a journal no engine is running on.

Every change goes through the file layer (``fileio``), so the crash-state tests
see each write, fsync, rename and unlink, and every step is crash-safe: the copy
is durable before the rewrite, and the rewrite is a temporary file renamed over
the segment, then the directory is fsynced.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import msgspec

from aotx.engine.errors import JournalError
from aotx.engine.fileio import OS, FileIO, describe_os_error, write_file
from aotx.engine.journal.conversations import ConversationTable, GapNote, Receipt, checkpoint_parts
from aotx.engine.journal.directory import DirLock, remove_older_segments
from aotx.engine.journal.records import (
    FLAG_CHECKPOINT, HEADER_BYTES, Checkpoint, CheckpointEnd, Gap, encode_frame, encode_segment_header, fit_frame,
)
from aotx.engine.journal.segments import (
    DAMAGED_SUFFIX, TMP_SUFFIX, Damage, Entry, JournalScan, Problem, list_segments, read_segment, segment_name,
)

#: how many times recovery rescans after salvaging before it gives up (each pass
#: salvages everything the scan found, so the second scan is clean)
_SALVAGE_PASSES = 4


@dataclass
class RecoveryReport:
    """What ``recover`` found and did. ``segments``: numbers of the live chain,
    ``next_seq``: the seq the next record gets; ``bytes_dropped``: bytes of torn
    tail cut off; ``problem``: one line describing what was cut or salvaged, or
    None for a clean journal; ``damage``: one map per salvaged damage (where, what
    was lost, the copy kept, the conversations and messages affected);
    ``gaps``: every ``Gap`` in the journal (this salvage's and earlier ones');
    ``records``: the entries, when asked for."""

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
    damage: list[dict[str, Any]] = field(default_factory=list)
    gaps: list[GapNote] = field(default_factory=list)
    acknowledged_seq: int = 0

    def summary(self) -> str:
        """One line for the engine's log."""
        s = (f"journal: {len(self.table.live())} conversations, {self.n_records} records up to seq "
             f"{self.last_seq} from {len(self.segments)} segment(s)")
        if self.interrupted:
            s += f"; {len(self.interrupted)} interrupted repl{'y' if len(self.interrupted) == 1 else 'ies'}"
        if self.bytes_dropped:
            s += f"; dropped {self.bytes_dropped} bytes of torn tail"
        if self.damage:
            lost = sum(d["n_lost"] for d in self.damage)
            s += (f"; DAMAGE salvaged in {len(self.damage)} place(s), {lost} record(s) lost, every valid record "
                  f"after the damage kept (copies: {', '.join(sorted({d['copy'] for d in self.damage if d['copy']}))})")
        if self.problem and not self.damage:
            s += f" ({self.problem})"
        return s

    def notices(self) -> list[str]:
        """One line per salvaged damage for the user: where, what was lost, which
        conversations and messages it touched, where the copy is."""
        return [damage_notice(d) for d in self.damage]

    def to_dict(self) -> dict[str, Any]:
        return {"conversations": len(self.table.live()), "records": self.n_records, "last_seq": self.last_seq,
                "last_tick": self.last_tick, "next_seq": self.next_seq, "segments": self.segments,
                "superseded": self.superseded, "bytes_dropped": self.bytes_dropped, "problem": self.problem,
                "detail": msgspec.to_builtins(self.detail), "moved_aside": self.moved_aside,
                "interrupted": self.interrupted, "damage": self.damage,
                "gaps": msgspec.to_builtins(self.gaps), "acknowledged_seq": self.acknowledged_seq}


def damage_notice(d: dict[str, Any]) -> str:
    """One line for a salvaged damage (a ``RecoveryReport.damage`` map)."""
    convs: dict[str, list[str]] = {}
    for a in d.get("affected", []):
        key = a["conv_id"] if not a.get("title") else f"“{a['title']}” ({a['conv_id']})"
        msgs = convs.setdefault(key, [])
        if a.get("msg_id") and a["msg_id"] not in msgs:
            msgs.append(a["msg_id"])
    who = "; ".join(f"{k}: message{'s' if len(v) > 1 else ''} {', '.join(v)}" if v else k for k, v in convs.items())
    lost = d["n_lost"]
    what = ("no record lost" if not lost else f"{lost} record{'s' if lost > 1 else ''} lost (seq {d['first_lost']}"
            + (f"..{d['last_lost']}" if lost > 1 else "") + ")")
    where = (f"segment {d['segment']} was missing" if d.get("missing") else
             f"segment {d['segment']} bytes {d['offset']}..{d['end']}")
    return (f"journal damage in {where} ({d['message']}; {d['why']}): {what}; "
            + (f"affected: {who}" if who else "no conversation could be named")
            + (f"; byte-exact copy kept as {d['copy']}" if d.get("copy") else "")
            + "; every valid record after it was kept")


def recover(directory: str | os.PathLike, *, repair: bool = False, keep_records: bool = False,
            fs: FileIO = OS) -> RecoveryReport:
    """Recover the journal in ``directory`` (see the module docstring for the policy).

    Takes the directory lock (``JournalError`` while an engine holds it). ``repair``
    is what ``aotx journal repair`` passes; the policy is the same either way (a torn
    tail is cut, damage salvaged), so it changes nothing and is kept for callers.
    ``keep_records`` fills ``report.records`` with every entry (memory grows with
    the journal; for tests and tools). Raises ``JournalError`` for a newer format
    version and for a directory or segment that cannot be read or written."""
    d = Path(directory)
    _mkdir(d, fs)
    lock = DirLock(d)
    try:
        return recover_locked(d, repair=repair, keep_records=keep_records, fs=fs)
    finally:
        lock.release()


def _mkdir(d: Path, fs: FileIO) -> None:
    try:
        fs.mkdir(d)
    except OSError as e:
        raise JournalError(f"cannot create the journal directory {d}: {describe_os_error(e)}") from None


def _replay(d: Path, keep_records: bool) -> tuple[JournalScan, ConversationTable, list[Entry]]:
    scan = JournalScan(d)
    table = ConversationTable()
    records: list[Entry] = []
    for e in scan.entries():
        table.apply(e.record, e.seq, e.tick)
        table.note_receipt(Receipt(e.segment, e.end, e.seq))
        if keep_records:
            records.append(e)
    return scan, table, records


def recover_locked(d: Path, *, repair: bool = False, keep_records: bool = False, fs: FileIO = OS) -> RecoveryReport:
    """``recover`` for a caller that already holds the directory lock."""
    try:
        return _recover_locked(d, keep_records, fs)
    except OSError as e:
        raise JournalError(f"cannot recover the journal in {d}: {describe_os_error(e)} writing "
                           f"{e.filename or d}; nothing a receipt covered was changed") from None


def _recover_locked(d: Path, keep_records: bool, fs: FileIO) -> RecoveryReport:
    changed = False
    for p in d.iterdir():  # a compaction or salvage that crashed before its rename
        if p.name.endswith(".seg" + TMP_SUFFIX):
            fs.unlink(p)
            changed = True
    salvaged: list[tuple[Damage, str]] = []
    first_problem: Problem | None = None
    for attempt in range(_SALVAGE_PASSES):
        scan, table, records = _replay(d, keep_records)
        if scan.version_problem is not None:
            raise JournalError(f"journal {d}: {scan.version_problem}; nothing was changed")
        if first_problem is None:
            first_problem = scan.problem
        if not scan.damage:
            break
        if attempt == _SALVAGE_PASSES - 1:
            raise JournalError(f"journal {d}: salvage did not converge ({scan.damage[0]}); nothing acknowledged was "
                               "removed, the copies are kept as *.damaged")
        salvaged += _salvage(d, scan, fs)
        changed = True
    report = RecoveryReport(table=table, n_records=scan.n_records, last_seq=scan.last_seq,
                            last_tick=scan.last_tick, superseded=scan.superseded, records=records,
                            acknowledged_seq=scan.acked_seq)
    report.detail = first_problem
    segs = [s.number for s in scan.segments]
    if scan.tail is not None:
        p = scan.tail
        info = next(s for s in scan.segments if s.number == p.segment)
        report.bytes_dropped = _cut(d, info, p.offset, fs)
        if p.offset == 0:
            segs.remove(p.segment)
        report.problem = f"cut a {p.kind} tail at {p}; {report.bytes_dropped} bytes dropped"
        changed = True
    if salvaged:
        report.damage = _damage_reports(salvaged, table)
        report.moved_aside = sorted({c for _, c in salvaged if c})
        report.problem = "; ".join(str(dm) for dm, _ in salvaged)
    if changed:
        fs.fsync_dir(d)
    report.gaps = list(table.gaps)
    report.segments = segs
    report.next_seq = scan.next_seq
    report.interrupted = [m.msg_id for m in table.finish_recovery()]
    return report


def _damage_reports(salvaged: list[tuple[Damage, str]], table: ConversationTable) -> list[dict[str, Any]]:
    """One map per salvaged damage, with what it affected: the records read past the
    failed CRC, and what the replay after the salvage met after its ``Gap``."""
    by_first = {g.first_seq: g for g in table.gaps}
    out = []
    for dm, copy in salvaged:
        note = by_first.get(dm.first_lost)
        affected: list[dict[str, Any]] = []
        seen = set()
        hints = []
        for f in dm.found:
            f = dict(f)
            if "conv_id" not in f:  # a damaged key: match the record's strings to known ids
                for v in f.get("strings", []):
                    if v in table.conversations:
                        f["conv_id"] = v
                        break
            if "conv_id" in f and "msg_id" not in f and f["conv_id"] in table.conversations:
                ids = {m.msg_id for m in table.conversations[f["conv_id"]].messages}
                f.update({"msg_id": v for v in f.get("strings", []) if v in ids})
            if "conv_id" in f:
                hints.append({"conv_id": f["conv_id"], **({"msg_id": f["msg_id"]} if f.get("msg_id") else {}),
                              "what": f"its {f['type']} record was lost"})
        for a in hints + (note.affected if note is not None else []):
            key = (a.get("conv_id"), a.get("msg_id"))
            if key in seen or not a.get("conv_id"):
                continue
            seen.add(key)
            c = table.conversations.get(a["conv_id"])
            entry = {"conv_id": a["conv_id"], "what": a.get("what", "")}
            if a.get("msg_id"):
                entry["msg_id"] = a["msg_id"]
            if c is not None and c.title:
                entry["title"] = c.title
            affected.append(entry)
        out.append({"segment": dm.segment, "offset": dm.offset, "end": dm.end, "nbytes": dm.end - dm.offset,
                    "kind": dm.kind, "message": dm.message, "why": dm.why, "first_lost": dm.first_lost,
                    "last_lost": dm.last_lost, "n_lost": dm.n_lost, "missing": dm.missing, "copy": copy,
                    "affected": affected})
    return out


def _copy_name(path: Path, data: bytes) -> tuple[Path, bool]:
    """Where the byte-exact copy of ``path`` goes, and whether an identical copy is
    already there (a salvage that crashed before its rewrite leaves one)."""
    for p in sorted(path.parent.glob(path.name + ".*" + DAMAGED_SUFFIX)):
        try:
            if p.stat().st_size == len(data) and p.read_bytes() == data:
                return p, True
        except OSError:
            continue
    stamp = int(time.time())
    dest = path.with_name(f"{path.name}.{stamp}{DAMAGED_SUFFIX}")
    k = 1
    while dest.exists():
        dest = path.with_name(f"{path.name}.{stamp}-{k}{DAMAGED_SUFFIX}")
        k += 1
    return dest, False


def _salvage(d: Path, scan: JournalScan, fs: FileIO) -> list[tuple[Damage, str]]:
    """Rewrite every damaged segment with ``Gap`` records in place of its bad bytes
    (after a fsynced byte-exact copy) and create missing segments. Returns each
    damage with the name of the copy kept ("" when there was nothing to copy)."""
    out: list[tuple[Damage, str]] = []
    infos = {s.number: s for s in scan.segments}
    by_segment: dict[int, list[Damage]] = {}
    for dm in scan.damage:
        if dm.missing:
            _create_missing(d, dm, fs)
            out.append((dm, ""))
        else:
            by_segment.setdefault(dm.segment, []).append(dm)
    for number, damages in by_segment.items():
        info = infos[number]
        path = Path(info.path)
        data = read_segment(path)
        copy, exists = _copy_name(path, data)
        if not exists:
            write_file(fs, copy, [data], exclusive=True)
            fs.fsync_dir(d)
        tmp = path.with_name(path.name + TMP_SUFFIX)
        write_file(fs, tmp, _rebuild(data, damages, copy.name))
        fs.replace(tmp, path)
        fs.fsync_dir(d)
        out += [(dm, copy.name) for dm in damages]
    return out


def copy_name(segment: int, created_at: int) -> str:
    """The usual name of the byte-exact copy of ``segment`` made at ``created_at``
    (a Gap record leaves its ``copy`` field empty when the copy is named so)."""
    return f"{segment_name(segment)}.{int(created_at)}{DAMAGED_SUFFIX}"


def _gap(dm: Damage, copy: str) -> Gap:
    now = int(time.time())
    if copy:
        try:  # the copy's name holds its time: keep the two equal so the name can be derived
            now = int(copy[len(segment_name(dm.segment)) + 1:-len(DAMAGED_SUFFIX)])
        except ValueError:
            pass
    return Gap(last_seq=dm.last_lost, segment=dm.segment, offset=dm.offset, nbytes=dm.end - dm.offset,
               copy="" if copy == copy_name(dm.segment, now) else copy,
               reason=dm.message[:200], created_at=now,
               affected=[{k: v for k, v in f.items() if k in ("conv_id", "msg_id", "type")} for f in dm.found],
               opens_checkpoint=dm.opens_checkpoint)


def _gap_frame(dm: Damage, copy: str) -> bytes:
    """The Gap frame for ``dm``: exactly the size of the bad bytes when some form of it
    fits (dropping detail until it does: what it affected, the reason, where the bad
    bytes were, the time that names the copy), so that every later record keeps its offset and every receipt stays
    exact; else the full record (later offsets in the segment move)."""
    gap = _gap(dm, copy)
    size = dm.end - dm.offset
    for drop in ((), ("affected",), ("affected", "reason"), ("affected", "reason", "offset", "nbytes"),
                 ("affected", "reason", "offset", "nbytes", "created_at", "copy"),
                 ("affected", "reason", "offset", "nbytes", "created_at", "copy", "segment")):
        g = msgspec.structs.replace(gap, **{k: type(getattr(gap, k))() for k in drop})
        f = fit_frame(g, dm.tick, dm.first_lost, size)
        if f is not None:
            return f
    return encode_frame(gap, dm.tick, dm.first_lost)


def _rebuild(data: bytes, damages: list[Damage], copy: str) -> list[bytes]:
    """The segment's new bytes: its header (rebuilt when damaged), its valid bytes,
    and a Gap frame wherever records were lost (sized to the bad bytes when it fits)."""
    from aotx.engine.journal.records import decode_segment_header

    header = data[:HEADER_BYTES]
    try:
        h = decode_segment_header(header)
        number, base, flags = h.number, h.base_seq, h.flags
    except Exception:  # noqa: BLE001 - a damaged header is rebuilt below
        number, base, flags = 0, 1, 0
    pieces: list[bytes] = []
    cursor = HEADER_BYTES
    rebuilt = False
    for dm in sorted(damages, key=lambda x: (x.offset, not x.header, not x.prefix)):
        number = dm.segment
        if dm.header:
            base, flags, rebuilt = dm.base_seq, dm.flags, True
            continue
        if dm.prefix:
            base, rebuilt = dm.first_lost, True
        pieces.append(data[cursor:dm.offset])
        if dm.n_lost:
            pieces.append(_gap_frame(dm, copy))
        cursor = max(cursor, dm.end)
    pieces.append(data[cursor:])
    head = encode_segment_header(number, base, flags) if rebuilt else header
    return [head] + [p for p in pieces if p]


def _create_missing(d: Path, dm: Damage, fs: FileIO) -> None:
    """Segment files ``dm.segment .. dm.through`` are gone: create them, the first
    holding a Gap for the records lost with them, the rest empty."""
    for n in range(dm.segment, max(dm.through, dm.segment) + 1):
        if n == dm.segment:
            chunks = [encode_segment_header(n, dm.first_lost)]
            if dm.n_lost:
                chunks.append(encode_frame(_gap(dm, ""), dm.tick, dm.first_lost))
        else:
            chunks = [encode_segment_header(n, dm.last_lost + 1)]
        write_file(fs, d / segment_name(n), chunks, exclusive=True)
    fs.fsync_dir(d)


def _cut(d: Path, seg, offset: int, fs: FileIO) -> int:
    """Truncate ``seg`` at ``offset`` (unlink it when its header is bad); fsync."""
    path = Path(seg.path)
    size = path.stat().st_size
    if offset == 0:
        fs.unlink(path)
        return size
    fd = fs.open(path, os.O_WRONLY)
    try:
        fs.ftruncate(fd, offset)
        fs.fsync(fd)
    finally:
        fs.close(fd)
    return size - offset


# ---- read-only tools -------------------------------------------------------------------

@dataclass
class VerifyReport:
    """Result of ``verify``: ``ok`` when every record of every live segment checks.
    ``damage``: what a crash does not explain (recovery would salvage it);
    ``tail``: a torn tail (recovery would cut it); ``gaps``: records an earlier
    salvage recorded as lost (the journal reads clean, and says what it lost)."""

    ok: bool
    segments: list[int]
    superseded: list[int]
    n_records: int
    last_seq: int
    bytes: int  # total size of the live segments
    problem: Problem | None = None
    damage: list[str] = field(default_factory=list)
    tail: Problem | None = None
    gaps: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "segments": self.segments, "superseded": self.superseded,
                "records": self.n_records, "last_seq": self.last_seq, "bytes": self.bytes,
                "problem": msgspec.to_builtins(self.problem), "damage": self.damage,
                "tail": msgspec.to_builtins(self.tail), "gaps": self.gaps}


def verify(directory: str | os.PathLike) -> VerifyReport:
    """Check every header, record CRC and sequence number; report the first problem
    with its segment and byte offset, and every damage. Reads only; raises
    ``JournalError`` only when a file cannot be read at all."""
    scan = JournalScan(directory)
    table = ConversationTable()
    for e in scan.entries():
        table.apply(e.record, e.seq, e.tick)
    return VerifyReport(ok=scan.problem is None, segments=[s.number for s in scan.segments],
                        superseded=scan.superseded, n_records=scan.n_records, last_seq=scan.last_seq,
                        bytes=sum(s.size for s in scan.segments), problem=scan.problem,
                        damage=[str(x) for x in scan.damage], tail=scan.tail,
                        gaps=msgspec.to_builtins(table.gaps))


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
    """Every valid record of the live chain in order, across damage (``verify``
    reports it). Reads only."""
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
    parts: int = 0  # CheckpointPart records written
    end_seq: int = 0  # seq of the CheckpointEnd (the next record gets end_seq + 1)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def checkpoint_frames(table: ConversationTable, tick: int, seq: int, *, part_bytes: int = 1 << 20):
    """The frames of a streamed checkpoint of ``table`` numbered from ``seq``: the
    opening Checkpoint, one or more CheckpointPart per live conversation, the
    CheckpointEnd. A generator: one conversation is encoded at a time, so memory
    stays bounded by the largest conversation, not the table. Yields bytes; the
    generator's return value (``StopIteration.value``) is ``(n_parts, last_seq)``."""
    live = table.live()
    begin = seq
    yield encode_frame(Checkpoint(covers_seq=table.last_seq, created_at=time.time(), streamed=True,
                                  n_conversations=len(live)), tick, seq)
    n_parts = 0
    for c in live:
        for part in checkpoint_parts(c, part_bytes):
            seq += 1
            n_parts += 1
            yield encode_frame(part, tick, seq)
    seq += 1
    yield encode_frame(CheckpointEnd(begin_seq=begin, n_conversations=len(live), n_parts=n_parts), tick, seq)
    return n_parts, seq


def compact(directory: str | os.PathLike, *, fs: FileIO = OS) -> CompactReport:
    """Replace the journal by one checkpoint segment holding the live conversations.

    Runs recovery first (same policy), then streams the checkpoint into
    ``NNN.seg.tmp`` one conversation at a time (any size, bounded memory), fsyncs
    it, renames it into place, fsyncs the directory, and only then removes the
    older segments (fsync again). A crash at any point leaves a journal that
    recovers to the same conversations. Takes the directory lock: ``JournalError``
    while an engine runs (the engine checkpoints online instead)."""
    d = Path(directory)
    _mkdir(d, fs)
    lock = DirLock(d)
    try:
        rep = recover_locked(d, fs=fs)
        before = sum(p.stat().st_size for _, p in list_segments(d))
        table = rep.table
        dropped = sum(1 for c in table.conversations.values() if c.deleted)
        if not rep.n_records:
            return CompactReport(None, rep.last_seq, 0, 0, [], before, before, rep.summary())
        number = max(n for n, _ in list_segments(d)) + 1
        seq = rep.next_seq
        final = d / segment_name(number)
        tmp = final.with_name(final.name + TMP_SUFFIX)
        frames = checkpoint_frames(table, rep.last_tick, seq)
        result: dict[str, int] = {}

        def chunks():
            yield encode_segment_header(number, seq, FLAG_CHECKPOINT)
            result["parts"], result["last"] = yield from frames

        try:
            write_file(fs, tmp, chunks())
            fs.replace(tmp, final)
            fs.fsync_dir(d)
            removed = remove_older_segments(d, number, fs)
        except OSError as e:
            raise JournalError(f"journal {d}: compaction failed ({describe_os_error(e)}); the journal is unchanged"
                               ) from None
        return CompactReport(number, seq - 1, len(table.live()), dropped, removed, before, final.stat().st_size,
                             rep.summary(), parts=result.get("parts", 0), end_seq=result.get("last", 0))
    finally:
        lock.release()
