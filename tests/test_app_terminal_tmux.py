"""aotx-chat in a real terminal (tmux), on the scripted engine: what the terminal sends.

* A bracketed paste of a path that names no dropped file (``/api/v1/users``) stays in
  the input as text (it was swallowed: "Not attached", the text gone).
* Text typed right after Enter (the next message, started within 0.2 s) stays in the
  input (it was cleared with the message just sent).

tmux gives the app a real pseudo-terminal at 80x24; ``paste-buffer -p`` pastes the way a
terminal does (bracketed), ``send-keys`` types. Bounded: each wait has its own limit.
Skips without tmux.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=20).stdout


def pane(session: str) -> str:
    return tmux("capture-pane", "-p", "-t", session)


def wait_for(session: str, cond, limit_s: float) -> str:
    deadline = time.monotonic() + limit_s
    screen = ""
    while time.monotonic() < deadline:
        screen = pane(session)
        if cond(screen):
            return screen
        time.sleep(0.1)
    raise AssertionError(f"not on screen within {limit_s:.0f} s:\n{screen}")


@pytest.fixture
def chat(tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux)")
    session = f"aotx-chat-{os.getpid()}"
    log = tmp_path / "log.json"
    cmd = (f"cd {ROOT} && env AOTX_HOME={tmp_path / 'home'} PYTHONDONTWRITEBYTECODE=1 TERM=xterm-256color "
           f"{sys.executable} -m tests.fakes.fake_chat --log {log}; sleep 30")
    tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "24", cmd)
    try:
        wait_for(session, lambda s: "Type a message below" in s and "ready" in s, 60)
        yield session, log
    finally:
        tmux("kill-session", "-t", session)


def quit_and_log(session: str, log: Path) -> dict:
    tmux("send-keys", "-t", session, "C-q")
    deadline = time.monotonic() + 20
    while not log.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return json.loads(log.read_text())


def test_a_pasted_api_path_stays_text_in_a_real_terminal(chat):
    session, log = chat
    tmux("set-buffer", "-b", "aotx", "/api/v1/users")
    tmux("paste-buffer", "-p", "-b", "aotx", "-t", session)
    screen = wait_for(session, lambda s: "/api/v1/users" in s, 10)
    assert "Not attached" not in screen
    tmux("send-keys", "-t", session, "Enter")
    wait_for(session, lambda s: "echo /api/v1/users" in s, 10)
    assert quit_and_log(session, log)["submitted"] == ["/api/v1/users"]


def test_text_typed_right_after_enter_goes_to_the_next_message(chat):
    session, log = chat
    # one send-keys: "first", Enter and "second" reach the app within milliseconds
    tmux("send-keys", "-t", session, "first", "Enter", "second")
    wait_for(session, lambda s: "echo first" in s, 10)
    time.sleep(0.5)
    tmux("send-keys", "-t", session, "Enter")
    wait_for(session, lambda s: "echo second" in s, 10)
    assert quit_and_log(session, log)["submitted"] == ["first", "second"]
