"""The gateway against a real engine on the default model.

One engine subprocess (8 slots x 1024 tokens, CPU) serves the module; gateways
run in-process on 127.0.0.1 (a free port each) in a thread of their own with
the limits a test needs. The official ``openai`` client chats through them
(streaming and not, greedy, at most 16 tokens), httpx covers every error path,
and a bounded load test runs 32 concurrent streams. Pure parts (key ring, key
file, the engine-error table) are tested without HTTP.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from aotx.engine.errors import UsageError  # noqa: E402
from aotx.engine.gateway import server as G  # noqa: E402
from aotx.engine.gateway import auth as A  # noqa: E402
from aotx.engine.gateway import schema as S  # noqa: E402
from aotx.engine import protocol as P  # noqa: E402
from aotx.engine.gateway.link import engine_error  # noqa: E402

pytestmark = pytest.mark.realmodel

from tests.gateway_support import KEY, engine_call, gateway, start_engine, stop_engine  # noqa: E402
KEY2 = "sk-aotx-test-key-second-0123456789"
GREEDY = {"temperature": 0, "max_tokens": 8}
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hi"}]


# ---- fixtures ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory, default_model_path):
    """(socket path, AOTX_HOME) of an engine subprocess serving the module."""
    home = tmp_path_factory.mktemp("gw-home")
    proc, sock = start_engine(home, None, slots=4, context=1024, timeout=120)
    yield sock, home
    stop_engine(proc)


@pytest.fixture(scope="module")
def gw(engine):
    with gateway(engine[0], per_key_concurrency=40, max_queue=64) as url:
        yield url


@pytest.fixture()
def oa(gw):
    return openai.OpenAI(base_url=gw + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


def _show(sock, conv_id):
    return engine_call(sock, lambda c: c.show(conv_id))


def _receipt_ok(r) -> bool:
    return (isinstance(r, dict) and all(isinstance(r.get(k), int) for k in ("segment", "offset", "last_seq"))
            and r["last_seq"] > 0)


# ---- the openai client ------------------------------------------------------------------

def test_openai_chat_non_streaming_and_streaming_agree_and_carry_receipts(oa, engine):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    raw = oa.chat.completions.with_raw_response.create(model="local", messages=msgs, **GREEDY)
    c = raw.parse()
    assert c.id.startswith("chatcmpl-") and c.object == "chat.completion" and c.model == "SmolLM2-135M-Instruct.Q4_1"
    assert isinstance(c.created, int) and len(c.choices) == 1
    ch = c.choices[0]
    assert ch.index == 0 and ch.message.role == "assistant" and ch.message.content
    assert ch.finish_reason in ("stop", "length")
    assert c.usage.completion_tokens <= 8 and c.usage.prompt_tokens > 5
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    receipt = json.loads(raw.headers["x-aotx-receipt"])
    assert _receipt_ok(receipt)
    conv = raw.headers["x-aotx-conversation"]
    assert c.model_extra["aotx"]["receipt"] == receipt and c.model_extra["aotx"]["conversation"] == conv
    view = _show(engine[0], conv)
    assert view.system_prompt == "You are terse."
    assert [m.role for m in view.messages] == ["user", "assistant"]
    assert view.messages[1].text == ch.message.content and view.messages[1].receipt is not None

    stream = oa.chat.completions.create(model="local", messages=msgs, stream=True,
                                        stream_options={"include_usage": True}, **GREEDY)
    text, finish, usage, receipts, ids = "", None, None, [], set()
    for chunk in stream:  # the receipt event arrives as a harmless chunk with an empty delta
        ids.add(chunk.id)
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage:
            usage = chunk.usage
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if (chunk.model_extra or {}).get("aotx"):
            receipts.append(chunk.model_extra["aotx"]["receipt"])
    assert text == ch.message.content  # greedy: same reply, and the deltas add up to it
    assert finish == ch.finish_reason and usage.completion_tokens == c.usage.completion_tokens
    assert len(receipts) == 1 and _receipt_ok(receipts[0]) and receipts[0]["last_seq"] > receipt["last_seq"]
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")


def test_openai_continues_a_conversation_named_by_header(oa, engine):
    first = oa.chat.completions.with_raw_response.create(
        model="local", messages=[{"role": "user", "content": "Say one word."}], **GREEDY)
    conv = first.headers["x-aotx-conversation"]
    second = oa.chat.completions.with_raw_response.create(
        model="local", messages=[{"role": "user", "content": "Say one word."},
                             {"role": "assistant", "content": first.parse().choices[0].message.content},
                             {"role": "user", "content": "Another one."}],
        extra_headers={"X-AOTX-Conversation": conv}, **GREEDY)
    assert second.headers["x-aotx-conversation"] == conv
    view = _show(engine[0], conv)
    assert [m.role for m in view.messages] == ["user", "assistant", "user", "assistant"]
    assert view.messages[2].text == "Another one."
    assert json.loads(second.headers["x-aotx-receipt"])["last_seq"] > json.loads(
        first.headers["x-aotx-receipt"])["last_seq"]


def test_openai_completions_raw_and_models(oa):
    r = oa.completions.create(model="local", prompt="The capital of France is", **GREEDY)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.choices[0].text
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 8
    text = "".join(c.choices[0].text for c in oa.completions.create(
        model="local", prompt="The capital of France is", stream=True, **GREEDY) if c.choices)
    assert text == r.choices[0].text
    models = oa.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert oa.models.retrieve("SmolLM2-135M-Instruct.Q4_1").owned_by == "aotx"
    # regression: "context" said 8192 (the trained context) while
    # the engine served 1024, so a client sizing its prompts from it got a 400
    extra = models.data[0].model_extra
    assert extra["aotx"]["context"] == 1024 and extra["max_model_len"] == 1024
    assert extra["aotx"]["context_train"] == 8192
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("gpt-4")


def test_openai_client_sees_errors_as_its_exceptions(gw):
    bad = openai.OpenAI(base_url=gw + "/v1", api_key="sk-wrong-wrong-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=gw + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        good.chat.completions.create(model="local", messages=[{"role": "user", "content": "hi"}], n=17)
    assert e.value.body["param"] == "n"


def test_raw_sse_ends_with_receipt_comment_then_done(gw):
    with httpx.Client(base_url=gw, headers=_auth(), timeout=60) as h:
        with h.stream("POST", "/v1/chat/completions",
                      json={"messages": HELLO, "stream": True, "temperature": 0, "max_tokens": 4}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            conv = r.headers["x-aotx-conversation"]
            lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and lines[-2].startswith(": aotx.receipt {")
    ev = json.loads(lines[-2][len(": aotx.receipt "):])
    assert ev["conversation"] == conv and _receipt_ok(ev["receipt"])
    finish = json.loads(lines[-3][len("data: "):])
    assert finish["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(ln.startswith("data: ") for ln in lines[:-2])


def test_bug_the_openai_quickstart_stream_loop_raised_index_error(oa):
    """The receipt went out as ``event: aotx.receipt`` with a chunk of no choices; the openai
    client does not skip named events, so ``chunk.choices[0]`` in the quickstart's loop raised
    IndexError on the last chunk (chat and completions alike), and with ``include_usage`` the
    usage chunk was not the last. Now the receipt is an SSE comment (skipped by every client)
    and rides on the usage chunk when one is asked for; every choice finishes once."""
    text = "".join(ch.choices[0].delta.content or "" for ch in
                   oa.chat.completions.create(model="local", messages=HELLO, max_tokens=5, temperature=0, stream=True))
    assert text
    text = "".join(ch.choices[0].text for ch in oa.completions.create(model="local", prompt="Once", max_tokens=5,
                                                                        temperature=0, stream=True))
    assert text
    for create, kw in ((oa.chat.completions.create, {"messages": HELLO}), (oa.completions.create, {"prompt": "Once"})):
        finishes: dict[int, list] = {}
        chunks = list(create(model="local", n=2, max_tokens=4, temperature=1.0, seed=5, stream=True,
                             stream_options={"include_usage": True}, **kw))
        for ch in chunks:
            for c in ch.choices:
                if c.finish_reason:
                    finishes.setdefault(c.index, []).append(c.finish_reason)
        assert sorted(finishes) == [0, 1] and all(len(v) == 1 for v in finishes.values()), finishes
        assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
        assert chunks[-1].model_extra["aotx"]["receipt"]
        assert all(ch.choices for ch in chunks[:-1])


GOOD = [
    # (body, what the parsed request must show)
    ({"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]},
     lambda r: r.system == "be brief" and [(t.role, t.text) for t in r.messages] == [("user", "hi")]),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
     lambda r: [(t.role, t.text) for t in r.messages] == [("user", "ab")]),
    ({"messages": HELLO, "max_completion_tokens": 7, "stop": "END", "seed": -1},
     lambda r: r.sampling.max_tokens == 7 and r.sampling.stop == ["END"] and r.sampling.seed == (1 << 63) - 1),
    ({"messages": HELLO, "temperature": 0, "top_p": 0.5, "top_k": 3, "n": 1, "stream": True,
      "stream_options": {"include_usage": True}},
     lambda r: r.sampling.temperature == 0 and r.sampling.top_p == 0.5 and r.sampling.top_k == 3 and r.stream
     and r.include_usage),
    # the protocol's defaults (no ceiling by default: the reply runs to its end or the context)
    ({"messages": HELLO}, lambda r: r.sampling == P.SamplingParams()),
    # a client's own maximum (Claude Code sends 32,000) is served, not refused
    ({"messages": HELLO, "max_tokens": 32000}, lambda r: r.sampling.max_tokens == 32000),
]


@pytest.mark.parametrize("body,check", GOOD)
def test_parse_chat_good(body, check):
    assert check(S.parse_chat(body, S.Limits()))


def test_bug_max_tokens_above_the_ceiling_is_capped_not_refused():
    """Regression: max_tokens above the gateway's ceiling was
    a 400, so Claude Code (max_tokens 32,000) could not talk to it at all; an operator's
    --max-tokens-ceiling now caps the reply instead, and the default has none."""
    lim = S.Limits(max_tokens_ceiling=4096)
    assert S.parse_chat({"messages": HELLO, "max_tokens": 32000}, lim).sampling.max_tokens == 4096
    assert S.parse_chat({"messages": HELLO, "max_tokens": 100}, lim).sampling.max_tokens == 100
    assert S.parse_chat({"messages": HELLO}, lim).sampling.max_tokens == 4096


def test_multi_turn_request_stores_earlier_turns_as_history(oa, engine):
    """A fresh conversation keeps a request's earlier turns as real messages (not one
    folded user turn), so the chat template renders them as turns."""
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3?"}]
    raw = oa.chat.completions.with_raw_response.create(model="local", messages=msgs, **GREEDY)
    view = _show(engine[0], raw.headers["x-aotx-conversation"])
    assert [(m.role, m.text) for m in view.messages[:3]] == [("user", "2+2?"), ("assistant", "4"),
                                                            ("user", "and 3+3?")]
    assert view.messages[3].role == "assistant" and view.messages[3].text == raw.parse().choices[0].message.content



def test_parallel_tool_results_sent_to_a_named_conversation_are_all_kept(oa, engine):
    """A request continuing a conversation by X-AOTX-Conversation submitted only its last
    message: the results of a parallel tool call (two ``tool`` messages) lost every result
    but the last, silently. The conversation cannot take two messages in one turn, so such a
    request starts a new conversation holding its whole history (named in the response's
    header, as a Responses request with several new items does)."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]
    ask = [{"role": "user", "content": "Look up a and b."}]
    raw = oa.chat.completions.with_raw_response.create(model="local", messages=ask, max_tokens=2, temperature=0)
    conv = raw.headers["x-aotx-conversation"]
    calls = [{"id": f"call_{k}", "type": "function", "function": {"name": "lookup", "arguments": f'{{"q": "{k}"}}'}}
             for k in ("a", "b")]
    msgs = ask + [{"role": "assistant", "content": None, "tool_calls": calls},
                  {"role": "tool", "tool_call_id": "call_a", "content": "RESULT-ONE"},
                  {"role": "tool", "tool_call_id": "call_b", "content": "RESULT-TWO"}]
    raw = oa.chat.completions.with_raw_response.create(model="local", messages=msgs, tools=tools, max_tokens=2,
                                                       temperature=0, extra_headers={"X-AOTX-Conversation": conv})
    view = _show(engine[0], raw.headers["x-aotx-conversation"])
    texts = [(m.role, m.text) for m in view.messages]
    assert ("tool", "RESULT-ONE") in texts and ("tool", "RESULT-TWO") in texts, texts
    # one new result: the named conversation goes on
    more = msgs + [{"role": "assistant", "content": None, "tool_calls": calls[:1]},
                   {"role": "tool", "tool_call_id": "call_a", "content": "RESULT-THREE"}]
    conv2 = raw.headers["x-aotx-conversation"]
    raw = oa.chat.completions.with_raw_response.create(model="local", messages=more, tools=tools, max_tokens=2,
                                                       temperature=0, extra_headers={"X-AOTX-Conversation": conv2})
    assert raw.headers["x-aotx-conversation"] == conv2
    assert ("tool", "RESULT-THREE") in [(m.role, m.text) for m in _show(engine[0], conv2).messages]


# ---- error paths over HTTP ----------------------------------------------------------------


BAD_BODIES = [
    # (name, raw body, status, param or None)
    ("malformed json", b'{"messages": [', 400, None),
    ("empty body", b"", 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("nan temperature", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "temperature"),
    ("deep nesting", b"[" * 100000 + b"]" * 100000, 400, None),
    ("huge integer", b'{"messages": [], "max_tokens": ' + b"9" * 5000 + b"}", 400, None),
    ("invalid utf-8", b'{"messages": "\xff\xfe"}', 400, None),
]

BAD_FIELDS = [
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": ["hi"]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    # a user message with no content was answered as an empty message (200)
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [{"role": "user", "content": None}]}, "messages"),
    ({"messages": [{"role": "system"}, {"role": "user", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "https://example.com/cat.png"}}]}]}, "messages"),
    # (a final assistant message is a prefill the reply continues: tests/test_gateway_http.py)
    ({"messages": [{"role": "assistant", "content": "yo"}]}, "messages"),  # a prefill with no user message
    ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "a"}]}, "messages"),
    ({"messages": HELLO, "temperature": "hot"}, "temperature"),
    ({"messages": HELLO, "temperature": 3}, "temperature"),
    ({"messages": HELLO, "top_p": [1]}, "top_p"),
    ({"messages": HELLO, "max_tokens": -1}, "max_tokens"),
    ({"messages": HELLO, "max_tokens": "10"}, "max_tokens"),
    ({"messages": HELLO, "seed": 1.5}, "seed"),
    ({"messages": HELLO, "stop": 3}, "stop"),
    ({"messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": HELLO, "stream": "yes"}, "stream"),
    ({"messages": HELLO, "n": 17}, "n"),
    ({"messages": HELLO, "tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"messages": HELLO, "tools": "f"}, "tools"),
    ({"messages": HELLO, "tool_choice": "required"}, "tool_choice"),
    ({"messages": HELLO, "functions": [{"name": "f"}]}, "functions"),
    ({"messages": HELLO, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": HELLO, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": HELLO, "logit_bias": {"50256": -100}}, "logit_bias"),
    ({"messages": HELLO, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": HELLO, "response_format": {"type": "json_object"}, "grammar": "root ::= \"a\""}, "grammar"),
    ({"messages": HELLO, "model": 7}, "model"),
    ({"messages": [{"role": "user", "content": "x"}] * 257}, "messages"),
]


def test_bad_bodies_are_400_with_a_message(gw):
    with httpx.Client(base_url=gw, headers=_auth(), timeout=30) as h:
        for name, body, status, param in BAD_BODIES:
            r = h.post(CHAT, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (name, r.text)
            err = r.json()["error"]
            assert err["message"] and err["type"] == "invalid_request_error", name
            if param:
                assert err["param"] == param, (name, err)
        for body, param in BAD_FIELDS:
            r = h.post(CHAT, json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["message"], (body, err)
        comp = [({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [1, 2, 3]}, "prompt"), ({}, "prompt"),
                ({"prompt": "x", "echo": True}, "echo"), ({"prompt": "x", "best_of": 2}, "best_of"),
                ({"prompt": "x", "suffix": "y"}, "suffix")]
        for body, param in comp:
            r = h.post("/v1/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_auth_401_and_health_open(gw):
    with httpx.Client(base_url=gw, timeout=30) as h:
        for headers in ({}, _auth("sk-aotx-wrong-key-0123456789"), {"Authorization": f"Basic {KEY}"},
                        {"Authorization": "Bearer"}, {"Authorization": KEY}):
            for method, path in (("GET", "/v1/models"), ("POST", CHAT), ("POST", "/v1/completions")):
                r = h.request(method, path, headers=headers, json={"messages": HELLO})
                assert r.status_code == 401, (headers, path)
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert r.headers["www-authenticate"] == "Bearer"
        r = h.get("/health")
        assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["context"] == 1024
        r = h.get("/v1/nothing", headers=_auth())
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = h.get(CHAT, headers=_auth())
        assert r.status_code == 405 and "error" in r.json()


def test_body_limit_413_with_and_without_content_length(engine):
    lim = S.Limits(max_body_bytes=4096)
    with gateway(engine[0], limits=lim) as url, httpx.Client(base_url=url, headers=_auth(), timeout=30) as h:
        big = {"messages": [{"role": "user", "content": "x" * 5000}]}
        r = h.post(CHAT, json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

        def chunks():
            data = json.dumps(big).encode()
            for i in range(0, len(data), 1000):
                yield data[i:i + 1000]

        r = h.post(CHAT, content=chunks())  # chunked: no Content-Length
        assert r.status_code == 413


def test_unknown_fields_ignored_and_too_long_is_400_with_numbers(gw, engine):
    with httpx.Client(base_url=gw, headers=_auth(), timeout=60) as h:
        r = h.post(CHAT, json={"messages": HELLO, "max_tokens": 2, "temperature": 0, "frequency_penalty": 0.5,
                               "presence_penalty": 0.1, "user": "u1", "metadata": {"a": "b"}, "store": False,
                               "tool_choice": "none", "tools": [], "parallel_tool_calls": False,
                               "some_future_field": {"x": 1}, "max_completion_tokens": 2,
                               "messages_extra": None, "seed": -5, "stop": "\n\n"})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 2
        r = h.post(CHAT, json={"messages": [{"role": "user", "content": "hello " * 1500}], "max_tokens": 4})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["context_tokens"] == 1024
        assert err["prompt_tokens"] > 1024 and str(err["prompt_tokens"]) in err["message"]
        r = h.post(CHAT, json={"messages": HELLO}, headers={"X-AOTX-Conversation": "c_doesnotexist"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "conversation_not_found"
        r = h.post(CHAT, json={"messages": HELLO}, headers={"X-AOTX-Conversation": "../../etc/passwd"})
        assert r.status_code == 400


COUNTING = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 300, "temperature": 0}  # goes on and on


def _open_stream(h, body, headers=None, path="/v1/completions"):
    """Start a streaming request and read its first SSE line; returns the open response."""
    req = h.build_request("POST", path, json={**body, "stream": True}, headers=headers or {})
    r = h.send(req, stream=True)
    assert r.status_code == 200, r.read()
    lines = r.iter_lines()
    first = next(lines)
    assert first.startswith("data: ")
    return r, lines


def test_queue_full_and_per_key_limits_are_429_with_retry_after(engine):
    long = COUNTING
    with gateway(engine[0], keys=(KEY, KEY2), per_key_concurrency=1, max_queue=2) as url, \
            httpx.Client(base_url=url, timeout=60) as h:
        a, a_lines = _open_stream(h, long, _auth(KEY))  # keep the line iterators: collecting one closes its stream
        r = h.post(CHAT, json={"messages": HELLO, "max_tokens": 1}, headers=_auth(KEY))
        assert r.status_code == 429 and r.json()["error"]["code"] == "concurrency_limit"
        assert int(r.headers["retry-after"]) >= 1
        b, b_lines = _open_stream(h, long, _auth(KEY2))  # another key still gets in
        r = h.post(CHAT, json={"messages": HELLO, "max_tokens": 1}, headers=_auth(KEY2))
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert int(r.headers["retry-after"]) >= 1
        a.close()
        b.close()
        deadline = time.monotonic() + 20  # the slots come back once the cancels land
        while True:
            r = h.post(CHAT, json={"messages": HELLO, "max_tokens": 1}, headers=_auth(KEY))
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text


def test_disconnect_cancels_generation_and_busy_conversation_is_409(gw, engine):
    long = COUNTING
    with httpx.Client(base_url=gw, headers=_auth(), timeout=60) as h:
        r, lines = _open_stream(h, long)
        conv = r.headers["x-aotx-conversation"]
        next(lines)  # one token in
        busy = h.post(CHAT, json={"messages": HELLO, "max_tokens": 1}, headers={"X-AOTX-Conversation": conv})
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "conversation_busy"
        r.close()
        _wait_cancelled(engine[0], conv)

    # non-streaming: the client gives up (read timeout) and the reply is cancelled too
    with httpx.Client(base_url=gw, headers=_auth(), timeout=httpx.Timeout(60, read=1.0)) as h:
        with pytest.raises(httpx.ReadTimeout):
            h.post("/v1/completions", json=long, headers={"X-AOTX-Conversation": conv})
    _wait_cancelled(engine[0], conv, n_replies=2)


def _wait_cancelled(sock, conv, n_replies=1):
    deadline = time.monotonic() + 20
    while True:
        view = _show(sock, conv)
        replies = [m for m in view.messages if m.role == "assistant"]
        if len(replies) == n_replies and replies[-1].status == "cancelled":
            assert len(replies[-1].token_ids) < 300
            return
        assert time.monotonic() < deadline, f"not cancelled: {[(m.role, m.status) for m in view.messages]}"
        time.sleep(0.1)


def test_no_engine_is_503_with_retry_after(tmp_path):
    with gateway(tmp_path / "none.sock") as url, httpx.Client(base_url=url, headers=_auth(), timeout=30) as h:
        r = h.post(CHAT, json={"messages": HELLO})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "engine_unavailable"
        assert h.get("/health").status_code == 503


@pytest.mark.parametrize("code,status", [("too_long", 400), ("busy", 409), ("not_found", 404), ("not_ready", 503),
                                         ("bad_request", 400), ("unsupported_media", 400), ("internal", 500)])
def test_engine_error_table(code, status):
    e = engine_error(P.Error(id=1, code=code, message="m"), None, 2)
    assert e.status == status and e.body["error"]["message"]
    assert (e.headers.get("Retry-After") == "2") == (status == 503)


# ---- keys ------------------------------------------------------------------------------------

def test_key_file_generated_0600_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    keys, path, created = A.load_or_create(None)
    assert created and path == tmp_path / "gateway" / "api_keys"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and keys[0].startswith("sk-aotx-") and len(keys[0]) > 40
    again, _, created2 = A.load_or_create(None)
    assert again == keys and not created2
    path.chmod(0o644)
    with pytest.raises(UsageError, match="chmod 600"):
        A.load_or_create(None)
    other = tmp_path / "k"
    other.write_text("# comment\n\nshort\n")
    other.chmod(0o600)
    with pytest.raises(UsageError, match="at least 16"):
        A.load_or_create(other)
    other.write_text("# only a comment\n")
    with pytest.raises(UsageError, match="no key"):
        A.load_or_create(other)
    with pytest.raises(UsageError, match="does not exist"):
        A.load_or_create(tmp_path / "missing")


def test_gateway_key_file_first_line_is_the_key(tmp_path):
    """Regression: the first line was a comment, so ``head -1 api_keys`` gave no key."""
    path = tmp_path / "gateway" / "api_keys"
    key = A.generate_key_file(path)
    first = path.read_text().splitlines()[0]
    assert first == key and first.startswith("sk-aotx-")
    assert A.read_key_file(path) == [key]
    head = subprocess.run(["head", "-1", str(path)], capture_output=True, text=True)
    assert head.stdout.strip() == key


@pytest.mark.parametrize("header,ok", [
    (f"Bearer {KEY}", True), (f"bearer {KEY}", True), (f"Bearer  {KEY} ", True), (f"Bearer {KEY2}", True),
    (None, False), ("", False), ("Bearer", False), ("Bearer ", False), (f"Basic {KEY}", False), (KEY, False),
    (f"Bearer {KEY}x", False), (f"Bearer {KEY[:-1]}", False), ("Bearer \udcff", False),
])
def test_key_ring(header, ok):
    assert (A.KeyRing([KEY, KEY2]).check(header) is not None) == ok


@pytest.mark.parametrize("host,loop", [("127.0.0.1", True), ("localhost", True), ("::1", True), ("127.0.0.2", True),
                                       ("0.0.0.0", False), ("192.168.1.5", False), ("::", False),
                                       ("example.com", False)])
def test_loopback(host, loop):
    assert G.is_loopback(host) == loop


# ---- the command -------------------------------------------------------------------------------

def test_cli_gateway_generates_key_and_serves_openai(engine, tmp_path):
    sock, _ = engine
    env = dict(os.environ, AOTX_HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", "gateway", "--host", "0.0.0.0", "--socket", str(sock)],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--api-key-file" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "gateway").exists()

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen([sys.executable, "-m", "aotx.engine.cli.commands", "gateway", "--port", str(port), "--socket",
                             str(sock)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        keyfile = tmp_path / "gateway" / "api_keys"
        key = A.read_key_file(keyfile)[0]
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        c = oa.chat.completions.create(model="local", messages=HELLO, **GREEDY)
        assert c.choices[0].message.content and _receipt_ok(c.model_extra["aotx"]["receipt"])
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    assert str(keyfile) in err and "generated" in err


# ---- load -----------------------------------------------------------------------------------------

def test_load_32_concurrent_streams_all_complete_with_receipts(gw):
    async def one(client, i):
        stream = await client.chat.completions.create(
            model="local", messages=[{"role": "user", "content": f"Say the number {i}."}], stream=True,
            temperature=0, max_tokens=8, stream_options={"include_usage": True})   # the receipt rides on usage
        text, finish, receipt = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if (chunk.model_extra or {}).get("aotx"):
                receipt = chunk.model_extra["aotx"]["receipt"]
        return text, finish, receipt

    async def main():
        client = openai.AsyncOpenAI(base_url=gw + "/v1", api_key=KEY, max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(32)))
        finally:
            await client.close()

    t0 = time.monotonic()
    results = asyncio.run(main())
    assert len(results) == 32
    for text, finish, receipt in results:
        assert text and finish in ("stop", "length") and _receipt_ok(receipt)
    print(f"32 streams of 8 tokens in {time.monotonic() - t0:.1f} s")
