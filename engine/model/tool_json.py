"""Tool calls read out of a reply's text: the JSON scanning every family's parser shares.

Owns: ``ToolCall`` (one call: its name, its arguments as the model's own JSON text, an
id), reading a call object (``_call_from``, a ``<tool_call>`` block's body:
``_hermes_block``), the exact text of a value (``_raw_value``), calls written without
the family's markup (``_bare_calls``, ``_bare_scan``, ``_bare_start``), JSON-aware
splitting (``_split_top``), and the streaming helpers (``_partial_suffix``,
``_json_prefix``). A call whose JSON does not parse is never an exception.
Leaves to others: the families, ``parse``, ``StreamParser`` and the grammars
(``tool_calls.py``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

@dataclass
class ToolCall:
    """One call: ``arguments`` is JSON text (the model's own, stripped)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict[str, Any]:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d



_DECODER = json.JSONDecoder()


def _call_from(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False) if not isinstance(args, str) else args)


def _hermes_block(body: str) -> ToolCall | None:
    """A ``<tool_call>`` block's body -> a call with the raw arguments text."""
    body = body.strip()
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    call = _call_from(obj, "arguments")
    if call is None:
        return None
    raw = _raw_value(body, "arguments")
    if raw is not None:
        call.arguments = raw
    return call


def _raw_value(body: str, key: str) -> str | None:
    """The exact text of ``key``'s value in a JSON object's text (None if not found)."""
    m = re.search(r'"%s"\s*:\s*' % re.escape(key), body)
    if not m:
        return None
    try:
        _, end = _DECODER.raw_decode(body, m.end())
    except ValueError:
        return None
    return body[m.end():end]



_FENCE = re.compile(r"```[ \t]*(?:json)?[ \t]*\n?(.*?)\n?```", re.S)


def _bare_calls(text: str) -> list[ToolCall]:
    """Calls written without the family's markup, the whole reply being one or more JSON
    objects ``{"name": ..., "arguments": {...}}`` (or ``"parameters"``), bare or in one
    ```json fence: what Qwen2.5 models sometimes write instead of ``<tool_call>`` blocks
    (llama.cpp's Hermes parser takes them too). An object without an arguments key is an
    answer, not a call (a JSON reply may well have a "name")."""
    body = text.strip()
    m = _FENCE.fullmatch(body)
    if m:
        body = m.group(1).strip()
    if not body.startswith("{"):
        return []
    calls, _ = _bare_scan(body)
    return calls


def _bare_scan(body: str) -> tuple[list[ToolCall], bool]:
    """(calls, repeated) of a reply body made of bare JSON call objects (one per line
    or run together): identical calls collapse into one (a small model may repeat its
    call until max_tokens), and a last object cut short that is the start of one
    already written is dropped (the repeat the generation was stopped in). ``repeated``:
    some call came twice (so the reply is complete). ([], False) for anything else."""
    calls: list[ToolCall] = []
    seen: set[tuple[str, str]] = set()
    texts: list[str] = []
    repeated, pos = False, 0
    while pos < len(body):
        try:
            obj, end = _DECODER.raw_decode(body, pos)
        except ValueError:
            rest = body[pos:].rstrip()
            if calls and any(t.startswith(rest) for t in texts):
                break  # a repeat cut short
            return [], False
        if not isinstance(obj, dict) or not ({"arguments", "parameters"} & obj.keys()):
            return [], False
        args_key = "arguments" if "arguments" in obj else "parameters"
        call = _call_from(obj, args_key)
        if call is None:
            return [], False
        raw = _raw_value(body[pos:end], args_key)
        if raw is not None:
            call.arguments = raw
        key = (call.name, _canonical(call.arguments))
        if key in seen:
            repeated = True
        else:
            seen.add(key)
            calls.append(call)
            texts.append(body[pos:end])
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;,":
            pos += 1
    return calls, repeated


def _canonical(args: str) -> str:
    try:
        return json.dumps(json.loads(args), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return args


def _bare_start(s: str, final: bool) -> bool | None:
    """Whether a reply starting with ``s`` (stripped) may be a bare call (held while it
    streams), None while too short to tell."""
    if s.startswith("{") or re.match(r"```[ \t]*(?:json)?[ \t]*\n?[ \t]*\{", s):
        return True
    if not final and (not s or re.fullmatch(r"`{1,3}|```[ \t]*(?:j|js|jso|json)?[ \t]*\n?[ \t]*", s)):
        return None
    return False


def _split_top(s: str, sep: str) -> list[str]:
    """Split on ``sep`` outside JSON strings and brackets."""
    parts, depth, start, in_str, esc = [], 0, 0, False, False
    for i, ch in enumerate(s):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(s[start:i].strip())
            start = i + 1
    parts.append(s[start:].strip())
    return [p for p in parts if p]



def _partial_suffix(t: str, tag: str, start: int) -> int:
    """Length of the longest suffix of ``t[start:]`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(t) - start), 0, -1):
        if t.endswith(tag[:k]):
            return k
    return 0


def _json_prefix(s: str) -> str | None:
    """The arguments text so far: from the first ``{`` or ``[`` of ``s`` (leading
    whitespace skipped) to the end of ``s`` while that value is open, or to its closing
    bracket once it closes (so the call object's own ``}`` and what follows are never
    sent). None before the value starts, or for a value that is not an object/array
    (the whole block is parsed at its end instead)."""
    i = len(s) - len(s.lstrip())
    if i >= len(s) or s[i] not in "{[":
        return None
    depth, in_str, esc = 0, False, False
    for j in range(i, len(s)):
        ch = s[j]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return s[i:j + 1]
    return s[i:]

