"""Whether a JSON schema admits any finite JSON value: a pure function.

Owns: ``no_value_reason(schema)``, the check that refuses a ``json_schema`` whose every
value would have to contain itself without end (``{"type": "object", "properties": {"a":
{"$ref": "#"}}, "required": ["a"]}``): constrained decoding would then write ``{"a": {"a":
...`` until ``max_tokens`` and return text that does not parse. A schema whose language
is empty from its first token (``{"$ref": "#"}``) is also refused by the engine when it
compiles it (``runtime/constraints.py``); this check finds the cases that only end in a
dead end later. Leaves everything else about a schema to llguidance.

It is a least fixpoint over the schema's nodes (as a grammar's productive nonterminals
are found): a node has a value when its type allows a value whose required parts
(``required`` properties, the first ``minItems`` items) all have one, and each of its
``$ref``, ``allOf`` parts and some ``anyOf`` / ``oneOf`` branch has one. It only answers
"no" when that is certain; keywords it does not read (string patterns, numeric ranges,
``not``) count as satisfiable and are left to llguidance, which reports its own errors.
"""

from __future__ import annotations

from typing import Any

_MAX_ROUNDS = 64  # each round marks at least one node; a schema of a request has far fewer


def _resolve(root: Any, ref: str) -> Any:
    """The node a local ``$ref`` ("#", "#/$defs/x") names; None for another (remote) ref."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _has_value(root: Any) -> bool:
    known: set[int] = set()  # ids of nodes found to have a value

    def ev(node: Any, busy: set[int]) -> bool:
        if node is True or not isinstance(node, dict):
            return node is not False
        k = id(node)
        if k in known:
            return True
        if k in busy:  # a cycle: what this round knows so far (the least fixpoint)
            return False
        busy.add(k)
        try:
            ok = node_ok(node, busy)
        finally:
            busy.discard(k)
        if ok:
            known.add(k)
        return ok

    def node_ok(node: dict, busy: set[int]) -> bool:
        if "$ref" in node:
            target = _resolve(root, node["$ref"])
            if target is not None and not ev(target, busy):
                return False
        for sub in node.get("allOf") or []:
            if not ev(sub, busy):
                return False
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and branches and not any(ev(b, busy) for b in branches):
                return False
        t = node.get("type")
        types = [t] if isinstance(t, str) else t if isinstance(t, list) else None
        if types is None or any(x not in ("object", "array") for x in types):
            return True  # a value of another type (a string, a number, null) satisfies it
        if "object" in types:
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            extra = node.get("additionalProperties", True)
            req = node.get("required") if isinstance(node.get("required"), list) else []
            if all(ev(props.get(r, extra), busy) for r in req if isinstance(r, str)):
                return True
        if "array" in types:
            n = node.get("minItems", 0)
            n = n if isinstance(n, int) and n > 0 else 0
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            items = node.get("items", True)
            if all(ev(prefix[i] if i < len(prefix) else items, busy) for i in range(min(n, len(prefix) + 1))):
                return True
        return False

    for _ in range(_MAX_ROUNDS):
        before = len(known)
        if ev(root, set()):
            return True
        if len(known) == before:
            return False
    return True  # undecided within the rounds: left to llguidance


def no_value_reason(schema: Any) -> str | None:
    """Why no finite JSON value satisfies ``schema`` (None when one may)."""
    if schema is False:
        return "the schema is false: no value satisfies it"
    if not isinstance(schema, dict) or _has_value(schema):
        return None
    return ("no finite JSON value satisfies the schema: every value it allows must contain another such value "
            "without end (a required property or item that refers back to the schema); give the recursion a "
            "case that ends")
