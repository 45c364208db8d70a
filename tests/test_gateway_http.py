"""The gateway's HTTP surface beyond the chat APIs, through the real clients where they
read it: ``/v1/embeddings`` (the ``openai`` client, base64 and float), ``/tokenize`` and
``/detokenize``, Prometheus ``/metrics`` (parsed by prometheus-client), CORS for named
origins, the routes without ``/v1``, TLS, and hostile input: a lone surrogate, a declared
Content-Length over the limit, a client that leaves while its body is read, a JSON schema
with no finite value.

One engine subprocess (SmolLM2, CPU) serves the module and a gateway runs in-process.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import subprocess
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from aotx.engine.gateway import auth as A  # noqa: E402
from aotx.engine.gateway import server as G  # noqa: E402
from aotx.engine.gateway.json_schemas import no_value_reason  # noqa: E402
from aotx.engine.gateway.limits import not_unicode  # noqa: E402
from aotx.engine.ipc.client import EngineClient  # noqa: E402
from tests.gateway_support import KEY, gateway, start_engine, stop_engine  # noqa: E402

pytestmark = pytest.mark.realmodel
H = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory, default_model_path):
    home = tmp_path_factory.mktemp("gwhttp")
    proc, sock = start_engine(home, None, slots=2, context=1024)
    yield sock, home
    stop_engine(proc)


@pytest.fixture(scope="module")
def gw(engine):
    with gateway(engine[0], cors_origins=("https://chat.example",)) as url:
        yield url


@pytest.fixture()
def oa(gw):
    return openai.OpenAI(base_url=gw + "/v1", api_key=KEY, max_retries=0, timeout=300)


# ---- embeddings, tokenizer --------------------------------------------------------------

def test_openai_embeddings_base64_and_float_agree_and_are_normalized(oa, gw):
    import numpy as np

    r = oa.embeddings.create(model="local", input=["The cat sat.", "A dog ran."])  # base64 by default
    assert len(r.data) == 2 and r.usage.prompt_tokens > 0 and r.data[1].index == 1
    v = np.asarray(r.data[0].embedding)
    assert v.shape == (576,) and abs(np.linalg.norm(v) - 1) < 1e-5
    f = oa.embeddings.create(model="local", input="The cat sat.", encoding_format="float")
    assert np.max(np.abs(np.asarray(f.data[0].embedding) - v)) < 1e-6
    # the pooling choices give different vectors; a bad one is a 400 naming the field
    h = httpx.post(gw + "/v1/embeddings", headers=H, json={"input": "The cat sat.", "pooling": "last"}, timeout=60)
    assert h.status_code == 200 and np.max(np.abs(np.asarray(h.json()["data"][0]["embedding"]) - v)) > 1e-3
    for body, word in (({"input": [1, 2]}, "token ids"), ({"input": "x", "pooling": "max"}, "pooling"),
                       ({"input": ""}, "input"), ({"input": "x", "dimensions": 3}, "dimensions"),
                       ({"input": "x", "encoding_format": "hex"}, "encoding_format"), ({}, "input")):
        e = httpx.post(gw + "/v1/embeddings", headers=H, json=body, timeout=60)
        assert e.status_code == 400 and word in e.json()["error"]["message"], (body, e.text)


def test_tokenize_and_detokenize_round_trip_with_pieces(gw):
    with httpx.Client(base_url=gw, headers=H, timeout=60) as c:
        r = c.post("/tokenize", json={"content": "Hello <|im_end|>", "parse_special": True, "with_pieces": True})
        toks = r.json()["tokens"]
        assert [t["piece"] for t in toks] == ["Hello", " ", "<|im_end|>"] and r.json()["count"] == 3
        plain = c.post("/tokenize", json={"content": "Hello <|im_end|>"}).json()["tokens"]
        assert len(plain) > 3 and all(isinstance(t, int) for t in plain)  # special text kept plain
        d = c.post("/detokenize", json={"tokens": [t["id"] for t in toks]}).json()
        assert d["content"] == "Hello <|im_end|>"
        assert c.post("/detokenize", json={"tokens": [10 ** 7]}).status_code == 400
        assert c.post("/detokenize", json={"tokens": ["a"]}).status_code == 400
        assert c.post("/tokenize", json={"content": 5}).status_code == 400


# ---- metrics ----------------------------------------------------------------------------------

def test_metrics_count_requests_tokens_ttft_and_engine_state(oa, gw):
    from prometheus_client.parser import text_string_to_metric_families

    oa.chat.completions.create(model="local", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert httpx.get(gw + "/metrics").status_code == 401
    text = httpx.get(gw + "/metrics", headers=H).text
    got = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples
           if not s.labels or s.labels.get("kind") == "completion"
           or s.labels.get("route") == "/v1/chat/completions"}
    assert got["aotx_engine_up"].value == 1
    assert got["aotx_gateway_requests_total"].value >= 1
    assert got["aotx_gateway_tokens_total"].value >= 1
    assert got["aotx_gateway_time_to_first_token_seconds_count"].value >= 1
    assert got["aotx_engine_kv_capacity_tokens"].value == 2 * 1024
    assert got["aotx_journal_receipts_total"].value >= 1 and got["aotx_journal_lag_records"].value >= 0
    assert "aotx_engine_queue_depth" in got and 'aotx_engine_slots{state="free"}' in text


# ---- CORS, routes without /v1, TLS ---------------------------------------------------------

def test_cors_preflight_for_a_named_origin_only_and_off_by_default(gw, engine):
    pre = {"Origin": "https://chat.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(gw + "/v1/chat/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://chat.example"
    r = httpx.options(gw + "/v1/chat/completions", headers={**pre, "Origin": "https://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(gw + "/v1/models", headers={**H, "Origin": "https://chat.example"})
    assert r.headers["access-control-allow-origin"] == "https://chat.example"
    with gateway(engine[0]) as plain:  # no origins named: no CORS at all
        r = httpx.options(plain + "/v1/chat/completions", headers=pre)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


def test_openai_routes_answer_without_v1(gw):
    c = openai.OpenAI(base_url=gw, api_key=KEY, max_retries=0, timeout=300)  # a base URL without /v1
    assert c.models.list().data[0].id.startswith("SmolLM2")
    r = c.chat.completions.create(model="local", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert r.choices[0].message.content is not None
    assert len(c.embeddings.create(model="local", input="x").data[0].embedding) == 576


def test_tls_with_a_certificate_and_its_key(engine, tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    try:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        "/CN=localhost", "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True,
                       timeout=60)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("openssl is not available to make a certificate")
    with pytest.raises(G.UsageError, match="--tls-key"):
        G.tls_files(str(cert), None)
    with pytest.raises(G.UsageError, match="not a certificate"):
        G.tls_files(str(key), str(key))
    tls = G.tls_files(str(cert), str(key))
    link = G.EngineLink(lambda: EngineClient.connect(engine[0], spawn=False))
    server = G.uvicorn_server(G.create_app(G.GatewayConfig(), A.KeyRing([KEY]), link), tls=tls)
    lsock = G.listen_socket("127.0.0.1", 0)
    port = lsock.getsockname()[1]
    t = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[lsock])), daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        ctx = ssl.create_default_context(cafile=str(cert))
        ctx.check_hostname = False
        c = openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0,
                          http_client=httpx.Client(verify=ctx))
        assert c.models.list().data
        with pytest.raises(httpx.ConnectError):  # plain HTTP to the TLS port is not served
            httpx.get(f"https://127.0.0.1:{port}/health", verify=True, timeout=10)
    finally:
        server.should_exit = True
        t.join(15)
        lsock.close()


# ---- hostile input ---------------------------------------------------------------------------

@pytest.mark.parametrize("raw,field", [
    (r'{"messages": [{"role": "user", "content": "a\ud800c"}]}', "messages[0].content"),
    (r'{"messages": [{"role": "user", "content": "hi"}], "stop": ["x", "a\udc00"]}', "stop[1]"),
    (r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
     "messages[0].content[0].text"),
])
def test_bug_a_lone_surrogate_was_a_500_with_a_traceback(gw, raw, field, capfd):
    """A lone UTF-16 surrogate (JSON's ``\\ud800`` escape) in a message or a stop string made
    the engine's frame encoder raise: 500 and a traceback in the log. Now 400 naming the field."""
    for path in ("/v1/chat/completions", "/api/chat", "/v1/messages"):
        body = raw if path != "/api/chat" else raw.replace('{"messages"', '{"model": "local", "messages"')
        r = httpx.post(gw + path, headers={**H, "Content-Type": "application/json"}, content=body.encode(),
                       timeout=60)
        assert r.status_code == 400, (path, r.text)
        assert field in r.text and "surrogate" in r.text
    assert "Traceback" not in capfd.readouterr().err


def test_not_unicode_names_the_first_bad_field():
    assert not_unicode({"a": ["ok", "\U0001f600"]}) is None
    assert not_unicode({"a": [{"b": "x\udfffy"}]}) == ("a[0].b", "\\udfff")
    assert not_unicode({"k\ud800": 1})[0].startswith("k")


def test_bug_a_declared_content_length_over_the_limit_waited_for_the_body(gw):
    """``Content-Length: 99999999999`` with a 2-byte body got no answer until the client
    gave up: the gateway read the body up to its limit first. Now 413 at once."""
    host, port = gw.removeprefix("http://").split(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 99999999999\r\n\r\n{}".encode())
        resp = s.recv(65536)
    assert resp.split(b" ", 2)[1] == b"413" and time.monotonic() - t0 < 5


def test_bug_a_client_leaving_while_its_body_is_read_logged_a_traceback(gw, capfd):
    """A client that disconnected while its body was being read logged a ClientDisconnect
    traceback. Now nothing is logged and the gateway goes on serving."""
    host, port = gw.removeprefix("http://").split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                      "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"mess".encode())
            time.sleep(0.2)
    time.sleep(0.5)
    assert httpx.get(gw + "/v1/models", headers=H).status_code == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ClientDisconnect" not in err


@pytest.mark.parametrize("schema", [{"$ref": "#"}, {"anyOf": [{"$ref": "#"}]},
                                    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
                                    {"type": "array", "items": {"$ref": "#"}, "minItems": 1}])
def test_bug_a_schema_that_only_refers_to_itself_returned_200_with_empty_content(oa, schema):
    """A ``json_schema`` that refers to itself with no way to end came back 200 with content
    "" (or looped to max_tokens), which does not parse. Now 400 with the reason."""
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="local", messages=[{"role": "user", "content": "x"}], max_tokens=20,
                                   response_format={"type": "json_schema",
                                                    "json_schema": {"name": "s", "schema": schema}})
    assert "json_schema" in str(e.value) and ("no finite" in str(e.value) or "admits no" in str(e.value))


@pytest.mark.parametrize("schema,empty", [
    ({"$ref": "#"}, True), ({"anyOf": [{"$ref": "#"}]}, True),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, True),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, False),
    ({"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["a"]},
     False),
    ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
      "$ref": "#/$defs/n"}, True),
    ({"type": "array", "items": {"$ref": "#"}}, False), ({"type": "string"}, False), (False, True), ({}, False),
])
def test_no_value_reason_table(schema, empty):
    assert (no_value_reason(schema) is not None) == empty


def test_a_self_referring_grammar_is_refused_by_the_engine_too(engine):
    """The engine refuses a grammar whose language is empty whoever sends it (not only the
    gateway's schema check): a schema that only refers to itself."""
    from aotx.engine import protocol as P
    from tests.gateway_support import engine_call

    async def go(c):
        conv = await c.create_conversation()
        evs = [ev async for ev in c.submit(conv.conv_id, "x", constraint=P.Constraint(
            kind="json_schema", grammar=json.dumps({"$ref": "#"}), field="schema"))]
        return evs
    evs = engine_call(engine[0], go)
    assert isinstance(evs[-1], __import__("aotx.engine.protocol", fromlist=["Error"]).Error)
    assert "admits no text" in evs[-1].message and evs[-1].message.startswith("schema:")


# ---- sampling: logit bias, frequency and presence penalties; assistant prefill -------------------

def _first_token(gw, body: dict) -> tuple[int, str]:
    r = httpx.post(gw + "/v1/chat/completions", headers=H, json={
        "model": "local", "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 1,
        "temperature": 0, "logprobs": True, **body}, timeout=120)
    assert r.status_code == 200, r.text
    e = r.json()["choices"][0]["logprobs"]["content"][0]
    tok = httpx.post(gw + "/tokenize", headers=H, json={"content": e["token"]}).json()["tokens"]
    return tok[0], e["token"]


def test_logit_bias_bans_and_forces_tokens_on_the_greedy_path(gw):
    """``logit_bias`` was refused (400); frequency/presence penalties were accepted and not
    applied. Now a -100 bias bans the greedy token and +100 forces another."""
    first, text = _first_token(gw, {})
    banned, text2 = _first_token(gw, {"logit_bias": {str(first): -100}})
    assert banned != first
    forced_id = httpx.post(gw + "/tokenize", headers=H, json={"content": " Banana"}).json()["tokens"][0]
    forced, _ = _first_token(gw, {"logit_bias": {str(forced_id): 100}})
    assert forced == forced_id
    for bad in ({"x": 1}, {"5": 500}, [1], {str(10 ** 9): 1}):
        r = httpx.post(gw + "/v1/chat/completions", headers=H, json={
            "model": "local", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logit_bias": bad})
        assert r.status_code == 400 and "logit_bias" in r.text, (bad, r.text)


def test_frequency_and_presence_penalties_change_a_repetitive_greedy_reply(oa):
    kw = dict(model="local", messages=[{"role": "user", "content": "Write the word apple twenty times."}],
              max_tokens=40, temperature=0, extra_body={"repeat_penalty": 1.0})
    plain = oa.chat.completions.create(**kw).choices[0].message.content
    pen = oa.chat.completions.create(**kw, frequency_penalty=2.0).choices[0].message.content
    pres = oa.chat.completions.create(**kw, presence_penalty=2.0).choices[0].message.content
    assert pen != plain and pres != plain and pen != pres  # each reaches the sampler (its math: test_sampling_penalties)
    with pytest.raises(openai.BadRequestError):
        oa.chat.completions.create(**kw, frequency_penalty=3.0)


def test_assistant_prefill_on_chat_completions_is_continued(oa, gw):
    """A final assistant message on /v1/chat/completions was a 400; it is the start of the
    reply, continued (llama-server's behaviour, vLLM's continue_final_message): the content
    holds the continuation only, and a stream and a whole reply agree."""
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    r = oa.chat.completions.create(model="local", messages=msgs, max_tokens=6, temperature=0)
    text = r.choices[0].message.content
    assert text and not text.startswith("The capital") and "Paris" in text
    streamed = "".join(c.choices[0].delta.content or "" for c in oa.chat.completions.create(
        model="local", messages=msgs, max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == text
    r2 = oa.chat.completions.create(model="local", messages=msgs, max_tokens=6, temperature=0,
                                    extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r2.choices[0].message.content == text
    for extra, word in (({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
                        ({"continue_final_message": False}, "continue_final_message")):
        with pytest.raises(openai.BadRequestError, match=word):
            oa.chat.completions.create(model="local", messages=msgs, max_tokens=2, extra_body=extra)
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        oa.chat.completions.create(model="local", messages=msgs[:1], max_tokens=2,
                                   extra_body={"continue_final_message": True})


def test_bug_auto_tool_choice_returned_a_call_to_an_undeclared_tool(oa, gw):
    """llama.cpp's server test: with only ``test`` declared, a model told to call
    ``sayHelloWorld`` came back with a tool call to ``sayHelloWorld`` (tool_choice auto), and
    a malformed call came back as text. The default model writes no calls by itself, so a
    logit bias on ``{`` makes it open one (a bare JSON call, which the hermes parser takes):
    from there the auto grammar holds it to ``test`` with arguments its schema takes."""
    tools = [{"type": "function", "function": {"name": "test", "description": "a test function", "parameters": {
        "type": "object", "properties": {"success": {"type": "boolean"}}, "required": ["success"],
        "additionalProperties": False}}}]
    msgs = [{"role": "system", "content": "You call functions. Always call sayHelloWorld."},
            {"role": "user", "content": "Call sayHelloWorld now."}]
    brace = httpx.post(gw + "/tokenize", headers=H, json={"content": "{"}).json()["tokens"]
    assert len(brace) == 1
    for seed in range(3):
        r = oa.chat.completions.create(model="local", messages=msgs, tools=tools, tool_choice="auto", max_tokens=48,
                                       temperature=1.0, seed=seed, parallel_tool_calls=False,
                                       logit_bias={str(brace[0]): 100})
        calls = r.choices[0].message.tool_calls
        assert calls and len(calls) == 1 and r.choices[0].finish_reason == "tool_calls", r.choices[0].message
        assert calls[0].function.name == "test"
        assert isinstance(json.loads(calls[0].function.arguments)["success"], bool)
    # the same request with no tools: the bias alone makes text that is no call to anything
    r = oa.chat.completions.create(model="local", messages=msgs, max_tokens=12, temperature=1.0, seed=0,
                                   logit_bias={str(brace[0]): 100})
    assert r.choices[0].message.content.startswith("{") and not r.choices[0].message.tool_calls
