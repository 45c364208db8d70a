"""aotx-chat against a real engine on the default model: the issue-17 defects that live
in the engine (6: a vanished client's reply; 7: capsule notices on a new chat).

The test starts ``aotx serve`` (2 slots, 512 tokens of context) on a socket of its own,
with AOTX_HOME in a temporary folder, and drives the real ``ChatApp`` with Pilot through
the factory ``aotx-chat`` uses. Bounded: every wait has its own limit.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from aotx.app.app import ChatApp
from aotx.app.main import client_factory
from aotx.engine import protocol as P

pytestmark = pytest.mark.realmodel

ENGINE_ARGS = ["--slots", "2", "--context", "512", "--device", "cpu"]


async def until(pilot, cond, limit_s: float, what: str) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if cond():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"not reached within {limit_s:.0f} s: {what}")


@pytest.fixture
def engine(tmp_path, monkeypatch, default_model_path):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("AOTX_HOME", str(home))
    sock_dir = Path(tempfile.mkdtemp(prefix="aotx-e6-"))
    sock = sock_dir / "e.sock"
    log = open(home / "engine-test.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "aotx.engine.cli.commands", "serve", "--socket", str(sock), *ENGINE_ARGS],
                            env={**os.environ, "AOTX_HOME": str(home)}, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=log, start_new_session=True)
    yield sock
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        if proc.poll() is not None:
            break
        proc.send_signal(sig)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass
    log.close()
    shutil.rmtree(sock_dir, ignore_errors=True)


async def test_defect6_a_killed_app_leaves_the_reply_finished_not_cancelled(engine):
    """Regression: after ``kill -9`` of aotx-chat mid-reply and a restart, the partial
    reply said "Assistant cancelled"; nobody cancelled. The engine now writes the reply
    to the end, and the next aotx-chat shows it finished (following it while it runs)."""
    factory = client_factory(str(engine), ENGINE_ARGS, spawn=False)
    # 160 tokens: the reply must still be running when the app dies (with 24, a fast tick
    # finished it before the kill on a CI run, and nothing was left to write afterwards)
    sampling = P.SamplingParams(temperature=0.0, max_tokens=160)
    app = ChatApp(factory, status_poll_s=0, default_sampling=sampling)
    async with app.run_test(size=(110, 36)) as pilot:
        await until(pilot, lambda: app.ready, 90, "the engine is ready")
        app.chat_input.insert("Write a long story about a cat named Tom.")
        await pilot.press("enter")
        await until(pilot, lambda: len(app.messages()) == 2 and app.messages()[1].n_tokens >= 3, 60,
                    "the reply streams")
        conv_id, reply_id, seen = app.conv_id, app.messages()[1].msg_id, app.messages()[1].text
        n_seen = app.messages()[1].n_tokens
        # kill -9 of the app: its socket is cut, nothing is said to the engine
        app.connection_lost = lambda: None  # this app is "dead": it does not reconnect
        app.client._writer.transport.abort()
        await pilot.pause(0.2)
    app2 = ChatApp(factory, status_poll_s=0)
    async with app2.run_test(size=(110, 36)) as pilot:
        await until(pilot, lambda: app2.ready and app2.conv_id == conv_id and len(app2.messages()) == 2, 30,
                    "a fresh app opens the conversation")
        reply = app2.messages()[1]
        assert reply.msg_id == reply_id
        await until(pilot, lambda: reply.position == "durable", 240, "the engine finished the reply")
        assert reply.finish_reason in ("length", "stop"), reply.finish_reason
        assert "cancelled" not in str(reply.query_one(".msg-header").render())
        assert reply.text.startswith(seen)
        assert reply.n_tokens == 160 or reply.finish_reason == "stop", (reply.n_tokens, reply.finish_reason)
        assert reply.n_tokens > n_seen or reply.finish_reason == "stop"  # written after the app was gone
    view = await _show(engine, conv_id)
    assert view.messages[-1].status == "complete"


async def _show(sock: Path, conv_id: str) -> P.ConversationView:
    from aotx.engine.ipc.client import EngineClient

    c = await EngineClient.connect(sock, spawn=False)
    try:
        return await c.show(conv_id)
    finally:
        await c.close()


async def test_defect7_no_capsule_words_on_a_new_chat(engine):
    """Regression: "Context restored from a capsule: restored 29 tokens of context from a
    parked capsule (host memory) (no re-prefill)" on a brand-new chat."""
    factory = client_factory(str(engine), ENGINE_ARGS, spawn=False)
    sampling = P.SamplingParams(temperature=0.0, max_tokens=8)
    app = ChatApp(factory, status_poll_s=0, default_sampling=sampling)
    async with app.run_test(size=(110, 36)) as pilot:
        await until(pilot, lambda: app.ready, 90, "the engine is ready")
        for i, question in enumerate(["Hi there", "Name a colour."]):
            if i:
                await pilot.press("ctrl+n")  # a new chat: its start is shared with the first one's
                await until(pilot, lambda: not app.messages(), 20, "a new conversation")
            app.chat_input.insert(question)
            await pilot.press("enter")
            await until(pilot, lambda: len(app.messages()) == 2 and app.messages()[1].position == "durable", 90,
                        "the reply is durable")
            words = " ".join(app.messages()[1].notices()).lower()
            assert "capsule" not in words and "prefill" not in words and "host memory" not in words, words
        await asyncio.sleep(0)
