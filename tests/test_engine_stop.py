"""A reply in progress when the engine is stopped (``aotx stop`` / SIGTERM).

Regression: `aotx stop` during `aotx run` closed the connection
under the reply, and the client said "the engine closed the connection in the middle of a
reply", as for a crash. Now the engine tells each reply in progress that it is stopping,
ends it as cancelled with its text so far committed and durable, and the client ends the
reply cleanly (exit code 1, one line saying so and how to continue).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.gateway_support import engine_call, start_engine, stop_engine

LONG = "Write a very long story about a dragon and a knight, at least 3000 words, with many chapters."


def _streaming_reply(home, sock):
    """`aotx run` of a long reply against the engine at ``sock``, returned once its first 40
    bytes have streamed: (the process, what it printed so far)."""
    env = dict(os.environ, AOTX_HOME=str(home))
    run = subprocess.Popen([sys.executable, "-m", "aotx.engine.cli.commands", "run", "--socket", str(sock),
                            "--temperature", "0", "--max-tokens", "3000", LONG],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = b""
    deadline = time.monotonic() + 120
    while len(out) < 40:                    # the reply is streaming
        assert run.poll() is None and time.monotonic() < deadline, run.stderr.read().decode()
        out += os.read(run.stdout.fileno(), 4096)
    return run, out


def test_bug_stop_during_a_reply_ends_it_cancelled_and_durable_not_as_a_crash(tmp_path, default_model_path):
    proc, sock = start_engine(tmp_path, None, slots=2, context=4096)
    try:
        run, out = _streaming_reply(tmp_path, sock)
        proc.terminate()                        # what `aotx stop` sends
        rest, err = run.communicate(timeout=60)
        out += rest
        proc.wait(30)
        assert run.returncode == 1, err
        text = err.decode()
        assert "the engine is stopping: this reply ends here" in text
        assert "closed the connection" not in text and "Traceback" not in text
        assert "aotx run --conversation c" in text
        conv = text.split("aotx run --conversation ")[1].split()[0]
    finally:
        stop_engine(proc)
    proc, sock = start_engine(tmp_path, None, slots=2, context=4096)
    try:
        view = engine_call(sock, lambda c: c.show(conv))
        reply = view.messages[-1]
        assert reply.role == "assistant" and reply.status == "cancelled"
        assert reply.receipt is not None and reply.receipt.last_seq > 0     # durable before the engine exited
        assert out.decode().strip() == reply.text.strip()                   # what was shown is what was kept
    finally:
        stop_engine(proc)


def test_bug_an_engine_killed_mid_reply_leaves_aotx_run_a_way_to_continue(tmp_path, default_model_path):
    """A kill -9 of the engine during `aotx run` printed "the engine closed the connection in
    the middle of a reply" (exit 2) and nothing else: no conversation id, no way on but
    `conversations list`. Now it says the reply is kept up to its last durable token and
    names `aotx run --conversation ID`, exit 1; that conversation holds the interrupted reply."""
    proc, sock = start_engine(tmp_path, None, slots=2, context=4096)
    try:
        run, _ = _streaming_reply(tmp_path, sock)
        proc.kill()                             # kill -9
        _, err = run.communicate(timeout=60)
        proc.wait(30)
        text = err.decode()
        assert run.returncode == 1, text
        assert "Traceback" not in text and "kept up to its last durable token" in text
        conv = text.split("aotx run --conversation ")[1].split()[0]
    finally:
        stop_engine(proc)
    proc, sock = start_engine(tmp_path, None, slots=2, context=4096)
    try:
        view = engine_call(sock, lambda c: c.show(conv))
        assert view.messages[-1].role == "assistant" and view.messages[-1].text     # the interrupted reply's part
    finally:
        stop_engine(proc)
