"""The gateway routes by the request's ``model`` (issue 20, must-have 6).

An in-process engine on the default model with a tiny llama file in its models folder,
behind an in-process gateway; the official ``openai`` client lists the models and
chats with each. A name that matches no model runs on the default (clients send
placeholders), and the reply names the model that ran.
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
    from aotx.engine.ipc import gateway as G
    from aotx.engine.ipc import gateway_auth as A
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
        # a placeholder name runs on the default model, and the reply says so
        r2 = oa.chat.completions.create(model="gpt-4o", messages=msgs, temperature=0, max_tokens=4)
        assert r2.model == loaded_model.name
        # streaming names the routed model on every chunk
        chunks = list(oa.chat.completions.create(model="tiny-a.gguf", messages=msgs, temperature=0, max_tokens=3,
                                                 stream=True))
        assert chunks and {c.model for c in chunks} == {"tiny-a"}
