"""The journal's directory: its writer lock and the removal of segments a checkpoint
made obsolete.

Owns: ``DirLock`` (one writer per journal directory: the engine's ``Journal``, or an
offline ``recover``/``compact``) and ``remove_older_segments``. Both the writer and
recovery use them, so they live below both (no import circle between the two).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from aotx.engine.errors import JournalError
from aotx.engine.fileio import OS, FileIO, describe_os_error
from aotx.engine.journal.segment_files import list_segments

LOCK_NAME = "LOCK"


class DirLock:
    """An exclusive ``flock`` on ``directory/LOCK``: one writer per journal.
    Raises ``JournalError`` when another process (a running engine) holds it, or
    the directory cannot be written (read-only, permissions)."""

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / LOCK_NAME
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            hint = (" (the file system is read-only)" if e.errno == errno.EROFS else
                    " (check the owner and mode of the data dir, or set AOTX_HOME)" if e.errno in (
                        errno.EACCES, errno.EPERM) else "")
            raise JournalError(f"cannot write the journal in {directory}: {describe_os_error(e)}{hint}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise JournalError(f"the journal in {directory} is in use by another process (lock {self.path} is "
                               "held); stop the running engine first") from None

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def remove_older_segments(directory: Path, number: int, fs: FileIO = OS) -> list[int]:
    """Unlink every segment numbered below ``number`` and fsync the directory."""
    removed = []
    for n, path in list_segments(directory):
        if n < number:
            fs.unlink(path)
            removed.append(n)
    if removed:
        fs.fsync_dir(directory)
    return removed
