"""End to end: aotx-chat against a real engine on the default model.

Killed mid-reply: the test starts ``aotx serve`` (2 slots, 1024 tokens of context) on a socket of its
own, with AOTX_HOME in a temporary folder, and drives the real ``ChatApp`` with
Pilot. The app's client factory is the one ``aotx-chat`` uses (``main.client_factory``)
with the same socket and engine arguments, so when the engine dies the app itself
starts a new one, as a user would see. Steps:

1. ask a question (temperature 0), wait until tokens are on screen and some are durable;
2. ``kill -9`` the engine: the app says the engine stopped, marks the reply ◑,
   restarts an engine, reconnects and reloads the conversation: the user's message
   and the interrupted reply with its durable tokens;
3. change the conversation's settings with F4 (shorter replies, speculative ngram)
   and send another message: it gets a reply that turns durable;
4. drop the app without quitting and start a fresh one on the same AOTX_HOME: it
   opens the same conversation and shows every message that was durable, unchanged.

The app killed instead (its socket cut mid-reply): the engine writes the reply to its
end and the next app shows it finished, not cancelled; and a new chat whose start is
shared with another's shows no capsule words (``served``: 2 slots, 512 tokens, CPU).

Bounded: each wait has its own limit and the whole test stops after ``LIMIT_S``.
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
from textual.widgets import Input, Select

from aotx.app.app import ChatApp
from aotx.app.main import client_factory
from aotx.engine import protocol as P

pytestmark = pytest.mark.realmodel

ENGINE_ARGS = ["--slots", "2", "--context", "1024"]
QUESTION = "Write a long story about a cat named Tom."
LIMIT_S = 85.0


def start_engine(sock: Path, home: Path) -> subprocess.Popen:
    log = open(home / "first-engine.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "aotx.engine.cli.commands", "serve", "--socket", str(sock), *ENGINE_ARGS],
                            env={**os.environ, "AOTX_HOME": str(home)}, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=log, start_new_session=True)


def wait_answering(sock: Path, proc: subprocess.Popen, home: Path, limit_s: float = 60.0) -> None:
    """Wait until the engine started by the test accepts connections on ``sock``.

    Regression: the app was started before the first engine listened, so its
    factory found no engine and started a second one; that one won the socket lock and the
    test's ``welcome.pid == first.pid`` failed (26529 != 26528). One engine ran, as it
    should; the test had not waited for the engine it meant to kill."""
    import socket as socket_mod

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the first engine exited with code {proc.returncode}: "
                                 f"{(home / 'first-engine.log').read_text(errors='replace')[-800:]}")
        with socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM) as s:
            try:
                s.connect(str(sock))
                return
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(0.1)
    raise AssertionError(f"the first engine did not listen on {sock} within {limit_s:.0f} s")


def stop(pid: int) -> None:
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    return
            except ChildProcessError:  # not our child (the app's engine): poll its existence
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return
            time.sleep(0.05)


async def until(pilot, cond, limit_s: float, what: str) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if cond():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"not reached within {limit_s:.0f} s: {what}")


def screen_text(w) -> str:
    """What a message shows: its header line and its body."""
    from aotx.app.widgets.markdown_view import MarkdownView

    body = w.query_one(".msg-body")
    text = body.text if isinstance(body, MarkdownView) else str(body.render())
    return str(w.query_one(".msg-header").render()) + "\n" + text


@pytest.fixture
def e2e(tmp_path, monkeypatch, default_model_path):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("AOTX_HOME", str(home))  # the app's state, and the engine it restarts
    sock_dir = Path(tempfile.mkdtemp(prefix="aotx-e2e-"))  # short: Unix socket paths are limited
    sock = sock_dir / "e.sock"
    pids: list[int] = []
    first = start_engine(sock, home)
    pids.append(first.pid)
    wait_answering(sock, first, home)
    yield home, sock, first, pids
    for pid in pids:
        stop(pid)
    shutil.rmtree(sock_dir, ignore_errors=True)


async def test_engine_killed_mid_reply_app_recovers_and_a_fresh_app_loses_nothing(e2e):
    await asyncio.wait_for(_scenario(*e2e), LIMIT_S)


async def _scenario(home: Path, sock: Path, first: subprocess.Popen, pids: list[int]) -> None:
    factory = client_factory(str(sock), ENGINE_ARGS)  # spawns with the same args when none answers
    greedy = P.SamplingParams(temperature=0.0, max_tokens=96)
    app = ChatApp(factory, status_poll_s=0, default_sampling=greedy)
    async with app.run_test(size=(110, 40)) as pilot:
        await until(pilot, lambda: app.ready, 60, "the first engine is ready")
        assert app.client.welcome.pid == first.pid
        assert "SmolLM2" in app.status_bar.line() and "budget" in app.status_bar.line()

        # 1. ask; wait until the reply streams and some of its tokens are durable
        await pilot.press(*"Hi")  # typed keys reach the input
        app.chat_input.clear()
        app.chat_input.insert(QUESTION)
        await pilot.press("enter")

        def reply():
            ms = app.messages()
            return ms[1] if len(ms) == 2 and ms[1].role == "assistant" else None

        await until(pilot, lambda: reply() is not None and reply().durable_tokens >= 3 and reply().text.strip(),
                    40, "reply tokens on screen, some durable")
        r = reply()
        assert r.position == "committed" and screen_text(r).startswith("◐ Assistant")
        streamed, durable_n = r.text, r.durable_tokens
        conv_id, user_id, reply_id = app.conv_id, app.messages()[0].msg_id, r.msg_id

        # 2. kill -9 the engine mid-reply
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        await until(pilot, lambda: app.recovering, 10, "the app notices the engine died")
        notice = str(app.query_one("#input-notice").render())
        assert notice.startswith("The engine stopped"), notice
        assert app.status_bar.state in ("engine stopped", "connecting", "starting engine")
        assert r.position == "interrupted" and screen_text(r).startswith("◑")

        await until(pilot, lambda: app.ready and not app.recovering and app.client is not None, 60,
                    "the app restarted an engine and reconnected")
        new_pid = app.client.welcome.pid
        pids.append(new_pid)
        assert new_pid != first.pid
        await until(pilot, lambda: len(app.messages()) == 2 and app.messages()[1].msg_id == reply_id
                    and app.messages()[1].notices(), 10, "the conversation reloaded")
        assert app.conv_id == conv_id
        assert str(app.query_one("#input-notice").render()).startswith("The engine is back")
        user, back = app.messages()
        assert user.msg_id == user_id and user.text == QUESTION and user.position == "durable"
        assert screen_text(user).startswith("● You") and QUESTION in screen_text(user)
        assert back.position == "interrupted" and screen_text(back).startswith("◑ Assistant interrupted")
        assert any("stopped while writing" in n for n in back.notices())
        # the durable tokens are all there: at least as many as were durable at the kill, the same text
        assert back.n_tokens >= durable_n and back.text.strip()
        assert back.text.startswith(streamed) or streamed.startswith(back.text), (back.text, streamed)
        assert back.text in screen_text(back)

        # 3. F4: shorter replies and speculative ngram, then the conversation goes on
        await pilot.press("f4")
        await until(pilot, lambda: app.screen.query("#f-speculative"), 5, "the settings form")
        app.screen.query_one("#f-max_tokens", Input).value = "24"
        app.screen.query_one("#f-speculative", Select).value = "ngram"
        await pilot.press("ctrl+s")
        await until(pilot, lambda: "Saved" in str(app.query_one("#input-notice").render()), 10, "settings saved")
        app.chat_input.insert("What is the cat's name?")
        await pilot.press("enter")
        await until(pilot, lambda: len(app.messages()) == 4 and app.active is None
                    and app.messages()[3].position == "durable", 40, "the second reply is durable")
        second = app.messages()[3]
        assert second.text.strip() and second.n_tokens <= 24 and screen_text(second).startswith("● Assistant")
        view = await app.client.show(conv_id)
        assert view.sampling.max_tokens == 24 and view.sampling.speculative == "ngram"
        assert view.sampling.temperature == 0.0
        durable = [(m.msg_id, m.role, m.text, m.position) for m in app.messages()]
        assert [d[3] for d in durable] == ["durable", "interrupted", "durable", "durable"]
    # 4. the app is gone (never quit through its own action); a fresh one on the same home
    app2 = ChatApp(factory, status_poll_s=0)
    async with app2.run_test(size=(110, 40)) as pilot:
        await until(pilot, lambda: app2.ready and len(app2.messages()) == 4, 20, "a fresh app shows the conversation")
        assert app2.client.welcome.pid == new_pid  # the engine kept running
        assert app2.conv_id == conv_id
        assert [(m.msg_id, m.role, m.text, m.position) for m in app2.messages()] == durable
        assert screen_text(app2.messages()[1]).startswith("◑")


# ---- the app killed, the engine running ------------------------------------------------

SERVED_ARGS = ["--slots", "2", "--context", "512", "--device", "cpu"]


@pytest.fixture
def served(tmp_path, monkeypatch, default_model_path):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("AOTX_HOME", str(home))
    sock_dir = Path(tempfile.mkdtemp(prefix="aotx-e6-"))
    sock = sock_dir / "e.sock"
    log = open(home / "engine-test.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "aotx.engine.cli.commands", "serve", "--socket", str(sock),
                             *SERVED_ARGS],
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


async def test_a_killed_app_leaves_the_reply_finished_not_cancelled(served):
    """Regression: after ``kill -9`` of aotx-chat mid-reply and a restart, the partial
    reply said "Assistant cancelled"; nobody cancelled. The engine now writes the reply
    to the end, and the next aotx-chat shows it finished (following it while it runs)."""
    factory = client_factory(str(served), SERVED_ARGS, spawn=False)
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
    view = await _show(served, conv_id)
    assert view.messages[-1].status == "complete"


async def _show(sock: Path, conv_id: str) -> P.ConversationView:
    from aotx.engine.ipc.client import EngineClient

    c = await EngineClient.connect(sock, spawn=False)
    try:
        return await c.show(conv_id)
    finally:
        await c.close()


async def test_no_capsule_words_on_a_new_chat(served):
    """Regression: "Context restored from a capsule: restored 29 tokens of context from a
    parked capsule (host memory) (no re-prefill)" on a brand-new chat."""
    factory = client_factory(str(served), SERVED_ARGS, spawn=False)
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
