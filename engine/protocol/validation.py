"""Ranges and checks: every field of every operation, the same for every client.

Owns ``validate`` (the engine runs it first on every operation) and the limits the CLI
checks its flags against."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from aotx.engine.errors import RequestError
from aotx.engine.protocol.operations import (
    OPERATIONS,
    Cancel,
    CountTokens,
    CreateConversation,
    Detokenize,
    Embed,
    LoadModel,
    POOLINGS,
    PriorMessage,
    SetContextPolicy,
    SubmitMessage,
    SwitchModel,
    Tokenize,
    UnloadModel,
)
from aotx.engine.protocol.values import (
    CONSTRAINT_KINDS,
    CONTEXT_POLICIES,
    CONVERSATION_ORIGINS,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_TOP_LOGPROBS,
    MESSAGE_ROLES,
    Attachment,
    Constraint,
    SamplingParams,
)
from aotx.media.kinds import MediaKind


#: the largest integer a frame carries for a field with no upper bound of its own (MessagePack's
#: signed 64-bit range): a bigger one is out of range, named, never an overflow in the encoder
MAX_INTEGER = (1 << 63) - 1


class Limit(NamedTuple):
    """The range of one parameter: ``lo`` and ``hi`` inclusive (None: unbounded), except
    ``lo`` itself when ``lo_open``; ``integer`` for whole numbers."""

    lo: float | None
    hi: float | None
    lo_open: bool = False
    integer: bool = False


#: Each sampling parameter's range, checked the same way by the CLI (``--temperature``)
#: and by the engine for every operation of every client (``temperature``).
SAMPLING_LIMITS: dict[str, Limit] = {
    "temperature": Limit(0.0, 100.0),
    "top_k": Limit(0, None, integer=True),
    "top_p": Limit(0.0, 1.0),
    "min_p": Limit(0.0, 1.0),
    "repeat_penalty": Limit(0.0, 100.0, lo_open=True),  # 0 would divide by zero
    "repeat_last_n": Limit(-1, None, integer=True),
    "seed": Limit(0, (1 << 64) - 1, integer=True),
    "max_tokens": Limit(1, None, integer=True),
    "frequency_penalty": Limit(-2.0, 2.0),
    "presence_penalty": Limit(-2.0, 2.0),
}
#: ``SamplingParams.speculative``: "" the engine's default, "auto" prompt lookup where it
#: pays, "ngram" prompt lookup, "draft" the engine's draft model, "mtp" the model's own
#: multi-token-prediction head (a file with nextn layers), "off".
SPECULATIVE_MODES = ("", "auto", "ngram", "draft", "mtp", "off")
MAX_STOP_STRINGS = 64  # the stop checker keeps every prefix of every stop string: bound them
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 1024  # SamplingParams.logit_bias entries
LOGIT_BIAS_LIMIT = Limit(-100.0, 100.0)  # OpenAI's range of one bias
MAX_EMBED_TEXTS = 256  # Embed.texts
MAX_DETOKENIZE_IDS = 1 << 20  # Detokenize.ids


def limit_problem(name: str, value: Any, limit: Limit) -> str | None:
    """What is wrong with ``value`` for a parameter of range ``limit`` (None: nothing).
    ``name`` is how the caller's user wrote it: ``--top-p`` on the command line,
    ``top_p`` in an operation. NaN is out of every range."""
    if limit.integer:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{name} must be an integer, got {value!r}"
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name} must be a number, got {value!r}"
    lo, hi = limit.lo, limit.hi
    if limit.integer and hi is None and value > MAX_INTEGER:
        return f"{name} must be at most {MAX_INTEGER}, got {value}"
    bad = (isinstance(value, float) and math.isnan(value)) or (lo is not None and value < lo) or \
        (limit.lo_open and value == lo) or (hi is not None and value > hi)
    if not bad:
        return None
    if limit.lo_open:
        return f"{name} must be greater than {lo} and at most {hi}, got {value}"
    if hi is None:
        return f"{name} must be at least {lo}, got {value}"
    return f"{name} must be between {lo} and {hi}, got {value}"


def sampling_problem(sp: Any) -> str | None:
    """The first thing wrong with a ``SamplingParams`` (None: it is valid)."""
    if not isinstance(sp, SamplingParams):
        return f"sampling must be a SamplingParams, got {type(sp).__name__}"
    for name, limit in SAMPLING_LIMITS.items():
        v = getattr(sp, name)
        if v is None and name == "seed":
            continue
        why = limit_problem(name, v, limit)
        if why:
            return why
    if not isinstance(sp.stop, list) or not all(isinstance(x, str) for x in sp.stop):
        return "stop must be a list of strings"
    if len(sp.stop) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_CHARS for x in sp.stop):
        return (f"stop strings: at most {MAX_STOP_STRINGS} of at most {MAX_STOP_CHARS} characters each (got "
                f"{len(sp.stop)}, the longest {max(map(len, sp.stop), default=0)} characters)")
    if not isinstance(sp.logit_bias, dict) or len(sp.logit_bias) > MAX_LOGIT_BIAS:
        return f"logit_bias: at most {MAX_LOGIT_BIAS} token ids"
    for t, b in sp.logit_bias.items():
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            return f"logit_bias: {t!r} is not a token id (an integer of at least 0)"
        if (why := limit_problem(f"logit_bias[{t}]", b, LOGIT_BIAS_LIMIT)):
            return why
    if sp.speculative not in SPECULATIVE_MODES:
        return f"speculative mode {sp.speculative!r} is not available (use auto, ngram, draft, mtp or off)"
    return None



_ROLES = ("user", "assistant", "tool")


def constraint_problem(c: Any) -> str | None:
    """What is wrong with a ``Constraint``'s shape (None: nothing; whether the grammar
    compiles is the engine's to say)."""
    if not isinstance(c, Constraint):
        return f"constraint must be a Constraint, got {type(c).__name__}"
    where = c.field or "constraint"
    if c.kind not in CONSTRAINT_KINDS:
        return f"{where}: unknown grammar kind {c.kind!r} (use {', '.join(CONSTRAINT_KINDS)})"
    if not isinstance(c.grammar, str) or not c.grammar.strip():
        return f"{where}: the grammar is empty"
    if len(c.grammar) > MAX_GRAMMAR_CHARS:
        return f"{where}: a grammar of {len(c.grammar)} characters (at most {MAX_GRAMMAR_CHARS})"
    return None


def operation_problem(op: Any) -> str | None:
    """The first field of ``op`` that is out of range or of the wrong type (None: valid).
    The engine runs this on every operation of every client before it does anything,
    so a refused operation writes nothing."""
    if not isinstance(op, OPERATIONS):
        return f"unexpected message type {type(op).__name__}"
    if isinstance(op.id, bool) or not isinstance(op.id, int):
        return f"id must be an integer, got {op.id!r}"
    for name in ("conv_id", "title", "text", "msg_id", "at_msg_id", "model", "prefill"):
        v = getattr(op, name, "")
        if not isinstance(v, str):
            return f"{name} must be a string, got {type(v).__name__}"
    if getattr(op, "system_prompt", None) is not None and not isinstance(op.system_prompt, str):
        return f"system_prompt must be a string, got {type(op.system_prompt).__name__}"
    sampling = getattr(op, "sampling", None)
    if sampling is not None:
        why = sampling_problem(sampling)
        if why:
            return why
    if isinstance(op, (CreateConversation, SetContextPolicy)):
        policy = op.context if isinstance(op, CreateConversation) else op.policy
        if policy not in ("", *CONTEXT_POLICIES):
            return f"context policy {policy!r} is not one of {', '.join(CONTEXT_POLICIES)}"
    if isinstance(op, CreateConversation):
        if op.origin not in CONVERSATION_ORIGINS:
            return f"origin {op.origin!r}: one of {', '.join(repr(o) for o in CONVERSATION_ORIGINS)}"
        for m in op.messages:
            if not isinstance(m, PriorMessage) or not isinstance(m.text, str):
                return "prior messages must be PriorMessage(role, text)"
            if m.role not in _ROLES:
                return f"prior message role {m.role!r}: use user or assistant"
    elif isinstance(op, SubmitMessage):
        if not isinstance(op.raw, bool):
            return f"raw must be a boolean, got {op.raw!r}"
        if op.role not in MESSAGE_ROLES:
            return f"role {op.role!r}: a message is submitted as {' or '.join(MESSAGE_ROLES)}"
        if op.raw and (op.role != "user" or op.tools):
            return "a raw message (no chat template) has no role and no tools"
        if op.constraint is not None and (why := constraint_problem(op.constraint)):
            return why
        for name, v, lo, hi in (("logprobs", op.logprobs, -1, MAX_TOP_LOGPROBS), ("n", op.n, 1, MAX_CHOICES)):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                return f"{name} must be an integer between {lo} and {hi}, got {v!r}"
        for a in op.attachments:
            if not isinstance(a, Attachment) or not isinstance(a.path, str) or not a.path:
                return "an attachment needs the path of its file"
            if a.kind not in ("", *MediaKind):
                return f"{a.name or a.path}: unknown attachment kind {a.kind!r} (audio or image)"
    elif isinstance(op, CountTokens):
        if not op.messages:
            return "messages must hold the turn to count"
        for m in op.messages:
            if not isinstance(m, PriorMessage) or not isinstance(m.text, str) or m.role not in _ROLES:
                return "messages must be PriorMessage(role user, assistant or tool, text)"
        if op.messages[-1].role not in MESSAGE_ROLES:
            return f"the last message is the turn counted: role {' or '.join(MESSAGE_ROLES)}"
    elif isinstance(op, (LoadModel, UnloadModel, SwitchModel)):
        if not op.model.strip():
            return "model must name a model (see ListModels)"
        if isinstance(op, LoadModel) and not isinstance(op.evict_idle, bool):
            return f"evict_idle must be a boolean, got {op.evict_idle!r}"
    elif isinstance(op, Embed):
        if not isinstance(op.texts, list) or not op.texts or len(op.texts) > MAX_EMBED_TEXTS:
            return f"texts must hold 1 to {MAX_EMBED_TEXTS} texts"
        for i, t in enumerate(op.texts):
            if not isinstance(t, str) or not t:
                return f"texts[{i}] must be a non-empty string"
        if op.pooling not in POOLINGS:
            return f"pooling {op.pooling!r}: use {', '.join(POOLINGS)}"
        for name in ("normalize", "truncate"):
            if not isinstance(getattr(op, name), bool):
                return f"{name} must be a boolean, got {getattr(op, name)!r}"
    elif isinstance(op, Tokenize):
        if not isinstance(op.text, str):
            return f"text must be a string, got {type(op.text).__name__}"
        for name in ("add_special", "parse_special"):
            if not isinstance(getattr(op, name), bool):
                return f"{name} must be a boolean, got {getattr(op, name)!r}"
    elif isinstance(op, Detokenize):
        if not isinstance(op.ids, list) or len(op.ids) > MAX_DETOKENIZE_IDS:
            return f"ids must be a list of at most {MAX_DETOKENIZE_IDS:,} token ids"
        for i, t in enumerate(op.ids):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                return f"ids[{i}] must be a token id (an integer of at least 0), got {t!r}"
    elif isinstance(op, Cancel):
        if isinstance(op.target, bool) or not isinstance(op.target, int) or op.target < 0:
            return f"target must be a request id (an integer of at least 0), got {op.target!r}"
    return None


def validate(op: Any) -> None:
    """Raise ``RequestError`` (code bad_request) naming the first bad field of ``op``."""
    why = operation_problem(op)
    if why:
        raise RequestError(why)
