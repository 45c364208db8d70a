"""The journal writer: publication buffer, credits, flush, drain, receipts.

Owns: the preallocated publication ring (``buffer_bytes``), credits
(``reserve``), sequence numbers, grouping published records into blocks
(``flush``), the drain thread that appends blocks to segment files, fdatasyncs
and only then issues receipts (and records the last one in the ``RECEIPT``
file, which recovery reads to tell a torn tail from damage), segment rotation,
streamed online checkpoints, and waiting out a full disk. Leaves to others:
what records mean (``conversations.py``), reading and repairing the files at
start (``recovery.py``, which ``Journal`` runs first), the file system calls
themselves (``engine/fileio.py``: tests pass a recording or failing one), and
the segment and receipt files the drain appends to (``appender.py``).

Threads. ``reserve``, ``publish``, ``checkpoint_step`` and ``flush`` may be
called from any thread (a short lock orders them); none of them ever waits on
disk, so a tick can call them. The drain thread does every write and fsync. It
calls ``on_receipt(Receipt)`` after each fsync, on the drain thread, in
increasing ``last_seq`` order: hand it to your event loop
(``call_soon_threadsafe``) and return quickly. ``wait_durable`` and
``checkpoint`` block the calling thread; never call them in a tick.

Credits. The ring holds at most ``buffer_bytes`` of records that are not yet
durable. ``reserve(n)`` takes credit for n bytes or answers False at once when
the disk has fallen behind; ``publish`` spends reserved credit first and may
borrow free space beyond it; a record that fits in neither raises
``JournalError`` (reserve first). Credit comes back as blocks become durable.

Checkpoints stream (``checkpoint_stream.py``, whose methods ``Journal`` inherits):
a ``Checkpoint`` opens a new segment, its parts bypass the ring, and once its
``CheckpointEnd`` is durable the segments before it are removed. The segment does
not rotate while a checkpoint is open, so a checkpoint lies in one segment.

Disk full. A write or fsync that fails with ENOSPC or EDQUOT does not fail the
journal: the drain truncates the segment back to its durable size, marks the
journal ``degraded`` (a line naming the directory, its file system, the bytes
waiting and the bytes free), answers ``reserve`` with False, and retries the same
bytes (backing off to once a second) until they fit; then it clears the state
and the receipts resume. Nothing acknowledged is touched. Any other error (EIO
on fsync) fails the journal for good: after a failed fsync the page cache cannot
be trusted. ``on_error(exc)`` is called, ``reserve`` answers False, and
``publish``/``flush``/``wait_durable`` raise ``JournalError``. Restart the
engine; recovery keeps everything a receipt covered.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

import google_crc32c

from aotx.engine.errors import JournalError
from aotx.engine.fileio import NO_SPACE, OS, FileIO, describe_os_error
from aotx.engine.journal.appender import SegmentAppender, fmt_bytes, mount_point
from aotx.engine.journal.blocks import Block
from aotx.engine.journal.checkpoint_stream import CheckpointRun, StreamedCheckpoints  # noqa: F401 (re-exported)
from aotx.engine.journal.conversations import Receipt
from aotx.engine.journal.directory import LOCK_NAME, DirLock, remove_older_segments  # noqa: F401 (re-exported)
from aotx.engine.journal.records import (
    CRC, FLAG_CHECKPOINT, FRAME_OVERHEAD, HEADER_BYTES, RECORD_HEADER, Checkpoint, CheckpointEnd, CheckpointPart,
    Record, crc32c, encode_payload,
)

log = logging.getLogger("aotx.journal")


class Journal(StreamedCheckpoints):
    """The journal of one engine, open for appending.

    ``Journal(directory)`` takes the directory's lock, runs recovery (the
    report is ``self.recovery``, its ``table`` the rebuilt conversations),
    and continues after the last good record. Sizes are in bytes:
    ``segment_bytes`` is where segments rotate (a segment may exceed it by
    one block, or by a checkpoint), ``buffer_bytes`` the publication ring,
    ``part_bytes`` a checkpoint chunk. ``sync`` is the function that makes a
    file descriptor durable (default ``fs.fdatasync``; tests and benchmarks pass
    their own); ``fs`` the file layer. ``repair`` is passed to ``recover``.
    Raises ``JournalError`` when the directory is locked, unwritable, or
    recovery refuses (a newer format version)."""

    def __init__(self, directory: str | os.PathLike, *, segment_bytes: int = 64 << 20,
                 buffer_bytes: int = 8 << 20, on_receipt: Callable[[Receipt], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None,
                 sync: Callable[[int], None] | None = None, repair: bool = False, fs: FileIO = OS,
                 part_bytes: int = 1 << 20):
        from aotx.engine.journal.recovery import make_dir, recover_locked

        if buffer_bytes < 4096 or segment_bytes < 4096:
            raise JournalError(f"journal sizes too small: buffer {buffer_bytes} and segment {segment_bytes} "
                               "bytes (4096 at least)")
        self.directory = Path(directory)
        self.fs = fs
        make_dir(self.directory, fs)
        self._dirlock = DirLock(self.directory)
        try:
            self.recovery = recover_locked(self.directory, repair=repair, fs=fs)
        except BaseException:
            self._dirlock.release()
            raise
        self.segment_bytes = segment_bytes
        self.capacity = buffer_bytes
        self.part_bytes = part_bytes
        self._on_receipt = on_receipt
        self._on_error = on_error
        self._ring = bytearray(buffer_bytes)
        self._view = memoryview(self._ring)

        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._done = threading.Condition(self._lock)
        self._seq = self.recovery.next_seq - 1  # last seq handed out
        self._data_seq = self._seq  # last seq of a record that is not part of a checkpoint
        self._head = 0  # bytes ever published into the ring
        self._tail = 0  # bytes ever released (durable)
        self._flushed = 0  # bytes handed to the drain
        self._flushed_seq = self._seq
        self._reserved = 0
        self._side_bytes = 0  # bytes of side blocks (checkpoint parts) not yet durable
        self._pending: deque[Block] = deque()
        self._durable_seq = self._seq
        self._last_receipt: Receipt | None = None
        self._closing = False
        self._closed = False
        self._failed: BaseException | None = None
        self._degraded = ""
        self._cp_run: CheckpointRun | None = None
        self._cp_open = False  # drain side: the current segment holds an open checkpoint
        self._cp_segment = 0
        self._n = {"fsyncs": 0, "blocks": 0, "receipts": 0, "bytes_written": 0,
                   "checkpoints": 0, "callback_errors": 0, "no_space_retries": 0}
        self.callback_error: Exception | None = None  # the last exception raised by on_receipt

        self._files = SegmentAppender(self.directory, fs, sync if sync is not None else fs.fdatasync)
        try:  # the segment to append to: the last one recovery kept, or a new one
            self._files.open(self.recovery.append_segment, self._seq + 1)
        except OSError as e:
            self._dirlock.release()
            raise JournalError(f"cannot write the journal in {self.directory}: {describe_os_error(e)}") from None
        except BaseException:
            self._dirlock.release()
            raise
        self._thread = threading.Thread(target=self._drain, name="aotx-journal-drain", daemon=True)
        self._thread.start()

    @property
    def _sync(self) -> Callable[[int], None]:
        """The function that makes a segment's descriptor durable (tests replace it)."""
        return self._files.sync

    @_sync.setter
    def _sync(self, fn: Callable[[int], None]) -> None:
        self._files.sync = fn

    @property
    def _segment(self) -> int:
        return self._files.segment

    # ---- producer side (any thread, never waits on disk) ---------------------------

    def reserve(self, nbytes: int) -> bool:
        """Take credit for ``nbytes`` bytes of records; False (at once) when the ring
        has no room for them until the drain catches up, the disk is full
        (``degraded``), or the journal failed."""
        with self._lock:
            if self._failed is not None or self._closing or self._degraded:
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
        counting reserved credit, or the journal failed or is closed. Checkpoint
        records go through ``begin_checkpoint``/``checkpoint_step``."""
        if isinstance(record, (Checkpoint, CheckpointPart, CheckpointEnd)):
            raise JournalError("checkpoint records are written by Journal.checkpoint(), not publish()")
        payload = encode_payload(record)
        with self._lock:
            seq = self._put(record.type_id, payload, tick)
            self._data_seq = seq
            return seq

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

    def _seal(self, checkpoint: bool, ends_checkpoint: bool = False) -> None:
        # lock held
        if self._head == self._flushed:
            return
        self._pending.append(Block(self._flushed, self._head, self._flushed_seq + 1, self._seq, checkpoint,
                                    ends_checkpoint=ends_checkpoint))
        self._flushed = self._head
        self._flushed_seq = self._seq
        self._work.notify()


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
        ``reserve`` can grant now (for a client notice: asked vs free); 0 while the
        disk is full."""
        with self._lock:
            if self._degraded:
                return 0
            return self.capacity - (self._head - self._tail) - self._reserved

    @property
    def degraded(self) -> str:
        """"" normally; while the disk is full, one line saying which directory and
        file system, how many bytes wait to be written and how many are free."""
        return self._degraded

    @property
    def checkpointing(self) -> bool:
        return self._cp_run is not None

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
            return dict(self._n, segments_created=self._files.segments_created, capacity=self.capacity, used=used, reserved=self._reserved,
                        free=self.capacity - used - self._reserved, last_seq=self._seq,
                        durable_seq=self._durable_seq, segment=self._files.segment, segment_bytes=self._files.size,
                        pending_blocks=len(self._pending), failed=str(self._failed) if self._failed else None,
                        degraded=self._degraded, checkpointing=self._cp_run is not None)

    # ---- closing --------------------------------------------------------------------------

    def close(self, timeout: float | None = 30.0) -> None:
        """Flush, let the drain write and fsync everything, stop it, release the lock.
        Idempotent. Raises ``JournalError`` when the drain failed (a full disk that
        did not clear counts) or did not stop within ``timeout`` seconds."""
        with self._lock:
            if self._closed:
                return
            if self._failed is None:
                self._seal(False)
            self._closing = True
            self._work.notify_all()
        self._thread.join(timeout)
        alive = self._thread.is_alive()
        with self._lock:
            self._closed = True
            self._done.notify_all()
        if not alive:
            if self._failed is None:
                self._files.sync_receipts()
            self._files.close()
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
            if isinstance(exc, OSError) and exc.errno in NO_SPACE:
                exc = JournalError(f"the journal stopped with the disk still full: {self._degraded or exc}")
            with self._lock:
                self._failed = exc
                self._done.notify_all()
            if self._on_error is not None:
                self._on_error(exc)

    def _write_blocks(self, blocks: list[Block]) -> None:
        run_start = run_end = None
        run_seq = 0
        for b in blocks:
            if b.aborts_checkpoint:
                self._cp_open = False
                continue
            size = b.nbytes
            written = self._files.size + (0 if run_start is None else run_end - run_start)
            rotate = b.checkpoint or (not self._cp_open and written > HEADER_BYTES
                                      and written + size > self.segment_bytes)
            if (rotate or b.frames) and run_start is not None:
                self._commit(run_start, run_end, run_seq)
                run_start = None
            if rotate:
                self._until_space(lambda b=b: self._open_segment(
                    self._files.segment + 1, b.first_seq, FLAG_CHECKPOINT if b.checkpoint else 0), HEADER_BYTES)
                if b.checkpoint:
                    self._cp_open, self._cp_segment = True, self._files.segment
            if b.frames:
                self._commit(0, 0, b.last_seq, b.frames)
                continue
            if run_start is None:
                run_start = b.start
            run_end, run_seq = b.end, b.last_seq
            if b.checkpoint or b.ends_checkpoint:
                self._commit(run_start, run_end, run_seq)
                run_start = None
            if b.ends_checkpoint:
                self._cp_open = False
                self._n["checkpoints"] += 1
                try:
                    remove_older_segments(self.directory, self._cp_segment, self.fs)
                except OSError as e:  # they stay, superseded; the next checkpoint removes them
                    log.warning("journal: could not remove segments before %d: %s", self._cp_segment, e)
        self._n["blocks"] += len(blocks)
        if run_start is not None:
            self._commit(run_start, run_end, run_seq)

    def _commit(self, start: int, end: int, last_seq: int, frames: tuple = ()) -> None:
        """Append ring bytes [start, end) (or ``frames``) to the segment, fdatasync,
        record the receipt in the RECEIPT file, then issue it."""
        cap = self.capacity
        if frames:
            nbytes = sum(len(f) for f in frames)
        else:
            nbytes = end - start

        def pieces() -> list:
            if frames:
                return list(frames)
            a, b = start % cap, end - start
            if a + b <= cap:
                return [self._view[a:a + b]]
            return [self._view[a:cap], self._view[0:a + b - cap]]

        def attempt() -> None:
            self._n["bytes_written"] += self._files.append(pieces())

        self._until_space(attempt, nbytes)
        self._n["fsyncs"] += 1
        receipt = Receipt(self._files.segment, self._files.size, last_seq)
        self._files.record_receipt(receipt)
        with self._lock:
            if frames:
                self._side_bytes -= nbytes
            else:
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

    def _until_space(self, attempt: Callable[[], None], nbytes: int) -> None:
        """Run ``attempt``; while it fails for want of space, be degraded and retry it
        (50 ms, doubling to 1 s between tries) until it succeeds. The journal closing
        gives up: the error propagates."""
        delay = 0.05
        while True:
            try:
                attempt()
            except OSError as e:
                if e.errno not in NO_SPACE:
                    raise
                self._n["no_space_retries"] += 1
                self._set_degraded(e, nbytes)
                with self._lock:
                    if self._closing:
                        raise
                    self._work.wait(delay)
                    if self._closing:
                        raise
                delay = min(delay * 2, 1.0)
                continue
            if self._degraded:
                log.warning("journal: space is back on the disk of %s; writing again", self.directory)
                with self._lock:
                    self._degraded = ""
                    self._done.notify_all()
            return

    def _set_degraded(self, e: OSError, nbytes: int) -> None:
        try:
            st = os.statvfs(self.directory)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = 0
        try:
            mount = mount_point(self.directory)
        except OSError:
            mount = self.directory
        with self._lock:
            waiting = (self._head - self._tail) + self._side_bytes
        what = "quota exceeded" if e.errno == errno.EDQUOT else "disk full"
        need = max(nbytes, waiting)
        line = (f"{what}: the journal in {self.directory} (file system at {mount}) needs {fmt_bytes(need, True)} for "
                f"records waiting to be written and {fmt_bytes(free, True)} are free; new work is held until space returns")
        if not self._degraded:
            log.warning("journal: %s", line)
        with self._lock:
            self._degraded = line

    def _open_segment(self, number: int, base_seq: int, flags: int) -> None:
        self._files.open_segment(number, base_seq, flags)
