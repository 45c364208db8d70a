"""Streamed online checkpoints of the journal: a part of ``Journal``, in a module of its own.

Owns: ``CheckpointRun`` and the ``Journal`` methods that write one
(``begin_checkpoint``, ``checkpoint_step``, ``abort_checkpoint``, ``checkpoint``).
A checkpoint's ``Checkpoint`` record opens a new segment; each step encodes the next
conversations, about ``part_bytes`` at a time, into ``CheckpointPart`` records that
bypass the ring (they reach the drain as a block of their own, so a checkpoint of any
size never needs ring credit and never holds a live record up); the next chunk is
encoded once the previous one is durable, so memory stays bounded. The last step
publishes ``CheckpointEnd``; once it is durable the drain removes the segments
before the checkpoint's. Leaves to others: the ring, sequence numbers and the drain
(``writer.py``), the parts' contents (``conversations.checkpoint_parts``).
"""

from __future__ import annotations

import time
from collections import deque

import google_crc32c

from aotx.engine.errors import JournalError
from aotx.engine.journal.blocks import Block
from aotx.engine.journal.conversations import ConversationTable, checkpoint_parts
from aotx.engine.journal.records import (
    CRC, FRAME_OVERHEAD, RECORD_HEADER, Checkpoint, CheckpointEnd, CheckpointPart, crc32c, encode_payload,
)


class CheckpointRun:
    """A streamed checkpoint in progress (``Journal.begin_checkpoint``). ``done`` once
    its CheckpointEnd is published; ``end_seq`` is that record's seq."""

    def __init__(self, journal: StreamedCheckpoints, begin_seq: int, conv_ids: list[str], part_bytes: int):
        self.journal = journal
        self.begin_seq = begin_seq
        self.todo = deque(conv_ids)
        self.part_bytes = part_bytes
        self.n_parts = 0
        self.n_conversations = 0
        self.waiting_seq = begin_seq  # the next chunk is encoded once this is durable
        self.done = False
        self.end_seq = 0




class StreamedCheckpoints:
    """``Journal``'s checkpoint methods (``Journal`` inherits them; they use its ring and lock)."""

    def begin_checkpoint(self, table: ConversationTable, tick: int) -> CheckpointRun | None:
        """Open a streamed checkpoint of ``table`` (which must have applied every
        record published so far, else ``JournalError``): its Checkpoint record opens
        a new segment. Returns the run to pass to ``checkpoint_step``, or None when
        a checkpoint is already open, the ring has no room for the opening record
        now, or the disk is full (try later). Never waits."""
        live = table.live()
        payload = encode_payload(Checkpoint(covers_seq=table.last_seq, created_at=time.time(), streamed=True,
                                            n_conversations=len(live)))
        with self._lock:
            if table.last_seq != self._data_seq:
                raise JournalError(f"checkpoint of a table at seq {table.last_seq}, journal is at seq "
                                   f"{self._data_seq}")
            if self._cp_run is not None or self._degraded or self._failed is not None or self._closing:
                return None
            if self.capacity - (self._head - self._tail) - self._reserved < FRAME_OVERHEAD + len(payload):
                return None
            self._seal(False)
            seq = self._put(Checkpoint.type_id, payload, tick)
            self._seal(True)
            self._cp_run = CheckpointRun(self, seq, [c.conv_id for c in live], self.part_bytes)
            return self._cp_run

    def checkpoint_step(self, run: CheckpointRun, table: ConversationTable, tick: int) -> bool:
        """Write the next chunk of ``run`` (about ``part_bytes``: whole conversations,
        a long one split into consecutive parts), or its CheckpointEnd when every
        conversation is written. Does nothing while the previous chunk is not yet
        durable. ``table`` is the live table (it must have applied every record
        published). Returns True once the run is done. Never waits on disk."""
        if run.done:
            return True
        with self._lock:
            if self._failed is not None:
                raise JournalError(f"the journal failed: {self._failed}")
            if self._durable_seq < run.waiting_seq or self._degraded or self._closing:
                return False
            if table.last_seq != self._data_seq:
                raise JournalError(f"checkpoint step with a table at seq {table.last_seq}, journal is at seq "
                                   f"{self._data_seq}")
        if run.todo:
            payloads: list[bytes] = []
            size = 0
            while run.todo and size < run.part_bytes:
                c = table.get(run.todo.popleft())
                if c is None:
                    continue  # deleted since the checkpoint began: replay drops it too
                run.n_conversations += 1
                for part in checkpoint_parts(c, run.part_bytes):
                    p = encode_payload(part)
                    payloads.append(p)
                    size += len(p)
            if payloads:
                with self._lock:
                    run.waiting_seq = self._put_side(CheckpointPart.type_id, payloads, tick)
                    run.n_parts += len(payloads)
                return False
        end = encode_payload(CheckpointEnd(begin_seq=run.begin_seq, n_conversations=run.n_conversations,
                                           n_parts=run.n_parts))
        with self._lock:
            if self.capacity - (self._head - self._tail) - self._reserved < FRAME_OVERHEAD + len(end):
                return False
            self._seal(False)
            run.end_seq = self._put(CheckpointEnd.type_id, end, tick)
            self._seal(False, ends_checkpoint=True)
            run.done = True
            self._cp_run = None
        return True

    def abort_checkpoint(self, run: CheckpointRun) -> None:
        """Give up ``run`` without its CheckpointEnd: it stays an incomplete checkpoint
        that recovery does not start from (the older segments stay), and segments
        rotate again. Never waits."""
        with self._lock:
            if self._cp_run is run:
                self._cp_run = None
                self._pending.append(Block(0, 0, self._flushed_seq + 1, self._flushed_seq, False,
                                            aborts_checkpoint=True))
                self._work.notify()

    def _put_side(self, type_id: int, payloads: list[bytes], tick: int) -> int:
        """Publish records outside the ring as a block of their own (lock held); returns the last seq."""
        if self._failed is not None or self._closing:
            raise JournalError("the journal is closed" if self._closing else f"the journal failed: {self._failed}")
        self._seal(False)  # records published before these are written before them
        frames = []
        first = self._seq + 1
        for payload in payloads:
            self._seq += 1
            head = RECORD_HEADER.pack(type_id, tick, self._seq, len(payload))
            frames.append(head + payload + CRC.pack(google_crc32c.extend(crc32c(head), payload)))
        block = Block(0, 0, first, self._seq, False, tuple(frames))
        self._side_bytes += block.nbytes
        self._pending.append(block)
        self._flushed_seq = self._seq
        self._work.notify()
        return self._seq

    def checkpoint(self, table: ConversationTable, tick: int, timeout: float = 60.0) -> int:
        """Write a whole streamed checkpoint of ``table`` now, waiting for the disk as
        needed (tools and tests; the engine steps one chunk per tick instead). Once it
        is durable the older segments are removed. Returns the CheckpointEnd's seq.
        Raises ``JournalError`` when the table is behind the journal or it does not
        finish within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        run = None
        while run is None:
            run = self.begin_checkpoint(table, tick)
            if run is None:
                if self._cp_run is not None:
                    raise JournalError("a checkpoint is already being written")
                self._wait_progress(deadline)
        while not self.checkpoint_step(run, table, tick):
            self._wait_progress(deadline)
        return run.end_seq

    def _wait_progress(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise JournalError("the checkpoint did not finish in time (the disk is behind or full)")
        self.flush()
        self.wait_durable(self._seq, min(remaining, 0.5))

