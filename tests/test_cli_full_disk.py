"""``aotx run`` waiting for a receipt while the engine holds work for a full disk.

On a full disk ``aotx run`` waited for its last receipt for 11 minutes, ignored
SIGTERM (the README promises exit 143) and said nothing about the disk, though the
engine knew. Now it says so once on stderr (the engine's line: which disk, what it
needs, what is free) and a SIGTERM or Ctrl-C ends the wait with 143 or 130; the
engine keeps the reply and writes it once space returns.

The disk fills through the journal's file layer (``engine/fileio.py``): a ``FileIO``
whose segment writes fail with ENOSPC from the block holding the reply's
``MessageFinished`` on, after putting half of it down, until the test frees space.
The engine (a tiny llama) and its socket server run in this process; ``aotx run`` is
a real subprocess, so its signals are real.
"""

from __future__ import annotations

import asyncio
import errno
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from aotx.engine import protocol as P
from aotx.engine.fileio import FileIO
from aotx.engine.journal import MessageFinished, verify
from aotx.engine.journal.records import FrameError, decode_frame


class FillsAtTheReplysEnd(FileIO):
    """Segment writes fail with ENOSPC (half the block written first, as a filling disk
    does) from the first block that holds a MessageFinished on, while ``full``."""

    def __init__(self) -> None:
        self.paths: dict[int, str] = {}
        self.full = False
        self.armed = True
        self.failures = 0

    def open(self, path, flags, mode=0o600):
        fd = super().open(path, flags, mode)
        self.paths[fd] = str(path)
        return fd

    def writev(self, fd, buffers):
        if self.paths.get(fd, "").endswith(".seg"):
            data = b"".join(bytes(b) for b in buffers)
            if self.armed and not self.full and _holds_a_finish(data):
                self.full = True
            if self.full:
                super().writev(fd, [data[:len(data) // 2]])
                self.failures += 1
                raise OSError(errno.ENOSPC, "No space left on device")
        return super().writev(fd, buffers)


def _holds_a_finish(data: bytes) -> bool:
    off = 0
    while off < len(data):
        try:
            rec, _, _, off = decode_frame(data, off)
        except FrameError:
            return False
        if isinstance(rec, MessageFinished):
            return True
    return False


@pytest.fixture(scope="module")
def tiny(tiny_gguf, tmp_path_factory):
    from aotx.engine.model.loader import load_model

    return load_model(tiny_gguf.write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny.gguf", context_length=512),
                      device="cpu")


@pytest.fixture
def engine(tiny, tmp_path):
    from aotx.engine.ipc.server import Server
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store

    fs = FillsAtTheReplysEnd()
    store = open_store(tmp_path / "journal", fs=fs)
    eng = Engine(tiny, store, n_slots=1, n_ctx=256, prefill_chunk=64, device="cpu")
    sock_dir = Path(tempfile.mkdtemp(prefix="aotx-fd", dir="/tmp"))
    sock = sock_dir / "e.sock"

    def welcome() -> P.Welcome:
        return P.Welcome(protocol=P.PROTOCOL_VERSION, engine="aotx", model=tiny.name, device="cpu",
                         ready=eng.ready, pid=os.getpid(), journal=True)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = Server(eng, sock, welcome)
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    eng.start()
    yield eng, store, fs, sock
    fs.full = fs.armed = False  # space returns: the held records go down, the engine stops cleanly
    asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    eng.stop()
    store.close()
    shutil.rmtree(sock_dir, ignore_errors=True)


def start_run(sock: Path, tmp_path: Path) -> subprocess.Popen:
    env = dict(os.environ, AOTX_HOME=str(tmp_path / "home"), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.Popen([sys.executable, "-m", "aotx.engine.cli.commands", "run", "--socket", str(sock), "--raw",
                             "--temperature", "0", "--max-tokens", "6", "the"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def read_until(proc: subprocess.Popen, needle: str, timeout: float) -> str:
    """stderr of ``proc`` up to the line holding ``needle``."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    got = b""
    deadline = time.monotonic() + timeout
    while needle.encode() not in got:
        left = deadline - time.monotonic()
        assert left > 0 and proc.poll() is None, (proc.poll(), got.decode())
        if sel.select(left):
            chunk = os.read(proc.stderr.fileno(), 4096)
            assert chunk, got.decode()
            got += chunk
    return got.decode()


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_run_waiting_on_a_full_disk_says_so_once_and_exits_on_a_signal(engine, tmp_path, sig, code):
    eng, store, fs, sock = engine
    proc = start_run(sock, tmp_path)
    try:
        head = read_until(proc, "not yet durable", 60)
        assert fs.full and fs.failures >= 1
        assert "disk full" in head and str(store.journal.directory) in head and "free" in head
        t0 = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=20)
        assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = head + err.decode()
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr
    assert stderr.count("not yet durable: disk full") == 1, stderr  # said once
    assert f"stopped waiting for the reply's receipt ({signal.Signals(sig).name})" in stderr
    # the engine kept the reply: once space returns it is written and durable
    fs.full = fs.armed = False
    deadline = time.monotonic() + 30
    while store.journal.durable_seq < store.journal.last_seq:
        assert time.monotonic() < deadline, store.journal.stats()
        time.sleep(0.02)
    [conv] = store.table.live()
    reply = conv.messages[-1]
    assert reply.status == "complete" and reply.token_ids and reply.receipt is not None
    assert verify(store.journal.directory).ok


def test_a_new_run_while_the_disk_is_full_gets_one_line_not_a_traceback(engine, tmp_path):
    """With the engine holding work for a full disk, a second ``aotx run`` is refused when
    it creates its conversation; the refusal reached the user as a traceback
    (UnboundLocalError: the receipt watcher was not yet set when the error came)."""
    eng, store, fs, sock = engine
    first = start_run(sock, tmp_path)
    try:
        read_until(first, "not yet durable", 60)
        second = start_run(sock, tmp_path)
        out, err = second.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    text = err.decode()
    fs.full = fs.armed = False  # space returns: the first reply is written
    deadline = time.monotonic() + 30
    while store.journal.durable_seq < store.journal.last_seq:
        assert time.monotonic() < deadline, store.journal.stats()
        time.sleep(0.02)
    assert "Traceback" not in text, text
    assert second.returncode == 2, text
    assert len(text.strip().splitlines()) == 1 and "disk full" in text and str(store.journal.directory) in text
    assert len(store.table.live()) == 1  # the refused run wrote nothing
