"""Ollama's API on the gateway, through the official ``ollama`` Python client (and oterm,
Ollama's Textual client, run in a pty when it is installed).

One engine subprocess (SmolLM2, CPU) serves the module and a gateway runs in-process.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
ollama = pytest.importorskip("ollama")

from tests.gateway_support import KEY, engine_call, gateway, start_engine, stop_engine  # noqa: E402

pytestmark = pytest.mark.realmodel


@pytest.fixture(scope="module")
def engine(tmp_path_factory, default_model_path):
    home = tmp_path_factory.mktemp("gwollama")
    proc, sock = start_engine(home, None, slots=2, context=1024)
    yield sock, home
    stop_engine(proc)


@pytest.fixture(scope="module")
def gw(engine):
    with gateway(engine[0]) as url:
        yield url


@pytest.fixture()
def ol(gw):
    return ollama.Client(host=gw, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)


def _model(ol) -> str:
    return ol.list().models[0].model


def test_list_show_ps_and_version_through_the_ollama_client(ol, gw):
    models = ol.list().models
    assert models and models[0].model.startswith("SmolLM2") and models[0].details.format == "gguf"
    assert models[0].details.quantization_level == "Q4_1" and models[0].details.family == "llama"
    show = ol.show(models[0].model)
    assert "tools" in show.capabilities and show.modelinfo["llama.context_length"] == 8192
    assert "temperature" in show.parameters
    running = ol.ps().models
    assert [m.model for m in running] == [models[0].model] and running[0].context_length == 1024
    assert ol.show(models[0].model + ":latest").details.family == "llama"  # Ollama's tag taken off
    r = httpx.get(gw + "/api/version", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["version"].count(".") == 2


def test_chat_streamed_equals_whole_and_is_journaled(ol, engine, gw):
    m = _model(ol)
    kw = dict(model=m, messages=[{"role": "user", "content": "Name a colour."}],
              options={"temperature": 0, "num_predict": 12, "seed": 3})
    whole = ol.chat(**kw, stream=False)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    assert whole.eval_count > 0 and whole.prompt_eval_count > 0 and whole.total_duration > 0
    chunks = list(ol.chat(**kw, stream=True))
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert chunks[-1].eval_count == whole.eval_count
    raw = httpx.post(gw + "/api/chat", json={**kw, "stream": False}, headers={"Authorization": f"Bearer {KEY}"},
                     timeout=300)
    conv = raw.headers["X-AOTX-Conversation"]  # journaled like any other request, with its receipt
    assert raw.json()["aotx"]["conversation"] == conv and raw.json()["aotx"]["receipt"]["last_seq"] > 0
    view = engine_call(engine[0], lambda c: c.show(conv))
    assert [x.role for x in view.messages] == ["user", "assistant"]
    assert view.messages[1].text == whole.message.content == raw.json()["message"]["content"]


def test_generate_num_predict_stop_and_raw(ol):
    m = _model(ol)
    r = ol.generate(model=m, prompt="Count: 1, 2, 3,", raw=True, options={"temperature": 0, "num_predict": 5})
    assert r.done and r.done_reason == "length" and r.eval_count == 5
    r2 = ol.generate(model=m, prompt="Count: 1, 2, 3,", raw=True,
                     options={"temperature": 0, "num_predict": 30, "stop": [","]})
    assert "," not in r2.response and r2.done_reason == "stop"
    seeds = {ol.generate(model=m, prompt="Say a word.", options={"temperature": 1.0, "seed": 42,
                                                                 "num_predict": 8}).response for _ in range(2)}
    assert len(seeds) == 1


def test_format_json_schema_is_held(ol):
    m = _model(ol)
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    r = ol.chat(model=m, messages=[{"role": "user", "content": "How old is the Earth? Answer in JSON."}],
                format=schema, options={"temperature": 0, "num_predict": 40})
    assert isinstance(json.loads(r.message.content)["age"], int)


def test_embed_is_normalized_mean_pooling_and_legacy_route(ol):
    m = _model(ol)
    e = ol.embed(model=m, input=["The cat sat.", "A dog ran."])
    assert len(e.embeddings) == 2 and len(e.embeddings[0]) == 576
    for v in e.embeddings:
        assert abs(sum(x * x for x in v) - 1.0) < 1e-4
    one = ol.embed(model=m, input="The cat sat.").embeddings[0]
    assert max(abs(a - b) for a, b in zip(one, e.embeddings[0])) < 1e-5  # batch-invariant
    legacy = ol.embeddings(model=m, prompt="The cat sat.").embedding
    norm = sum(x * x for x in legacy) ** 0.5
    assert norm > 1.5 and max(abs(a / norm - b) for a, b in zip(legacy, one)) < 1e-4


def test_tools_and_images_reach_the_model(ol, gw):
    m = _model(ol)
    tools = [{"type": "function", "function": {"name": "get_time", "description": "the time",
                                               "parameters": {"type": "object", "properties": {}}}}]
    r = ol.chat(model=m, messages=[{"role": "user", "content": "What time is it?"}], tools=tools,
                options={"temperature": 0, "num_predict": 40})
    assert r.done
    # a tool round trip in Ollama's shape: the call's arguments an object, the result by tool_name
    r2 = ol.chat(model=m, messages=[
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": "12:00", "tool_name": "get_time"}], tools=tools,
        options={"temperature": 0, "num_predict": 20})
    assert r2.done and r2.message.content
    png = (Path(__file__).resolve().parents[1] / "assets" / "screenshot.png")
    with pytest.raises(ollama.ResponseError) as e:  # not an image: refused naming the field
        ol.chat(model=m, messages=[{"role": "user", "content": "What is this?", "images": [b"not a picture"]}])
    assert e.value.status_code == 400 and "images[0]" in str(e.value)
    assert png.is_file()


def test_bad_input_is_4xx_in_ollamas_shape(gw, ol):
    h = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=gw, headers=h, timeout=60) as c:
        cases = [
            ("/api/chat", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "does not exist"),
            ("/api/chat", {"model": "local", "messages": "x"}, 400, "messages"),
            ("/api/chat", {"model": "local", "messages": [{"role": "user", "content": "x"}],
                           "options": {"mirostat": 2}}, 400, "mirostat"),
            ("/api/chat", {"model": "local", "messages": [{"role": "user", "content": "x"}],
                           "options": {"num_ctx": 10 ** 6}}, 400, "num_ctx"),
            ("/api/chat", {"model": "local", "messages": [{"role": "user", "content": "x"}],
                           "options": {"bogus": 1}}, 400, "bogus"),
            ("/api/chat", {"model": "local", "messages": [{"role": "user", "content": "x"}], "think": True},
             400, "think"),
            ("/api/chat", {"model": "local", "messages": [{"role": "user", "content": "x"}],
                           "keep_alive": "soon"}, 400, "keep_alive"),
            ("/api/generate", {"model": "local", "prompt": "x", "context": [1, 2]}, 400, "context"),
            ("/api/generate", {"model": "local", "prompt": 3}, 400, "prompt"),
            ("/api/embed", {"model": "local", "input": []}, 400, "input"),
            ("/api/embed", {"model": "local", "input": "x", "dimensions": 7}, 400, "dimensions"),
            ("/api/show", {"model": ""}, 400, "model"),
            ("/api/show", [], 400, "object"),
        ]
        for path, body, status, word in cases:
            r = c.post(path, json=body)
            assert r.status_code == status and word in r.json()["error"], (path, body, r.status_code, r.text)
        assert c.get("/api/tags", headers={"Authorization": "Bearer wrong-key-0123456789"}).status_code == 401
        r = c.post("/api/chat", content=b"{", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]


def test_load_and_unload_with_keep_alive(ol):
    m = _model(ol)
    r = ol.generate(model=m, prompt="", keep_alive="5m")
    assert r.done and r.done_reason == "load"
    r = ol.chat(model=m, messages=[], keep_alive=0)  # the default model stays (the engine keeps it)
    assert r.done and r.done_reason == "unload" and [x.model for x in ol.ps().models] == [m]


def _oterm() -> tuple[str, str] | None:
    """(oterm's executable, the Python of its environment), or None when not installed."""
    exe = os.environ.get("AOTX_TEST_OTERM") or shutil.which("oterm") or next(
        (str(p) for p in (Path(sys.executable).parent / "oterm",) if p.is_file()), None)
    if exe is None:
        return None
    py = Path(exe).parent / "python"
    return exe, str(py if py.exists() else sys.executable)


@pytest.mark.skipif(sys.platform != "linux", reason="a pty")
def test_oterm_lists_the_models_and_chats(gw, engine, tmp_path):
    """oterm (Ollama's Textual client) in a pseudo-terminal against the gateway: its new-chat
    dialog lists the engine's model (``/api/tags``, ``/api/show``), and a message typed in a
    chat on that model is answered: the conversation, with oterm's message and the reply,
    is in the engine's journal. Bounded: 240 s in all."""
    found = _oterm()
    if found is None:
        # oterm pins older textual/pillow/huggingface_hub than the test environment: it lives in
        # a venv of its own, named by AOTX_TEST_OTERM (python3 -m venv V && V/bin/pip install oterm)
        pytest.skip("oterm is not installed here: set AOTX_TEST_OTERM to an oterm executable in a venv of its own")
    exe, py = found
    import fcntl
    import pty
    import select
    import struct
    import subprocess
    import termios

    env = dict(os.environ, OLLAMA_URL=gw, OLLAMA_API_KEY=KEY, HOME=str(tmp_path), TERM="xterm-256color",
               OTERM_DATA_DIR=str(tmp_path / "oterm"), XDG_CONFIG_HOME=str(tmp_path / "cfg"))
    model = httpx.get(gw + "/api/tags", headers={"Authorization": f"Bearer {KEY}"}).json()["models"][0]["name"]
    # one chat on the model in oterm's store, so oterm opens on it
    subprocess.run([py, "-c", "import asyncio, sys\nfrom oterm.store.store import Store\nfrom oterm.types import "
                    "ChatModel\nasync def m():\n    s = await Store.get_store()\n    await s.save_chat(ChatModel("
                    "name='t', model=sys.argv[1], provider='ollama', parameters={'max_tokens': 12, "
                    "'temperature': 0}))\nasyncio.run(m())", model], env=env, check=True, timeout=120)
    master, slave = pty.openpty()
    # a window of 40 x 120 cells of 10 x 20 pixels (textual-image divides by them)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 1200, 800))
    p = subprocess.Popen([exe], stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    screen = bytearray()
    deadline = time.monotonic() + 240

    def read_until(done, seconds: float) -> bool:
        end = min(deadline, time.monotonic() + seconds)
        while time.monotonic() < end:
            if done():
                return True
            r, _, _ = select.select([master], [], [], 0.2)
            if r:
                try:
                    chunk = os.read(master, 65536)
                except OSError:
                    return done()
                screen.extend(chunk)
                if b"\x1b[c" in chunk:  # the terminal's primary device attributes (a VT220)
                    os.write(master, b"\x1b[?62;22c")
        return done()

    def conversations() -> list:
        async def show(c):
            return [await c.show(v.conv_id) for v in await c.list_conversations()]
        return engine_call(engine[0], show)

    before = {v.conv_id for v in conversations()}
    said = "Say hello to oterm."
    try:
        assert read_until(lambda: b"Welcome" in screen or model.encode() in screen, 150), screen[-1500:]
        read_until(lambda: False, 3)
        os.write(master, b"\x0e")  # ctrl+n: the new-chat dialog lists the models
        assert read_until(lambda: screen.count(model.encode()) >= 2, 30), screen[-1500:]
        os.write(master, b"\x1b")  # escape: back to the chat
        read_until(lambda: False, 3)
        os.write(master, said.encode())
        read_until(lambda: False, 2)
        os.write(master, b"\r")

        def answered() -> bool:
            new = [v for v in conversations() if v.conv_id not in before]
            return any(len(v.messages) >= 2 and v.messages[-2].text == said and v.messages[-1].role == "assistant"
                       and v.messages[-1].status == "complete" for v in new)

        ok = False
        while not ok and time.monotonic() < deadline:
            read_until(lambda: False, 2)
            ok = answered()
        assert ok, screen[-1500:].decode("utf-8", "replace")
    finally:
        p.kill()
        p.wait(10)
        os.close(master)


def test_a_new_engine_gets_the_models_the_dead_one_had_loaded(tmp_path, tiny_gguf):
    """An engine died under the gateway and another one came up on the socket (the CLI's
    connect starts one on the default model): requests for the model the dead engine served
    got 404 until something reloaded it. The gateway remembers the loaded models and loads
    them into the new engine (by file when its catalog does not name them)."""
    (tmp_path / "elsewhere").mkdir()
    tiny = tmp_path / "elsewhere" / "tiny-r.gguf"
    tiny_gguf.write_tiny_llama(tiny, seed=3)
    home = tmp_path / "home"
    home.mkdir()
    sock = Path(tempfile.mkdtemp(prefix="aotx-rs", dir="/tmp")) / "e.sock"
    a, _ = start_engine(home, tiny, slots=1, context=256, sock=sock)
    try:
        with gateway(sock) as url:
            h = {"Authorization": f"Bearer {KEY}"}
            body = {"model": "tiny-r", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert httpx.post(url + "/v1/chat/completions", json=body, headers=h, timeout=120).status_code == 200
            stop_engine(a, kill=True)
            c, _ = start_engine(home, None, slots=1, context=256, sock=sock)  # the default model only
            try:
                r = httpx.post(url + "/v1/chat/completions", json=body, headers=h, timeout=300)
                assert r.status_code == 200, r.text
                assert r.json()["model"] == "tiny-r"
                names = {m["id"]: m["aotx"]["loaded"] for m in httpx.get(url + "/v1/models", headers=h).json()["data"]}
                assert names.get("tiny-r") is True and len(names) >= 2
            finally:
                stop_engine(c)
    finally:
        stop_engine(a)
