"""The drain's files: the segment being appended to and the acknowledged mark.

Owns: the open segment (its descriptor, number and durable size), creating the
next one (``open_segment``: header written and fsynced, then the directory),
appending a block and making it durable (``append``), cutting a failed append
back to the durable size, and the acknowledged mark: the last receipt issued,
kept in two files (``RECEIPT`` and ``RECEIPT.2``, both overwritten in place after
every fsync) so that losing one of them, or one of them with the last segment,
still leaves recovery a mark to check the segments against. Leaves to others: the
ring, credits and when to rotate (``writer.py``), what to do on a full disk
(``writer.py``'s retry loop), reading the mark back (``segments.read_acknowledged``).

Only the drain thread calls it after ``Journal`` opened it; nothing here takes a lock.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

from aotx.engine.fileio import NO_SPACE, FileIO, write_all
from aotx.engine.journal.conversations import Receipt
from aotx.engine.journal.records import HEADER_BYTES, RECEIPT_FILES, encode_receipt, encode_segment_header
from aotx.engine.journal.segment_files import list_segments, segment_name

log = logging.getLogger("aotx.journal")

RECEIPT_SYNC_S = 1.0  # the RECEIPT files are fdatasynced at most this often (they may lag after a power loss)


def mount_point(path: Path) -> Path:
    """The mount point of the file system holding ``path``."""
    path = path.resolve()
    dev = os.stat(path).st_dev
    while path.parent != path and os.stat(path.parent).st_dev == dev:
        path = path.parent
    return path


def fmt_bytes(n: int, exact: bool = False) -> str:
    """``n`` bytes in words ("1.5 MiB"), with the exact count after it when ``exact``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}" + (f" ({n} bytes)" if exact else "")
    return f"{n} bytes"


class SegmentAppender:
    """The segment files of one open journal, as the drain writes them.

    ``open(last_segment, next_seq)``: append to segment ``last_segment`` (recovery's
    last), or, when None, create the next segment number with base ``next_seq``.
    ``sync`` makes a descriptor durable (``fs.fdatasync`` unless a test passes its
    own). Raises ``OSError`` (the caller turns it into ``JournalError``)."""

    def __init__(self, directory: Path, fs: FileIO, sync: Callable[[int], None]):
        self.directory = directory
        self.fs = fs
        self.sync = sync
        self.fd = -1
        self.segment = 0
        self.size = 0  # bytes of the open segment that are durable
        self.segments_created = 0
        self._ack_fds: list[int] = []
        self._ack_synced = 0.0

    def open(self, last_segment: int | None, next_seq: int) -> None:
        try:
            self._open_receipt_files()
            if last_segment is not None:
                self.segment = last_segment
                self.fd = self.fs.open(self.directory / segment_name(last_segment), os.O_WRONLY | os.O_APPEND)
                self.size = os.fstat(self.fd).st_size
            else:
                self.open_segment(max([n for n, _ in list_segments(self.directory)], default=0) + 1, next_seq, 0)
        except BaseException:
            self.close()
            raise

    def _open_receipt_files(self) -> None:
        created = False
        for name in RECEIPT_FILES:
            path = self.directory / name
            created |= not path.exists()
            self._ack_fds.append(self.fs.open(path, os.O_RDWR | os.O_CREAT))
        if created:
            self.fs.fsync_dir(self.directory)

    def open_segment(self, number: int, base_seq: int, flags: int) -> None:
        """Create segment ``number`` (header only), fsync it and the directory, and
        append to it from now on. A failure removes the partial file."""
        path = self.directory / segment_name(number)
        fd = self.fs.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND)
        try:
            write_all(self.fs, fd, encode_segment_header(number, base_seq, flags))
            self.sync(fd)
            self.fs.fsync_dir(self.directory)
        except BaseException:
            self.fs.close(fd)
            try:
                self.fs.unlink(path)
                self.fs.fsync_dir(self.directory)
            except OSError:
                pass
            raise
        if self.fd >= 0:
            self.fs.close(self.fd)
        self.fd, self.segment, self.size = fd, number, HEADER_BYTES
        self.segments_created += 1

    def append(self, parts: list) -> int:
        """Write ``parts`` (bytes-like) at the end of the segment and make them durable;
        returns the bytes written. On a failure for want of space, whatever part got
        in is cut off again (the caller writes the same bytes later); any error raises."""
        written = 0
        try:
            while parts:
                n = self.fs.writev(self.fd, parts)
                written += n
                while parts and n >= len(parts[0]):
                    n -= len(parts[0])
                    parts.pop(0)
                if n:
                    parts[0] = parts[0][n:]
            self.sync(self.fd)
        except OSError as e:
            if e.errno in NO_SPACE:
                try:
                    self.fs.ftruncate(self.fd, self.size)
                except OSError:
                    pass
            raise
        self.size += written
        return written

    def record_receipt(self, receipt: Receipt) -> None:
        """Overwrite both receipt files with ``receipt`` (before it is issued, so no
        receipt a client holds is ever past them after a crash of the process);
        fdatasync them at most once a second. A failure never fails the journal:
        recovery then knows an older acknowledged point."""
        data = encode_receipt(receipt.segment, receipt.offset, receipt.last_seq)
        now = time.monotonic()
        sync = now - self._ack_synced >= RECEIPT_SYNC_S
        if sync:
            self._ack_synced = now
        for name, fd in zip(RECEIPT_FILES, self._ack_fds):
            try:
                self.fs.pwrite(fd, data, 0)
                if sync:
                    self.fs.fdatasync(fd)
            except OSError as e:
                log.warning("journal: could not record receipt %s in %s: %s", receipt.last_seq, name, e)

    def sync_receipts(self) -> None:
        for fd in self._ack_fds:
            try:
                self.fs.fdatasync(fd)
            except OSError:
                pass

    def close(self) -> None:
        for fd in [self.fd, *self._ack_fds]:
            if fd >= 0:
                try:
                    self.fs.close(fd)
                except OSError:
                    pass
        self.fd = -1
        self._ack_fds = []
