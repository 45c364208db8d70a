"""``aotx conversations export ID -o PATH``: what PATH may be, and how the file is written.

The export renamed a temporary file over whatever PATH named: a device node
(``/dev/full`` became a regular file holding the conversation), a FIFO, a symbolic
link (the link itself replaced). Now a PATH that exists and is not a regular file is
refused by name and left as it was; the file is written private, given the user's
umask only once complete, then renamed into place.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from aotx.engine import protocol as P
from aotx.engine.errors import UsageError
from aotx.engine.present import export as E

CONV = P.ConversationView(conv_id="c1", title="Plans", messages=[
    P.MessageView(msg_id="m1", role="user", text="hello"),
    P.MessageView(msg_id="m2", role="assistant", text="hi there", status="complete")])


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_a_fifo_is_refused_by_name_and_left_a_fifo(tmp_path):
    fifo = tmp_path / "pipe.md"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match=r"it is a FIFO \(named pipe\), not a regular file; nothing was written"):
        E.write_export(CONV, fifo)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and leftovers(tmp_path) == []


def test_a_symbolic_link_is_refused_and_neither_it_nor_its_target_changes(tmp_path):
    target = tmp_path / "notes.md"
    target.write_text("mine\n")
    link = tmp_path / "link.md"
    link.symlink_to(target)
    with pytest.raises(UsageError, match=r"it is a symbolic link \(to .*notes.md\), not a regular file"):
        E.write_export(CONV, link)
    assert link.is_symlink() and target.read_text() == "mine\n" and leftovers(tmp_path) == []


def test_a_device_node_is_refused_and_nothing_is_created_beside_it(tmp_path):
    # a node of its own in the test's folder (never /dev: a build without the fix
    # would replace it): the null device's numbers
    dev = tmp_path / "full.md"
    try:
        os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")
    with pytest.raises(UsageError, match="it is a character device, not a regular file"):
        E.write_export(CONV, dev)
    assert stat.S_ISCHR(os.lstat(dev).st_mode) and leftovers(tmp_path) == []


def test_a_folder_is_refused(tmp_path):
    (tmp_path / "out.md").mkdir()
    with pytest.raises(UsageError, match="it is a directory, not a regular file"):
        E.write_export(CONV, tmp_path / "out.md")


def test_a_regular_file_is_replaced_whole_private_while_written_and_with_the_umask_after(tmp_path, monkeypatch):
    target = tmp_path / "plans.md"
    target.write_text("old\n")
    modes = []
    real_fsync = os.fsync

    def fsync(fd):
        modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    old = os.umask(0o027)
    try:
        E.write_export(CONV, target)
    finally:
        os.umask(old)
    assert modes == [0o600]  # nobody else could read it while it was being written
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # 0666 less the umask, once complete
    assert "hi there" in target.read_text() and leftovers(tmp_path) == []


def test_a_planted_temporary_name_is_never_followed(tmp_path):
    """The old export wrote ``.NAME.tmp`` with open(..., "w"): a link planted there was followed."""
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    (tmp_path / ".plans.md.tmp").symlink_to(victim)
    E.write_export(CONV, tmp_path / "plans.md")
    assert victim.read_text() == "keep\n" and "hello" in (tmp_path / "plans.md").read_text()


def test_the_cli_refuses_a_fifo_in_one_line(tmp_path):
    from aotx.engine.journal import ConversationCreated, Journal, MessageAccepted

    home = tmp_path / "home"
    with Journal(home / "journal") as j:
        j.publish(ConversationCreated("c1", "Plans"), 0)
        j.publish(MessageAccepted("c1", "m1", "user", "hello"), 0)
    fifo = tmp_path / "pipe.md"
    os.mkfifo(fifo)
    env = dict(os.environ, AOTX_HOME=str(home), PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", "conversations", "export", "c1", "-o",
                        str(fifo)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert "it is a FIFO (named pipe), not a regular file" in r.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_exporting_over_a_private_file_keeps_it_private(tmp_path):
    """An export over an existing file took the umask's mode: a file the user had made
    0600 (a conversation is private text) became readable by everyone (0644)."""
    old = os.umask(0o022)
    try:
        p = tmp_path / "talk.md"
        p.write_text("old\n")
        os.chmod(p, 0o600)
        E.write_export(CONV, p)
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600 and "hi there" in p.read_text()
        fresh = tmp_path / "new.md"
        E.write_export(CONV, fresh)
        assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o644  # a new file: the umask's mode
    finally:
        os.umask(old)
