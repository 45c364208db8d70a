"""Remote models against real OpenAI-compatible servers started by the test on loopback.

* AOTX's own gateway (an in-process engine on the default model behind
  ``gateway.create_app``): the remote reply equals, token for token, what the local
  model gives the same chat (same model, same template, greedy);
* llama-cpp-python's server (``python -m llama_cpp.server``, its ``server`` extra) on the
  default model: AOTX journals exactly the text the official ``openai`` client gets
  from it for the same request, and a server killed mid-stream leaves an interrupted
  reply that the conversation continues from. The server's venv is ``$AOTX_LLAMA_VENV``
  when set, else built once into ``.cache/llama-server-venv`` (llama.cpp compiles for
  minutes; bounded by ``LLAMA_BUILD_TIMEOUT_S``); the tests skip, saying why, when it
  cannot be had;
* a kill -9 of AOTX's engine (``aotx serve`` in a subprocess) in the middle of a remote
  reply: after the restart the user's message and the committed part are there with
  their receipts, the reply is interrupted, and the conversation goes on on its model.
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

from aotx.engine import protocol as P
from aotx.engine.runtime.catalog import RemoteSpec, write_remote
from tests.fakes.inproc import Client, make_engine, reply, stop
from tests.fakes.openai_server import FakeOpenAI, free_port

pytestmark = pytest.mark.realmodel
ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-aotx-remote-test-0123456789abcdef"
LLAMA_BUILD_TIMEOUT_S = 600
# no multimodal library (the server test sends text), and -O1: the build 2.5 min on 2 cores, not
# 4 at -O3 (2026-12-07; the server then answers this test's requests in 3.6 s)
LLAMA_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
                    "-DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS_RELEASE=-O1 -DCMAKE_CXX_FLAGS_RELEASE=-O1")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    (tmp_path / "models").mkdir(exist_ok=True)
    return tmp_path


def wait_port(port: int, proc: subprocess.Popen | None = None, timeout: float = 120, log: Path | None = None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            if proc is not None and proc.poll() is not None:
                tail = log.read_text()[-2000:] if log and log.exists() else ""
                pytest.fail(f"the server exited with {proc.returncode}: {tail}")
            time.sleep(0.2)
    pytest.fail(f"nothing listened on port {port} within {timeout} s")


# ---- AOTX's gateway as the remote ------------------------------------------------------------

@contextmanager
def aotx_gateway(sock: Path):
    from aotx.engine.gateway import server as G
    from aotx.engine.gateway import auth as A
    from aotx.engine.ipc.client import EngineClient

    config = G.GatewayConfig()
    link = G.EngineLink(lambda: EngineClient.connect(sock, spawn=False), config.retry_after_s)
    server = G.uvicorn_server(G.create_app(config, A.KeyRing([KEY]), link))
    lsock = G.listen_socket("127.0.0.1", 0)
    t = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[lsock])), daemon=True)
    t.start()
    end = time.monotonic() + 30
    while not server.started:
        assert t.is_alive() and time.monotonic() < end, "the gateway did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{lsock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        t.join(15)
        lsock.close()


def test_aotx_gateway_as_the_remote_gives_the_local_models_tokens(loaded_model, engine_server, home):
    cluster = engine_server(slots=2, context=1024)  # "the cluster": another engine, behind its gateway
    (home / "gateway.key").write_text(KEY + "\n")
    with aotx_gateway(cluster.socket) as url:
        write_remote(home / "models", "cluster", RemoteSpec(url=url, model=loaded_model.name,
                                                            api_key_file=str(home / "gateway.key")))
        eng = make_engine(loaded_model, home, journal="local-journal", context=1024)
        try:
            c = Client(eng)
            remote = c.create(model="cluster", system_prompt="You are terse.")
            local = c.create(system_prompt="You are terse.")
            _, end_r = c.run(remote.conv_id, "Name a colour.", raw=False, n=12)
            _, end_l = c.run(local.conv_id, "Name a colour.", raw=False, n=12)
            assert isinstance(end_r, P.Committed) and isinstance(end_l, P.Committed), (end_r, end_l)
            assert end_r.text == end_l.text and end_r.text
            assert end_r.n_completion == end_l.n_completion  # the gateway's usage
            # a second turn: the remote conversation's history goes with it
            _, end_r2 = c.run(remote.conv_id, "Another one.", raw=False, n=12)
            _, end_l2 = c.run(local.conv_id, "Another one.", raw=False, n=12)
            assert end_r2.text == end_l2.text
            view = c.call(P.ShowConversation, P.ConversationInfo, conv_id=remote.conv_id).conversation
            assert [m.model for m in view.messages if m.role == "assistant"] == ["cluster", "cluster"]
        finally:
            stop(eng)


# ---- llama-cpp-python's server ------------------------------------------------------------------

def _llama_python() -> Path:
    """The python of a venv with llama-cpp-python[server]: $AOTX_LLAMA_VENV, or one built
    once into .cache/llama-server-venv (skips with the reason when that fails)."""
    env = os.environ.get("AOTX_LLAMA_VENV")
    venv = Path(env) if env else ROOT / ".cache" / "llama-server-venv"
    py = venv / "bin" / "python"
    ok = venv / "READY"
    if py.exists() and (env or ok.exists()):
        probe = subprocess.run([str(py), "-c", "import llama_cpp.server"], capture_output=True, timeout=120)
        if probe.returncode == 0:
            return py
        if env:
            pytest.skip(f"$AOTX_LLAMA_VENV={env} has no llama_cpp.server: {probe.stderr.decode()[-300:]}")
    if env:
        pytest.skip(f"$AOTX_LLAMA_VENV={env} is not a venv")
    failed = venv.parent / "llama-server-venv.FAILED"
    if failed.exists():
        pytest.skip(f"building llama-cpp-python[server] failed before: {failed.read_text()[-300:]} (remove {failed} "
                    f"to try again)")
    venv.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, capture_output=True)
        r = subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-cache-dir", "llama-cpp-python[server]"],
                           env=dict(os.environ, CMAKE_ARGS=LLAMA_CMAKE_ARGS), capture_output=True,
                           timeout=LLAMA_BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        failed.write_text(f"not built within {LLAMA_BUILD_TIMEOUT_S} s")
        pytest.skip(f"llama-cpp-python[server] did not build within {LLAMA_BUILD_TIMEOUT_S} s")
    except (OSError, subprocess.CalledProcessError) as e:
        failed.write_text(str(e))
        pytest.skip(f"cannot make a venv for llama-cpp-python: {e}")
    if r.returncode != 0:
        failed.write_text(r.stderr.decode()[-2000:])
        pytest.skip(f"pip could not build llama-cpp-python[server]: {r.stderr.decode()[-300:]}")
    ok.write_text(f"built in {time.monotonic() - t0:.0f} s\n")
    return py


@pytest.fixture(scope="module")
def llama_python():
    return _llama_python()


@contextmanager
def llama_server(py: Path, model: Path, log: Path):
    port = free_port()
    with open(log, "ab") as fh:
        proc = subprocess.Popen([str(py), "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
                                 "--port", str(port), "--n_ctx", "2048", "--model_alias", "smollm", "--api_key", KEY,
                                 "--n_threads", "2", "--verbose", "False"], stdout=fh, stderr=fh,
                                start_new_session=True)
    try:
        wait_port(port, proc, 180, log)
        yield f"http://127.0.0.1:{port}/v1", proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_llama_cpp_server_as_the_remote(loaded_model, default_model_path, llama_python, home):
    openai = pytest.importorskip("openai")
    with llama_server(llama_python, default_model_path, home / "llama.log") as (url, proc):
        write_remote(home / "models", "llama", RemoteSpec(url=url, model="smollm", api_key=KEY))
        direct = openai.OpenAI(base_url=url, api_key=KEY).chat.completions.create(
            model="smollm", messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0.0, top_p=0.95, max_tokens=24, extra_body={"top_k": 40, "min_p": 0.05}, seed=None)
        if not direct.choices[0].message.content:  # seen with a llama-cpp-python wheel built for another CPU
            pytest.skip(f"llama-cpp-python's server at {llama_python} answers with no text even to the openai "
                        f"client (a broken build; set $AOTX_LLAMA_VENV to a working venv)")
        eng = make_engine(loaded_model, home)
        try:
            c = Client(eng)
            conv = c.create(model="llama")
            _, end = c.run(conv.conv_id, "What is the capital of France?", raw=False, n=24)
            assert isinstance(end, P.Committed) and end.finish_reason in ("stop", "length"), end
            assert end.text == direct.choices[0].message.content and end.text
            view = c.call(P.ShowConversation, P.ConversationInfo, conv_id=conv.conv_id).conversation
            assert view.messages[-1].text == end.text and view.messages[-1].model == "llama"
            # the server dies in the middle of a long reply: interrupted, the part kept
            rid = c.submit(conv.conv_id, "Count from one to two hundred, in words.", raw=False, n=400)
            c.sink.until(lambda e: isinstance(e, P.Token) and e.id == rid and e.pos >= 3)
            os.killpg(proc.pid, signal.SIGKILL)
            end2 = reply(c.sink, rid)
            assert isinstance(end2, P.Committed) and end2.finish_reason == "interrupted", end2
            assert end2.text and end2.n_completion >= 4
        finally:
            stop(eng)


# ---- kill -9 of AOTX's engine in the middle of a remote reply -----------------------------------

def _serve(home: Path, sock: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, AOTX_HOME=str(home))
    fh = open(log, "ab")
    return subprocess.Popen([sys.executable, "-m", "aotx.engine.cli.commands", "serve", "--socket", str(sock), "--slots", "2",
                             "--context", "512", "--device", "cpu"], env=env, stdout=fh, stderr=fh,
                            start_new_session=True)


async def _connect(sock: Path, proc: subprocess.Popen, log: Path):
    from aotx.engine.errors import EngineError
    from aotx.engine.ipc.client import EngineClient

    end = time.monotonic() + 180
    while True:
        try:
            return await EngineClient.connect(sock, spawn=False, client_name="test")
        except EngineError:
            if proc.poll() is not None:
                pytest.fail(f"the engine exited with {proc.returncode}: {log.read_text()[-2000:]}")
            if time.monotonic() > end:
                pytest.fail("the engine did not answer within 180 s")
            await asyncio.sleep(0.2)


async def test_remote_conversation_keeps_its_receipts_and_resumes_after_kill_9(home):
    words = [f" w{i}" for i in range(400)]
    with FakeOpenAI(words=words, delay_s=0.05) as srv:
        write_remote(home / "models", "far", RemoteSpec(url=srv.url, model="far"))
        sock = Path(f"/tmp/aotx-rk-{os.getpid()}.sock")
        log = home / "serve.log"
        proc = _serve(home, sock, log)
        try:
            c = await _connect(sock, proc, log)
            conv = await c.create_conversation(title="far", model="far")
            durable_text, tokens_text, user_receipt = "", "", None
            covered = 0
            async for ev in c.submit(conv.conv_id, "Count", sampling=P.SamplingParams(max_tokens=2000)):
                if isinstance(ev, P.Durable) and ev.msg_id and user_receipt is None:
                    user_receipt = ev.receipt
                elif isinstance(ev, P.Token):
                    tokens_text += ev.text
                    last_seq = ev.seq
                elif isinstance(ev, P.Durable) and tokens_text and ev.receipt.last_seq >= last_seq:
                    durable_text, covered = tokens_text, ev.receipt.last_seq
                if len(durable_text) > 20:
                    break
            os.killpg(proc.pid, signal.SIGKILL)  # kill -9, mid-reply
            proc.wait(10)
            await c.close()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        assert user_receipt is not None and covered > 0
        n_requests = len(srv.requests)
        proc = _serve(home, sock, log)
        try:
            c = await _connect(sock, proc, log)
            view = await c.show(conv.conv_id)
            assert view.model == "far"
            user, rep = view.messages
            assert user.text == "Count" and user.receipt is not None
            # durable in the segment the receipt named (recovery gives it its own record's boundary)
            assert user.receipt.segment == user_receipt.segment and user.receipt.last_seq <= user_receipt.last_seq
            assert rep.status == "interrupted" and rep.model == "far"
            assert rep.text.startswith(durable_text) and words[0] in rep.text  # nothing durable was lost
            # it goes on, on its model, with the interrupted part in its history
            srv.words = [" done", "."]
            text = ""
            async for ev in c.submit(conv.conv_id, "Go on", sampling=P.SamplingParams(max_tokens=50)):
                if isinstance(ev, P.Committed):
                    text = ev.text
                    assert ev.finish_reason == "stop"
            assert text == " done."
            assert len(srv.requests) == n_requests + 1
            msgs = srv.requests[-1][1]["messages"]
            assert msgs[-2]["role"] == "assistant" and msgs[-2]["content"] == rep.text
            await c.close()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            sock.unlink(missing_ok=True)
