"""``aotx run``: a signal (SIGTERM, SIGHUP; a second one) cancels the reply it was
streaming, as Ctrl-C does, in one-shot and interactive use; engine flags given to a
running engine are named, not silently ignored (a GPU or a malformed size that cannot
be had is refused); a bad attachment named once; ``load_s`` is the load this reply paid;
a conversation past its context says what to do; several runs started together share
one engine; the engine's context clamp and capsule notices said in the user's words.

The tests that need an engine share ``aotx serve`` on the default model (2 slots, 512
tokens of context, CPU) on a socket of their own, with AOTX_HOME in a temporary folder.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import cli_support
from tests.gateway_support import start_engine, stop_engine


aotx, one_line = cli_support.aotx, cli_support.one_line


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("cli-run")


@pytest.fixture(scope="module")
def engine(home, default_model_path):
    # the engine does not see VLLM_API_KEY (a client-side key must not reach it)
    proc, sock = start_engine(home, None, slots=2, context=512, timeout=180,
                              sock=Path(f"/tmp/aotx-nu-{os.getpid()}.sock"), unset=("VLLM_API_KEY",))
    yield sock
    stop_engine(proc)
    sock.unlink(missing_ok=True)


def _last_reply_conv(home: Path, sock: Path) -> str:
    listed = json.loads(aotx(home, "conversations", "list", "--socket", str(sock), "--json").stdout)
    return max(listed, key=lambda c: c["created_at"])["id"]


def _last_reply(home: Path, sock: Path) -> dict:
    shown = json.loads(aotx(home, "conversations", "show", _last_reply_conv(home, sock), "--socket", str(sock),
                            "--json").stdout)
    return shown["messages"][-1]


# ---- without the shared engine (those that start one run before it starts) ----------------


def test_aotx_run_says_capsule_notices_in_the_users_words_and_only_when_continuing():
    """Regression: ``aotx run`` printed "restored 29 tokens of context from a parked capsule
    (host memory) (no re-prefill)" on stderr for a brand-new chat."""
    from aotx.engine.cli.client import capsule_words
    from aotx.engine import protocol as P

    picked = P.Notice(id=1, kind="capsule", resource="capsule", asked=29,
                      message="picked up where this conversation left off (29 tokens of context kept, not read again)")
    assert capsule_words(picked, continuing=False) == ""  # a new chat's shared start is no news
    assert capsule_words(picked, continuing=True) == "picked up where this conversation left off"
    again = P.Notice(id=1, kind="capsule", resource="capsule",
                     message="reading this conversation's earlier messages again: its saved state could not be used "
                             "(it was made by another model)")
    words = capsule_words(again, continuing=True)
    assert words.startswith("reading") and "capsule" not in words and "prefill" not in words


def test_three_aotx_run_started_together_share_one_engine(tmp_path, default_model_path):
    """Regression: `for i in 1 2 3; do aotx run ... & done` with no engine: each started one;
    the two that lost the socket's lock exited, and their clients gave up ("the engine
    exited with code 2 before answering: another engine is already serving ...") while the
    winner was still loading. They now wait for it."""
    sock = f"/tmp/aotx-three-{os.getpid()}.sock"
    env = dict(os.environ, AOTX_HOME=str(tmp_path))
    cmd = [sys.executable, "-m", "aotx.engine.cli.commands", "run", "--socket", sock, "--max-tokens", "2",
           "--temperature", "0"]
    procs = [subprocess.Popen([*cmd, f"Say hello {i}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, text=True) for i in range(3)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0], [o[1][-400:] for o in outs]
        assert sum("started an engine" in o[1] for o in outs) >= 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        subprocess.run([*cmd[:3], "stop", "--socket", sock], env=env, capture_output=True, timeout=60)


def test_run_that_starts_an_engine_says_the_engines_context_clamp(tmp_path, default_model_path):
    """Regression: `--context` past the model's trained context was capped with a note only
    in engine.log, which a user of `aotx run` never sees."""
    try:
        r = aotx(tmp_path, "run", "--context", "99999", "--max-tokens", "2", "--temperature", "0", "hi", timeout=200)
        assert r.returncode == 0, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("aotx: engine: ")]
        assert len(lines) == 1 and "--context 99,999 is more than the 8,192 tokens" in lines[0] \
            and "each slot holds 8,192" in lines[0], r.stderr
        # a second client of the same engine (it did not start it) says nothing again
        r = aotx(tmp_path, "run", "--max-tokens", "2", "--temperature", "0", "hi", timeout=200)
        assert r.returncode == 0 and "aotx: engine: " not in r.stderr, r.stderr
    finally:
        aotx(tmp_path, "stop", timeout=60)


@pytest.mark.realmodel
def test_load_s_counts_the_engine_start_this_command_waited_for(tmp_path, default_model_path):
    """The other half: a run that started the engine reports its load as load_s."""
    sock = tmp_path / "e.sock"
    try:
        r = aotx(tmp_path, "run", "--socket", str(sock), "--slots", "1", "--context", "256", "--device", "cpu",
                 "--json", "--max-tokens", "1", "--temperature", "0", "hi")
        assert r.returncode == 0, r.stderr
        done = next(e for e in map(json.loads, r.stdout.splitlines()) if e["event"] == "done")
        assert done["timings"]["load_s"] == done["timings"]["engine_load_s"] > 0.0, done["timings"]
    finally:
        aotx(tmp_path, "stop", "--socket", str(sock), timeout=60)


# ---- against the shared engine --------------------------------------------------------------

@pytest.mark.realmodel
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_and_sighup_of_aotx_run_cancel_the_reply(home, engine, sig, code):
    """Regression: `timeout`/`kill` (SIGTERM) or a closed terminal (SIGHUP) ended `aotx run`
    but the engine went on writing the reply and journaled it "complete" although nobody
    received it. Now both cancel it, as Ctrl-C does, and exit 128 + the signal."""
    env = dict(os.environ, AOTX_HOME=str(home))
    proc = subprocess.Popen([sys.executable, "-m", "aotx.engine.cli.commands", "run", "--socket", str(engine),
                             "--temperature", "0", "--max-tokens", "400", "Write a very long story about a cat."],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "no token within 120 s"
        assert os.read(proc.stdout.fileno(), 64)  # the reply streams
        proc.send_signal(sig)
        assert proc.wait(60) == code, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    reply = _last_reply(home, engine)
    assert reply["role"] == "assistant"
    assert reply["status"] == "cancelled" and reply["finish_reason"] == "cancelled", reply


@pytest.mark.realmodel
def test_engine_flags_given_to_a_running_engine_are_named_not_silently_ignored(home, engine):
    """Regression: `aotx run --context 8192 --slots 4 --kv-type f32` against a running engine
    exited 0 and said nothing; status still showed the running engine's sizes."""
    r = aotx(home, "run", "--socket", str(engine), "--slots", "4", "--context", "1024", "--kv-type", "f32",
             "--max-tokens", "1", "--temperature", "0", "hi")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if "ignores" in x)
    assert "--slots 4 (it has 2)" in line and "--context 1024 (it has 512 tokens per slot)" in line, line
    assert "--kv-type f32 (it has f16)" in line and "`aotx stop` first" in line, line
    same = aotx(home, "run", "--socket", str(engine), "--slots", "2", "--context", "512", "--max-tokens", "1",
                "--temperature", "0", "hi")
    assert same.returncode == 0 and "ignores" not in same.stderr, same.stderr  # what it has: nothing to say


@pytest.mark.realmodel
def test_device_cuda_or_a_bad_budget_against_a_running_cpu_engine_is_refused(home, engine):
    """Regression: `aotx run --device cuda "hi"` with a CPU engine running only warned and
    answered on the CPU (rc 0), and `--memory-budget 5X` only warned "ignores
    --memory-budget 5X". The GPU that was asked for cannot be had without a restart, and a
    malformed size is a usage error: one line each, exit 2, nothing submitted."""
    n = len(json.loads(aotx(home, "conversations", "list", "--socket", str(engine), "--json").stdout))
    r = aotx(home, "run", "--socket", str(engine), "--device", "cuda", "--max-tokens", "1", "hi")
    assert r.returncode == 2
    assert one_line(r) == (f"aotx: --device cuda: the running engine on {engine} runs on the cpu; engine flags apply "
                           "when an engine starts (`aotx stop` first)")
    r = aotx(home, "run", "--socket", str(engine), "--memory-budget", "5X", "--max-tokens", "1", "hi")
    assert r.returncode == 2
    assert one_line(r) == "aotx: --memory-budget: cannot read '5X' as a size (e.g. 4G, 512M)"
    assert len(json.loads(aotx(home, "conversations", "list", "--socket", str(engine), "--json").stdout)) == n


@pytest.mark.realmodel
def test_a_second_signal_keeps_the_first_ones_exit_code(home, engine):
    """Regression: SIGTERM then SIGHUP 10 ms apart exited 129, not 143."""
    env = dict(os.environ, AOTX_HOME=str(home))
    proc = subprocess.Popen([sys.executable, "-m", "aotx.engine.cli.commands", "run", "--socket", str(engine),
                             "--temperature", "0", "--max-tokens", "400", "Write a very long story about a dog."],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "no token within 120 s"
        assert os.read(proc.stdout.fileno(), 64)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.01)
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(60) == 143
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.realmodel
def test_a_bad_attachment_is_named_once_on_one_line(home, engine, tmp_path):
    """Regression: `--attach README.md` printed "README.md: README.md: not an image…", and
    printed it twice (the media notice, then the refusal)."""
    notes = tmp_path / "notes.md"
    notes.write_text("# not a picture\n")
    r = aotx(home, "run", "--socket", str(engine), "--attach", str(notes), "what is this")
    assert r.returncode == 2
    line = one_line(r)
    assert line.startswith("aotx: notes.md: not an image or audio file") and line.count("notes.md") == 1, line


@pytest.mark.realmodel
def test_load_s_is_the_load_this_reply_paid_not_the_engines_startup(home, engine):
    """Regression: `aotx run --json`'s done.timings.load_s repeated the engine's startup
    time (13.5 s) on every reply to an engine that had long loaded its model."""
    r = aotx(home, "run", "--socket", str(engine), "--json", "--max-tokens", "1", "--temperature", "0", "hi")
    done = next(e for e in map(json.loads, r.stdout.splitlines()) if e["event"] == "done")
    assert done["timings"]["load_s"] == 0.0, done["timings"]
    assert done["timings"]["engine_load_s"] > 0.0  # the startup, under a name that says so


@pytest.mark.realmodel
def test_sigterm_of_the_interactive_aotx_run_cancels_the_reply_too(home, engine):
    """The chat of `aotx run` (no prompt, at a terminal): SIGTERM mid-reply cancelled
    nothing either. Now it cancels the reply and ends the chat with 143."""
    import pty

    master, slave = pty.openpty()
    env = dict(os.environ, AOTX_HOME=str(home), TERM="dumb")
    proc = subprocess.Popen([sys.executable, "-m", "aotx.engine.cli.commands", "run", "--socket", str(engine),
                             "--temperature", "0", "--max-tokens", "400"], env=env, stdin=slave, stdout=slave,
                            stderr=slave, start_new_session=True)
    os.close(slave)
    try:
        def read_until(cond, limit_s: float) -> bytes:
            got, end = b"", time.monotonic() + limit_s
            while not cond(got):
                assert time.monotonic() < end, got
                if select.select([master], [], [], 0.5)[0]:
                    got += os.read(master, 4096)
            return got

        read_until(lambda b: b">>> " in b, 120)
        os.write(master, b"Write a very long story about a cat.\r")
        got_reply = read_until(lambda b: b"cat." in b and len(b.split(b"cat.", 1)[-1].strip()) > 40, 120)  # the reply streams
        proc.send_signal(signal.SIGTERM)
        while proc.poll() is None and select.select([master], [], [], 0.2)[0]:
            try:
                os.read(master, 4096)
            except OSError:
                break
        assert proc.wait(60) == 143, got_reply
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    reply = _last_reply(home, engine)
    assert reply["role"] == "assistant" and reply["status"] == "cancelled", reply


def test_a_conversation_past_its_context_is_one_line_with_what_to_do(home, engine):
    """Regression: continuing a conversation that had filled its context printed two lines
    ("the prompt is 143 tokens; the context holds 128 ..." and "prompt of 143 tokens does
    not fit ...") and no way forward."""
    first = aotx(home, "run", "--socket", str(engine), "--max-tokens", "1", "--temperature", "0", "Hello there.")
    assert first.returncode == 0, first.stderr
    conv = _last_reply_conv(home, engine)
    r = aotx(home, "run", "--socket", str(engine), "--conversation", conv, "--max-tokens", "1", "word " * 600)
    assert r.returncode == 2
    line = one_line(r)
    assert "the context holds 512" in line and f"aotx conversations fork {conv} --at" in line, line
