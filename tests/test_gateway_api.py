"""The gateway as a complete local API, through the official clients, on the default model.

One engine subprocess (SmolLM2, CPU, 4 slots) serves the module; a gateway runs
in-process. The ``openai`` client asks for schema-valid JSON (20 generated schemas,
each checked with ``jsonschema``), JSON mode and grammars, log probabilities (equal to
``aotx logits`` for the same ids), n = 4 choices from one prefill (the engine's prefill
counter says so) with a seed that reproduces them, an image part; the Responses API
continues a response by id (after a kill -9 of the engine too: the capsule on disk is
restored); the ``anthropic`` client talks to ``/v1/messages``. Bad input gets a 400 or
413 naming the field, and the engine keeps serving. Tool calling with a real instruct
model is in test_gateway_qwen.py.
"""

from __future__ import annotations

import base64
import json
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from tests.gateway_support import KEY, engine_call, gateway, start_engine, stop_engine  # noqa: E402

pytestmark = pytest.mark.realmodel
ROOT = Path(__file__).resolve().parent.parent
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, default_model_path):
    home = tmp_path_factory.mktemp("gwapi")
    proc, sock = start_engine(home, None)
    yield sock, home
    stop_engine(proc)


@pytest.fixture(scope="module")
def gw(engine):
    with gateway(engine[0], per_key_concurrency=40, max_queue=64) as url:
        yield url


@pytest.fixture()
def oa(gw):
    return openai.OpenAI(base_url=gw + "/v1", api_key=KEY, max_retries=0, timeout=300)


def _auth():
    return {"Authorization": f"Bearer {KEY}"}


# ---- structured output ---------------------------------------------------------------------

def _schema(rng: random.Random, depth: int = 0) -> dict:
    """A random JSON schema whose every instance is short (bounded strings, arrays, depth)."""
    props = {}
    for i in range(rng.randint(1, 3 if depth else 4)):
        kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array", "object"] if depth < 1
                          else ["string", "integer", "boolean", "enum"])
        name = rng.choice(["name", "age", "city", "score", "tags", "ok", "level", "color", "size", "info"]) + str(i)
        if kind == "string":
            props[name] = {"type": "string", "maxLength": rng.randint(3, 12)}
        elif kind == "integer":
            lo = rng.randint(-50, 50)
            props[name] = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
        elif kind == "number":
            props[name] = {"type": "number", "minimum": 0, "maximum": 100}
        elif kind == "boolean":
            props[name] = {"type": "boolean"}
        elif kind == "enum":
            props[name] = {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no"], 3)}
        elif kind == "array":
            props[name] = {"type": "array", "items": {"type": "string", "maxLength": 6},
                           "minItems": 1, "maxItems": rng.randint(1, 3)}
        else:
            props[name] = _schema(rng, depth + 1)
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def test_json_schema_output_is_valid_for_20_generated_schemas(oa):
    rng = random.Random(2026)
    schemas = [_schema(rng) for _ in range(20)]

    def ask(i: int):
        return oa.chat.completions.create(
            model="local", messages=[{"role": "user", "content": "Fill in this record with plausible values."}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schemas[i],
                                                                    "strict": True}},
            temperature=0.8, seed=i, max_tokens=300)

    with ThreadPoolExecutor(4) as ex:
        replies = list(ex.map(ask, range(20)))
    for i, r in enumerate(replies):
        c = r.choices[0]
        assert c.finish_reason == "stop", (i, c.message.content)
        jsonschema.validate(json.loads(c.message.content), schemas[i])


def test_json_object_and_grammars(oa):
    r = oa.chat.completions.create(model="local", messages=[{"role": "user", "content": "Give me JSON about a cat."}],
                                   response_format={"type": "json_object"}, temperature=0, max_tokens=120)
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":  # the small model may ramble on to max_tokens inside the object
        assert isinstance(json.loads(text), dict)
    for grammar, ok in [('root ::= "yes" | "no"', lambda t: t in ("yes", "no")),
                        ({"type": "lark", "grammar": 'start: /[0-9]{3}-[0-9]{4}/'},
                         lambda t: len(t) == 8 and t[3] == "-" and t.replace("-", "").isdigit()),
                        ({"type": "regex", "grammar": "(cat|dog)s?"}, lambda t: t.rstrip("s") in ("cat", "dog"))]:
        r = oa.chat.completions.create(model="local", messages=[{"role": "user", "content": "Answer."}], temperature=0.7,
                                       seed=3, max_tokens=20, extra_body={"grammar": grammar})
        assert ok(r.choices[0].message.content), (grammar, r.choices[0].message.content)
        assert r.choices[0].finish_reason == "stop"


# ---- logprobs, n, seed ----------------------------------------------------------------------------

def test_logprobs_equal_aotx_logits_for_the_same_ids(gw, engine, default_model_path):
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.tokenizer import Tokenizer

    prompt = "The capital of France is"
    with httpx.Client(base_url=gw, headers=_auth(), timeout=300) as h:
        r = h.post("/v1/completions", json={"prompt": prompt, "temperature": 0, "repeat_penalty": 1.0,
                                                  "max_tokens": 5, "logprobs": 5})  # plain greedy: the top token
        assert r.status_code == 200, r.text
        body = r.json()
        conv = r.headers["x-aotx-conversation"]
    lp = body["choices"][0]["logprobs"]
    view = engine_call(engine[0], lambda c: c.show(conv))
    out_ids = view.messages[-1].token_ids
    tok = Tokenizer.from_metadata(GGUFFile.open(default_model_path).metadata)
    prompt_ids = tok.encode(prompt, add_special=True, parse_special=False)
    ids = prompt_ids + out_ids
    res = subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", "logits", "--model", str(default_model_path),
                          "--top", "5", "--json", "--ids", ",".join(map(str, ids))],
                         capture_output=True, text=True, timeout=600, env={**__import__("os").environ,
                                                                            "AOTX_HOME": str(engine[1])})
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)["positions"]
    assert len(lp["tokens"]) == len(out_ids) == 5
    for j in range(len(out_ids)):
        row = rows[len(prompt_ids) - 1 + j]["top"]  # the logits that predicted output token j
        top = lp["top_logprobs"][j]
        want = [tok.token_bytes(i).decode("utf-8", "replace") for i, _ in row]
        assert list(top)[:len(set(want))] == list(dict.fromkeys(want))[:len(top)], (j, top, want)
        # log probabilities differ from logits by one constant per row (the log-sum-exp)
        gaps_lp = [v - lp["token_logprobs"][j] for v in top.values()]
        gaps_logit = [v - row[0][1] for _, v in row][:len(gaps_lp)]
        assert max(abs(a - b) for a, b in zip(sorted(gaps_lp), sorted(gaps_logit))) < 2e-2, (j, gaps_lp, gaps_logit)
        assert lp["tokens"][j] == want[0]  # greedy: the most likely token


def test_n4_prefills_the_prompt_once_and_a_seed_reproduces_the_choices(oa, engine):
    def prefilled() -> float:
        return engine_call(engine[0], lambda c: c.status()).stats["prefill_tokens"]

    msgs = [{"role": "user", "content": "Write one short sentence about the sea."}]
    before = prefilled()
    r = oa.chat.completions.create(model="local", messages=msgs, n=4, temperature=1.0, seed=11, max_tokens=12)
    after = prefilled()
    assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
    cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
    # once: the prompt less what a capsule of an earlier conversation already held
    assert after - before == r.usage.prompt_tokens - (cached or 0), "the prompt was prefilled more than once"
    convs = {c.model_extra["aotx"]["conversation"] for c in r.choices}
    assert len(convs) == 4, "each choice lives in its own conversation"
    # the same seed, the same choices: two runs of the same shape (each reuses the prompt's prefix,
    # which the first run left in the slots; a prefill of another length may round logits differently)
    a = oa.chat.completions.create(model="local", messages=msgs, n=4, temperature=1.0, seed=11, max_tokens=12)
    b = oa.chat.completions.create(model="local", messages=msgs, n=4, temperature=1.0, seed=11, max_tokens=12)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    r = a
    # streaming: four choices, each with its finish
    chunks = list(oa.chat.completions.create(model="local", messages=msgs, n=4, temperature=1.0, seed=11,
                                             max_tokens=12, stream=True))
    texts = {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert [texts[i] for i in range(4)] == [c.message.content for c in r.choices]


def test_chat_logprobs_streaming_and_not(oa):
    kw = dict(model="local", messages=[{"role": "user", "content": "Say hello."}], temperature=0, max_tokens=6,
              logprobs=True, top_logprobs=3)
    r = oa.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob for e in content)
    streamed = [e for ch in oa.chat.completions.create(**kw, stream=True) for c in ch.choices
                if c.logprobs and c.logprobs.content for e in c.logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


# ---- media ---------------------------------------------------------------------------------------

def _data_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def test_image_part_goes_through_the_media_profile(oa, engine):
    pytest.importorskip("PIL")
    raw = oa.chat.completions.with_raw_response.create(
        model="local", max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "What does this screenshot say?"},
                                                {"type": "image_url", "image_url": {
                                                    "url": _data_url(ROOT / "assets" / "screenshot.png",
                                                                     "image/png")}}]}])
    assert raw.parse().choices[0].finish_reason in ("stop", "length")
    view = engine_call(engine[0], lambda c: c.show(raw.headers["x-aotx-conversation"]))
    user = [m for m in view.messages if m.role == "user"][-1]
    assert [a.kind for a in user.attachments] == ["image"] and user.attachments[0].sha256
    assert user.attachments[0].name == "messages[0].content[1].image_url"


# ---- bad input ----------------------------------------------------------------------------------

def _ok_after(h) -> None:
    r = h.post("/v1/chat/completions", json={"messages": HELLO, "temperature": 0, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_bad_input_is_400_or_413_naming_the_field_and_the_engine_keeps_serving(gw):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    cases = [
        ({"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}},
         "response_format"),
        ({"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}},
         "response_format"),
        ({"messages": HELLO, "grammar": "root ::= undefined_rule"}, "grammar"),
        ({"messages": HELLO, "tools": [weather], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
         "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(b"this is not a picture at all").decode()}}]}]},
         "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]},
         "messages"),
    ]
    with httpx.Client(base_url=gw, headers=_auth(), timeout=300) as h:
        for body, param in cases:
            r = h.post("/v1/chat/completions", json=body)
            assert r.status_code in (400, 403), (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["message"], (body, err)
            _ok_after(h)
        r = h.post("/v1/chat/completions", json=cases[-2][0])
        assert "messages[0].content[0].image_url" in r.json()["error"]["message"]


def test_a_200_mb_data_url_is_413_naming_the_field(gw):
    host, port = gw.removeprefix("http://").split(":")
    head = json.dumps({"model": "local", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]}]})
    prefix = head[:head.index('base64,"') + len("base64,")].encode()
    total = 200 << 20
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
              f"Content-Type: application/json\r\nContent-Length: {total}\r\n\r\n".encode() + prefix)
    sent, chunk = len(prefix), b"A" * (1 << 20)
    s.settimeout(0.05)
    resp = b""
    try:
        while sent < total and b"\r\n\r\n" not in resp:
            try:
                s.sendall(chunk)
                sent += len(chunk)
            except OSError:
                break
            try:
                resp += s.recv(65536)
            except socket.timeout:
                pass
        s.settimeout(30)
        while b"}" not in resp.partition(b"\r\n\r\n")[2]:
            more = s.recv(65536)
            if not more:
                break
            resp += more
    finally:
        s.close()
    status = int(resp.split(b" ", 2)[1])
    body = json.loads(resp.partition(b"\r\n\r\n")[2].split(b"\r\n0\r\n")[0].strip().split(b"\r\n")[-1]
                      if b"chunked" in resp.partition(b"\r\n\r\n")[0].lower() else resp.partition(b"\r\n\r\n")[2])
    assert status == 413 and sent < total
    assert "messages[0].content[1].image_url.url" in body["error"]["message"], body
    with httpx.Client(base_url=gw, headers=_auth(), timeout=300) as h:
        _ok_after(h)


# ---- the Responses API on the journal ------------------------------------------------------------

def test_responses_continue_by_id_and_after_a_kill_9(tmp_path, default_model_path):
    home = tmp_path
    proc, sock = start_engine(home, None, slots=2, context=1024)
    try:
        with gateway(sock) as url:
            oa = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
            r1 = oa.responses.create(model="local", input="My name is Ada. Say hi.", max_output_tokens=8,
                                     temperature=0, instructions="You are terse.")
            assert r1.id.startswith("resp_") and r1.status in ("completed", "incomplete")
            assert r1.output[0].type == "message" and r1.output_text
            r2 = oa.responses.create(model="local", input="What is my name?", previous_response_id=r1.id,
                                     max_output_tokens=8, temperature=0)
            assert r2.previous_response_id == r1.id
            assert r2.usage.input_tokens_details.cached_tokens > 0, "the conversation's state was not reused"
            assert r2.model_extra["aotx"]["conversation"] == r1.model_extra["aotx"]["conversation"]
            # the capsule of r2's conversation is on disk before the crash
            deadline = time.monotonic() + 60
            while engine_call(sock, lambda c: c.status()).capsules.get("disk_count", 0) < 1:
                assert time.monotonic() < deadline, "no capsule reached the disk"
                time.sleep(0.2)
            stop_engine(proc, kill=True)
            proc, sock2 = start_engine(home, None, slots=2, context=1024)
            assert sock2 == sock
            got = oa.responses.retrieve(r2.id)  # durable: read back from the journal
            assert got.output_text == r2.output_text
            r3 = oa.responses.create(model="local", input="And again, my name?", previous_response_id=r2.id,
                                     max_output_tokens=8, temperature=0)
            assert r3.status in ("completed", "incomplete")
            assert r3.usage.input_tokens_details.cached_tokens > 0, "the capsule on disk was not restored"
            view = engine_call(sock, lambda c: c.show(r1.model_extra["aotx"]["conversation"]))
            assert [m.role for m in view.messages] == ["user", "assistant"] * 3
            # streaming, continuing r3
            events = list(oa.responses.create(model="local", input="Bye.", previous_response_id=r3.id,
                                              max_output_tokens=6, temperature=0, stream=True))
            types = [e.type for e in events]
            assert types[0] == "response.created" and types[-1] == f"response.{events[-1].response.status}"
            assert events[-1].response.status in ("completed", "incomplete")
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert text == events[-1].response.output_text
            bad = httpx.post(url + "/v1/responses", headers=_auth(), json={
                "input": "x", "previous_response_id": "resp_c0000000000_m0000000000"}, timeout=60)
            assert bad.status_code == 404 and bad.json()["error"]["param"] == "previous_response_id"
    finally:
        stop_engine(proc)


# ---- Anthropic's Messages API ----------------------------------------------------------------------

def test_anthropic_messages_text_and_streaming(gw):
    anthropic = pytest.importorskip("anthropic")
    cl = anthropic.Anthropic(base_url=gw, api_key=KEY, max_retries=0, timeout=300)
    greedy = {"temperature": 0}  # (recent SDKs dropped the temperature argument; the API takes it)
    # a first identical request leaves the prompt's prefix in the capsule cache, so both compared
    # replies prefill the same last token on it (a 22-row prefill and a 1-row one round differently
    # on the CPU until its matmul is row-invariant for every n: greedy may then differ)
    cl.messages.create(model="local", max_tokens=1, system="Be terse.", extra_body=greedy,
                       messages=[{"role": "user", "content": "Name a color."}])
    m = cl.messages.create(model="local", max_tokens=8, system="Be terse.", extra_body=greedy,
                           messages=[{"role": "user", "content": "Name a color."}])
    assert m.role == "assistant" and m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens > 0
    with cl.messages.stream(model="local", max_tokens=8, system="Be terse.", extra_body=greedy,
                            messages=[{"role": "user", "content": "Name a color."}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text == final.content[0].text
    with pytest.raises(anthropic.BadRequestError):
        cl.messages.create(model="local", max_tokens=8, messages=[{"role": "wizard", "content": "x"}])


def test_anthropic_malformed_blocks_are_400_naming_the_field_not_500(gw):
    """Wrong types inside /v1/messages blocks (a text that is not a string, an image source
    that is not an object, a tool_choice type that is a list) crashed the parser: a 500
    'internal error in the gateway' in OpenAI's shape. Each is a 400 in Anthropic's error
    body naming the field."""
    user = {"role": "user", "content": "hi"}
    cases = [
        ({"system": [{"type": "text", "text": 5}], "messages": [user]}, "system[0].text"),
        ({"messages": [user, {"role": "assistant", "content": [{"type": "text", "text": {"a": 1}}]}, user]},
         "messages[1].content[0].text"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": ["x"]}]}]}, "messages[0].content[0].text"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                      "content": [{"type": "text", "text": 5}]}]}]},
         "messages[0].content[0].content[0].text"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": "x"}]}]},
         "messages[0].content[0].source"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": 5}}]}]},
         "messages[0].content[0].source.data"),
        ({"messages": [user], "tools": [{"name": "f", "input_schema": {"type": "object"}}],
          "tool_choice": {"type": ["tool"]}}, "tool_choice.type"),
        ({"messages": [user], "tools": [5]}, "tools[0]"),
        ({"messages": [user], "stop_sequences": "END"}, "stop_sequences"),
    ]
    with httpx.Client(base_url=gw, headers=_auth(), timeout=300) as h:
        for body, where in cases:
            r = h.post("/v1/messages", json={"model": "local", "max_tokens": 2, **body})
            assert r.status_code == 400, (body, r.status_code, r.text)
            err = r.json()
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
            assert where in err["error"]["message"], (where, err)
        r = h.post("/v1/messages", json={"model": "local", "max_tokens": 2, "messages": [user]})
        assert r.status_code == 200 and r.json()["content"], r.text


def test_anthropic_stop_sequence_is_reported_as_stop_sequence(gw):
    """A reply cut by one of ``stop_sequences`` came back as ``end_turn`` with
    ``stop_sequence`` null: the gateway looked for the sequence at the end of the text, from
    which the engine had already cut it. The engine now says which stop string ended the reply."""
    anthropic = pytest.importorskip("anthropic")
    cl = anthropic.Anthropic(base_url=gw, api_key=KEY, max_retries=0, timeout=300)
    stops = ["e", "a", "o", "i"]
    kw = dict(model="local", max_tokens=40, stop_sequences=stops, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "Write a sentence about the weather."}])
    m = cl.messages.create(**kw)
    assert m.stop_reason == "stop_sequence", m
    assert m.stop_sequence in stops
    text = m.content[0].text if m.content else ""
    assert not any(s in text for s in stops), text
    with cl.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", m.stop_sequence)
    m2 = cl.messages.create(**{**kw, "stop_sequences": ["\u2603\u2603"], "max_tokens": 3})
    assert (m2.stop_reason, m2.stop_sequence) == ("max_tokens", None)


def test_responses_continued_from_one_id_by_concurrent_requests_each_branch_from_it(gw, engine):
    """Four requests continuing the same ``previous_response_id`` at once: all but one got a
    409 conversation_busy (each submitted to the response's conversation, which the first was
    generating in), and one that came in after the first had finished answered with the first's
    turn in its history (the gateway saw the response as the conversation's last reply, then
    submitted after another turn had landed). Each is now a 200 whose history is the response's
    conversation up to that response and its own message."""
    oa = openai.OpenAI(base_url=gw + "/v1", api_key=KEY, max_retries=0, timeout=300)
    r1 = oa.responses.create(model="local", input="Name a fruit.", max_output_tokens=4, temperature=0)
    asks = [f"Now name the number {i}." for i in range(4)]

    def go(text):
        return oa.responses.create(model="local", input=text, previous_response_id=r1.id, max_output_tokens=12,
                                   temperature=0)

    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(go, asks))
    r1_conv = r1.model_extra["aotx"]["conversation"]
    for ask, r in zip(asks, outs):
        assert r.status in ("completed", "incomplete") and r.previous_response_id == r1.id
        view = engine_call(engine[0], lambda c: c.show(r.model_extra["aotx"]["conversation"]))
        users = [m.text for m in view.messages if m.role == "user"]
        assert users == ["Name a fruit.", ask], (ask, users)
    assert len({r.model_extra["aotx"]["conversation"] for r in outs} - {r1_conv}) >= 3


def test_responses_and_messages_errors_name_their_own_fields_not_chats(gw):
    """A bad /v1/responses or /v1/messages field was refused naming the chat-completions field
    the gateway had turned it into: 'messages[0].tool_call_id' (param "messages") for
    input[0].call_id, 'max_tokens' for max_output_tokens, 'messages[2].tool_call_id' for a
    tool_result's tool_use_id. Each names the field of the request that was sent."""
    cases = [
        ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "x", "output": "y"}]},
         "'input[0].call_id'", "input"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": "x"}, "'max_output_tokens'", "max_output_tokens"),
        ("/v1/responses", {"instructions": "be terse", "input": [{"role": "user", "content": "a"},
                                                                  {"role": "wizard", "content": "b"}]},
         "'input[1].role'", "input"),
        ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": 5}, {"role": "user", "content": "a"}]},
         "'input[0].name'", "input"),
        ("/v1/messages", {"max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]},
         "'messages[2].content[0].tool_use_id'", None),
        ("/v1/messages", {"max_tokens": 2, "system": "s", "messages": [{"role": "user", "content": "hi"}],
                          "tools": [{"name": "", "input_schema": {"type": "object"}}]}, "'tools[0].name'", None),
    ]
    with httpx.Client(base_url=gw, headers=_auth(), timeout=300) as h:
        for path, body, where, param in cases:
            r = h.post(path, json={"model": "local", **body})
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert where in err["message"], (where, err)
            if param is not None:
                assert err["param"] == param, (param, err)


def test_anthropic_stream_message_start_carries_the_prompts_token_count(gw):
    """A streamed /v1/messages reply's message_start said input_tokens 0 (clients such as
    Claude Code read the context used from it); it now carries the prompt's token count,
    the same as the non-streamed reply's usage."""
    body = {"model": "local", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": "Name three colors."}]}
    with httpx.Client(base_url=gw, headers=_auth(), timeout=300) as h:
        whole = h.post("/v1/messages", json=body).json()
        with h.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
            events = [json.loads(ln[len("data: "):]) for ln in r.iter_lines() if ln.startswith("data: ")]
    # message_start comes before the engine knows how much of the prompt its cache holds: it
    # counts the whole prompt; the final usage splits it (input_tokens excludes cache reads)
    start = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
    prompt = whole["usage"]["input_tokens"] + whole["usage"]["cache_read_input_tokens"]
    assert start["input_tokens"] == prompt > 5, (start, whole["usage"])
    delta = next(e for e in events if e["type"] == "message_delta")["usage"]
    assert delta["input_tokens"] + delta["cache_read_input_tokens"] == prompt


def test_streamed_completion_logprobs_text_offsets_count_from_the_start_of_the_text(oa):
    """Each streamed /v1/completions chunk's logprobs.text_offset restarted at 0 (the offset
    within that chunk); offsets are into the whole completion text, as the non-streamed
    reply's (and vLLM's) are."""
    kw = dict(model="local", prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=1)
    whole = oa.completions.create(**kw).choices[0]
    text, offsets, tokens = "", [], []
    for ch in oa.completions.create(stream=True, **kw):
        for c in ch.choices:
            text += c.text
            if c.logprobs:
                offsets += c.logprobs.text_offset
                tokens += c.logprobs.tokens
    assert text == whole.text and tokens == whole.logprobs.tokens
    assert offsets == whole.logprobs.text_offset and offsets[-1] > 0, (offsets, whole.logprobs.text_offset)


def test_continuing_a_response_still_being_generated_is_409_not_a_fork_of_its_partial_text(gw, engine):
    """A response id is known from a stream's first event. Continuing it while it streams
    must not branch from the text written so far (a fork of the unfinished reply): it is a
    409 saying the response is in progress, and the stream finishes undisturbed.

    The streamed reply is held long by its schema (a string of at least 400 characters):
    a free reply ended after ~25 tokens, 0.25 s after the 409 here, and on a loaded 2-core
    CI machine it had ended before the continuation arrived (200, a fork; CI at 53738f6)."""
    fmt = {"type": "json_schema", "name": "count", "strict": True,
           "schema": {"type": "object", "properties": {"numbers": {"type": "string", "minLength": 400}},
                      "required": ["numbers"], "additionalProperties": False}}
    with httpx.Client(base_url=gw, headers=_auth(), timeout=300) as h:
        before = len(engine_call(engine[0], lambda c: c.list_conversations()))
        with h.stream("POST", "/v1/responses", json={"model": "local", "input": "Count slowly from one to fifty.",
                                                     "max_output_tokens": 250, "temperature": 0,
                                                     "text": {"format": fmt}, "stream": True}) as r:
            lines = r.iter_lines()
            rid = None
            for ln in lines:
                if ln.startswith("data: "):
                    rid = json.loads(ln[6:])["response"]["id"]
                    break
            nxt = h.post("/v1/responses", json={"model": "local", "input": "and?", "previous_response_id": rid,
                                                "max_output_tokens": 2})
            rest = [ln for ln in lines if ln.startswith("data: ")]
        assert nxt.status_code == 409, nxt.text
        assert nxt.json()["error"]["param"] == "previous_response_id", nxt.text
        last = json.loads(rest[-1][6:])
        assert last["type"] in ("response.completed", "response.incomplete"), last["type"]
        text = last["response"]["output"][0]["content"][0]["text"]
        assert len(text) >= 400 or last["response"]["usage"]["output_tokens"] == 250, text  # not cut short
        # the stream's own conversation, and no fork
        assert len(engine_call(engine[0], lambda c: c.list_conversations())) == before + 1


def test_anthropic_usage_counts_cached_prompt_tokens_once():
    """Regression: usage said input_tokens 31 and
    cache_read_input_tokens 30 for a 31-token prompt; Anthropic's input_tokens excludes
    the tokens read from the cache, so clients counted 30 tokens twice."""
    from types import SimpleNamespace

    from aotx.engine.gateway.anthropic import _usage

    u = _usage(SimpleNamespace(n_prompt=31, n_completion=5, n_cached=30))
    assert u == {"input_tokens": 1, "output_tokens": 5, "cache_read_input_tokens": 30}
    assert _usage(SimpleNamespace(n_prompt=12, n_completion=0, n_cached=0))["input_tokens"] == 12


def test_bug_a_response_cut_at_max_output_tokens_is_incomplete_down_to_its_message_item(oa):
    """Regression: a response stopped by max_output_tokens said
    status "incomplete" but its message item "completed", and its stream ended with
    response.completed; OpenAI marks both incomplete and ends with response.incomplete."""
    prompt = "Count from one to one hundred in words, separated by commas."
    r = oa.responses.create(model="local", input=prompt, max_output_tokens=4, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output[0].status == "incomplete"
    assert r.usage.output_tokens == 4
    events = list(oa.responses.create(model="local", input=prompt, max_output_tokens=4, temperature=0, stream=True))
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done and done[-1].item.status == "incomplete"
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert not any(e.type == "response.completed" for e in events)
    full = oa.responses.create(model="local", input="Say hi.", max_output_tokens=256, temperature=0)
    assert full.status == "completed" and full.output[0].status == "completed"


def test_bug_responses_ignored_model_grammar_and_repeat_penalty(gw, oa):
    """/v1/responses copied only the sampling fields into the request it made, so 'model' was
    dropped: any name (gpt-5, nonsense) was answered by the default model, and a second model
    could never be reached; 'grammar' and 'repeat_penalty' were dropped too. Now an unknown
    model gets the 404 chat completions gives, and a grammar constrains the reply."""
    with pytest.raises(openai.NotFoundError) as e:
        oa.responses.create(model="nonsense-model-xyz", input="hi", max_output_tokens=4)
    assert e.value.body["code"] == "model_not_found"
    r = oa.responses.create(model="local", input="Answer yes or no: is the sky blue?", max_output_tokens=6,
                            temperature=0, extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert r.output_text in ("yes", "no"), r.output_text
    with httpx.Client(base_url=gw, headers=_auth(), timeout=300) as h:
        bad = h.post("/v1/responses", json={"model": "local", "input": "hi", "repeat_penalty": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "repeat_penalty"
