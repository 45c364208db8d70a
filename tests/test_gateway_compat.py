"""Gaps between the gateway and the APIs it imitates, each closed with a regression test
through the official clients (``openai``, ``anthropic``) where they read the field.

One engine subprocess (SmolLM2, CPU) serves the module and a gateway runs in-process;
a test that kills an engine starts its own.
"""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from tests.gateway_support import KEY, engine_call, gateway, start_engine, stop_engine  # noqa: E402

pytestmark = pytest.mark.realmodel


@pytest.fixture(scope="module")
def engine(tmp_path_factory, default_model_path):
    home = tmp_path_factory.mktemp("gwcompat")
    proc, sock = start_engine(home, None, slots=2, context=1024)
    yield sock, home
    stop_engine(proc)


@pytest.fixture(scope="module")
def gw(engine):
    with gateway(engine[0]) as url:
        yield url


@pytest.fixture()
def oa(gw):
    return openai.OpenAI(base_url=gw + "/v1", api_key=KEY, max_retries=0, timeout=300)


def _auth():
    return {"Authorization": f"Bearer {KEY}"}


def test_bug_logprobs_leave_out_the_end_of_generation_token(oa):
    """Chat logprobs listed one token more than the reply's text: the end-of-generation
    token (SmolLM2's ``<|im_end|>``) that ended it, as the last entry. OpenAI's logprobs
    are the returned content's tokens only: their bytes join to the content, streamed or not."""
    kw = dict(model="local", messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=200,
              logprobs=True, top_logprobs=2)
    r = oa.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "stop", "the reply did not end by itself: the test needs an end token"
    entries = c.logprobs.content
    assert b"".join(bytes(e.bytes) for e in entries) == c.message.content.encode(), [e.token for e in entries][-3:]
    streamed, text = [], ""
    for ch in oa.chat.completions.create(**kw, stream=True):
        for sc in ch.choices:
            text += sc.delta.content or ""
            if sc.logprobs and sc.logprobs.content:
                streamed += sc.logprobs.content
    assert text == c.message.content
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in entries]


def test_bug_retrieved_response_lacks_previous_response_id(oa):
    """GET /v1/responses/{id} answered without ``previous_response_id`` (OpenAI's Response
    carries it, null when none). It is the id the response was created with: after a plain
    continuation, a branch (a fork of the conversation) and several new input items (a new
    conversation holding the history) alike."""
    kw = dict(model="local", max_output_tokens=3, temperature=0)
    r1 = oa.responses.create(input="Name a fruit.", **kw)
    r2 = oa.responses.create(input="Another one.", previous_response_id=r1.id, **kw)
    r3 = oa.responses.create(input="A vegetable?", previous_response_id=r1.id, **kw)  # r1 is no longer last: a fork
    r4 = oa.responses.create(input=[{"role": "user", "content": "One more."}, {"role": "user", "content": "Go."}],
                             previous_response_id=r2.id, **kw)
    assert r3.model_extra["aotx"]["conversation"] != r1.model_extra["aotx"]["conversation"]
    got = {r.id: oa.responses.retrieve(r.id) for r in (r1, r2, r3, r4)}
    assert got[r1.id].previous_response_id is None and "previous_response_id" in got[r1.id].model_fields_set
    assert got[r2.id].previous_response_id == r1.id
    assert got[r3.id].previous_response_id == r1.id
    assert got[r4.id].previous_response_id == r2.id
    for r in (r1, r2, r3, r4):
        assert got[r.id].output_text == r.output_text


def test_bug_engine_dying_mid_stream_ends_each_stream_with_its_protocols_error(tmp_path, default_model_path):
    """An engine killed while three replies stream (chat completions, Responses, Messages):
    each stream ends with its protocol's error, as the official clients read it. Chat: a
    ``data: {"error": ...}`` chunk, then ``data: [DONE]`` (vLLM's form; llama.cpp's server
    sends the same chunk): the openai client raises APIError. Responses: a
    ``response.failed`` event whose response has status "failed" and an error object (it
    was an ``error`` event and no terminal response event). Messages: ``event: error`` with
    ``{"type": "error", "error": {"type": "api_error", "message"}}``."""
    anthropic = pytest.importorskip("anthropic")
    proc, sock = start_engine(tmp_path, None, slots=4, context=1024)
    try:
        with gateway(sock) as url:
            oa = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
            an = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=300)
            ask = "Count from one to three hundred in words, one number per line."
            chat = oa.chat.completions.create(model="local", messages=[{"role": "user", "content": ask}],
                                              max_tokens=900, temperature=0, stream=True)
            resp = oa.responses.create(model="local", input=ask, max_output_tokens=900, temperature=0, stream=True)
            msgs = an.messages.create(model="local", max_tokens=900, messages=[{"role": "user", "content": ask}],
                                      stream=True, extra_body={"temperature": 0})
            chat_it, resp_it, msgs_it = iter(chat), iter(resp), iter(msgs)
            for it, is_text in ((chat_it, lambda e: e.choices and e.choices[0].delta.content),
                                (resp_it, lambda e: e.type == "response.output_text.delta"),
                                (msgs_it, lambda e: e.type == "content_block_delta")):
                while not is_text(next(it)):
                    pass
            stop_engine(proc, kill=True)
            with pytest.raises(openai.APIError) as chat_err:
                for _ in chat_it:
                    pass
            assert "engine" in chat_err.value.message
            rest = list(resp_it)
            assert rest[-1].type == "response.failed", [e.type for e in rest[-3:]]
            failed = rest[-1].response
            assert failed.status == "failed" and failed.error is not None and failed.error.message
            assert not any(e.type in ("response.completed", "response.incomplete") for e in rest)
            with pytest.raises(anthropic.APIStatusError) as msg_err:
                for _ in msgs_it:
                    pass
            body = msg_err.value.body
            assert body["type"] == "error" and body["error"]["type"] == "api_error" and body["error"]["message"]
    finally:
        stop_engine(proc)


def test_engine_dying_mid_stream_raw_chat_chunks_end_error_then_done(tmp_path, default_model_path):
    """The same on the wire, for chat completions: the last two SSE data lines are the error
    object and ``[DONE]``."""
    proc, sock = start_engine(tmp_path, None, slots=2, context=1024)
    try:
        with gateway(sock) as url, httpx.Client(base_url=url, headers=_auth(), timeout=300) as h:
            body = {"model": "local", "max_tokens": 900, "temperature": 0, "stream": True,
                    "messages": [{"role": "user", "content": "Count from one to three hundred in words."}]}
            with h.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                for ln in lines:
                    if ln.startswith("data: ") and '"content":"' in ln and '"content":""' not in ln:
                        break
                stop_engine(proc, kill=True)
                data = [ln[6:] for ln in lines if ln.startswith("data: ")]
            assert data[-1] == "[DONE]"
            err = json.loads(data[-2])["error"]
            assert err["type"] == "server_error" and "engine" in err["message"], err
    finally:
        stop_engine(proc)


def test_bug_anthropic_assistant_prefill_is_continued_not_refused(gw):
    """A Messages request whose last message is the assistant's (a prefill) was a 400 (the
    last message must be the user's). Anthropic continues the reply from the prefilled text
    and returns the continuation only: the prompt ends inside the assistant turn (no
    end-of-turn after the prefill), so a count the prefill started goes on from it."""
    anthropic = pytest.importorskip("anthropic")
    cl = anthropic.Anthropic(base_url=gw, api_key=KEY, max_retries=0, timeout=300)
    prefill = "1, 2, 3, 4, 5, 6,"
    kw = dict(model="local", max_tokens=8, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "Count from 1 to 20, separated by commas."},
                        {"role": "assistant", "content": prefill}])
    m = cl.messages.create(**kw)
    text = m.content[0].text
    assert text.lstrip().startswith("7"), text
    assert prefill not in text
    with cl.messages.stream(**kw) as s:
        assert "".join(s.text_stream) == text
    # an empty final assistant message asks for a plain reply; trailing whitespace is refused, as Anthropic does
    plain = cl.messages.create(**{**kw, "messages": kw["messages"][:1] + [{"role": "assistant", "content": ""}]})
    assert plain.content and plain.content[0].text
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        cl.messages.create(**{**kw, "messages": kw["messages"][:1] + [{"role": "assistant", "content": "1, "}]})
    with pytest.raises(anthropic.BadRequestError, match="user message before it"):
        cl.messages.create(**{**kw, "messages": [{"role": "assistant", "content": "Hi"}]})


def test_bug_anthropic_count_tokens_endpoint_counts_the_prompt_as_messages_renders_it(gw, engine):
    """POST /v1/messages/count_tokens was a 404 (Claude Code and the anthropic client call it
    to size a conversation). It answers ``{"input_tokens": N}``: the prompt of the same body
    sent to /v1/messages (system, earlier turns, tools, a prefill), as that reply's usage
    counts it, storing nothing; a bad body is a 400 in Anthropic's error shape."""
    anthropic = pytest.importorskip("anthropic")
    cl = anthropic.Anthropic(base_url=gw, api_key=KEY, max_retries=0, timeout=300)
    tools = [{"name": "get_weather", "description": "Weather in a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    turns = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello! How can I help?"},
             {"role": "user", "content": "What is the weather in Paris?"}]
    bodies = [dict(messages=turns[:1]), dict(messages=turns, system="Be terse."),
              dict(messages=turns, system="Be terse.", tools=tools),
              dict(messages=turns + [{"role": "assistant", "content": "Let me"}], system="Be terse.")]
    before = len(engine_call(engine[0], lambda c: c.list_conversations()))
    counts = [cl.messages.count_tokens(model="local", **b).input_tokens for b in bodies]
    assert len(engine_call(engine[0], lambda c: c.list_conversations())) == before  # nothing stored
    for b, n in zip(bodies, counts):
        u = cl.messages.create(model="local", max_tokens=1, **b).usage
        assert n == u.input_tokens + (u.cache_read_input_tokens or 0), (b, n, u)
    assert counts[0] < counts[1] < counts[2] and counts[3] > counts[1]
    with httpx.Client(base_url=gw, headers=_auth(), timeout=300) as h:
        for body, where in (({"model": "local"}, "messages"),
                            ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
                            ({"messages": turns[:1], "tools": [5]}, "tools[0]"),
                            ({"messages": [{"role": "assistant", "content": "x"}]}, "user message before it")):
            r = h.post("/v1/messages/count_tokens", json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["type"] == "error" and where in r.json()["error"]["message"], r.text
        r = h.post("/v1/messages/count_tokens", content=b"{nope", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        r = httpx.post(gw + "/v1/messages/count_tokens", json={"messages": turns[:1]}, timeout=60)
        assert r.status_code == 401
