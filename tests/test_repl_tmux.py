"""End to end in a real terminal: ``aotx run`` with no prompt, driven through tmux on
the default model.

tmux gives the program a real pseudo-terminal (so ``aotx run`` sees a TTY and opens
the interactive chat, with readline), the test types into it with ``send-keys`` and
reads the screen with ``capture-pane``. Steps: the prompt appears (an engine is
started in the background on a socket of the test's own), a question gets a streamed
reply and the turn line with aotx-chat's markers, ``/set`` and ``/system`` are saved
in the conversation, ``/attach`` of a missing file says why, ``/fork`` continues in a
branch, ``/bye`` leaves with exit code 0, and the journal has both conversations.
Bounded: each wait has its own limit. Skips without tmux or the default model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.realmodel
ROOT = Path(__file__).resolve().parent.parent


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=20).stdout


def pane(session: str) -> str:
    return tmux("capture-pane", "-p", "-J", "-S", "-200", "-t", session)


def wait_for(session: str, text: str, limit_s: float, times: int = 1) -> str:
    """Until ``text`` shows in the pane ``times`` times; returns the pane."""
    deadline = time.monotonic() + limit_s
    screen = ""
    while time.monotonic() < deadline:
        screen = pane(session)
        if screen.count(text) >= times:
            return screen
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not on screen within {limit_s:.0f} s:\n{screen[-3000:]}")


def aotx(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", *args], capture_output=True, text=True,
                          env={**os.environ, "AOTX_HOME": str(home)}, timeout=60, cwd=ROOT)


def test_repl_in_a_real_terminal(tmp_path, default_model_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux)")
    home = tmp_path / "home"
    sock_dir = Path(tempfile.mkdtemp(prefix="aotx-repl-"))
    sock = sock_dir / "e.sock"
    session = f"aotx-repl-{os.getpid()}"
    cmd = (f"cd {ROOT} && env AOTX_HOME={home} PYTHONDONTWRITEBYTECODE=1 {sys.executable} -m aotx.engine.cli.commands run "
           f"--socket {sock} --slots 1 --context 512 --device cpu --temperature 0 --max-tokens 24; "
           "echo REPL-EXIT-$?; sleep 60")
    tmux("new-session", "-d", "-s", session, "-x", "120", "-y", "40", cmd)
    try:
        screen = wait_for(session, ">>> ", 120)
        assert "/help lists the commands" in screen
        tmux("send-keys", "-t", session, "What is the capital of France?", "Enter")
        screen = wait_for(session, "● you  ● reply", 90)
        reply = screen.split("What is the capital of France?", 1)[1].split("● you", 1)[0].strip()
        assert reply, screen
        assert "tokens" in screen and "context " in screen and "/512" in screen
        tmux("send-keys", "-t", session, "/set temperature 0.5", "Enter")
        wait_for(session, "temperature=0.5 top_k", 10)
        tmux("send-keys", "-t", session, "/system Answer in one word.", "Enter")
        wait_for(session, "system prompt set", 10)
        tmux("send-keys", "-t", session, f"/attach {tmp_path}/missing.png", "Enter")
        assert "no such file" in wait_for(session, "not attached", 10)
        tmux("send-keys", "-t", session, "/fork", "Enter")
        wait_for(session, "you are in the fork", 20)
        tmux("send-keys", "-t", session, "And of Italy?", "Enter")
        wait_for(session, "● you  ● reply", 90, times=2)
        tmux("send-keys", "-t", session, "/bye", "Enter")
        wait_for(session, "REPL-EXIT-0", 20)
        # the journal has both conversations; the engine still runs and answers for it
        r = aotx(home, "conversations", "list", "--json", "--socket", str(sock))
        convs = {c["title"]: c for c in json.loads(r.stdout)}
        assert set(convs) == {"What is the capital of France?", "What is the capital of France? (fork 1)"}, convs
        assert convs["What is the capital of France? (fork 1)"]["messages"] == 4
        r = aotx(home, "conversations", "show", "--json", "--socket", str(sock),
                 convs["What is the capital of France?"]["id"])
        view = json.loads(r.stdout)
        assert view["system_prompt"] == "Answer in one word."
        assert view["sampling"]["temperature"] == 0.5
        assert [m["role"] for m in view["messages"]] == ["user", "assistant"]
    finally:
        tmux("kill-session", "-t", session)
        aotx(home, "stop", "--socket", str(sock))
        shutil.rmtree(sock_dir, ignore_errors=True)
