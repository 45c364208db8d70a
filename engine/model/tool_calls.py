"""Tool calls in a model's own words: each chat-template family's format, parsed and forced.

Owns, per template family (``family_of`` tells it from the template's source):

* parsing a reply's text into content and tool calls (``parse``), and the same
  incrementally while it streams (``StreamParser``: text deltas in, content deltas
  and tool-call deltas out; concatenated, they equal ``parse`` of the whole text);
* the grammars of calls (``tool_grammar.py``, re-exported here): ``call_grammar`` forces
  one, for ``tool_choice`` "required" or a named function; ``auto_grammar`` holds
  ``auto``'s calls to the declared tools once the model opens one;
* the tools' description for a template that does not take ``tools``
  (``fallback_system_prompt``: the Hermes format, parsed as ``hermes``).

Families (the formats their models were trained on; vLLM's tool parsers and
llama.cpp's ``common/chat.cpp`` recognise the same):

* ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one
  block per call (Qwen2.5, Qwen3, Hermes 2/3, and the fallback);
* ``llama3_json``: ``{"name": ..., "parameters": {...}}`` as the whole reply,
  optionally after ``<|python_tag|>``, several joined by ``;`` (Llama 3.1-3.3);
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

Leaves the JSON scanning the parsers share (``tool_json.py``: ``ToolCall`` is defined
there), rendering (the chat template), decoding (the runtime) and the HTTP shapes (the
gateway) to others. A call whose JSON does not parse stays content (never an
exception): what the model wrote is what the client gets.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from aotx.engine.model.tool_json import (
    _DECODER, ToolCall, _bare_calls, _bare_scan, _bare_start, _call_from, _canonical, _hermes_block, _json_prefix,
    _partial_suffix, _raw_value, _split_top,
)
from aotx.engine.model.tool_grammar import _function  # noqa: F401 (the tools' function objects)

FAMILIES = ("hermes", "llama3_json", "mistral")


def family_of(template_source: str) -> str:
    """The tool-call family of a chat template (by the markup it writes); ``hermes``
    for a template that names none (the fallback prompt teaches that format)."""
    src = template_source or ""
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "<tool_call>" in src:
        return "hermes"
    if "<|python_tag|>" in src or ("<|start_header_id|>" in src and "tools" in src):
        return "llama3_json"
    return "hermes"


def takes_tools(template_source: str) -> bool:
    """Whether a chat template renders a ``tools`` variable itself."""
    return bool(re.search(r"\btools\b", template_source or ""))


def fallback_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The tools' description for a template without ``tools`` (Hermes's wording, the
    format ``hermes`` parses), appended to the system prompt."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def template_message(m: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates expect it: an assistant's ``tool_calls`` with each
    ``arguments`` as an object (HF's convention; OpenAI sends JSON text)."""
    calls = m.get("tool_calls")
    if not calls:
        return m
    out = []
    for c in calls:
        c = dict(c)
        fn = dict(c.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # the template gets the text as it came
        c["function"] = fn
        out.append(c)
    return {**m, "tool_calls": out}


# ---- parsing ----------------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse(text: str, family: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a finished reply in ``family``'s format. Text that is not a
    well-formed call stays in the content; after a ``<tool_call>`` block that repeats an
    earlier one the model is looping, and the rest is dropped (as ``StreamParser`` does)."""
    if family == "hermes":
        calls: list[ToolCall] = []
        content: list[str] = []
        pos = 0
        for m in _HERMES.finditer(text):
            call = _hermes_block(m.group(1))
            if call is None:
                continue
            content.append(text[pos:m.start()])
            if any((c.name, _canonical(c.arguments)) == (call.name, _canonical(call.arguments)) for c in calls):
                pos = len(text)  # a copy of an earlier call: the model is looping; it and the rest go
                break
            calls.append(call)
            pos = m.end()
        content.append(text[pos:])
        if not calls:
            bare = _bare_calls(text)
            return ("", bare) if bare else (text, [])
        return "".join(content).strip(), calls
    if family == "llama3_json":
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in _split_top(body, ";"):
            try:
                c = _call_from(json.loads(part), "parameters")
            except ValueError:
                return text, []
            if c is None:
                return text, []
            raw = _raw_value(part, "parameters") or _raw_value(part, "arguments")
            if raw is not None:
                c.arguments = raw
            calls.append(c)
        return "", calls
    if family == "mistral":
        at = text.find("[TOOL_CALLS]")
        if at < 0:
            return text, []
        body = text[at + len("[TOOL_CALLS]"):].strip()
        try:
            arr, _ = _DECODER.raw_decode(body)
        except ValueError:
            return text, []
        arr = arr if isinstance(arr, list) else [arr]
        calls = [c for c in (_call_from(o, "arguments") for o in arr) if c is not None]
        if not calls:
            return text, []
        return text[:at].strip(), calls
    return text, []



# ---- streaming ----------------------------------------------------------------------

@dataclass
class Delta:
    """What one text delta adds: ``content`` text, and tool-call pieces as
    ``(index, id or None, name or None, arguments text)`` in order."""

    content: str = ""
    calls: list[tuple[int, str | None, str | None, str]] = field(default_factory=list)


class StreamParser:
    """Reply text deltas -> content deltas and tool-call deltas (OpenAI's streaming
    shape: a call's first delta has its id and name, later ones add arguments text).

    ``hermes``: text outside ``<tool_call>`` blocks streams as content at once (a
    possible start of ``<tool_call>`` is held back); inside a block, the name is sent
    once ``"name": "..."`` is complete and the arguments text as it arrives, up to the
    end of its JSON value. ``llama3_json`` and ``mistral``: a reply that starts as a call
    is held and its calls are sent when it ends (``finish``); other replies stream as
    content. ``finish`` returns the rest. The calls sent equal ``parse``'s of the whole
    text; content may differ from ``parse``'s only in surrounding whitespace."""

    def __init__(self, family: str, id_prefix: str = "", names: frozenset[str] | set[str] | None = None):
        self.family = family
        self.id_prefix = id_prefix  # call i gets the id ``id_prefix + str(i)`` (random ids without one)
        # the declared tools' names (None: any): a call to another one is not a call but text,
        # as the model wrote it (the auto grammar keeps them from being written at all)
        self.names = frozenset(names) if names is not None else None
        self._foreign = False  # hermes: the open block names an undeclared tool
        self.text = ""
        self._sent = 0        # chars of self.text consumed
        self._index = -1      # current call index
        self._calls: list[ToolCall] = []
        self._in_call = False
        self._call_start = 0  # where the current block's body starts
        self._args_sent = 0   # chars of the current call's arguments sent
        self._named = False
        self._held = family in ("llama3_json", "mistral")
        self._decided = False

    @property
    def calls(self) -> list[ToolCall]:
        return self._calls

    def _declared(self, calls: list[ToolCall]) -> list[ToolCall]:
        """``calls``, or none when one of them names a tool that was not declared."""
        if self.names is not None and any(c.name not in self.names for c in calls):
            return []
        return calls

    def _name(self, call: ToolCall, i: int) -> None:
        if self.id_prefix:
            call.id = f"{self.id_prefix}{i}"

    def feed(self, delta: str) -> Delta:
        self.text += delta
        d = self._hermes_or_bare(final=False) if self.family == "hermes" else self._whole(final=False)
        return self._trim(d, final=False)

    def finish(self) -> Delta:
        d = self._hermes_or_bare(final=True) if self.family == "hermes" else self._whole(final=True)
        return self._trim(d, final=True)

    _bare: bool | None = None  # hermes: the reply may be a bare JSON call (held to the end)
    # the reply's calls are complete and the model repeats one of them (a bare call object
    # or a <tool_call> block written again identically): the rest of the generation is
    # waste; the caller may stop it (what came after the first copy is not a new call)
    complete = False

    def _hermes_or_bare(self, final: bool) -> Delta:
        """A hermes reply that starts like a bare JSON call (``_bare_calls``) is held and
        parsed whole at the end; any other streams through ``_hermes``."""
        if self._bare is None:
            self._bare = _bare_start(self.text.lstrip(), final)
            if self._bare is None:
                return Delta()
        if self._bare:
            if not final:
                if not self.complete:
                    body = self.text.strip()
                    m = re.match(r"```[ \t]*(?:json)?[ \t]*\n?", body)
                    if m:
                        body = body[m.end():]
                    self.complete = _bare_scan(body.rstrip("`").rstrip())[1]
                return Delta()
            calls = self._declared(_bare_calls(self.text))
            if not calls:  # not a call after all: the text as the tag parser sees it
                self._bare = False
                return self._hermes(final=True)
            out = Delta()
            for i, c in enumerate(calls):  # OpenAI's shape: the call's header, then its arguments
                self._name(c, i)
                self._calls.append(c)
                out.calls.append((i, c.id, c.name, ""))
                out.calls.append((i, None, None, c.arguments))
            self._sent = len(self.text)
            return out
        return self._hermes(final)

    _pending: ToolCall | None = None  # hermes: a block naming a tool already called, held to its end

    def _emit(self, call: ToolCall) -> list[tuple]:
        """A held call, sent whole: its header, then its arguments."""
        self._index += 1
        self._name(call, self._index)
        self._calls.append(call)
        return [(self._index, call.id, call.name, ""), (self._index, None, None, call.arguments)]

    _ws = ""          # content whitespace held back (it may end up around a call)
    _content_sent = False

    def _trim(self, d: Delta, final: bool) -> Delta:
        """Hold whitespace at the edges of the content: sent once more content follows;
        dropped at the end when the reply has calls (as ``parse`` strips it)."""
        text = self._ws + d.content
        core = text.rstrip()
        self._ws = text[len(core):]
        if core and not self._content_sent and self._calls:
            core = core.lstrip()
        if core:
            self._content_sent = True
        if final and self._ws and not self._calls:
            core += self._ws
            self._ws = ""
        d.content = core
        return d

    # hermes ---------------------------------------------------------------------------

    def _hermes(self, final: bool) -> Delta:
        out = Delta()
        open_tag, close_tag = "<tool_call>", "</tool_call>"
        while True:
            t = self.text
            if self.complete:  # a block repeated: what follows is the loop the stop cut short
                self._sent = len(t)
                self._in_call = False
                return out
            if not self._in_call:
                at = t.find(open_tag, self._sent)
                if at < 0:
                    # hold back a suffix that may be the start of <tool_call>
                    keep = 0 if final else _partial_suffix(t, open_tag, self._sent)
                    end = len(t) - keep
                    out.content += t[self._sent:end]
                    self._sent = end
                    return out
                out.content += t[self._sent:at]
                self._in_call = True
                self._call_start = self._sent = at + len(open_tag)
                self._named = False
                self._args_sent = 0
                continue
            body_end = t.find(close_tag, self._call_start)
            body = t[self._call_start:body_end if body_end >= 0 else len(t)]
            if not self._named:
                m = re.match(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*', body)
                if m:
                    self._named = True
                    call = ToolCall(json.loads('"' + m.group(1) + '"'), "")
                    self._args_at = self._call_start + m.end()
                    self._foreign = self.names is not None and call.name not in self.names
                    if self._foreign:
                        pass  # not a call: the block is text, sent whole at its end
                    elif any(c.name == call.name for c in self._calls):
                        self._pending = call  # held whole: it may be a copy of an earlier call
                    else:
                        self._index += 1
                        self._name(call, self._index)
                        self._calls.append(call)
                        out.calls.append((self._index, call.id, call.name, ""))
            if self._foreign:
                if body_end < 0:
                    if final:
                        out.content += open_tag + body
                        self._sent = len(t)
                        self._in_call = self._foreign = False
                    return out
                out.content += open_tag + body + close_tag
                self._foreign = self._in_call = False
                self._sent = body_end + len(close_tag)
                continue
            if self._named and self._pending is not None:
                args = _json_prefix(t[self._args_at:body_end if body_end >= 0 else len(t)])
                if args is not None:
                    self._pending.arguments = args
                if body_end < 0 and final:  # cut off: sent as far as it got, as any unfinished call
                    out.calls.extend(self._emit(self._pending))
                    self._pending = None
            elif self._named:
                call = self._calls[-1]
                args = _json_prefix(t[self._args_at:body_end if body_end >= 0 else len(t)])
                if args is not None and len(args) > self._args_sent:
                    piece = args[self._args_sent:]
                    out.calls.append((self._index, None, None, piece))
                    call.arguments += piece
                    self._args_sent = len(args)
            if body_end < 0:
                if final:
                    if not self._named:  # an unfinished block: what the model wrote is content
                        out.content += open_tag + body
                    self._sent = len(t)
                    self._in_call = False
                return out
            if not self._named:  # a block in another shape: try it whole
                call = _hermes_block(body)
                if call is not None:
                    self._index += 1
                    self._name(call, self._index)
                    self._calls.append(call)
                    out.calls.append((self._index, call.id, call.name, call.arguments))
                else:
                    out.content += open_tag + body + close_tag
            elif self._pending is not None:
                call, self._pending = self._pending, None
                full = _hermes_block(body)
                if full is not None:
                    call.arguments = full.arguments
                key = (call.name, _canonical(call.arguments))
                if any((c.name, _canonical(c.arguments)) == key for c in self._calls):
                    self.complete = True  # the same call again: the model is repeating itself; dropped
                else:
                    out.calls.extend(self._emit(call))
            else:
                call = self._calls[-1]
                full = _hermes_block(body)
                if full is not None and full.arguments.startswith(call.arguments) and full.arguments != call.arguments:
                    piece = full.arguments[len(call.arguments):]
                    out.calls.append((self._index, None, None, piece))
                    call.arguments = full.arguments
            if len(self._calls) > 1:
                last = self._calls[-1]
                key = (last.name, _canonical(last.arguments))
                if any((c.name, _canonical(c.arguments)) == key for c in self._calls[:-1]):
                    self.complete = True  # the same block again: the model is repeating itself
            self._in_call = False
            self._sent = body_end + len(close_tag)
            # the newline between blocks is not content
            while self._sent < len(t) and t[self._sent] in "\n ":
                self._sent += 1

    # llama3_json / mistral ---------------------------------------------------------------

    def _whole(self, final: bool) -> Delta:
        out = Delta()
        t = self.text
        if not self._decided:
            s = t.lstrip()
            lead = "{" if self.family == "llama3_json" else "[TOOL_CALLS]"
            alt = "<|python_tag|>" if self.family == "llama3_json" else lead
            if not s and not final:
                return out
            if s.startswith(lead) or s.startswith(alt):
                self._decided, self._held = True, True
            elif lead.startswith(s) or alt.startswith(s):
                if not final:
                    return out
                self._decided, self._held = True, False
            else:
                self._decided, self._held = True, False
        if not self._held:
            out.content = t[self._sent:]
            self._sent = len(t)
            return out
        if not final:
            return out
        content, calls = parse(t, self.family)
        calls = self._declared(calls)
        if not calls:
            out.content = t
        else:
            out.content = content
            for i, c in enumerate(calls):
                self._name(c, i)
                self._calls.append(c)
                out.calls.append((i, c.id, c.name, c.arguments))
        self._sent = len(t)
        return out



from aotx.engine.model.tool_grammar import auto_grammar, call_grammar, tool_names  # noqa: E402,F401 (re-exported)
