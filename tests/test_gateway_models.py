"""The gateway routes by the request's ``model``.

An in-process engine on the default model with a tiny llama file in its models folder,
behind an in-process gateway; the official ``openai`` client lists the models and
chats with each. ``local`` names the default model; a name that matches no model gets
a 404 ``model_not_found`` naming the close ones; the reply names the model that ran.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.realmodel
KEY = "sk-aotx-route-test-0123456789abcdef"


@contextmanager
def gateway(sock: Path):
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


def test_gateway_lists_and_routes_by_model(engine_server, loaded_model, tmp_path, tiny_gguf):
    (tmp_path / "models").mkdir(exist_ok=True)
    tiny_gguf.write_tiny_llama(tmp_path / "models" / "tiny-a.gguf", seed=1)
    h = engine_server(slots=2, context=256)  # AOTX_HOME is tmp_path: its models folder holds tiny-a
    with gateway(h.socket) as url:
        oa = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)
        listed = {m.id: m for m in oa.models.list().data}
        assert set(listed) == {loaded_model.name, "tiny-a"}
        assert listed["tiny-a"].model_extra["aotx"]["loaded"] is False
        assert listed[loaded_model.name].model_extra["aotx"]["default"] is True
        assert oa.models.retrieve("tiny-a").id == "tiny-a"
        with pytest.raises(openai.NotFoundError):
            oa.models.retrieve("nope")
        msgs = [{"role": "user", "content": "hello"}]
        raw = oa.chat.completions.with_raw_response.create(model="tiny-a", messages=msgs, temperature=0,
                                                           max_tokens=4)
        r = raw.parse()
        assert r.model == "tiny-a" and r.choices[0].message.content is not None
        conv_id = raw.headers["x-aotx-conversation"]
        view = h.store.view(conv_id)
        assert view.model == "tiny-a" and view.messages[-1].model == "tiny-a"
        # loaded now, and listed so
        assert {m.id: m for m in oa.models.list().data}["tiny-a"].model_extra["aotx"]["loaded"] is True
        # "local" (the README's examples) runs on the default model, and the reply says so
        r2 = oa.chat.completions.create(model="local", messages=msgs, temperature=0, max_tokens=4)
        assert r2.model == loaded_model.name
        assert oa.chat.completions.create(model=loaded_model.name.upper(), messages=msgs, temperature=0,
                                          max_tokens=2).model == loaded_model.name
        # the gateway served unknown names with the default model (200 for "gpt-4" and "smol"):
        # they get OpenAI's 404 model_not_found naming the close ones, and nothing is written
        before = len(h.store.list_views())
        for name, near in (("gpt-4", ""), ("smol", loaded_model.name)):
            with pytest.raises(openai.NotFoundError) as ei:
                oa.chat.completions.create(model=name, messages=msgs, max_tokens=2)
            err = ei.value.body
            assert ei.value.status_code == 404 and err["type"] == "invalid_request_error", err
            assert err["code"] == "model_not_found" and err["param"] == "model", err
            assert f"the model {name!r} does not exist" in err["message"]
            assert (f"did you mean {near}?" in err["message"]) if near else "did you mean" not in err["message"]
        with pytest.raises(openai.NotFoundError):
            oa.completions.create(model="smol", prompt="hi", max_tokens=2)
        import httpx

        r3 = httpx.post(f"{url}/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                        json={"model": "smol", "max_tokens": 2, "messages": msgs}, timeout=60)
        assert r3.status_code == 404, r3.text
        body = r3.json()
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error", body
        assert f"did you mean {loaded_model.name}?" in body["error"]["message"]
        r4 = httpx.post(f"{url}/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                        json={"model": "smol", "max_tokens": 2, "messages": msgs, "stream": True}, timeout=60)
        assert r4.status_code == 404 and r4.json()["error"]["type"] == "not_found_error", r4.text
        assert len(h.store.list_views()) == before
        # regression: "LOCAL" was refused though names match without case; GET /v1/models/{id}
        # refused "local" and a lower-case id that chat accepted; a 100,000-character name came
        # back whole in the 404
        assert oa.chat.completions.create(model="LOCAL", messages=msgs, temperature=0,
                                          max_tokens=2).model == loaded_model.name
        assert oa.models.retrieve("local").id == loaded_model.name
        assert oa.models.retrieve(loaded_model.name.lower() + ".gguf").id == loaded_model.name
        with pytest.raises(openai.NotFoundError):
            oa.models.retrieve("smol")
        before = len(h.store.list_views())   # the LOCAL chat made one
        with pytest.raises(openai.NotFoundError) as ei:
            oa.chat.completions.create(model="x" * 100_000, messages=msgs, max_tokens=2)
        assert "(100,000 characters)" in ei.value.body["message"] and len(ei.value.body["message"]) < 600
        assert len(h.store.list_views()) == before
        # streaming names the routed model on every chunk
        chunks = list(oa.chat.completions.create(model="tiny-a.gguf", messages=msgs, temperature=0, max_tokens=3,
                                                 stream=True))
        assert chunks and {c.model for c in chunks} == {"tiny-a"}


def test_tool_calls_on_a_routed_model_use_that_models_format(engine_server, tmp_path, llama3_vocab_path):
    """The gateway built the forced call's grammar and parsed replies in the default model's
    tool-call format (hermes <tool_call> blocks, the engine's Welcome) whatever model the
    request named: a Llama 3 model was made to write Qwen's markup. The routed model's own
    format (ModelInfo.tool_format, from its chat template) is used."""
    import shutil

    (tmp_path / "models").mkdir(exist_ok=True)
    shutil.copy(llama3_vocab_path, tmp_path / "models" / "llama3-tools.gguf")
    h = engine_server(slots=2, context=512)
    tools = [{"type": "function", "function": {"name": "flag", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
        "additionalProperties": False}}}]
    with gateway(h.socket) as url:
        oa = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)
        for stream in (False, True):
            kw = dict(model="llama3-tools", messages=[{"role": "user", "content": "flag it"}], tools=tools,
                      tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=40)
            if stream:
                names = [t.function.name for ch in oa.chat.completions.create(stream=True, **kw)
                         for c in ch.choices for t in (c.delta.tool_calls or []) if t.function.name]
                assert names == ["flag"]
                continue
            raw = oa.chat.completions.with_raw_response.create(**kw)
            c = raw.parse().choices[0]
            assert c.finish_reason == "tool_calls" and [t.function.name for t in c.message.tool_calls] == ["flag"]
            assert c.message.content is None
            text = h.store.view(raw.headers["x-aotx-conversation"]).messages[-1].text
            assert text.lstrip().startswith('{"name": "flag"'), text  # Llama 3's JSON call, not <tool_call>
