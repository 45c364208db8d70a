"""Crash-consistency harness: every state a power loss could leave, recovered.

In the manner of SQLite's crash-test VFS (``test_vfs.c``) and ALICE/CrashMonkey:
the journal and capsule writers go through ``aotx.engine.fileio``; here a
``RecordingIO`` performs every call for real and records it (create, write at
its offset, fsync, truncate, rename, unlink, directory fsync), along with each
receipt the writer issued. ``Disk`` replays the record and, after every
operation, builds the states a power loss at that moment could leave:

* file data written since the file's last fsync: none of it, all of it, every
  prefix of the writes, each write torn at 512-byte sector boundaries (the first
  sectors persisted; or, reordered, only the later ones, the earlier ones
  reading as they were or as zeros), each write dropped while later ones stay;
* directory operations since the directory's last fsync (creates, renames,
  unlinks): every prefix of them, in order (a metadata-journaling file system
  such as ext4 commits them in order).

Each distinct state is written to a directory and recovered. Checks: recovery
never raises; every record a receipt had covered at that moment is recovered
with its exact content; the conversations equal a replay of the records
written, less only records that were never receipted; a second recovery finds
nothing to do and ``verify`` is clean. The number of states checked is printed
(the closing note quotes it); the harness is bounded to well under a minute.

Workloads: the engine's writer (segment rotation, a streamed online checkpoint
and the removal of the segments it replaces, more records after it), offline
compaction, salvage of a damaged segment, and capsule writes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from aotx.engine.fileio import FileIO
from aotx.engine.journal import (
    ConversationCreated, ConversationDeleted, ConversationTable, Journal, MessageAccepted, MessageFinished,
    TokensCommitted, compact, recover, verify,
)
from aotx.engine.journal.records import CHECKPOINT_RECORDS, HEADER_BYTES, Gap

SECTOR = 512


# ---- recording -------------------------------------------------------------------------

class RecordingIO(FileIO):
    """Performs every operation and appends it to ``ops`` as the model needs it.

    Files are named by an object id assigned when a name is created (inode
    numbers are reused by the file system after an unlink, ids are not). Paths
    are recorded relative to ``root``."""

    def __init__(self, root: Path, initial: dict[str, int]):
        self.root = Path(root)
        self.ops: list[tuple] = []
        self.lock = threading.Lock()
        self.names = dict(initial)  # volatile name -> object id
        self.next_id = max(initial.values(), default=0) + 1
        self.fds: dict[int, tuple[int, bool]] = {}  # fd -> (object id, O_APPEND)

    def rel(self, path) -> str:
        return str(Path(path).resolve().relative_to(self.root.resolve()))

    def mark(self, *op) -> None:
        with self.lock:
            self.ops.append(op)

    def open(self, path, flags, mode=0o600):
        name = self.rel(path)
        with self.lock:
            fd = super().open(path, flags, mode)
            if name in self.names and not (flags & os.O_EXCL):
                obj = self.names[name]
                if flags & os.O_TRUNC:
                    self.ops.append(("trunc", obj, 0))
            else:
                obj = self.next_id
                self.next_id += 1
                self.names[name] = obj
                self.ops.append(("create", name, obj))
            self.fds[fd] = (obj, bool(flags & os.O_APPEND))
        return fd

    def _pos(self, fd: int) -> int:
        obj, append = self.fds[fd]
        return os.fstat(fd).st_size if append else os.lseek(fd, 0, os.SEEK_CUR)

    def write(self, fd, data):
        with self.lock:
            pos = self._pos(fd)
            n = super().write(fd, data)
            self.ops.append(("write", self.fds[fd][0], pos, bytes(memoryview(data)[:n])))
        return n

    def writev(self, fd, buffers):
        with self.lock:
            pos = self._pos(fd)
            n = super().writev(fd, buffers)
            self.ops.append(("write", self.fds[fd][0], pos, b"".join(bytes(b) for b in buffers)[:n]))
        return n

    def pwrite(self, fd, data, offset):
        with self.lock:
            n = super().pwrite(fd, data, offset)
            self.ops.append(("write", self.fds[fd][0], offset, bytes(data[:n])))
        return n

    def fsync(self, fd):
        super().fsync(fd)
        self.mark("fsync", self.fds[fd][0])

    def fdatasync(self, fd):
        super().fdatasync(fd)
        self.mark("fsync", self.fds[fd][0])

    def ftruncate(self, fd, size):
        with self.lock:
            super().ftruncate(fd, size)
            self.ops.append(("trunc", self.fds[fd][0], size))

    def close(self, fd):
        with self.lock:
            super().close(fd)
            self.fds.pop(fd, None)

    def replace(self, src, dst):
        with self.lock:
            super().replace(src, dst)
            s, d = self.rel(src), self.rel(dst)
            self.names[d] = self.names.pop(s)
            self.ops.append(("rename", s, d))

    def unlink(self, path):
        with self.lock:
            super().unlink(path)
            name = self.rel(path)
            self.names.pop(name, None)
            self.ops.append(("unlink", name))

    def fsync_dir(self, path):
        super().fsync_dir(path)
        self.mark("fsync_dir")


def snapshot(root: Path) -> tuple[dict[str, bytes], dict[str, int]]:
    """The files under ``root`` (all durable: the state a workload starts from)."""
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != "LOCK":
            files[str(p.relative_to(root))] = p.read_bytes()
    return files, {name: i + 1 for i, name in enumerate(files)}


# ---- the model of the disk ---------------------------------------------------------------

def _apply(data: bytearray, op: tuple) -> None:
    if op[0] == "w":
        _, off, b = op
        if off > len(data):
            data.extend(bytes(off - len(data)))
        data[off:off + len(b)] = b
    else:
        del data[op[1]:]


def _sample(xs: list, k: int) -> list:
    if len(xs) <= k:
        return xs
    step = (len(xs) - 1) / (k - 1)
    return sorted({xs[round(i * step)] for i in range(k)})


def _variants(pending: list[tuple]) -> list[list[tuple]]:
    """The subsets of ``pending`` (writes and truncates since the last fsync, in
    order) that a power loss can leave persisted, torn at sector boundaries."""
    out: list[list[tuple]] = [[], list(pending)]
    n = len(pending)
    out += [pending[:j] for j in _sample(list(range(1, n)), 8)]
    for j, op in enumerate(pending):
        if op[0] != "w":
            continue
        _, off, b = op
        cuts = [c for c in range((off // SECTOR + 1) * SECTOR, off + len(b), SECTOR)]
        for c in _sample(cuts, 6):
            out.append(pending[:j] + [("w", off, b[:c - off])])  # the first sectors reached the disk
            out.append(pending[:j] + [("w", c, b[c - off:])])  # only the later ones did (reordered)
    if n >= 2:
        out += [pending[:j] + pending[j + 1:] for j in _sample(list(range(n)), 6)]  # one write lost
    return out


class Disk:
    """Replays a ``RecordingIO`` record and yields the crash states after each op."""

    def __init__(self, initial: dict[str, bytes], ids: dict[str, int]):
        self.vol = {ids[n]: bytearray(b) for n, b in initial.items()}  # object -> volatile content
        self.dur = {ids[n]: bytes(b) for n, b in initial.items()}  # object -> content at its last fsync
        self.pending: dict[int, list[tuple]] = {}
        self.names = dict(ids)  # volatile
        self.dnames = dict(ids)  # durable (as of the last directory fsync)
        self.dpending: list[tuple] = []

    def step(self, op: tuple) -> None:
        kind = op[0]
        if kind == "create":
            _, name, obj = op
            self.vol[obj] = bytearray()
            self.dur[obj] = b""
            self.names[name] = obj
            self.dpending.append(op)
        elif kind == "write":
            _, obj, off, b = op
            _apply(self.vol[obj], ("w", off, b))
            self.pending.setdefault(obj, []).append(("w", off, b))
        elif kind == "trunc":
            _, obj, size = op
            _apply(self.vol[obj], ("t", size))
            self.pending.setdefault(obj, []).append(("t", size))
        elif kind == "fsync":
            obj = op[1]
            self.dur[obj] = bytes(self.vol[obj])
            self.pending.pop(obj, None)
        elif kind == "rename":
            _, s, d = op
            self.names[d] = self.names.pop(s)
            self.dpending.append(op)
        elif kind == "unlink":
            self.names.pop(op[1], None)
            self.dpending.append(op)
        elif kind == "fsync_dir":
            self.dnames = self._names_after(len(self.dpending))
            self.dpending = []

    def _names_after(self, k: int) -> dict[str, int]:
        names = dict(self.dnames)
        for op in self.dpending[:k]:
            if op[0] == "create":
                names[op[1]] = op[2]
            elif op[0] == "rename":
                if op[1] in names:
                    names[op[2]] = names.pop(op[1])
            elif op[0] == "unlink":
                names.pop(op[1], None)
        return names

    def states(self):
        """Every crash state now: ``{name: bytes}`` maps (duplicates included)."""
        dir_views = [self._names_after(k) for k in _sample(list(range(len(self.dpending) + 1)), 6)]
        for names in dir_views:
            objs = set(names.values())
            for others in ("none", "all"):
                base = {o: (bytes(self.vol[o]) if others == "all" else self.dur[o]) for o in objs}
                yield {n: base[o] for n, o in names.items()}
                for obj in objs:
                    for var in _variants(self.pending.get(obj, [])):
                        data = bytearray(self.dur[obj])
                        for op in var:
                            _apply(data, op)
                        files = {n: (bytes(data) if o == obj else base[o]) for n, o in names.items()}
                        yield files


def crash_states(initial: dict[str, bytes], ids: dict[str, int], ops: list[tuple]):
    """``(op index, receipted seq at that moment, state)`` for each distinct state."""
    disk = Disk(initial, ids)
    seen: set[bytes] = set()
    receipted = 0
    yield from _distinct(disk, -1, receipted, seen)
    for i, op in enumerate(ops):
        if op[0] == "receipt":
            receipted = max(receipted, op[1])
            continue
        disk.step(op)
        yield from _distinct(disk, i, receipted, seen)


def _distinct(disk: Disk, i: int, receipted: int, seen: set[bytes]):
    for files in disk.states():
        h = hashlib.blake2b(digest_size=16)
        for name in sorted(files):
            h.update(name.encode() + b"\0" + hashlib.blake2b(files[name], digest_size=16).digest())
        key = h.digest()
        if key in seen:
            continue
        seen.add(key)
        yield i, receipted, files


def materialize(files: dict[str, bytes], d: Path) -> None:
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    for name, data in files.items():
        p = d / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


# ---- checks --------------------------------------------------------------------------------

def _view(table: ConversationTable) -> list[dict]:
    out = []
    for c in table.live():
        d = c.to_dict(messages=True)
        d.pop("seq", None)
        for m in d.get("messages", []):
            m.pop("receipt", None)
            m.pop("seq", None)
        out.append(d)
    return out


def check_journal_state(d: Path, receipted: int, published: dict[int, object], lost_ok=lambda seq: False,
                        again: bool = True):
    """Recover ``d`` and check it against the records written (``published``: seq ->
    record, checkpoint records excluded); ``again``: recover a second time and verify
    (nothing left to do). Returns the recovery report."""
    rep = recover(d, keep_records=True)
    assert rep.last_seq >= receipted, f"receipted seq {receipted} lost: recovered up to {rep.last_seq}"
    lost: set[int] = set()
    for e in rep.records:
        if isinstance(e.record, Gap):
            lost |= set(range(e.seq, e.record.last_seq + 1))
        elif not isinstance(e.record, CHECKPOINT_RECORDS):
            assert e.record == published[e.seq], f"seq {e.seq} recovered with other content"
    for s in lost:
        assert s > receipted or lost_ok(s), f"receipted seq {s} lost to salvage"
    ref = ConversationTable()
    for s in sorted(published):
        if s <= rep.last_seq and s not in lost:
            ref.apply(published[s], s)
    ref.finish_recovery()
    assert _view(rep.table) == _view(ref)
    if again or rep.damage or rep.bytes_dropped:
        second = recover(d)
        assert second.damage == [] and second.bytes_dropped == 0 and second.last_seq == rep.last_seq
        assert verify(d).ok
    return rep


class Budget:
    """Counts states and stops a workload's loop when its share of time is spent."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds
        self.n = 0

    def spent(self) -> bool:
        return time.monotonic() > self.deadline


def _run_states(workdir: Path, initial, ids, ops, check, budget: Budget) -> int:
    n = 0
    d = workdir / "state"
    for i, receipted, files in crash_states(initial, ids, ops):
        materialize(files, d)
        try:
            check(d, receipted, i)
        except AssertionError as e:
            raise AssertionError(f"crash state after op {i} ({ops[i] if i >= 0 else 'start'}): {e}") from None
        n += 1
        budget.n += 1
        if budget.spent():
            break
    return n


# ---- workloads -----------------------------------------------------------------------------

def _writer_workload(d: Path) -> tuple[RecordingIO, dict[int, object], dict[str, bytes], dict[str, int]]:
    """The engine's pattern: conversations, user messages, replies streamed a few
    tokens per tick with a flush per tick, segments rotating, one conversation
    deleted, a streamed online checkpoint in small parts, more records after it."""
    d.mkdir(parents=True, exist_ok=True)
    initial, ids = snapshot(d)
    fs = RecordingIO(d, ids)
    published: dict[int, object] = {}
    table = ConversationTable()

    def on_receipt(r):
        fs.mark("receipt", r.last_seq)

    j = Journal(d, segment_bytes=8192, buffer_bytes=32768, fs=fs, on_receipt=on_receipt, part_bytes=1500)

    def pub(rec, tick):
        seq = j.publish(rec, tick)
        published[seq] = rec
        table.apply(rec, seq, tick)

    def tick_flush():
        j.flush()
        j.wait_durable(j.last_seq, 10)

    for k in range(3):
        pub(ConversationCreated(f"c{k}", f"chat {k}", float(k)), 0)
        pub(MessageAccepted(f"c{k}", f"u{k}", "user", "hello " * (k + 1)), 0)
        pub(MessageAccepted(f"c{k}", f"r{k}", "assistant"), 0)
    tick_flush()
    pos = [0, 0, 0]
    for t in range(1, 41):
        for k in range(3):  # a tick's block spans one to three sectors
            pub(TokensCommitted(f"c{k}", f"r{k}", pos[k], [t, t + 1], f"<{t}>" * (1 + (t * 7 + k * 5) % 40)), t)
            pos[k] += 2
        tick_flush()
    pub(MessageFinished("c0", "r0", "stop", 3, pos[0]), 41)
    pub(ConversationDeleted("c2"), 41)
    tick_flush()
    j.checkpoint(table, 42)
    for t in range(43, 55):
        pub(TokensCommitted("c1", "r1", pos[1], [t], f"[{t}]" * 20), t)
        pos[1] += 1
        tick_flush()
    pub(MessageFinished("c1", "r1", "length", 3, pos[1]), 55)
    tick_flush()
    # group commit: several ticks' blocks queue while the disk is busy and go out in
    # one write (many sectors) and one fsync
    j._sync = lambda fd: (time.sleep(0.02), fs.fdatasync(fd))  # a busy disk
    pub(MessageAccepted("c1", "u9", "user", "again " * 30), 56)
    pub(MessageAccepted("c1", "r9", "assistant"), 56)
    p9 = 0
    for t in range(57, 137):
        pub(TokensCommitted("c1", "r9", p9, [t, t, t], f"({t})" * (5 + t % 17)), t)
        p9 += 3
        j.flush()
        time.sleep(0.005)
        if t % 8 == 0:
            j.wait_durable(j.last_seq, 10)
    pub(MessageFinished("c1", "r9", "stop", 9, p9), 137)
    j.close()
    return fs, published, initial, ids


@pytest.fixture(scope="module")
def report_count():
    counts: dict[str, int] = {}
    yield counts


def test_power_loss_at_every_point_of_the_writer_loses_no_receipted_record(tmp_path, capsys):
    t0 = time.monotonic()
    fs, published, initial, ids = _writer_workload(tmp_path / "journal")
    assert any(op[0] == "unlink" for op in fs.ops)  # the checkpoint removed the segments it replaced
    assert sum(1 for op in fs.ops if op[0] == "create" and op[1].endswith(".seg")) >= 3  # 2 rotations + the checkpoint
    budget = Budget(40)
    n = _run_states(tmp_path, initial, ids, fs.ops,  # every 3rd clean state is also recovered twice
                    lambda d, receipted, i: check_journal_state(d, receipted, published, again=budget.n % 3 == 0),
                    budget)
    with capsys.disabled():
        print(f"\n[crash states] writer: {n} distinct power-loss states recovered from {len(fs.ops)} recorded "
              f"operations in {time.monotonic() - t0:.1f} s")
    assert n >= 1000


def test_power_loss_during_offline_compaction_and_salvage(tmp_path, capsys):
    t0 = time.monotonic()
    _, published, _, _ = _writer_workload(tmp_path / "journal")
    total = 0
    # offline compaction of the finished journal
    work = tmp_path / "compact"
    shutil.copytree(tmp_path / "journal", work)
    initial, ids = snapshot(work)
    fs = RecordingIO(work, ids)
    compact(work, fs=fs)
    assert any(op[0] == "rename" for op in fs.ops)
    last = max(published)
    total += _run_states(tmp_path / "c", initial, ids, fs.ops,
                         lambda d, receipted, i: check_journal_state(d, last, published), Budget(12))
    # salvage: an acknowledged record damaged in the middle of the last segment
    work = tmp_path / "salvage"
    shutil.copytree(tmp_path / "journal", work)
    seg = sorted(work.glob("*.seg"))[-1]
    data = bytearray(seg.read_bytes())
    data[HEADER_BYTES + 200] ^= 0x10
    seg.write_bytes(bytes(data))
    initial, ids = snapshot(work)
    fs = RecordingIO(work, ids)
    rep = recover(work, fs=fs)
    assert rep.damage and rep.damage[0]["n_lost"] == 1
    lost = rep.damage[0]["first_lost"]
    total += _run_states(tmp_path / "s", initial, ids, fs.ops,
                         lambda d, receipted, i: check_journal_state(d, last, published, lambda s: s == lost),
                         Budget(8))
    with capsys.disabled():
        print(f"\n[crash states] compaction + salvage: {total} distinct power-loss states recovered in "
              f"{time.monotonic() - t0:.1f} s")
    assert total >= 50


def test_power_loss_during_capsule_writes_never_leaves_a_bad_capsule(tmp_path, capsys):
    import numpy as np

    from aotx.engine.state import capsule as C
    from aotx.engine.state.cache import CapsuleCache

    t0 = time.monotonic()
    root = tmp_path / "caps"
    root.mkdir()

    def cap(n: int, fill: float) -> C.Capsule:
        k = np.full((2, 2, n, 8), fill, np.float32)
        toks = np.arange(n, dtype=np.int32)
        hdr = C.CapsuleHeader(fingerprint="fp", backend="cpu", layout="kv", n_tokens=n,
                              shapes={"k": list(k.shape), "v": list(k.shape), "tokens": [n]},
                              crc32c=C._crc(k, k, toks))
        return C.Capsule(hdr, k, k.copy(), toks)

    old, new = cap(40, 1.0), cap(70, 2.0)  # 5 KiB and 9 KiB: several sectors each
    C.save(old, root / "c1.caps")
    initial, ids = snapshot(root)
    fs = RecordingIO(root, ids)
    C.save(new, root / "c1.caps", fs)
    fs.mark("receipt", 1)  # from here on the new capsule must be what a crash leaves
    C.save(cap(10, 3.0), root / "c2.caps", fs)

    def check(d: Path, done: int, i: int) -> None:
        cache = CapsuleCache(d, fingerprint="fp")
        assert not list(d.glob("*.tmp"))  # a crash's temporary file is removed when the cache opens
        got = C.load(d / "c1.caps")  # always a whole, verified capsule
        assert got.n_tokens == (70 if done else got.n_tokens) and got.n_tokens in (40, 70)
        if (d / "c2.caps").exists():
            assert C.load(d / "c2.caps").n_tokens == 10
        assert set(cache.disk) <= {"c1", "c2"}

    n = _run_states(tmp_path / "w", initial, ids, fs.ops, check, Budget(8))
    with capsys.disabled():
        print(f"\n[crash states] capsules: {n} distinct power-loss states checked in {time.monotonic() - t0:.1f} s")
    assert n >= 50


class FullDiskIO(RecordingIO):
    """Records like ``RecordingIO``; while ``full`` is set, a segment write puts half its
    bytes on disk and then fails with ENOSPC (as a write that runs out of space does)."""

    full = False
    failures = 0

    def writev(self, fd, buffers):
        if self.full:
            data = b"".join(bytes(b) for b in buffers)
            half = len(data) // 2
            if half:
                super().writev(fd, [data[:half]])
            self.failures += 1
            raise OSError(28, "No space left on device")
        return super().writev(fd, buffers)


def test_power_loss_while_the_disk_is_full_and_after_space_returns(tmp_path, capsys):
    """The no-space path (a partial write, the truncate back to the durable size, the
    retry) under power loss: receipted records survive every state."""
    t0 = time.monotonic()
    d = tmp_path / "journal"
    d.mkdir()
    initial, ids = snapshot(d)
    fs = FullDiskIO(d, ids)
    published: dict[int, object] = {}
    j = Journal(d, segment_bytes=8192, buffer_bytes=32768, fs=fs, on_receipt=lambda r: fs.mark("receipt", r.last_seq))

    def pub(rec, tick):
        published[j.publish(rec, tick)] = rec

    pub(ConversationCreated("c", "t"), 0)
    pub(MessageAccepted("c", "r", "assistant"), 0)
    for t in range(1, 40):
        if t == 10:
            fs.full = True
        pub(TokensCommitted("c", "r", 2 * t, [t, t], f"<{t}>" * (3 + t % 11)), t)
        j.flush()
        if t == 14:
            deadline = time.monotonic() + 10
            while not j.degraded and time.monotonic() < deadline:
                time.sleep(0.01)
            assert "disk full" in j.degraded and not j.reserve(100)
            time.sleep(0.3)  # a few retries, each a partial write cut back
            fs.full = False
        if not fs.full:
            j.wait_durable(j.last_seq, 10)
    j.close()
    assert fs.failures >= 2 and any(op[0] == "trunc" for op in fs.ops)
    n = _run_states(tmp_path, initial, ids, fs.ops,
                    lambda d, receipted, i: check_journal_state(d, receipted, published), Budget(10))
    with capsys.disabled():
        print(f"\n[crash states] disk full: {n} distinct power-loss states recovered ({fs.failures} writes failed "
              f"for want of space) in {time.monotonic() - t0:.1f} s")
    assert n >= 100

