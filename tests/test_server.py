"""The engine's socket: one engine per path, stale sockets, permissions, the CLI on it.

Covers ``ipc/server.py``'s SocketLock and bind_socket directly, two engines on
one path (in-process and ``aotx serve`` as a subprocess), and ``aotx run
--json`` against an in-process engine (``engine_server`` in conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from aotx.engine.errors import EngineError
from aotx.engine.ipc.server import Server, SocketLock, bind_socket


@pytest.fixture
def sock_dir():
    d = Path(tempfile.mkdtemp(prefix="aotx-s", dir="/tmp"))
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


def test_socket_lock_is_exclusive(sock_dir):
    a, b = SocketLock(sock_dir / "e.sock"), SocketLock(sock_dir / "e.sock")
    a.acquire()
    try:
        with pytest.raises(EngineError, match=f"another engine is already serving {sock_dir / 'e.sock'}$"):
            b.acquire()
        assert b.fd < 0
        assert (sock_dir / "e.sock.lock").read_text() == str(os.getpid())
    finally:
        a.release()
    b.acquire()  # free again once the holder is gone
    b.release()


def test_stale_socket_is_replaced_and_mode_is_0600(sock_dir):
    path = sock_dir / "e.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # a dead engine's leftover: the file stays, nobody listens
    assert stat.S_ISSOCK(path.lstat().st_mode)
    s = bind_socket(path)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(str(path))  # the new socket answers
        c.close()
    finally:
        s.close()


def test_live_socket_and_non_socket_are_refused(sock_dir):
    path = sock_dir / "e.sock"
    live = bind_socket(path)
    try:
        with pytest.raises(EngineError, match="already answers"):
            bind_socket(path)
    finally:
        live.close()
    path.unlink()
    path.write_text("not a socket")
    with pytest.raises(EngineError, match="is not a socket"):
        bind_socket(path)
    assert path.read_text() == "not a socket"  # left alone


def test_second_server_on_one_path_cannot_start(engine_server):
    h = engine_server(slots=1, context=64, journal=False)
    assert stat.S_IMODE(h.socket.stat().st_mode) == 0o600

    async def second():
        await Server(h.engine, h.socket, lambda: None).start()

    with pytest.raises(EngineError, match="another engine is already serving"):
        asyncio.run(second())


def _aotx(args, home, timeout=120):
    env = dict(os.environ, AOTX_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_aotx_serve_refuses_a_second_engine(engine_server, tmp_path):
    h = engine_server(slots=1, context=64, journal=False)
    r = _aotx(["serve", "--socket", str(h.socket), "--device", "cpu"], tmp_path, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"aotx: another engine is already serving {h.socket}"
    # the running engine is untouched: its socket still answers
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(str(h.socket))
    c.close()


CODE_REQUEST = 'Write a Python function that checks whether a string is a palindrome.'


def test_aotx_run_json_output(engine_server, tmp_path, refs_dir):
    h = engine_server(slots=2, context=256)
    r = _aotx(["run", "--socket", str(h.socket), "--json", "--temperature", "0", "--max-tokens", "8",
               CODE_REQUEST], tmp_path)
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "accepted"
    assert "done" in kinds and "token" in kinds
    tok = [e for e in events if e["event"] == "token"]
    done_at = kinds.index("done")
    assert max(i for i, k in enumerate(kinds) if k == "token") < done_at
    done = events[done_at]
    assert set(done) >= {"prompt_ids", "completion_ids", "text", "finish_reason", "timings"}
    assert done["completion_ids"] == [e["id"] for e in tok]
    assert done["text"] == "".join(e["text"] for e in tok)
    assert done["finish_reason"] in ("stop", "length")
    assert len(tok) == 8 or done["finish_reason"] == "stop"
    # end to end, the chat template and greedy decode agree with llama.cpp on this prompt
    # (its reference: tests/data/refs/smollm2/chat_refs.json "code_request", whose first near-tie, a top-two
    # gap under 0.1, is at step 27; "short_question" has one at step 0)
    ref = next(c for c in json.loads((refs_dir / "chat_refs.json").read_text())["results"]
               if c["name"] == "code_request")
    assert done["prompt_ids"] == ref["prompt_token_ids"]
    assert done["completion_ids"] == ref["completion_token_ids"][:len(done["completion_ids"])]
    t = done["timings"]
    assert set(t) >= {"load_s", "prompt_tokens", "prompt_tokens_per_s", "completion_tokens", "decode_tokens_per_s"}
    assert t["prompt_tokens"] == len(done["prompt_ids"]) > 5
    assert t["completion_tokens"] == len(done["completion_ids"])
    assert t["prompt_tokens_per_s"] > 0 and t["decode_tokens_per_s"] > 0
    # load_s is the load this reply waited for: none, the engine was already up with its model
    # (it repeated the engine's startup on every reply before); engine_load_s is that startup
    assert t["load_s"] == 0.0 and t["engine_load_s"] > 0
    assert [e["pos"] for e in tok] == list(range(len(done["prompt_ids"]), len(done["prompt_ids"]) + len(tok)))
    # durable receipts: the user's message, then the finish record
    durable = [e for e in events if e["event"] == "durable"]
    assert durable and set(durable[-1]["receipt"]) == {"segment", "offset", "last_seq"}
    assert kinds[-1] == "durable"
    # the conversation holds what was printed
    conv = events[0]["conversation"]
    r2 = _aotx(["conversations", "show", conv, "--json", "--socket", str(h.socket)], tmp_path)
    assert r2.returncode == 0, r2.stderr
    shown = json.loads(r2.stdout)
    assert shown["messages"][1]["token_ids"] == done["completion_ids"]


def test_run_ends_on_an_engine_without_journal(engine_server, tmp_path):
    """Regression: with the journal off no receipt ever comes; ``aotx run`` waited for one forever."""
    h = engine_server(slots=1, context=128, journal=False)
    r = _aotx(["run", "--socket", str(h.socket), "--json", "--temperature", "0", "--max-tokens", "3", "--raw",
               "Hello"], tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["event"] == "done"


def test_status_json_over_the_socket(engine_server, tmp_path):
    h = engine_server(slots=3, context=128, journal=False)
    r = _aotx(["status", "--json", "--socket", str(h.socket)], tmp_path)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["ready"] is True and st["n_ctx"] == 128 and len(st["slots"]) == 3
    assert all(s["state"] == "free" for s in st["slots"])


def test_no_runtime_dir_warning_without_xdg_runtime_dir(tmp_path):
    """Without XDG_RUNTIME_DIR (and without AOTX_HOME) the socket goes under the data dir,
    and nothing but AOTX's own line is printed (platformdirs' RuntimeDirWarning was printed
    on every command)."""
    from tests.cli_support import one_line

    env = {"XDG_DATA_HOME": str(tmp_path / "data")}
    r = subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", "status"], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL,
                       env={k: v for k, v in dict(os.environ, **env).items()
                            if k not in ("XDG_RUNTIME_DIR", "AOTX_HOME")})
    assert "RuntimeDirWarning" not in r.stderr
    assert str(tmp_path / "data" / "aotx" / "run" / "engine.sock") in one_line(r)
