"""The journal writer: publication buffer, credits, flush, drain, receipts.

Owns: the preallocated publication ring (``buffer_bytes``), credits
(``reserve``), sequence numbers, grouping published records into blocks
(``flush``), the drain thread that appends blocks to segment files, fdatasyncs
and only then issues receipts, segment rotation, and online checkpoints.
Leaves to others: what records mean (``conversations.py``), reading and
repairing the files at start (``recovery.py``, which ``Journal`` runs first).

Threads. ``reserve``, ``publish``, ``checkpoint`` and ``flush`` may be called
from any thread (a short lock orders them); none of them ever waits on disk,
so a tick can call them. The drain thread does every write and fsync. It calls
``on_receipt(Receipt)`` after each fsync, on the drain thread, in increasing
``last_seq`` order: hand it to your event loop (``call_soon_threadsafe``) and
return quickly. ``wait_durable`` blocks the calling thread; never call it in a
tick.

Credits. The ring holds at most ``buffer_bytes`` of records that are not yet
durable. ``reserve(n)`` takes credit for n bytes or answers False at once when
the disk has fallen behind; ``publish`` spends reserved credit first and may
borrow free space beyond it; a record that fits in neither raises
``JournalError`` (reserve first). Credit comes back as blocks become durable.

Failure. An error in the drain (disk full, EIO on fsync) fails the journal for
good: after a failed fsync the page cache cannot be trusted, so nothing is
retried. ``on_error(exc)`` is called, ``reserve`` answers False, and
``publish``/``flush``/``wait_durable`` raise ``JournalError``. Restart the
engine; recovery keeps everything a receipt covered.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, NamedTuple

import google_crc32c

from aotx.engine.errors import JournalError
from aotx.engine.journal.conversations import ConversationTable, Receipt
from aotx.engine.journal.directory import LOCK_NAME, DirLock, remove_older_segments  # noqa: F401 (re-exported)
from aotx.engine.journal.records import (
    CRC, FLAG_CHECKPOINT, FRAME_OVERHEAD, HEADER_BYTES, RECORD_HEADER, Checkpoint, Record,
    crc32c, encode_payload, encode_segment_header,
)
from aotx.engine.journal.segments import fsync_dir, list_segments, segment_name

class _Block(NamedTuple):
    start: int  # absolute ring offset (bytes published before it)
    end: int
    first_seq: int
    last_seq: int
    checkpoint: bool


class Journal:
    """The journal of one engine, open for appending.

    ``Journal(directory)`` takes the directory's lock, runs recovery (the
    report is ``self.recovery``, its ``table`` the rebuilt conversations),
    and continues after the last good record. Sizes are in bytes:
    ``segment_bytes`` is where segments rotate (a segment may exceed it by
    one block), ``buffer_bytes`` the publication ring. ``sync`` is the
    function that makes a file descriptor durable (``os.fdatasync``; tests
    and benchmarks pass their own). ``repair`` is passed to ``recover``.
    Raises ``JournalError`` when the directory is locked or recovery refuses."""

    def __init__(self, directory: str | os.PathLike, *, segment_bytes: int = 64 << 20,
                 buffer_bytes: int = 8 << 20, on_receipt: Callable[[Receipt], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None,
                 sync: Callable[[int], None] = os.fdatasync, repair: bool = False):
        from aotx.engine.journal.recovery import recover_locked

        if buffer_bytes < 4096 or segment_bytes < 4096:
            raise JournalError(f"journal sizes too small: buffer {buffer_bytes} and segment {segment_bytes} "
                               "bytes (4096 at least)")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._dirlock = DirLock(self.directory)
        try:
            self.recovery = recover_locked(self.directory, repair=repair)
        except BaseException:
            self._dirlock.release()
            raise
        self.segment_bytes = segment_bytes
        self.capacity = buffer_bytes
        self._on_receipt = on_receipt
        self._on_error = on_error
        self._sync = sync
        self._ring = bytearray(buffer_bytes)
        self._view = memoryview(self._ring)

        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._done = threading.Condition(self._lock)
        self._seq = self.recovery.next_seq - 1  # last seq handed out
        self._head = 0  # bytes ever published into the ring
        self._tail = 0  # bytes ever released (durable)
        self._flushed = 0  # bytes handed to the drain
        self._flushed_seq = self._seq
        self._reserved = 0
        self._pending: deque[_Block] = deque()
        self._durable_seq = self._seq
        self._last_receipt: Receipt | None = None
        self._closing = False
        self._closed = False
        self._failed: BaseException | None = None
        self._n = {"fsyncs": 0, "blocks": 0, "receipts": 0, "bytes_written": 0, "segments_created": 0,
                   "checkpoints": 0, "callback_errors": 0}
        self.callback_error: Exception | None = None  # the last exception raised by on_receipt

        # the segment to append to: the last one recovery kept, or a new one
        self._fd = -1
        if self.recovery.segments:
            self._segment = self.recovery.segments[-1]
            path = self.directory / segment_name(self._segment)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            self._seg_size = os.fstat(self._fd).st_size
        else:
            self._segment = 0
            self._seg_size = 0
            self._open_segment(max([n for n, _ in list_segments(self.directory)], default=0) + 1,
                               self._seq + 1, 0)
        self._thread = threading.Thread(target=self._drain, name="aotx-journal-drain", daemon=True)
        self._thread.start()

    # ---- producer side (any thread, never waits on disk) ---------------------------

    def reserve(self, nbytes: int) -> bool:
        """Take credit for ``nbytes`` bytes of records; False (at once) when the ring
        has no room for them until the drain catches up, or the journal failed."""
        with self._lock:
            if self._failed is not None or self._closing:
                return False
            if self.capacity - (self._head - self._tail) - self._reserved < nbytes:
                return False
            self._reserved += nbytes
            return True

    def release(self, nbytes: int) -> None:
        """Give back reserved credit that will not be used (a reply ended early)."""
        with self._lock:
            self._reserved = max(0, self._reserved - nbytes)

    def publish(self, record: Record, tick: int) -> int:
        """Write ``record`` complete into the ring, then publish it; returns its seq.

        The record is durable once a receipt with ``last_seq >= seq`` arrives,
        after a ``flush``. Raises ``JournalError`` when there is no room even
        counting reserved credit, or the journal failed or is closed. A
        ``Checkpoint`` goes through ``checkpoint()``."""
        if isinstance(record, Checkpoint):
            raise JournalError("a Checkpoint record is written by Journal.checkpoint(), not publish()")
        payload = encode_payload(record)
        with self._lock:
            return self._put(record.type_id, payload, tick)

    def _put(self, type_id: int, payload: bytes, tick: int) -> int:
        # lock held
        if self._failed is not None:
            raise JournalError(f"the journal failed and takes no more records: {self._failed}")
        if self._closing:
            raise JournalError("the journal is closed")
        n = FRAME_OVERHEAD + len(payload)
        if n > self.capacity:
            raise JournalError(f"a record of {n} bytes exceeds the journal buffer of {self.capacity} bytes "
                               "(raise buffer_bytes)")
        take = min(n, self._reserved)
        free = self.capacity - (self._head - self._tail) - self._reserved
        if n - take > free:
            raise JournalError(f"no journal credit for a record of {n} bytes ({self._reserved} reserved, "
                               f"{free} free of {self.capacity}); reserve before publishing")
        self._reserved -= take
        seq = self._seq + 1
        head = RECORD_HEADER.pack(type_id, tick, seq, len(payload))
        frame = head + payload + CRC.pack(google_crc32c.extend(crc32c(head), payload))
        pos = self._head % self.capacity
        first = min(n, self.capacity - pos)
        self._view[pos:pos + first] = frame[:first]
        if first < n:
            self._view[0:n - first] = frame[first:]
        self._seq = seq
        self._head += n
        return seq

    def flush(self) -> None:
        """Group every record published since the last flush into one block and
        hand it to the drain thread. Never waits. Raises ``JournalError`` when
        the journal failed."""
        with self._lock:
            if self._failed is not None:
                raise JournalError(f"the journal failed: {self._failed}")
            self._seal(False)

    def _seal(self, checkpoint: bool) -> None:
        # lock held
        if self._head == self._flushed:
            return
        self._pending.append(_Block(self._flushed, self._head, self._flushed_seq + 1, self._seq, checkpoint))
        self._flushed = self._head
        self._flushed_seq = self._seq
        self._work.notify()

    def checkpoint(self, table: ConversationTable, tick: int) -> int | None:
        """Publish a Checkpoint of ``table``'s live conversations as the first record
        of a new segment, and flush. Once it is durable, older segments are removed.

        ``table`` must have applied every record published so far (its
        ``last_seq`` equals the journal's), else ``JournalError``. Returns the
        checkpoint's seq, or None when the ring has no room now (try later).
        Raises ``JournalError`` when the snapshot is larger than the ring."""
        payload = encode_payload(Checkpoint(covers_seq=table.last_seq, conversations=table.snapshot(),
                                            created_at=time.time()))
        if FRAME_OVERHEAD + len(payload) > self.capacity:
            raise JournalError(f"a checkpoint of {len(payload)} bytes does not fit the journal buffer of "
                               f"{self.capacity} bytes; compact offline with compact()")
        with self._lock:
            if table.last_seq != self._seq:
                raise JournalError(f"checkpoint of a table at seq {table.last_seq}, journal is at seq {self._seq}")
            if self.capacity - (self._head - self._tail) - self._reserved < FRAME_OVERHEAD + len(payload):
                return None
            self._seal(False)
            seq = self._put(Checkpoint.type_id, payload, tick)
            self._seal(True)
            return seq

    # ---- waiting and status ------------------------------------------------------------

    def wait_durable(self, seq: int, timeout: float | None = None) -> bool:
        """Block until record ``seq`` is durable (flushing first if it is not yet
        flushed). Returns False when ``timeout`` seconds pass first. Raises
        ``JournalError`` when the journal fails or closes before that."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if seq > self._flushed_seq and self._failed is None:
                self._seal(False)
            while self._durable_seq < seq:
                if self._failed is not None:
                    raise JournalError(f"the journal failed before seq {seq} was durable: {self._failed}")
                if self._closed or seq > self._seq:
                    raise JournalError(f"seq {seq} will not become durable (journal at seq {self._seq}"
                                       f"{', closed' if self._closed else ''})")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._done.wait(remaining)
            return True

    @property
    def last_seq(self) -> int:
        """Sequence number of the last published record."""
        return self._seq

    @property
    def durable_seq(self) -> int:
        """Every record up to this seq is on disk."""
        return self._durable_seq

    @property
    def free_bytes(self) -> int:
        """Bytes of the ring neither holding undurable records nor reserved: what
        ``reserve`` can grant now (for a client notice: asked vs free)."""
        with self._lock:
            return self.capacity - (self._head - self._tail) - self._reserved

    @property
    def last_receipt(self) -> Receipt | None:
        return self._last_receipt

    @property
    def failed(self) -> BaseException | None:
        return self._failed

    def stats(self) -> dict:
        """Counters and levels for status displays and tests (sizes in bytes)."""
        with self._lock:
            used = self._head - self._tail
            return dict(self._n, capacity=self.capacity, used=used, reserved=self._reserved,
                        free=self.capacity - used - self._reserved, last_seq=self._seq,
                        durable_seq=self._durable_seq, segment=self._segment, segment_bytes=self._seg_size,
                        pending_blocks=len(self._pending), failed=str(self._failed) if self._failed else None)

    # ---- closing --------------------------------------------------------------------------

    def close(self, timeout: float | None = 30.0) -> None:
        """Flush, let the drain write and fsync everything, stop it, release the lock.
        Idempotent. Raises ``JournalError`` when the drain failed or did not stop
        within ``timeout`` seconds."""
        with self._lock:
            if self._closed:
                return
            if self._failed is None:
                self._seal(False)
            self._closing = True
            self._work.notify()
        self._thread.join(timeout)
        alive = self._thread.is_alive()
        with self._lock:
            self._closed = True
            self._done.notify_all()
        if not alive:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            self._dirlock.release()
        if alive:
            raise JournalError(f"the journal drain did not finish within {timeout} s")
        if self._failed is not None:
            raise JournalError(f"the journal failed: {self._failed}")

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the drain thread ------------------------------------------------------------------

    def _drain(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._pending and not self._closing:
                        self._work.wait()
                    if not self._pending:
                        return
                    blocks = list(self._pending)
                    self._pending.clear()
                self._write_blocks(blocks)
        except BaseException as exc:  # the journal is failed for good; see the module docstring
            with self._lock:
                self._failed = exc
                self._done.notify_all()
            if self._on_error is not None:
                self._on_error(exc)

    def _write_blocks(self, blocks: list[_Block]) -> None:
        run_start = run_end = None
        run_seq = 0
        for b in blocks:
            size = b.end - b.start
            written = self._seg_size + (0 if run_start is None else run_end - run_start)
            rotate = b.checkpoint or (written > HEADER_BYTES and written + size > self.segment_bytes)
            if rotate and run_start is not None:
                self._commit(run_start, run_end, run_seq)
                run_start = None
            if rotate:
                self._open_segment(self._segment + 1, b.first_seq, FLAG_CHECKPOINT if b.checkpoint else 0)
            if run_start is None:
                run_start = b.start
            run_end, run_seq = b.end, b.last_seq
            if b.checkpoint:
                self._commit(run_start, run_end, run_seq)
                run_start = None
                self._n["checkpoints"] += 1
                remove_older_segments(self.directory, self._segment)
        self._n["blocks"] += len(blocks)
        if run_start is not None:
            self._commit(run_start, run_end, run_seq)

    def _commit(self, start: int, end: int, last_seq: int) -> None:
        """Append ring bytes [start, end) to the segment, fdatasync, then issue the receipt."""
        cap = self.capacity
        pieces = []
        a, b = start % cap, end - start
        if a + b <= cap:
            pieces.append(self._view[a:a + b])
        else:
            pieces += [self._view[a:cap], self._view[0:a + b - cap]]
        while pieces:
            n = os.writev(self._fd, pieces)
            self._n["bytes_written"] += n
            while pieces and n >= len(pieces[0]):
                n -= len(pieces[0])
                pieces.pop(0)
            if n:
                pieces[0] = pieces[0][n:]
        self._sync(self._fd)
        self._n["fsyncs"] += 1
        self._seg_size += end - start
        receipt = Receipt(self._segment, self._seg_size, last_seq)
        with self._lock:
            self._tail = end
            self._durable_seq = last_seq
            self._last_receipt = receipt
            self._done.notify_all()
        self._n["receipts"] += 1
        if self._on_receipt is not None:
            try:
                self._on_receipt(receipt)
            except Exception as exc:  # a broken callback must not stop durability
                self._n["callback_errors"] += 1
                self.callback_error = exc

    def _open_segment(self, number: int, base_seq: int, flags: int) -> None:
        """Create segment ``number`` (header only), fsync it and the directory."""
        path = self.directory / segment_name(number)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        try:
            os.write(fd, encode_segment_header(number, base_seq, flags))
            self._sync(fd)
            fsync_dir(self.directory)
        except BaseException:
            os.close(fd)
            raise
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._segment, self._seg_size = fd, number, HEADER_BYTES
        self._n["segments_created"] += 1
