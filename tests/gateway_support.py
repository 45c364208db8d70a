"""Shared by the test files that need an engine subprocess (gateway and CLI tests) and an
in-process gateway.

``start_engine(home, model, ...)`` runs ``aotx serve`` on a Unix socket under ``home``
(returns the process and socket; ``stop_engine`` ends it, ``kill -9`` included);
``gateway(sock)`` serves a gateway on 127.0.0.1 in a thread of its own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from aotx.engine.gateway import server as G
from aotx.engine.gateway import auth as A
from aotx.engine.ipc.client import EngineClient

KEY = "sk-aotx-test-key-0123456789abcdef"


def start_engine(home: Path, model: Path | None, *, slots: int = 4, context: int = 2048,
                 timeout: float = 300, device: str = "cpu", sock: Path | None = None,
                 unset: tuple[str, ...] = ()) -> tuple[subprocess.Popen, Path]:
    """``aotx serve`` in the background with ``AOTX_HOME=home`` (its socket ``sock``, default
    ``home/e.sock``; ``unset``: environment variables it must not see); waits until its socket
    answers."""
    sock = sock or home / "e.sock"
    env = dict(os.environ, AOTX_HOME=str(home))
    for name in unset:
        env.pop(name, None)
    log = open(home / "engine.log", "ab")
    args = [sys.executable, "-m", "aotx.engine.cli.commands", "serve", "--socket", str(sock), "--slots", str(slots),
            "--context", str(context), "--device", device]
    if model is not None:
        args += ["--model", str(model)]
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=log, start_new_session=True)
    log.close()
    deadline = time.monotonic() + timeout
    while True:
        try:
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(sock))
            s.close()
            return proc, sock
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"engine exited with {proc.returncode}: {(home / 'engine.log').read_text()[-3000:]}")
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"engine did not start within {timeout:.0f} s")
            time.sleep(0.2)


def stop_engine(proc: subprocess.Popen, kill: bool = False) -> None:
    if proc.poll() is not None:
        return
    if kill:
        os.kill(proc.pid, signal.SIGKILL)
    else:
        proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def gateway(sock: Path, *, keys=(KEY,), file_roots=None, **cfg):
    """A gateway on 127.0.0.1:<free port> in a thread; yields its base URL."""
    config = G.GatewayConfig(**cfg)
    link = G.EngineLink(lambda: EngineClient.connect(sock, spawn=False), config.retry_after_s)
    app = G.create_app(config, A.KeyRing(list(keys), file_roots), link)
    server = G.uvicorn_server(app)
    lsock = G.listen_socket("127.0.0.1", 0)
    port = lsock.getsockname()[1]
    t = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[lsock])), daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert t.is_alive() and time.monotonic() < deadline, "gateway did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(15)
        lsock.close()


def engine_call(sock: Path, fn):
    """Run ``await fn(client)`` on a fresh engine connection."""
    async def go():
        c = await EngineClient.connect(sock, spawn=False)
        try:
            return await fn(c)
        finally:
            await c.close()
    return asyncio.run(go())
