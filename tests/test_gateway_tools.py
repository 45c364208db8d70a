"""Pure parts of the gateway's tool calling and request parsing: no model, no HTTP.

Tool-call parsing per template family (table of real-world outputs), the streaming
parser against the whole-text parser on every way of cutting a reply into deltas
(hypothesis), the forced-call grammar compiled by llguidance and walked with a real
vocabulary, request parsing (tools, tool_choice, constraints, media parts), naming the
open field of an oversized body, and the key file's ``allow-files`` option.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aotx.engine.errors import UsageError
from aotx.engine.gateway import auth as A
from aotx.engine.gateway import media as M
from aotx.engine.gateway import schema as S
from aotx.engine.model import tool_calls as T

ROOT = Path(__file__).resolve().parent.parent
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

PARSE = [
    # (family, reply text, content, [(name, arguments text)])
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
     [("get_weather", '{"city": "Paris"}')]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
               '{"name": "b", "arguments": {"x": [1, "}"]}}\n</tool_call>', "Let me check.",
     [("a", "{}"), ("b", '{"x": [1, "}"]}')]),
    ("hermes", "Paris is sunny today.", "Paris is sunny today.", []),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ("hermes", '<tool_call>{"arguments": {"q": 1}, "name": "s"}</tool_call>', "", [("s", '{"q": 1}')]),
    # bare calls (Qwen2.5-Coder's reply to a tools request after main's merge): whole-reply JSON, or one fence
    ("hermes", '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}', "",
     [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("hermes", '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}\n```', "",
     [("get_weather", '{"city": "Paris"}')]),
    ("hermes", '{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 36}', []),   # an answer, not a call
    # the README's second turn with Qwen2.5-Coder-0.5B: the same bare call line over and over, cut by
    # max_tokens (or by the gateway's stop) inside a copy: one call
    ("hermes", '{"name": "get_weather", "arguments": {"city": "Paris"}}\n' * 3 + '{"name": "get_wea', "",
     [("get_weather", '{"city": "Paris"}')]),
    ("hermes", '{"name": "a", "arguments": {"x": 1}}\n{"name": "b", "arguments": {}}\n{"name": "a", "arguments": {"x":1}}',
     "", [("a", '{"x": 1}'), ("b", "{}")]),
    # a cut that is not a copy of a call already written: what the model wrote stays content
    ("hermes", '{"name": "a", "arguments": {}}\n{"name": "zz', '{"name": "a", "arguments": {}}\n{"name": "zz', []),
    ("hermes", 'See {"name": "f", "arguments": {}}', 'See {"name": "f", "arguments": {}}', []),
    ("hermes", "```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", '{"city": "Oslo"}')]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"a": 1}}', "",
     [("f", "{}"), ("g", '{"a": 1}')]),
    ("llama3_json", "{braces in prose} are fine", "{braces in prose} are fine", []),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', "", [("f", '{"a": 1}')]),
    ("mistral", "no calls here", "no calls here", []),
]


@pytest.mark.parametrize("family,text,content,calls", PARSE)
def test_parse_per_family(family, text, content, calls):
    got_content, got = T.parse(text, family)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls


def _stream(family: str, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]], list[str]]:
    p = T.StreamParser(family, "call_m1_")
    content, calls, ids = "", {}, []
    pieces, at = [], 0
    for c in sorted(set(cuts)):
        pieces.append(text[at:c])
        at = c
    pieces.append(text[at:])
    for d in [p.feed(x) for x in pieces] + [p.finish()]:
        content += d.content
        for i, cid, name, args in d.calls:
            e = calls.setdefault(i, ["", ""])
            if cid is not None:
                ids.append(cid)
                e[0] = name
            e[1] += args
    return content, [tuple(calls[i]) for i in sorted(calls)], ids


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(PARSE), data=st.data())
def test_streamed_calls_equal_parsed_calls_for_any_chunking(case, data):
    family, text, content, calls = case
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    got_content, got_calls, ids = _stream(family, text, cuts)
    assert got_calls == calls
    assert got_content.strip() == content.strip()
    assert ids == [f"call_m1_{i}" for i in range(len(calls))]


def test_stream_parser_says_complete_when_a_call_repeats():
    line = '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    block = "<tool_call>\n" + line + "</tool_call>\n"
    for text, n_first in ((line * 4, len(line) * 2), (block * 3, len(block) * 2)):  # stopped at the first repeat
        p = T.StreamParser("hermes", "call_x_")
        at = None
        for i, ch in enumerate(text):
            p.feed(ch)
            if p.complete and at is None:
                at = i + 1
        assert at is not None and at <= n_first, (text, at)
    p = T.StreamParser("hermes")
    for piece in ('{"name": "a", "arguments": {"x": 1}}\n', '{"name": "a", "arguments": {"x": 2}}\n'):
        p.feed(piece)
    assert not p.complete  # two different calls to one tool are two calls


def test_template_family_and_tools_variable():
    assert T.family_of("... <tool_call>\\n{...} ...{% if tools %}") == "hermes"
    assert T.family_of("<|start_header_id|>ipython ... <|python_tag|> {{ tools }}") == "llama3_json"
    assert T.family_of("[AVAILABLE_TOOLS] [TOOL_CALLS] {{ tools }}") == "mistral"
    assert T.takes_tools("{% if tools %}x{% endif %}") and not T.takes_tools("{{ messages }}")
    m = T.template_message({"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]})
    assert m["tool_calls"][0]["function"]["arguments"] == {"a": 1}  # templates want an object (HF's convention)


@pytest.fixture(scope="module")
def smol_tok(default_model_path):
    """The default model's vocabulary (SmolLM2's 49,152 tokens) as the engine reads it."""
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.tokenizer import Tokenizer

    return Tokenizer.from_metadata(GGUFFile.open(default_model_path).metadata)


def test_forced_call_grammar_accepts_only_calls_to_the_named_tools(smol_tok):
    pytest.importorskip("llguidance")
    from aotx.engine.runtime.constraints import Compiler

    tiny_tokenizer = smol_tok
    c = Compiler(tiny_tokenizer)
    tools = [WEATHER, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    g = c.compile("lark", T.call_grammar(tools, "hermes", name="get_weather"), "tool_choice")
    good = tiny_tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    assert g.matcher.validate_tokens(good) == len(good)
    bad = tiny_tokenizer.encode('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert g.matcher.validate_tokens(bad) < len(bad)
    for fam in ("llama3_json", "mistral"):
        c.compile("lark", T.call_grammar(tools, fam), "tool_choice")  # compiles


# ---- request parsing -----------------------------------------------------------------------

HELLO = [{"role": "user", "content": "hi"}]
PNG = (ROOT / "assets" / "screenshot.png").read_bytes()


def test_parse_chat_tools_constraints_and_media():
    r = S.parse_chat({"messages": HELLO, "tools": [WEATHER], "tool_choice": "required", "n": 3, "logprobs": True,
                      "top_logprobs": 2}, S.Limits())
    assert r.tools.forced and r.tools.tools[0]["function"]["name"] == "get_weather" and r.n == 3 and r.logprobs == 2
    r = S.parse_chat({"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}, S.Limits())
    assert r.constraint.kind == "json_schema" and r.constraint.field == "response_format.json_schema.schema"
    r = S.parse_chat({"messages": HELLO, "grammar": 'root ::= "a"'}, S.Limits())
    assert (r.constraint.kind, r.constraint.field) == ("gbnf", "grammar")
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = S.parse_chat({"messages": msgs, "tools": [WEATHER]}, S.Limits())
    assert r.messages[-1].role == "tool" and r.messages[-1].meta == {"tool_call_id": "call_1", "name": "get_weather"}
    assert r.messages[1].meta["tool_calls"][0]["id"] == "call_1"
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    r = S.parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, {
        "type": "image_url", "image_url": {"url": url}}]}]}, S.Limits())
    (part,) = r.messages[-1].parts
    assert part.kind == "image" and part.data == PNG and part.where == "messages[0].content[1].image_url"
    assert M.check(part) == ("image", ".png")


def test_no_repetition_penalty_by_default_with_tools_or_a_constraint():
    """Regression: with the engine's default penalty of 1.1 over the prompt's last tokens,
    Qwen2.5-Coder answered a tools request with a fenced JSON block, not its <tool_call>."""
    from aotx.engine import protocol as P

    fmt = {"type": "json_object"}
    assert S.parse_chat({"messages": HELLO}, S.Limits()).sampling.repeat_penalty == P.REPEAT_PENALTY
    assert S.parse_chat({"messages": HELLO, "tools": [WEATHER]}, S.Limits()).sampling.repeat_penalty == 1.0
    assert S.parse_chat({"messages": HELLO, "tools": [WEATHER], "tool_choice": "none"},
                        S.Limits()).sampling.repeat_penalty == P.REPEAT_PENALTY
    assert S.parse_chat({"messages": HELLO, "response_format": fmt}, S.Limits()).sampling.repeat_penalty == 1.0
    assert S.parse_chat({"messages": HELLO, "response_format": fmt, "repeat_penalty": 1.3},
                        S.Limits()).sampling.repeat_penalty == 1.3
    assert S.parse_completion({"prompt": "x", "grammar": 'root ::= "a"'}, S.Limits()).sampling.repeat_penalty == 1.0


@pytest.mark.parametrize("body,param,status", [
    ({"messages": HELLO, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", 400),
    ({"messages": HELLO, "tools": [WEATHER, WEATHER]}, "tools", 400),
    ({"messages": HELLO, "tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", 400),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
     "messages", 400),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + "A" * (30 << 20)}}]}]}, "messages", 413),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/hosts"}}]}]},
     "messages", 403),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA",
                                                                                           "format": "aac"}}]}]},
     "messages", 400),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,AAAA"}}]}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": "y"}]}, "messages", 400),
])
def test_parse_chat_refusals(body, param, status):
    with pytest.raises(S.BadRequest) as e:
        S.parse_chat(body, S.Limits())
    assert (e.value.param, e.value.status) == (param, status), e.value.message


def test_media_parts_are_checked_by_content_and_stored_once(tmp_path):
    not_png = M.MediaPart("image", "messages[0].content[0].image_url", data=b"GIF89a but really text?")
    assert M.check(not_png)[0] == "image"  # a GIF is an image
    with pytest.raises(M.MediaRefusal) as e:
        M.check(M.MediaPart("image", "messages[0].content[0].image_url", data=b"hello, I am text, not pixels"))
    assert e.value.status == 400 and e.value.message.startswith("messages[0].content[0].image_url:")
    wav = (ROOT / "assets" / "clip.wav").read_bytes()
    with pytest.raises(M.MediaRefusal):
        M.check(M.MediaPart("image", "x", data=wav))  # audio in an image part
    a1 = M.attach(M.MediaPart("image", "p", data=PNG), tmp_path)
    a2 = M.attach(M.MediaPart("image", "p", data=PNG), tmp_path)
    assert a1.path == a2.path and Path(a1.path).read_bytes() == PNG and (Path(a1.path).stat().st_mode & 0o777) == 0o600
    root = tmp_path / "pics"
    root.mkdir()
    (root / "s.png").write_bytes(PNG)
    part = M.image_url_part(f"file://{root}/s.png", "w", (root.resolve(),))
    assert M.attach(part).path == str((root / "s.png").resolve())
    with pytest.raises(M.MediaRefusal) as e:
        M.image_url_part(f"file://{root}/../pics/../../etc/passwd", "w", (root.resolve(),))
    assert e.value.status in (400, 403)


@pytest.mark.parametrize("prefix,path", [
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a,b"}, {"type": "image_url", '
     b'"image_url": {"url": "data:image/png;base64,AAAA', "messages[0].content[1].image_url.url"),
    (b'{"a": [1, {"b": "x\\"y', "a[1].b"),
    (b'{"a": 1}', None),
    (b'{"input": "long long', "input"),
])
def test_open_field_of_a_cut_body(prefix, path):
    assert M.open_field(prefix) == path


def test_key_file_allow_files_option(tmp_path):
    d = tmp_path / "pics"
    d.mkdir()
    text = f"# keys\nsk-aotx-aaaaaaaaaaaaaaaaaaaa allow-files={d}\nsk-aotx-bbbbbbbbbbbbbbbbbbbb\n"
    opts = A.key_options(text)
    assert opts == {"sk-aotx-aaaaaaaaaaaaaaaaaaaa": (d.resolve(),)}
    ring = A.KeyRing(["sk-aotx-aaaaaaaaaaaaaaaaaaaa", "sk-aotx-bbbbbbbbbbbbbbbbbbbb"], opts)
    fa = ring.check("Bearer sk-aotx-aaaaaaaaaaaaaaaaaaaa")
    fb = ring.check("Bearer sk-aotx-bbbbbbbbbbbbbbbbbbbb")
    assert ring.file_roots(fa) == (d.resolve(),) and ring.file_roots(fb) == ()
    with pytest.raises(UsageError):
        A.key_options("sk-aotx-aaaaaaaaaaaaaaaaaaaa sneaky=1\n")
    with pytest.raises(UsageError):
        A.key_options(f"sk-aotx-aaaaaaaaaaaaaaaaaaaa allow-files={tmp_path}/nope\n")


def test_text_after_a_repeated_call_block_is_not_content():
    """Qwen forced to a named tool wrote its <tool_call> block twice and began a third before
    the gateway's stop (sent at the repeat) took effect: the unfinished third block came back
    as the message's content ('<tool_call>\\n{"name": "get_time'), streamed and not. After a
    block that repeats an earlier one, the rest of the reply is neither content nor a call."""
    block = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Kyiv"}}\n</tool_call>\n'
    for tail in ('<tool_call>\n{"name": "get_time', '<tool_call>\n{"name": "get_time", "arguments": {"ci',
                 "Sure, here it is", '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'):
        text = "Let me check.\n" + block * 2 + tail
        content, calls = T.parse(text, "hermes")
        assert content == "Let me check." and len(calls) == 1, (tail, content, calls)
        for step in (1, 7, len(text)):
            p = T.StreamParser("hermes", "call_x_")
            got = [p.feed(text[i:i + step]) for i in range(0, len(text), step)] + [p.finish()]
            assert "".join(d.content for d in got) == "Let me check.", (tail, step)
            assert [(c.name, c.arguments) for c in p.calls] == [(c.name, c.arguments) for c in calls]
            assert p.complete


def test_a_tool_call_block_written_twice_is_one_call():
    """A model looping on its <tool_call> block had each copy sent as one more call (the client
    would run get_time(Kyiv) twice, or send an email twice): a block naming a tool already
    called is held until it closes, and dropped when it is a copy. Two different calls to
    one tool stay two calls, streamed or not, in any chunking."""
    paris = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    tokyo = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>\n'
    other = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    for text, want in ((paris + paris, ['{"city": "Paris"}']),
                       (paris + tokyo, ['{"city": "Paris"}', '{"city": "Tokyo"}']),
                       (paris + tokyo + paris + tokyo, ['{"city": "Paris"}', '{"city": "Tokyo"}']),
                       (paris + other + paris, ['{"city": "Paris"}', '{"city": "Paris"}']),
                       (paris + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro',
                        ['{"city": "Paris"}', '{"city": "Ro'])):
        _, parsed = T.parse(text, "hermes")
        if not text.endswith("Ro"):
            assert [c.arguments for c in parsed] == want, text
        for step in (1, 5, len(text)):
            got_content, got_calls, ids = _stream("hermes", text, list(range(step, len(text), step)))
            assert [a for _, a in got_calls] == want, (text, step, got_calls)
            assert ids == [f"call_m1_{i}" for i in range(len(want))] and got_content == ""


@pytest.mark.parametrize("family,text,whole", [
    ("hermes", "Hello there, no call.", True),
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>', True),
    ("hermes", '<tool_call>\n{"name": "sayHelloWorld", "arguments": {}}\n</tool_call>', False),  # undeclared
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Rome"}}\n</tool_call>', False),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }', False),  # malformed
    ("hermes", '{"name": "get_weather", "arguments": {"city": "Oslo"}}', True),  # a bare call, declared
    ("hermes", '{"name": "nope", "arguments": {}}', False),
    ("hermes", "I would write <tool_call]> here", True),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}', True),
    ("llama3_json", '{"name": "nope", "parameters": {}}', False),
    ("llama3_json", "Plain words.", True),
])
def test_auto_grammar_holds_calls_to_the_declared_tools(smol_tok, family, text, whole):
    """With tool_choice auto a call to a tool that was never declared came back as a tool
    call, and a malformed one as plain text. The lazy grammar lets free text through and,
    once a call opens, only a declared name and arguments its schema takes; ``whole``:
    the text is a complete reply under it (it may end there)."""
    pytest.importorskip("llguidance")
    from aotx.engine.runtime.constraints import Compiler

    c = Compiler(smol_tok)
    g = c.compile("lark", T.auto_grammar([WEATHER], family), "tools")
    ids = smol_tok.encode(text)
    n = g.matcher.validate_tokens(ids)
    if whole:
        assert n == len(ids) and g.consume(ids) and g.accepting, (text, n, len(ids))
    else:
        assert n < len(ids) or not (g.consume(ids) and g.accepting), text


def test_stream_parser_keeps_a_call_to_an_undeclared_tool_as_text():
    text = 'Hi <tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    p = T.StreamParser("hermes", "c_", names={"get_weather"})
    outs = [p.feed(ch) for ch in text] + [p.finish()]
    assert "".join(d.content for d in outs) == text and not any(d.calls for d in outs)
    p = T.StreamParser("hermes", "c_", names={"get_weather"})
    outs = [p.feed('{"name": "nope", "arguments": {}}'), p.finish()]
    assert not any(d.calls for d in outs)
    assert T.tool_names([WEATHER]) == ["get_weather"]
