"""A stopped engine says so before it closes its connections; a crashed one cannot.

Clients (aotx-chat, the interactive ``aotx run``) start another engine at once after a
crash, but after ``aotx stop`` they must wait for their user: the difference is the
``stopping`` Notice with id 0 that ``Server.close`` sends every connection first
(``EngineClient.stopped``). The Welcome carries the flags that start such an engine again.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

from aotx.engine import protocol as P
from aotx.engine.ipc.client import ConnectionLost, EngineClient
from aotx.engine.ipc.server import Server


class NullEngine:
    def post(self, op, conn) -> None:
        conn.send(P.Ok(id=op.id))

    def post_disconnect(self, conn) -> None:
        pass


def welcome() -> P.Welcome:
    return P.Welcome(protocol=P.PROTOCOL_VERSION, engine="aotx", model="null", device="cpu", pid=os.getpid(),
                     journal=False, engine_args=["--model", "/m/x.gguf", "--slots", "2"])


@pytest.fixture
def server():
    d = Path(tempfile.mkdtemp(prefix="aotx-s", dir="/tmp"))
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    srv = Server(NullEngine(), d / "e.sock", welcome)
    asyncio.run_coroutine_threadsafe(srv.start(), loop).result(10)
    yield srv, loop
    if srv._listen is not None:
        asyncio.run_coroutine_threadsafe(srv.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    th.join(5)
    shutil.rmtree(d, ignore_errors=True)


async def _lost(client: EngineClient) -> None:
    for _ in range(200):
        if client.closed:
            return
        await asyncio.sleep(0.01)


async def test_a_client_is_told_the_engine_was_stopped(server):
    srv, loop = server
    client = await EngineClient.connect(srv.path, spawn=False)
    assert client.welcome.engine_args == ["--model", "/m/x.gguf", "--slots", "2"]
    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(srv.close(), loop))
    await _lost(client)
    assert client.closed and client.stopped
    with pytest.raises(ConnectionLost):
        await client.status()


async def test_a_connection_that_just_breaks_is_not_a_stop(server):
    srv, loop = server
    client = await EngineClient.connect(srv.path, spawn=False)

    async def crash():  # every connection closed, no word first: what a killed engine leaves
        for t in list(srv._tasks):
            t.cancel()

    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(crash(), loop))
    await _lost(client)
    assert client.closed and not client.stopped
    await client.close()


def test_restart_args_are_the_stopped_engines_own(tmp_path, monkeypatch):
    """The flags in the Welcome start the same engine again: its model by absolute path
    (a relative one would name another file in the client's directory), its sizes as
    given, a draft model by absolute path; never the socket."""
    import argparse
    from types import SimpleNamespace

    from aotx.engine.cli.serve import restart_args

    model = tmp_path / "qwen.gguf"
    model.write_bytes(b"GGUF")
    draft = tmp_path / "small.gguf"
    draft.write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(model="qwen.gguf", device="auto", slots=2, context=10_000_000, memory_budget="4G",
                              kv_type=None, expert_cache=None, keep_alive="5m", speculative=None, draft_p_min=None,
                              draft_model="small.gguf", mmproj="none", evict_idle=True, socket="/tmp/x.sock")
    eng = SimpleNamespace(lm=SimpleNamespace(path=Path("qwen.gguf")))
    assert restart_args(args, eng) == ["--model", str(model), "--slots", "2", "--context", "10000000",
                                       "--memory-budget", "4G", "--keep-alive", "5m", "--draft-model", str(draft),
                                       "--mmproj", "none", "--evict-idle"]


def test_bug_aotx_stop_of_an_engine_its_parent_has_not_reaped_says_stopped(tmp_path, capsys):
    """An engine started by aotx-chat or the gateway stays a zombie until its parent reaps it;
    `aotx stop` took it for alive, waited 5 s and said 'it is still shutting down'."""
    import argparse
    import subprocess
    import time

    from aotx.engine.cli.client import _stop

    child = subprocess.Popen(["sleep", "30"])          # never waited for here: a zombie once killed
    sock = tmp_path / "engine.sock"
    Path(str(sock) + ".lock").write_text(str(child.pid))
    try:
        t = time.monotonic()
        assert _stop(argparse.Namespace(socket=str(sock))) == 0
        took = time.monotonic() - t
        assert capsys.readouterr().out.strip() == f"stopped the engine (pid {child.pid})"
        assert took < 3.0, took
    finally:
        child.kill()
        child.wait()
