"""Offline compaction: one streamed checkpoint of the live conversations replaces the journal.

Owns: ``compact`` (``aotx journal compact``) and ``checkpoint_frames`` (the frames
of a streamed checkpoint of a table, one conversation at a time). Leaves to
others: recovery, which runs first (``recovery.py``), the online checkpoint the
engine streams instead while it runs (``checkpoint_stream.py``), removing the
replaced segments (``directory.py``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aotx.engine.errors import JournalError
from aotx.engine.fileio import OS, FileIO, describe_os_error, write_file
from aotx.engine.journal.conversations import ConversationTable, checkpoint_parts
from aotx.engine.journal.directory import DirLock, remove_older_segments
from aotx.engine.journal.records import FLAG_CHECKPOINT, Checkpoint, CheckpointEnd, encode_frame, encode_segment_header
from aotx.engine.journal.recovery import make_dir, recover_locked
from aotx.engine.journal.segment_files import TMP_SUFFIX, list_segments, segment_name


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
    make_dir(d, fs)
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

