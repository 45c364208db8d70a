"""Grammars of tool calls in a model's own format: forced, or held to the declared tools.

Owns two llguidance Lark grammars per tool-call family (``tool_calls.FAMILIES``), each
call's JSON held to its tool's ``parameters`` schema (``%json``, with the separators
models write: ``{"a": 1, "b": 2}``):

* ``call_grammar``: the reply is a call (``tool_choice`` "required" or a named function);
* ``auto_grammar``: ``tool_choice`` "auto", a lazy grammar as llama.cpp's and
  llguidance's (free text until the model opens a call, then only a declared tool's name
  and arguments valid against its schema): for ``hermes``, text that does not hold
  ``<tool_call>``, or text up to the first ``<tool_call>`` (a lazy lexeme) followed by
  calls; a reply that starts as a bare JSON call (``{"name": ...}``, fenced or not: what
  Qwen2.5 models write at times, which ``tool_calls.parse`` takes) must be calls to the
  declared tools too; ``llama3_json``, whose calls are the whole reply, text that does not
  start with ``{``, or calls; ``mistral``, text up to ``[TOOL_CALLS]``, then the call list.

So an undeclared name or arguments that do not fit the schema cannot be written. The
grammars end with the calls: the model's end-of-generation token follows them. Leaves
parsing to ``tool_calls.py`` and compiling to the runtime (``constraints.py``).
"""

from __future__ import annotations

import json
from typing import Any

#: how models write JSON (llguidance's JSON options for every call's schema)
_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    """The ``function`` object of an OpenAI tool (or the tool itself, flat forms)."""
    f = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    return f


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    """The declared tools' names, in order."""
    return [str(_function(t).get("name", "")) for t in tools]


def _calls(tools: list[dict[str, Any]], family: str, name: str | None) -> tuple[list[str], str]:
    """(the ``call_i`` rules, "call_0 | call_1 | ...") of the tools (only ``name`` when given)."""
    fns = [_function(t) for t in tools]
    if name is not None:
        fns = [f for f in fns if f.get("name") == name]
    args_key = "parameters" if family == "llama3_json" else "arguments"
    rules = []
    for i, f in enumerate(fns):
        params = f.get("parameters") or {"type": "object"}
        schema = {"type": "object", "properties": {"name": {"const": f["name"]}, args_key: params},
                  "required": ["name", args_key], "additionalProperties": False, "x-guidance": _JSON}
        rules.append(f"call_{i}: %json " + json.dumps(schema, ensure_ascii=False))
    return rules, " | ".join(f"call_{i}" for i in range(len(fns)))


def call_grammar(tools: list[dict[str, Any]], family: str, *, name: str | None = None,
                 parallel: bool = True) -> str:
    """An llguidance Lark grammar for a reply that is one call (``parallel``: one or
    more) in ``family``'s format, to ``name`` or to any of ``tools``; each call's JSON
    is held to its tool's ``parameters`` schema (``%json``)."""
    rules, one = _calls(tools, family, name)
    if family == "hermes":
        block = f'"<tool_call>\\n" ({one}) "\\n</tool_call>"'
        start = "start: block (\"\\n\" block)*" if parallel else "start: block"
        return "\n".join([start, f"block: {block}", *rules])
    if family == "llama3_json":
        start = f"start: ({one}) (\"; \" ({one}))*" if parallel else f"start: {one}"
        return "\n".join([start, *rules])
    if family == "mistral":
        start = (f'start: "[TOOL_CALLS][" ({one}) (", " ({one}))* "]"' if parallel
                 else f'start: "[TOOL_CALLS][" ({one}) "]"')
        return "\n".join([start, *rules])
    raise ValueError(f"unknown tool-call family {family!r}")


def auto_grammar(tools: list[dict[str, Any]], family: str, *, parallel: bool = True) -> str:
    """The lazy grammar of ``tool_choice`` "auto" (see the module docstring): free text,
    or calls in ``family``'s format to the declared ``tools`` only."""
    rules, one = _calls(tools, family, None)

    def more(sep: str) -> str:  # the calls after the first one (none unless ``parallel``)
        return f"({sep} ({one}))*" if parallel else ""

    if family == "hermes":
        bare_start = r"[ \t\r\n]*(\{|```[ \t]*(json)?[ \t]*\n?[ \t]*\{)"
        return "\n".join([
            "start: TEXT | pre block_rest | bare",
            f'block_rest: ({one}) "\\n</tool_call>" ' + (f'("\\n<tool_call>\\n" ({one}) "\\n</tool_call>")*'
                                                         if parallel else ""),
            # a bare call: one or more call objects, in one ```json fence or none
            "bare: SEP? (FENCE bare_calls FENCE_END | bare_calls)",
            f"bare_calls: ({one}) {more('SEP')}",
            'FENCE: /```[ \\t]*(json)?[ \\t]*\\n?/',
            'FENCE_END: /\\n?```/',
            r'SEP: /[ \t\r\n;,]+/',
            # free text: never holds <tool_call> and never starts like a bare call
            f"TEXT: /(.|\\n)*/ & ~/((.|\\n)*<tool_call>(.|\\n)*)|({bare_start}(.|\\n)*)/",
            # the text before the first call, ending with its opening tag (lazy: the first one)
            f"pre[lazy]: /(.|\\n)*<tool_call>\\n/ & ~/{bare_start}(.|\\n)*/",
            *rules])
    if family == "llama3_json":
        return "\n".join([
            f"start: TEXT | ({one}) {more(json.dumps('; '))}",
            r"TEXT: /(.|\n)*/ & ~/[ \t\r\n]*\{(.|\n)*/",
            *rules])
    if family == "mistral":
        return "\n".join([
            f"start: TEXT | pre \"[\" ({one}) {more(json.dumps(', '))} \"]\"",
            r"TEXT: /(.|\n)*/ & ~/(.|\n)*\[TOOL_CALLS\](.|\n)*/",
            "pre[lazy]: /(.|\\n)*\\[TOOL_CALLS\\]/",
            *rules])
    raise ValueError(f"unknown tool-call family {family!r}")
