"""Private by default: the data dir and everything under it
0700/0600, the engine's umask 077, wider modes left by an older AOTX tightened at
start; another local user can read no file and cannot connect to the socket."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from aotx.engine.journal import ConversationCreated, Journal


def mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def test_wider_modes_left_by_an_older_aotx_are_tightened_at_start(tmp_path, monkeypatch):
    """Regression: capsules 0644 in 0755 directories and a 0644 compaction checkpoint made
    conversations readable by other users; the engine's start now makes them private."""
    home = tmp_path / "home"
    monkeypatch.setenv("AOTX_HOME", str(home))
    old = os.umask(0o022)
    try:
        for d in ("journal", "capsules/fp", "run", "models"):
            (home / d).mkdir(parents=True, mode=0o755)
        home.chmod(0o755)
        (home / "capsules" / "fp" / "c1.caps").write_bytes(b"tokens of the user's text")
        (home / "journal" / "0000000003.seg").write_bytes(b"checkpoint")
        (home / "engine.log").write_text("log")
        (home / "models" / "mine.gguf").write_bytes(b"GGUF")  # the user's model file: not ours to re-mode
    finally:
        os.umask(old)
    from aotx.engine.cli.serve import check_data_dir

    check_data_dir()
    for p in [home, *home.rglob("*")]:
        if p.parent.name == "models":  # the user's model files are not AOTX's to re-mode
            continue
        want = 0o700 if p.is_dir() else 0o600
        assert mode(p) & 0o077 == 0 and mode(p) <= want, (p, oct(mode(p)))
    assert mode(home / "models" / "mine.gguf") == 0o644


def test_everything_the_journal_writes_is_private_under_any_umask(tmp_path):
    old = os.umask(0)
    try:
        d = tmp_path / "j"
        with Journal(d, segment_bytes=4096) as j:
            for i in range(100):
                j.publish(ConversationCreated(f"c{i}", "x" * 50), 0)
                j.flush()
    finally:
        os.umask(old)
    assert mode(d) == 0o700
    assert {p.name: mode(p) for p in d.iterdir()} == {p.name: 0o600 for p in d.iterdir()}


PROBE = r"""
import json, os, socket, sys
paths, sock = json.loads(sys.argv[1]), sys.argv[2]
out = {}
for p in paths:
    try:
        if os.path.isdir(p) and not os.path.islink(p):
            os.listdir(p)
        else:
            with open(p, "rb") as fh:
                fh.read(1)
        out[p] = "READ"
    except OSError as e:
        out[p] = e.__class__.__name__
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sock)
    out[sock] = "CONNECTED"
except OSError as e:
    out[sock] = e.__class__.__name__
print(json.dumps(out))
"""


def _system_python() -> str | None:
    for p in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        if os.access(p, os.X_OK):
            return p
    return None


@pytest.fixture
def other_user():
    """A second local user, created for the test and removed after (needs root and useradd)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a second local user with useradd (run the suite as root to include it)")
    useradd, userdel = shutil.which("useradd"), shutil.which("userdel")
    if not useradd or not userdel:
        pytest.skip("useradd/userdel are not installed")
    name = f"aotxprobe{secrets.token_hex(3)}"
    subprocess.run([useradd, "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group", name], check=True,
                   capture_output=True)
    try:
        import pwd

        pw = pwd.getpwnam(name)
        yield pw.pw_uid, pw.pw_gid
    finally:
        subprocess.run([userdel, name], capture_output=True)


def test_a_second_local_user_can_read_nothing_and_cannot_connect(other_user, default_model_path):
    python = _system_python()
    if python is None:
        pytest.skip("no system python3 the second user can run (the test's interpreter may be under /root)")
    uid, gid = other_user
    base = Path(tempfile.mkdtemp(prefix="aotx-privacy-", dir="/tmp"))
    base.chmod(0o755)  # the second user can reach the data dir's parent: only its own modes protect it
    home = base / "home"
    proc = None
    try:
        home.mkdir(mode=0o755)
        home.chmod(0o755)  # as an older AOTX (or a wide umask) left it
        (home / "engine.log").write_text("started\n")
        (home / "engine.log").chmod(0o644)
        env = dict(os.environ, AOTX_HOME=str(home))
        log = open(base / "engine-test.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "aotx.engine.cli.commands", "serve", "--slots", "1", "--context",
                                 "256", "--device", "cpu"], env=env, stdout=log, stderr=log, start_new_session=True)
        sock = home / "run" / "engine.sock"
        _converse(sock, proc, base)
        time.sleep(0.5)  # the capsule of the reply is written in the background
        paths = [str(p) for p in [home, *home.rglob("*")]]
        assert any(p.endswith(".caps") for p in paths) and any(p.endswith(".seg") for p in paths), paths
        for p in [home, *home.rglob("*")]:  # the modes themselves
            m = mode(p)
            assert m & 0o077 == 0, (p, oct(m))
        r = subprocess.run([python, "-I", "-c", PROBE, json.dumps(paths), str(sock)], capture_output=True, text=True,
                           timeout=60, cwd="/", user=uid, group=gid, extra_groups=[], env={"PATH": "/usr/bin:/bin"})
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert set(got.values()) == {"PermissionError"}, {k: v for k, v in got.items() if v != "PermissionError"}
        assert str(sock) in got and len(got) == len(set(paths) | {str(sock)})
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(base, ignore_errors=True)


def _converse(sock: Path, proc, base: Path) -> None:
    """Wait for the engine, then one conversation with a short reply (journal records,
    a capsule, the socket all exist afterwards)."""
    import asyncio

    from aotx.engine import protocol as P
    from aotx.engine.ipc.client import EngineClient

    async def go():
        deadline = time.monotonic() + 180
        while True:
            try:
                client = await EngineClient.connect(sock, spawn=False)
                break
            except Exception:  # noqa: BLE001 - not up yet
                assert proc.poll() is None, (base / "engine-test.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "the engine did not start"
                await asyncio.sleep(0.2)
        try:
            conv = await client.create_conversation("private")
            async for _ in client.submit(conv.conv_id, "My secret is 42.", raw=True,
                                         sampling=P.SamplingParams(temperature=0.0, max_tokens=6)):
                pass
        finally:
            await client.close()

    asyncio.run(go())
