"""Capsule files on disk: private modes, no temporary file left by a failed write or a
crash, checkpoints written 0600."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from aotx.engine.state import capsule as C
from aotx.engine.state.cache import CapsuleCache


def _cap(n: int = 64, fill: float = 1.0) -> C.Capsule:
    k = np.full((2, 2, n, 8), fill, np.float32)
    toks = np.arange(n, dtype=np.int32)
    hdr = C.CapsuleHeader(fingerprint="fp", backend="cpu", layout="kv", n_tokens=n,
                          shapes={"k": list(k.shape), "v": list(k.shape), "tokens": [n]}, crc32c=C._crc(k, k, toks))
    return C.Capsule(hdr, k, k.copy(), toks)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture
def wide_umask():
    """The common default umask (022), under which main's tree wrote capsules 0644."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_capsules_are_written_0600_in_0700_directories(tmp_path, monkeypatch, wide_umask):
    """Regression: capsules were written 0644 in 0755 directories under the data dir (their
    token buffers decode to the user's text)."""
    monkeypatch.setenv("AOTX_HOME", str(tmp_path / "home"))
    from aotx.engine import paths

    caps = CapsuleCache(paths.capsules_dir() / "fingerprint", fingerprint="fp")
    path = caps.store_on_disk("c1", _cap())
    assert mode(path) == 0o600
    for d in (path.parent, paths.capsules_dir(), paths.data_dir()):
        assert mode(d) == 0o700, d


def test_compaction_checkpoints_are_written_0600(tmp_path, wide_umask):
    """Regression: `aotx journal compact` wrote its checkpoint segment 0644."""
    from aotx.engine.journal import ConversationCreated, Journal, compact

    with Journal(tmp_path) as j:
        j.publish(ConversationCreated("c", "private"), 0)
    rep = compact(tmp_path)
    assert rep.segment is not None
    for p in tmp_path.iterdir():
        assert mode(p) == 0o600, p


class FullDisk:
    """A file layer whose writes fail with ENOSPC once ``room`` bytes were written."""

    def __init__(self, room: int):
        from aotx.engine.fileio import FileIO

        outer = self

        class IO(FileIO):
            def write(self, fd, data):
                n = len(memoryview(data))
                if outer.room < n:
                    if outer.room > 0:  # a short write first, as a filling disk does
                        k = outer.room
                        outer.room = 0
                        return super().write(fd, memoryview(data)[:k])
                    raise OSError(errno.ENOSPC, "No space left on device")
                outer.room -= n
                return super().write(fd, data)

        self.room = room
        self.io = IO()


def test_a_capsule_write_that_fills_the_disk_leaves_no_temporary_file(tmp_path):
    """Regression: a capsule write on a full disk left a 2 MB `.caps.tmp` that kept the disk
    full, so every later message failed with [Errno 28], even after a restart."""
    disk = FullDisk(room=4096)
    caps = CapsuleCache(tmp_path, fingerprint="fp", fs=disk.io)
    with pytest.raises(OSError) as e:
        caps.store_on_disk("c1", _cap(2000))
    assert e.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no .caps.tmp, no partial capsule
    assert caps.usage()["write_errors"] == 1 and "c1" not in caps.disk
    disk.room = 1 << 30  # space is back
    path = caps.store_on_disk("c1", _cap(100))
    assert C.load(path).n_tokens == 100


def test_a_failed_save_never_replaces_a_good_capsule(tmp_path):
    path = tmp_path / "c1.caps"
    C.save(_cap(50), path)
    disk = FullDisk(room=100)
    with pytest.raises(OSError):
        C.save(_cap(500, 2.0), path, disk.io)
    assert C.load(path).n_tokens == 50 and not (tmp_path / "c1.caps.tmp").exists()


def test_eviction_to_a_full_disk_drops_the_capsule_instead_of_failing_the_tick(tmp_path):
    disk = FullDisk(room=0)
    caps = CapsuleCache(tmp_path, fingerprint="fp", host_bytes=1, fs=disk.io)
    caps.park("c1", _cap(64))  # over the host budget: evicted to disk, which is full
    assert caps.usage()["write_errors"] == 1 and not list(tmp_path.iterdir())


def test_temporary_capsules_a_crash_left_are_removed_when_the_cache_opens(tmp_path):
    """Regression: the tmp file was never removed, so the disk stayed full across restarts."""
    (tmp_path / "c1.caps.tmp").write_bytes(b"\0" * (2 << 20))
    C.save(_cap(30), tmp_path / "c2.caps")
    caps = CapsuleCache(tmp_path, fingerprint="fp")
    assert not (tmp_path / "c1.caps.tmp").exists()
    assert set(caps.disk) == {"c2"}


def test_a_capsule_path_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "c1.caps")
    with pytest.raises(C.CapsuleError, match="FIFO"):
        C.load(tmp_path / "c1.caps")
    caps = CapsuleCache(tmp_path, fingerprint="fp")
    assert "c1" not in caps.disk


def test_bug_the_disk_homes_usage_is_its_files_bytes(tmp_path):
    """`aotx status` said 'disk 2.8 KiB in 4' for 15 MB of capsule files: write_file counted
    len() of each array's view (a 4-D K counts its layers), not its bytes."""
    caps = CapsuleCache(tmp_path, fingerprint="fp")
    paths = [caps.store_on_disk(f"c{i}", _cap(64 * (i + 1))) for i in range(3)]
    on_disk = sum(p.stat().st_size for p in paths)
    assert on_disk > 3 * 2 * 2 * 2 * 64 * 8 * 4     # K and V of every capsule, at least
    assert caps.usage()["disk_bytes"] == on_disk and caps.usage()["disk_count"] == 3
