"""The file layer the journal and capsule writers go through.

Owns: every operation that changes a file or a directory on behalf of the
journal (``writer.py``, ``recovery.py``) and of capsules (``state/capsule.py``):
open, write, writev, pwrite, fsync, fdatasync, ftruncate, close, rename,
unlink, mkdir and the directory fsync. ``OS`` does them with ``os``. A test
passes its own ``FileIO`` instead: one that records every call, from which
``tests/test_crash_states.py`` builds every state a power loss could leave (in
the manner of SQLite's crash-test VFS and ALICE), or one that injects faults
(``ENOSPC`` on the n-th write). Leaves to others: what is written and when.

Reads are not routed through the layer (a crash does not change what a read
returns); ``read_regular`` reads a whole file without ever blocking on a FIFO
or a device and refuses anything but a regular file, naming what it found.

Every file is created private (mode 0600) and every directory 0700, whatever
the process umask: conversations and capsules are the user's text.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700

#: errno values that mean "no space": the write can succeed later, once space returns.
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


class FileIO:
    """The real file system (the default). Subclass and override to record or fail."""

    def open(self, path: str | os.PathLike, flags: int, mode: int = FILE_MODE) -> int:
        return os.open(path, flags | os.O_CLOEXEC, mode)

    def write(self, fd: int, data) -> int:
        return os.write(fd, data)

    def writev(self, fd: int, buffers: list) -> int:
        return os.writev(fd, buffers)

    def pwrite(self, fd: int, data, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def close(self, fd: int) -> None:
        os.close(fd)

    def replace(self, src: str | os.PathLike, dst: str | os.PathLike) -> None:
        os.replace(src, dst)

    def unlink(self, path: str | os.PathLike) -> None:
        os.unlink(path)

    def mkdir(self, path: str | os.PathLike, mode: int = DIR_MODE) -> None:
        """Create ``path`` and its missing parents, each with ``mode`` (exists: no-op)."""
        p = Path(path)
        missing = []
        while not p.exists():
            missing.append(p)
            if p.parent == p:
                break
            p = p.parent
        for d in reversed(missing):
            try:
                os.mkdir(d, mode)
            except FileExistsError:
                continue
            os.chmod(d, mode)  # the umask may have narrowed it; never widen past mode

    def fsync_dir(self, path: str | os.PathLike) -> None:
        """fsync a directory, so that creates, renames and unlinks in it are durable."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


OS = FileIO()


# ---- helpers over a FileIO ------------------------------------------------------------

def write_all(fs: FileIO, fd: int, data) -> None:
    """Write every byte of ``data`` (short writes continue; errors raise OSError)."""
    view = memoryview(data).cast("B")
    while view:
        n = fs.write(fd, view)
        view = view[n:]


def write_file(fs: FileIO, path: str | os.PathLike, chunks, *, exclusive: bool = False) -> int:
    """Create (or truncate) ``path`` with mode 0600, write ``chunks`` (an iterable of
    bytes-like), fsync and close it. Returns the bytes written. On any error the
    partial file is removed and the error re-raised. The caller fsyncs the directory."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = fs.open(path, flags, FILE_MODE)
    size = 0
    try:
        for c in chunks:
            write_all(fs, fd, c)
            size += memoryview(c).nbytes   # bytes: len() of a 4-D array's view counts its layers
        fs.fsync(fd)
    except BaseException:
        fs.close(fd)
        try:
            fs.unlink(path)
        except OSError:
            pass
        raise
    fs.close(fd)
    return size


class NotRegularFile(OSError):
    """A path that should be a regular file is a directory, FIFO, socket or device."""


def file_kind(mode: int) -> str:
    """What ``st_mode`` says a path is, in words ("a directory", "a FIFO", ...)."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def read_regular(path: str | os.PathLike, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path`` (the first ``limit`` bytes when given).

    Opens with O_NONBLOCK and checks the type with fstat before reading, so a FIFO
    or device never blocks. Raises ``NotRegularFile`` (an OSError) naming the type,
    or the OSError of the open/read (EACCES, EIO, ...)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, f"{path} is {file_kind(st.st_mode)}, not a regular file")
        want = st.st_size if limit is None else min(limit, st.st_size)
        parts = []
        got = 0
        while got < want:
            b = os.read(fd, min(want - got, 16 << 20))
            if not b:
                break
            parts.append(b)
            got += len(b)
        return b"".join(parts)
    finally:
        os.close(fd)


def describe_os_error(e: OSError) -> str:
    """A short reason for an OSError: "permission denied", "read-only file system", ..."""
    if isinstance(e, NotRegularFile):
        return str(e).split(" is ", 1)[-1] if " is " in str(e) else str(e)
    return (e.strerror or str(e)).lower()
