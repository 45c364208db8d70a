"""The data dir and its segment files when something is wrong with them: a read-only
data dir, an unreadable segment, a directory named ``*.seg``, a FIFO named ``*.seg``.
Each gives one clear line and exit code 2, never a traceback, never a hang.

Permissions do not bind root: when the tests run as root, each command runs with
every capability dropped (``setpriv --bounding-set=-all``), so that the file modes
bind it as they bind any user; without root the commands run as they are.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aotx.engine.errors import AotxError, JournalError
from aotx.engine.journal import ConversationCreated, Journal, MessageAccepted

TIMEOUT = 60  # seconds: far more than any of these needs; a hang fails the test


def _unprivileged() -> list[str]:
    """A command prefix under which file modes bind (root drops its capabilities)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: file modes would not bind the commands")
    return [setpriv, "--inh-caps=-all", "--bounding-set=-all", "--"]


def aotx(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, AOTX_HOME=str(home))
    return subprocess.run([*_unprivileged(), sys.executable, "-m", "aotx.engine.cli.commands", *args], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT, cwd="/")


def one_line_error(r: subprocess.CompletedProcess, *words: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines and lines[-1].startswith("aotx: "), r.stderr
    for w in words:
        assert w in lines[-1], (w, lines[-1])
    return lines[-1]


@pytest.fixture
def home(tmp_path):
    """A data dir with a journal of two records."""
    h = tmp_path / "home"
    with Journal(h / "journal") as j:
        j.publish(ConversationCreated("c1", "hello"), 0)
        j.publish(MessageAccepted("c1", "m1", "user", "hi"), 0)
    return h


def test_verify_works_on_a_healthy_journal_as_that_user(home):
    r = aotx(home, "journal", "verify")
    assert r.returncode == 0 and "2 records" in r.stdout, (r.stdout, r.stderr)


def test_a_fifo_named_like_a_segment_neither_hangs_verify_nor_the_engine_start(home):
    """Regression: a FIFO named *.seg hung `journal verify` and the engine's start."""
    os.mkfifo(home / "journal" / "0000000002.seg")
    line = one_line_error(aotx(home, "journal", "verify"), "0000000002.seg", "FIFO")
    assert "regular file" in line
    one_line_error(aotx(home, "journal", "repair"), "FIFO")
    from aotx.engine.runtime.store import open_store

    with pytest.raises(JournalError, match="FIFO"):  # the engine's start: open_store recovers the journal
        open_store(home / "journal")


def test_a_directory_named_like_a_segment_is_one_line(home):
    """Regression: a directory named *.seg gave a raw traceback (exit code 1)."""
    (home / "journal" / "0000000002.seg").mkdir()
    one_line_error(aotx(home, "journal", "verify"), "0000000002.seg", "a directory")
    one_line_error(aotx(home, "journal", "compact"), "a directory")


def test_an_unreadable_segment_is_one_line(home):
    """Regression: an unreadable segment gave a raw traceback (exit code 1)."""
    seg = home / "journal" / "0000000001.seg"
    seg.chmod(0o000)
    try:
        one_line_error(aotx(home, "journal", "verify"), "cannot read journal segment", "permission denied")
        one_line_error(aotx(home, "journal", "repair"), "permission denied")
    finally:
        seg.chmod(0o600)


def test_a_read_only_data_dir_is_one_line(home):
    """Regression: a read-only data dir gave raw tracebacks (exit code 1): the engine
    refuses before loading anything, journal commands that write say so, reads work."""
    (home / "run").mkdir(mode=0o700)
    seg = home / "journal" / "0000000001.seg"
    data = bytearray(seg.read_bytes())
    data[-6] ^= 1  # damage: salvaging it must write a copy beside the segment
    seg.write_bytes(bytes(data))
    for p in [home, *home.rglob("*")]:
        if p.is_dir():
            p.chmod(0o555)
    try:
        one_line_error(aotx(home, "serve", "--device", "cpu"), str(home), "permission denied")
        (home / "run").chmod(0o700)  # the socket's folder exists, the data dir is read-only:
        one_line_error(aotx(home, "run", "hi"), "engine.log", "permission denied")  # spawning cannot log
        one_line_error(aotx(home, "journal", "repair"), "journal", "permission denied")
        one_line_error(aotx(home, "journal", "compact"), "journal", "permission denied")
        r = aotx(home, "journal", "verify")  # reading needs no write access
        assert r.returncode == 1 and "damage" in r.stdout and not r.stderr, r.stderr
    finally:
        for p in [home, *home.rglob("*")]:
            if p.is_dir():
                p.chmod(0o700)


def test_a_data_dir_that_cannot_be_created_is_one_line(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o555)
    parent.chmod(0o555)
    one_line_error(aotx(parent / "home", "serve", "--device", "cpu"), "cannot create the AOTX directory",
                   str(parent / "home"))


def test_storage_errors_are_aotx_errors():
    from aotx.engine.errors import StorageError

    assert issubclass(StorageError, AotxError) and StorageError.exit_code == 2
