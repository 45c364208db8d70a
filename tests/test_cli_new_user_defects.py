"""The command-line defects a new user found (fixcli, second round): a killed ``aotx run``
left the engine writing; engine flags ignored silently by a running engine; ``--device
cuda`` without a GPU accepted; gateway ports out of range; ``unload`` of the default
model; the remote API key read from the engine's environment; doubled error prefixes;
``load_s`` repeating the engine's startup time.

The tests that need an engine run ``aotx serve`` on the default model (2 slots, 512
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
    return tmp_path_factory.mktemp("cli-new-user")


@pytest.fixture(scope="module")
def engine(home, default_model_path):
    # the engine does not see VLLM_API_KEY (the remote-key test sets it for the client only)
    proc, sock = start_engine(home, None, slots=2, context=512, timeout=180,
                              sock=Path(f"/tmp/aotx-nu-{os.getpid()}.sock"), unset=("VLLM_API_KEY",))
    yield sock
    stop_engine(proc)
    sock.unlink(missing_ok=True)


def _last_reply(home: Path, sock: Path) -> dict:
    shown = json.loads(aotx(home, "conversations", "show", _last_reply_conv(home, sock), "--socket", str(sock),
                            "--json").stdout)
    return shown["messages"][-1]


@pytest.mark.realmodel
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_bug1_sigterm_and_sighup_of_aotx_run_cancel_the_reply(home, engine, sig, code):
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
def test_bug2_engine_flags_given_to_a_running_engine_are_named_not_silently_ignored(home, engine):
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
    """Regression (helper-28): `aotx run --device cuda "hi"` with a CPU engine running only
    warned and answered on the CPU (rc 0), and `--memory-budget 5X` only warned "ignores
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
    """Regression (helper-28): SIGTERM then SIGHUP 10 ms apart exited 129, not 143."""
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


def _has_cuda() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.skipif(_has_cuda(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("argv", [["serve", "--device", "cuda"], ["run", "--device", "cuda", "hi"]])
def test_bug5_device_cuda_without_a_gpu_is_an_error_not_a_cpu_engine(tmp_path, argv):
    """Regression: `aotx serve --device cuda` (or `aotx run --device cuda` starting an
    engine) on a machine without a GPU warned "the engine runs on the cpu" and went on.
    Now it is one line saying why, exit 2, and no engine is started."""
    r = aotx(tmp_path, *argv, "--socket", str(tmp_path / "e.sock"), timeout=60)
    assert r.returncode == 2
    line = one_line(r)
    assert line.startswith("aotx: --device cuda: ") and ("CuPy" in line or "no CUDA device" in line), line
    assert "started an engine" not in r.stderr and not (tmp_path / "engine.log").exists()


@pytest.mark.skipif(_has_cuda(), reason="this machine has a CUDA device")
def test_a_refused_gateway_start_writes_no_key_file(tmp_path):
    """Regression (helper-26's note): `aotx gateway --device cuda` without a GPU (and no
    engine) wrote a new API key file before the engine's refusal stopped it. The key of a
    first start is now written once an engine answers."""
    r = aotx(tmp_path, "gateway", "--port", "0", "--device", "cuda", "--socket", str(tmp_path / "e.sock"),
             timeout=60)
    assert r.returncode == 2
    assert "--device cuda: " in one_line(r)
    assert not (tmp_path / "gateway" / "api_keys").exists()


def test_bug5_device_auto_still_falls_back_to_the_cpu():
    from aotx.engine.cli.serve import pick_device

    assert pick_device("auto") == ("cuda" if _has_cuda() else "cpu")
    assert pick_device("cpu") == "cpu"


@pytest.mark.parametrize("port", ["99999", "65536", "-1"])
def test_bug3_gateway_port_out_of_range_is_a_usage_error(tmp_path, port):
    """Regression: `aotx gateway --port 99999` was accepted and served on another port.
    Now 0..65535 (0: a free port), else one line, exit 2, and no key file written."""
    r = aotx(tmp_path, "gateway", "--port", port, timeout=60)
    assert r.returncode == 2
    assert one_line(r) == f"aotx: gateway: --port must be between 0 and 65535, got {port}"
    assert not (tmp_path / "gateway").exists()


@pytest.mark.realmodel
def test_bug4_unload_of_the_default_model_is_refused_and_it_stays_loaded(home, engine):
    """Regression: `aotx unload <default model>` said "unloaded" and left no model loaded
    although the README says the default model stays."""
    default = json.loads(aotx(home, "status", "--socket", str(engine), "--json").stdout)["model"]
    r = aotx(home, "unload", default, "--socket", str(engine))
    assert r.returncode == 2 and r.stdout == ""
    assert one_line(r) == (f"aotx: {default} is the engine's default model: it stays loaded (unload the models "
                           f"loaded beside it; `aotx stop` frees all of them)")
    listed = json.loads(aotx(home, "models", "--socket", str(engine), "--json").stdout)
    assert next(m for m in listed["models"] if m["name"] == default)["loaded"] is True


@pytest.mark.parametrize("prompt,words", [("", "empty"), ("   \n\t", "blank (only whitespace)")])
def test_bug7_an_empty_or_blank_prompt_is_one_line_with_one_prefix(tmp_path, prompt, words):
    """Regression: `aotx run ""` said "aotx: aotx run: the prompt is empty"; a prompt of
    spaces was sent to the model."""
    r = aotx(tmp_path, "run", "--socket", str(tmp_path / "e.sock"), prompt, timeout=60)
    assert r.returncode == 2 and one_line(r) == f"aotx: run: the prompt is {words}"
    assert not (tmp_path / "engine.log").exists()  # refused before an engine was started


@pytest.mark.realmodel
def test_bug7_a_bad_attachment_is_named_once_on_one_line(home, engine, tmp_path):
    """Regression: `--attach README.md` printed "README.md: README.md: not an image…", and
    printed it twice (the media notice, then the refusal)."""
    notes = tmp_path / "notes.md"
    notes.write_text("# not a picture\n")
    r = aotx(home, "run", "--socket", str(engine), "--attach", str(notes), "what is this")
    assert r.returncode == 2
    line = one_line(r)
    assert line.startswith("aotx: notes.md: not an image or audio file") and line.count("notes.md") == 1, line


@pytest.mark.realmodel
def test_bug7_fork_of_one_message_says_message_not_messages(home, engine):
    """Regression: "forked from c… with 1 messages"."""
    r = aotx(home, "run", "--socket", str(engine), "--json", "--max-tokens", "1", "--temperature", "0", "hi")
    conv = next(e for e in map(json.loads, r.stdout.splitlines()) if e["event"] == "done")["conversation"]
    shown = json.loads(aotx(home, "conversations", "show", conv, "--socket", str(engine), "--json").stdout)
    first = shown["messages"][0]["msg_id"]
    f = aotx(home, "conversations", "fork", conv, "--at", first, "--socket", str(engine))
    assert f.returncode == 0, f.stderr
    assert f"forked from {conv} with 1 message; continue" in f.stdout, f.stdout


@pytest.mark.realmodel
def test_bug8_load_s_is_the_load_this_reply_paid_not_the_engines_startup(home, engine):
    """Regression: `aotx run --json`'s done.timings.load_s repeated the engine's startup
    time (13.5 s) on every reply to an engine that had long loaded its model."""
    r = aotx(home, "run", "--socket", str(engine), "--json", "--max-tokens", "1", "--temperature", "0", "hi")
    done = next(e for e in map(json.loads, r.stdout.splitlines()) if e["event"] == "done")
    assert done["timings"]["load_s"] == 0.0, done["timings"]
    assert done["timings"]["engine_load_s"] > 0.0  # the startup, under a name that says so


@pytest.mark.realmodel
def test_bug8_load_s_counts_the_engine_start_this_command_waited_for(tmp_path, default_model_path):
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


@pytest.mark.realmodel
def test_bug1_sigterm_of_the_interactive_aotx_run_cancels_the_reply_too(home, engine):
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
    """Regression (new-user trial, session 4): continuing a conversation that had filled its
    context printed two lines ("the prompt is 143 tokens; the context holds 128 ..." and
    "prompt of 143 tokens does not fit ...") and no way forward."""
    first = aotx(home, "run", "--socket", str(engine), "--max-tokens", "1", "--temperature", "0", "Hello there.")
    assert first.returncode == 0, first.stderr
    conv = _last_reply_conv(home, engine)
    r = aotx(home, "run", "--socket", str(engine), "--conversation", conv, "--max-tokens", "1", "word " * 600)
    assert r.returncode == 2
    line = one_line(r)
    assert "the context holds 512" in line and f"aotx conversations fork {conv} --at" in line, line


def _last_reply_conv(home: Path, sock: Path) -> str:
    listed = json.loads(aotx(home, "conversations", "list", "--socket", str(sock), "--json").stdout)
    return max(listed, key=lambda c: c["created_at"])["id"]


def test_conversations_delete_from_the_cli(home, engine):
    """Regression (new-user trial, session 4): `aotx conversations delete ID` was "unknown
    conversations command 'delete'" (only F8 in aotx-chat deleted)."""
    r = aotx(home, "run", "--socket", str(engine), "--max-tokens", "1", "--temperature", "0", "Delete me later.")
    assert r.returncode == 0, r.stderr
    conv = _last_reply_conv(home, engine)
    d = aotx(home, "conversations", "delete", conv, "--socket", str(engine))
    assert d.returncode == 0 and d.stdout.startswith(f"deleted {conv}  “Delete me later.”"), d.stdout + d.stderr
    listed = json.loads(aotx(home, "conversations", "list", "--socket", str(engine), "--json").stdout)
    assert conv not in {c["id"] for c in listed}
    again = aotx(home, "conversations", "delete", conv, "--socket", str(engine))
    assert again.returncode == 2 and conv in one_line(again)
