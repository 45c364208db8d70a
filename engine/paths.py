"""Where AOTX keeps its files: one root for everything it writes.

The root is the platformdirs user data dir for ``aotx``, or ``$AOTX_HOME`` when
set (tests always set it to a temp dir). Every other path derives from it here;
nothing else in the code base picks a directory on its own.

Private by default: the data dir and every directory AOTX makes under it are
created 0700 (conversations, capsules and keys are the user's), and
``secure_data_dir`` (the engine runs it at start) tightens anything under the
root that other users could read or enter, for trees written by an older AOTX
or under a wide umask. A directory that cannot be created (a read-only file
system, a root owned by someone else) raises ``StorageError``: one line, exit 2.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from pathlib import Path

import platformdirs

from aotx.engine.errors import StorageError

PRIVATE_DIR = 0o700


def _why(e: OSError) -> str:
    if e.errno == errno.EROFS:
        return "the file system is read-only"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied (check its owner and mode, or set AOTX_HOME to a directory you own)"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full"
    if e.errno == errno.ENOTDIR:
        return "a file stands where a directory should be"
    return (e.strerror or str(e)).lower()


def private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) with mode 0700 unless it exists; return it.
    Raises ``StorageError`` naming the directory and why it cannot be made."""
    try:
        if not path.is_dir():
            missing = []
            p = path
            while not p.exists() and p.parent != p:
                missing.append(p)
                p = p.parent
            for d in reversed(missing):
                try:
                    os.mkdir(d, PRIVATE_DIR)
                except FileExistsError:
                    pass
            if not path.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
    except OSError as e:
        raise StorageError(f"cannot create the AOTX directory {path}: {_why(e)}") from None
    return path


def data_dir() -> Path:
    """The root of every file AOTX writes: ``$AOTX_HOME`` or the platform data dir."""
    home = os.environ.get("AOTX_HOME")
    root = Path(home).expanduser() if home else Path(platformdirs.user_data_dir("aotx", appauthor=False))
    return private_dir(root)


def runtime_dir() -> Path:
    """Directory for the engine's socket and lock: under ``$AOTX_HOME`` when set,
    else the platform runtime dir (falling back to the data dir). Mode 0700.

    On Linux without ``XDG_RUNTIME_DIR`` (containers, ssh, cron) the data dir's ``run``
    folder, not platformdirs' /tmp fallback: that one printed a RuntimeDirWarning on every
    command and lies outside the one root AOTX writes to."""
    if os.environ.get("AOTX_HOME"):
        return private_dir(data_dir() / "run")
    if sys.platform.startswith("linux") and not os.environ.get("XDG_RUNTIME_DIR"):
        return private_dir(data_dir() / "run")
    try:
        return private_dir(Path(platformdirs.user_runtime_dir("aotx", appauthor=False)))
    except StorageError:
        return private_dir(data_dir() / "run")


def models_dir() -> Path:
    """Folder scanned by ``aotx models`` for ``*.gguf`` files."""
    return private_dir(data_dir() / "models")


def journal_dir(create: bool = True) -> Path:
    """Folder of the journal's segment files and checkpoints (``create=False``: only
    name it, for commands that read)."""
    if not create:
        home = os.environ.get("AOTX_HOME")
        root = Path(home).expanduser() if home else Path(platformdirs.user_data_dir("aotx", appauthor=False))
        return root / "journal"
    return private_dir(data_dir() / "journal")


def capsules_dir() -> Path:
    """Folder of execution-state capsules written for resume after a restart."""
    return private_dir(data_dir() / "capsules")


def cache_dir() -> Path:
    """Folder for compiled-kernel caches and other rebuildable files."""
    return private_dir(data_dir() / "cache")


def socket_path() -> Path:
    """Default Unix socket of the engine."""
    return runtime_dir() / "engine.sock"


def startup_progress_paths(sock: Path) -> tuple[Path, Path]:
    """What an engine starting on ``sock`` says while it loads (JSON files beside the
    socket, removed once it answers): its stage (``<socket>.progress``) and the count of
    kernels compiled ahead (``<socket>.kernels``)."""
    return Path(str(sock) + ".progress"), Path(str(sock) + ".kernels")


def app_state_path() -> Path:
    """JSON file where the TUI remembers its theme and last conversation."""
    return data_dir() / "app_state.json"


def check_writable(directory: Path) -> None:
    """Raise ``StorageError`` unless a file can be created in ``directory`` (the
    engine checks its data dir before loading a model, so a read-only disk is one
    clear line at once, not a traceback later)."""
    probe = directory / f".aotx-write-test-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except FileExistsError:
        try:
            os.unlink(probe)
        except OSError:
            pass
    except OSError as e:
        raise StorageError(f"cannot write in the AOTX data dir {directory}: {_why(e)}") from None


#: subtrees of the data dir whose files are not AOTX's to re-mode (the user's models)
_NOT_OURS = ("models",)


def secure_data_dir(root: Path | None = None) -> tuple[list[str], list[str]]:
    """Make the data dir private: every directory 0700 at most and every file 0600
    at most (group and other bits cleared, symbolic links not followed; in the
    ``models`` folder only the folder itself: the model files in it are the user's).

    Returns ``(tightened, failed)``: paths whose mode was narrowed, and paths that
    stay readable by others because they could not be changed (another owner)."""
    root = data_dir() if root is None else root
    tightened: list[str] = []
    failed: list[str] = []

    def fix(path: Path, st: os.stat_result) -> None:
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            try:
                os.chmod(path, mode & 0o700, follow_symlinks=False)
                tightened.append(str(path))
            except (OSError, NotImplementedError):
                failed.append(str(path))

    try:
        fix(root, os.lstat(root))
    except OSError:
        return tightened, failed
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        names = dirnames + filenames
        if here == root:  # the models folder itself is made private, not the user's files in it
            dirnames[:] = [d for d in dirnames if d not in _NOT_OURS]
        for name in names:
            p = here / name
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode):
                continue
            fix(p, st)
    return tightened, failed
