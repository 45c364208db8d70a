"""Recovery: what happens to a journal at start.

Owns: ``recover`` (replay every valid record into a ``ConversationTable``, cut a
torn tail, salvage damage, report it) and the report's words (``RecoveryReport``:
one line for the engine's log, one notice per damage for users). Leaves to
others: ordering the segments and the tail-versus-damage rule (``chain.py``,
``segments.py``), the repairs themselves (``salvage.py``), read-only looks
(``reading.py``), compaction (``compaction.py``), appending (``writer.py``).

Policy. A torn tail (bad bytes at the end of the last segment, none valid after
them, all past the acknowledged mark) is what a crash leaves: ``recover`` cuts it
off (truncate + fsync) and says so. Damage (a bad record at or before the
acknowledged mark, a bad record followed by valid records, a missing, misplaced
or repeated segment, a bad header on a segment that holds records or that the
mark reaches) is not explained by a crash, and acknowledged data is never
truncated: ``recover`` keeps a byte-exact copy of each damaged segment
(``<segment>.<time>.damaged``, fsynced), rewrites the segment with a ``Gap``
record in place of the bad bytes, keeps every valid record after them, puts
renamed segments back under their own names, and reports which conversations
and messages the lost records touched (``RecoveryReport.damage``, ``notices()``).
A conversation whose creation was lost is rebuilt from its later records and
marked salvaged (``conversations.py``). Then the engine starts. A segment of a
newer format version is refused and nothing is changed. ``repair=True``
(``aotx journal repair``) salvages the same way; it exists for a journal no
engine is running on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from aotx.engine.errors import JournalError
from aotx.engine.fileio import OS, FileIO, describe_os_error
from aotx.engine.journal.conversations import ConversationTable, GapNote, Receipt
from aotx.engine.journal.damage import Damage, Entry, Problem
from aotx.engine.journal.directory import DirLock
from aotx.engine.journal.salvage import cut, salvage
from aotx.engine.journal.segment_files import TMP_SUFFIX
from aotx.engine.journal.segment_files import segment_name as segment_file
from aotx.engine.journal.segments import JournalScan

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
    append_segment: int | None = None  # the segment the writer appends to (None: it starts a new one)

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
    kind = d.get("kind")
    if kind == "misplaced":
        return (f"journal damage: {d['message']} ({d['why']}): no record lost; renamed back to "
                f"{segment_file(d['segment'])}")
    if kind == "duplicate":
        return (f"journal damage: {d['message']} ({d['why']}): no record lost; the repeat was moved aside as "
                f"{d['copy']}")
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
    make_dir(d, fs)
    lock = DirLock(d)
    try:
        return recover_locked(d, repair=repair, keep_records=keep_records, fs=fs)
    finally:
        lock.release()


def make_dir(d: Path, fs: FileIO) -> None:
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
        salvaged += salvage(d, scan, fs)
        changed = True
    report = RecoveryReport(table=table, n_records=scan.n_records, last_seq=scan.last_seq,
                            last_tick=scan.last_tick, superseded=scan.superseded, records=records,
                            acknowledged_seq=scan.acked_seq)
    report.detail = first_problem
    segs = [s.number for s in scan.segments]
    if scan.tail is not None:
        p = scan.tail
        info = next(s for s in scan.segments if s.number == p.segment)
        report.bytes_dropped = cut(d, info, p.offset, fs)
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
    last = scan.segments[-1] if scan.segments and scan.segments[-1].number in segs else None
    # appended to only when its file is named for it (a misplaced one that could not be
    # renamed back is read in its place, but new records go to a new segment)
    report.append_segment = last.number if last is not None and last.file_number == last.number else None
    report.next_seq = scan.next_seq
    report.interrupted = [m.msg_id for m in table.finish_recovery()]
    return report


def _readable(a: dict[str, Any], table: ConversationTable) -> dict[str, Any]:
    """``a`` without the ids that a damaged record's bytes misread: an id read past a failed
    checksum may be damaged itself, so one naming no conversation (or no message of it)
    is left out, unless the lost record is the one that made it."""
    t = a.get("type", "")
    conv = table.conversations.get(a.get("conv_id", ""))
    if conv is None and t and t != "ConversationCreated":
        return {}
    if a.get("msg_id") and t and t != "MessageAccepted" and (conv is None or conv.message(a["msg_id"]) is None):
        a = {k: v for k, v in a.items() if k != "msg_id"}
    return a


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
                              "type": f["type"], "what": f"its {f['type']} record was lost"})
        for a in hints + (note.affected if note is not None else []):
            a = _readable(a, table)
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
