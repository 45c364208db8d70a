"""The gateway's request errors and the parsing every API shares: pure functions.

Owns: ``BadRequest`` (a refusal naming the field), ``relabel`` (a chat-completions error
in another API's words), and the parsing of ``tools`` / ``tool_choice`` (``Tools``) and of
``response_format`` / ``grammar`` (a ``protocol.Constraint``; a JSON schema with no finite
value refused with the reason). Leaves the rest of a request to ``schema.py`` (which
re-exports these) and the engine's compile of a grammar to the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from aotx.engine import protocol as P
from aotx.engine.gateway.json_schemas import no_value_reason


class BadRequest(Exception):
    """A request the gateway refuses with 400 (or ``status``: 403 for a file the key may
    not read, 413 for a media part too large); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


# the key of a chat message made from another API's item (Responses' input, a Messages
# block) that holds where that item is in the request sent ("input[2]"): errors name it
AT = "_aotx_at"


def relabel(e: BadRequest, renames: tuple[tuple[str, str], ...], params: dict[str, str]) -> BadRequest:
    """``e`` in another API's terms: each (chat name, its name there) of ``renames``
    replaced in the message, the param mapped by ``params``."""
    msg = e.message
    for a, b in renames:
        msg = msg.replace(a, b)
    return BadRequest(msg, params.get(e.param, e.param), e.code, status=e.status)


def _type_name(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


def _refuse_if(cond: bool, name: str, why: str) -> None:
    if cond:
        raise BadRequest(f"'{name}' is not supported: {why}", name, "unsupported_parameter")


@dataclass(frozen=True)
class Tools:
    """What a request says about tools: the function ``tools`` (OpenAI's shape),
    ``choice`` "auto" | "none" | "required" | "function" (then ``name``), and whether
    several calls may come at once."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return bool(self.tools) and self.choice in ("required", "function")


def parse_tools(body: dict, tools_field: str = "tools", choice_field: str = "tool_choice") -> Tools:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of a chat body. Raises BadRequest."""
    _refuse_if(body.get("functions") not in (None, []), "functions",
               "the deprecated 'functions' form; send 'tools' with {\"type\": \"function\", \"function\": ...}")
    raw = body.get(tools_field)
    tools: list[dict[str, Any]] = []
    if raw is not None:
        if not isinstance(raw, list):
            raise BadRequest(f"'{tools_field}' must be an array, got {_type_name(raw)}", tools_field)
        for i, t in enumerate(raw):
            if not isinstance(t, dict) or t.get("type", "function") != "function":
                raise BadRequest(f"'{tools_field}[{i}]' must be a function tool ({{\"type\": \"function\", "
                                 f"\"function\": {{...}}}})", tools_field)
            fn = t.get("function", t if "name" in t else None)
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise BadRequest(f"'{tools_field}[{i}].function.name' must be a non-empty string", tools_field)
            params = fn.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise BadRequest(f"'{tools_field}[{i}].function.parameters' must be a JSON schema object", tools_field)
            clean = {"name": fn["name"]}
            if isinstance(fn.get("description"), str):
                clean["description"] = fn["description"]
            clean["parameters"] = params if params is not None else {"type": "object", "properties": {}}
            tools.append({"type": "function", "function": clean})
        names = [t["function"]["name"] for t in tools]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise BadRequest(f"'{tools_field}': the name {sorted(dup)[0]!r} is given twice", tools_field)
    tc = body.get(choice_field)
    choice, name = "auto", None
    if tc is None:
        choice = "auto" if tools else "none"
    elif isinstance(tc, str):
        if tc not in ("auto", "none", "required"):
            raise BadRequest(f"'{choice_field}' must be auto, none, required or a function, got {tc!r}", choice_field)
        choice = tc
    elif isinstance(tc, dict):
        fn = tc.get("function") if isinstance(tc.get("function"), dict) else tc
        name = fn.get("name")
        if not isinstance(name, str):
            raise BadRequest(f"'{choice_field}' names no function ({{\"type\": \"function\", \"function\": "
                             f"{{\"name\": ...}}}})", choice_field)
        choice = "function"
    else:
        raise BadRequest(f"'{choice_field}' must be a string or an object, got {_type_name(tc)}", choice_field)
    if choice in ("required", "function") and not tools:
        raise BadRequest(f"'{choice_field}' is {choice!r} but the request has no tools", choice_field)
    if choice == "function" and name not in [t["function"]["name"] for t in tools]:
        raise BadRequest(f"'{choice_field}' names the function {name!r}, which is not in '{tools_field}' "
                         f"({', '.join(t['function']['name'] for t in tools)})", choice_field, "unknown_tool")
    par = body.get("parallel_tool_calls", True)
    if not isinstance(par, bool):
        raise BadRequest(f"'parallel_tool_calls' must be a boolean, got {_type_name(par)}", "parallel_tool_calls")
    return Tools(tools, choice, name, par)


def parse_constraint(body: dict) -> P.Constraint | None:
    """The constraint of ``response_format`` or ``grammar`` (at most one). Raises BadRequest."""
    out: list[P.Constraint] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise BadRequest(f"'response_format' must be an object, got {_type_name(rf)}", "response_format")
        kind = rf.get("type")
        if kind == "json_object":
            out.append(P.Constraint(kind="json_schema", grammar='{"type": "object"}', field="response_format"))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise BadRequest("'response_format.json_schema' must be an object with a 'schema'", "response_format")
            schema = js.get("schema", {})
            if not isinstance(schema, (dict, bool)):
                raise BadRequest("'response_format.json_schema.schema' must be a JSON schema object",
                                 "response_format")
            if (why := no_value_reason(schema)) is not None:
                raise BadRequest(f"'response_format.json_schema.schema': {why}", "response_format", "invalid_schema")
            out.append(P.Constraint(kind="json_schema", grammar=json.dumps(schema),
                                    field="response_format.json_schema.schema"))
        elif kind not in ("text", None):
            raise BadRequest(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                             "response_format")
    g = body.get("grammar")
    if g is not None:
        if isinstance(g, str):
            g = {"type": "gbnf", "grammar": g}
        if not isinstance(g, dict):
            raise BadRequest(f"'grammar' must be a GBNF string or an object, got {_type_name(g)}", "grammar")
        kind = g.get("type", g.get("syntax", "gbnf"))
        text = g.get("grammar", g.get("value"))
        if kind not in ("lark", "gbnf", "regex"):
            raise BadRequest(f"'grammar.type' must be lark, gbnf or regex, got {kind!r}", "grammar")
        if not isinstance(text, str) or not text.strip():
            raise BadRequest("'grammar.grammar' must be the grammar's text", "grammar")
        out.append(P.Constraint(kind=kind, grammar=text, field="grammar"))
    if len(out) > 1:
        raise BadRequest("'response_format' and 'grammar' are two constraints; send one", "grammar")
    c = out[0] if out else None
    if c is not None and (why := P.constraint_problem(c)):
        raise BadRequest(why, c.field.split(".")[0])
    return c
