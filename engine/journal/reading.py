"""Read-only looks at a journal: ``verify``, ``read_table``, ``dump``.

Owns: what ``aotx journal verify`` checks and reports (every header, CRC and
sequence number; the damage a crash does not explain, a torn tail, the gaps an
earlier salvage recorded) and the table ``aotx conversations list|show`` read.
Nothing here changes a file or takes the writer lock. Leaves to others: the scan
(``segments.py``), changing anything (``recovery.py``, ``salvage.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from aotx.engine.journal.conversations import ConversationTable, Receipt
from aotx.engine.journal.damage import Damage, Entry, Problem
from aotx.engine.journal.records import Gap
from aotx.engine.journal.segments import JournalScan


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
    is only true when no engine is running. Damage the scan meets is replayed as the
    ``Gap`` salvage would write in its place, so the table is the one the engine's
    start will rebuild (a checkpoint whose opening record is damaged still loads its
    parts). Returns the table and the first problem (None for a clean journal)."""
    scan = JournalScan(directory)
    table = ConversationTable()
    seen = 0
    for e in scan.entries():
        seen = _replay_damage(table, scan.damage, seen)
        table.apply(e.record, e.seq, e.tick)
        table.note_receipt(Receipt(e.segment, e.end, e.seq))
    _replay_damage(table, scan.damage, seen)
    table.finish_recovery()
    return table, scan.problem


def _replay_damage(table: ConversationTable, damage: list[Damage], seen: int) -> int:
    """Apply a ``Gap`` for each damage from ``damage[seen:]`` that lost records (as
    salvage writes one); returns how many damages have been looked at."""
    for dm in damage[seen:]:
        if dm.n_lost and dm.first_lost > table.last_seq:
            affected = [{k: v for k, v in f.items() if k in ("conv_id", "msg_id", "type")} for f in dm.found]
            table.apply(Gap(last_seq=dm.last_lost, segment=dm.segment, offset=dm.offset, nbytes=dm.end - dm.offset,
                            reason=dm.message[:200], affected=affected, opens_checkpoint=dm.opens_checkpoint),
                        dm.first_lost, dm.tick)
    return len(damage)


def dump(directory: str | os.PathLike) -> Iterator[Entry]:
    """Every valid record of the live chain in order, across damage (``verify``
    reports it). Reads only."""
    yield from JournalScan(directory).entries()

