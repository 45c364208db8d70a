"""The client protocol: typed, versioned frames between clients and the engine.

Owns: the message schema (msgspec Structs, a tagged union) and the framing.
Leaves to others: sockets (``server.py``, ``client.py``) and meaning (runtime).

Framing: every frame is a 4-byte big-endian unsigned payload length followed by
that many bytes of MessagePack encoding one ``Message``. Frames above
``MAX_FRAME`` bytes are refused before any allocation. A connection opens with
``Hello`` from the client, answered by ``Welcome`` or an ``Error`` with code
``version_mismatch``. Every request carries an ``id`` chosen by the client; every
reply and event for it carries the same ``id`` (``req``), so one connection can
run many requests at once.

The events of one submitted message, in order: ``Accepted`` (it has a sequence
number), ``Durable`` (the user's message is on disk), then ``Token`` deltas,
``Notice`` (held / queued / refused, with the numbers), ``Durable`` receipts as
the reply's tokens reach disk, ``Committed`` (finished, with the reason), and a
last ``Durable`` covering the finish record.
"""

from __future__ import annotations

import math
import struct
from typing import Any, NamedTuple, Union

import msgspec

from aotx.engine.errors import ErrorCode, ProtocolError, RequestError  # noqa: F401 (ErrorCode re-exported)
from aotx.media.kinds import MediaKind

PROTOCOL_VERSION = 1
MAX_FRAME = 16 << 20  # bytes
_LEN = struct.Struct(">I")


class _Base(msgspec.Struct, tag_field="type", forbid_unknown_fields=False, omit_defaults=True):
    pass


# ---- shared value types ---------------------------------------------------

UNTIL_CONTEXT = 1_000_000
"""The default ``max_tokens``: more than any context, so a reply runs until it ends by
itself or the context is full (a requested 1000-word story is ~1,300 tokens: a
512-token default cut it; issue 17, point 15)."""


REPEAT_PENALTY = 1.1
"""The default repetition penalty (over the last 64 tokens). Measured on llama.cpp's
reference prompts for the default model (tests/tools/measure_repeat_penalty.py,
greedy; its docstring has the tables): without a penalty "What is the capital of
France?" loops ("la femme, la femme, ...") to the token limit in llama.cpp's greedy
reply and did in AOTX's (its first token is a near-tie: today's executor answers
instead), and 1.05 still looped; 1.1 ended it with a real answer, keeps the code
answer's start and halves a list's repeated phrasing; from 1.15 the code answer itself
changes. (Ollama's default is 1.1 too.) Issue 17, point 15."""


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """Sampling of one reply: the one definition of the parameters and their defaults
    (the CLI's flags, the gateway, the app and the engine's sampler take them from here;
    ``SAMPLING_LIMITS`` gives each one's range). temperature 0 means greedy; top_k 0,
    top_p 1 and min_p 0 disable those filters; repeat_penalty 1 disables it over the
    last ``repeat_last_n`` tokens (0: none, -1: all); seed None picks one; ``max_tokens``
    at its default (``UNTIL_CONTEXT``) leaves the context as the limit."""

    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = REPEAT_PENALTY
    repeat_last_n: int = 64
    seed: int | None = None
    max_tokens: int = UNTIL_CONTEXT
    stop: list[str] = []
    speculative: str = ""  # "" = the engine's default; SPECULATIVE_MODES


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
}
#: ``SamplingParams.speculative``: "" the engine's default, "auto" prompt lookup where it
#: pays, "ngram" prompt lookup, "draft" the engine's draft model, "off".
SPECULATIVE_MODES = ("", "auto", "ngram", "draft", "off")
MAX_STOP_STRINGS = 64  # the stop checker keeps every prefix of every stop string: bound them
MAX_STOP_CHARS = 1024


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
    if sp.speculative not in SPECULATIVE_MODES:
        return f"speculative mode {sp.speculative!r} is not available (use auto, ngram, draft or off)"
    return None


class Constraint(msgspec.Struct, omit_defaults=True):
    """Constrained decoding of one reply (``runtime/constraints.py``, llguidance): every
    token is drawn from those the grammar allows next. ``kind``: "json_schema" (``grammar``
    is the schema as JSON text), "lark" (llguidance's Lark dialect, ``%json`` included),
    "gbnf" (llama.cpp's GBNF) or "regex". ``field`` is the client's name for it (e.g.
    ``response_format.json_schema.schema``): the engine's refusal of a grammar it cannot
    compile starts with it."""

    kind: str
    grammar: str
    field: str = ""


CONSTRAINT_KINDS = ("json_schema", "lark", "gbnf", "regex")
MAX_GRAMMAR_CHARS = 1 << 20
MAX_CHOICES = 16       # SubmitMessage.n
MAX_TOP_LOGPROBS = 20  # SubmitMessage.logprobs (OpenAI's limit)
MESSAGE_ROLES = ("user", "tool")  # who a SubmitMessage speaks as


class Attachment(msgspec.Struct, omit_defaults=True):
    """A file attached to a message, referenced by content hash (sha256 hex)."""

    path: str
    kind: str  # MediaKind: "image" | "audio"
    sha256: str = ""
    name: str = ""


class Receipt(msgspec.Struct):
    """Where a record became durable: segment number, byte offset after the
    covering block, and the last sequence number the fsync covered."""

    segment: int
    offset: int
    last_seq: int


class MessageView(msgspec.Struct, omit_defaults=True):
    """One message of a conversation as clients see it.

    status: accepted | streaming | complete | interrupted | cancelled | failed.
    ``model``: the model that wrote a reply ("" in journals older than several models)."""

    msg_id: str
    role: str
    text: str = ""  # a reply before its first visible text has none (the table omits it then)
    status: str = "complete"
    token_ids: list[int] = []
    start_pos: int = 0
    finish_reason: str | None = None
    attachments: list[Attachment] = []
    receipt: Receipt | None = None
    seq: int = 0
    model: str = ""
    meta: dict[str, Any] = {}  # as PriorMessage.meta (the template's fields and clients' notes)


class ConversationView(msgspec.Struct, omit_defaults=True):
    """``model``: the model the conversation's next reply runs on ("": the engine's default)."""

    conv_id: str
    title: str = ""  # renamed to "": the table omits it then
    created_at: float = 0.0
    updated_at: float = 0.0
    n_messages: int = 0
    system_prompt: str | None = None
    sampling: SamplingParams | None = None
    messages: list[MessageView] = []
    busy: bool = False
    model: str = ""


class BudgetLine(msgspec.Struct):
    """One term of the resource budget, in bytes."""

    name: str
    bytes: int


class SlotView(msgspec.Struct, omit_defaults=True):
    slot: int
    conv_id: str | None = None
    state: str = "free"  # free | prefill | decode
    position: int = 0
    model: str = ""  # the loaded model whose slot it is


class ModelInfo(msgspec.Struct, omit_defaults=True):
    """One model the engine can run: an installed GGUF file or a remote endpoint.

    kind: "gguf" | "remote"; ``quant``: the file's tensor type (llama.cpp's file type
    name, e.g. Q4_K_M); ``n_ctx_train``: its trained context (tokens); ``needs_bytes``:
    the memory it takes at the engine's slots and context (accounted when loaded,
    estimated from the file's header otherwise; 0 for a remote one); ``idle_s``:
    seconds since a loaded model last generated; ``n_ctx``: the context a loaded model
    serves (what ``aotx status`` shows); ``busy``: its requests in flight;
    ``error``: why the file cannot be used ("" when it can)."""

    name: str
    kind: str = "gguf"
    path: str = ""
    url: str = ""
    size_bytes: int = 0
    arch: str = ""
    quant: str = ""
    n_ctx_train: int = 0
    loaded: bool = False
    default: bool = False
    needs_bytes: int = 0
    n_ctx: int = 0  # the context a loaded model serves (its slots' length); 0 when not loaded
    tool_format: str = ""  # a loaded model's tool-call family (its chat template's; as Welcome.tool_format)
    busy: int = 0
    idle_s: float = 0.0
    error: str = ""


# ---- client -> engine ------------------------------------------------------

class Hello(_Base, tag="hello"):
    protocol: int
    client: str = ""


class PriorMessage(msgspec.Struct, omit_defaults=True):
    """An earlier turn stored with a new conversation without generating (role
    "user", "assistant" or "tool"), e.g. the history of an OpenAI-style request.
    ``meta``: the message's fields for the chat template beside its text: an
    assistant's ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
    "arguments"}}]``), a tool result's ``tool_call_id`` and ``name``."""

    role: str
    text: str
    meta: dict[str, Any] = {}


CLIENT_META_PREFIX = "aotx_"
"""A ``meta`` key with this prefix is a client's own note on the message (the gateway's
``aotx_previous_response_id``): journaled and shown with the message (``MessageView.meta``),
never given to the chat template."""


def template_fields(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` without the clients' own notes (``CLIENT_META_PREFIX``): the chat template's fields."""
    if not any(k.startswith(CLIENT_META_PREFIX) for k in meta):
        return meta
    return {k: v for k, v in meta.items() if not k.startswith(CLIENT_META_PREFIX)}


class CreateConversation(_Base, tag="create"):
    """A new conversation; ``model`` names the model it runs on ("": the engine's default)."""

    id: int
    title: str = ""
    system_prompt: str | None = None
    sampling: SamplingParams | None = None
    messages: list[PriorMessage] = []
    model: str = ""


class ListConversations(_Base, tag="list"):
    id: int


class ShowConversation(_Base, tag="show"):
    id: int
    conv_id: str


class SubmitMessage(_Base, tag="submit"):
    """A user's message. ``model``: run the reply on this model, switching the
    conversation to it when it is another ("": the conversation's model)."""

    id: int
    conv_id: str
    text: str
    attachments: list[Attachment] = []
    sampling: SamplingParams | None = None
    raw: bool = False  # no chat template: the text is the prompt
    model: str = ""
    # -- the gateway's fields (a client that sends none gets the plain chat turn) --
    role: str = "user"  # MESSAGE_ROLES: "tool" for a tool's result fed back
    meta: dict[str, Any] = {}  # as PriorMessage.meta (a tool result: tool_call_id, name)
    tools: list[dict[str, Any]] = []  # function tools, given to the chat template as ``tools``
    constraint: Constraint | None = None  # the reply follows this grammar (constrained decoding)
    logprobs: int = -1  # -1: none; k >= 0: each Token carries its logprob and the top k
    n: int = 1  # choices: the prompt is prefilled once, then forked (choice i in its own conversation)
    strict_media: bool = False  # kept for old clients: an attachment that cannot be used refuses every message now
    # a continuation of one reply: refused (busy, nothing written) unless the conversation's last
    # message is ``after`` when the message is taken (another turn landed meanwhile: fork instead)
    after: str = ""
    # the reply continues this assistant text (a prefill): the prompt ends inside an assistant
    # turn opened with it (``encode_chat(continue_final=True)``); the reply holds the continuation
    # only, and the journal does not keep the prefill (a later turn's history lacks it)
    prefill: str = ""


class CountTokens(_Base, tag="count_tokens"):
    """How many tokens a chat turn's prompt is, as ``model``'s chat template renders it
    ("": the engine's default; loaded when it is not), storing and running nothing: the
    prompt a ``SubmitMessage`` of the last of ``messages`` (role user or tool) with these
    ``tools`` and ``prefill`` would get on a conversation holding the others and
    ``system_prompt``. Answered with ``TokenCount``."""

    id: int
    messages: list[PriorMessage] = []
    system_prompt: str | None = None
    tools: list[dict[str, Any]] = []
    prefill: str = ""
    model: str = ""


class Cancel(_Base, tag="cancel"):
    """Cancel the generation started by request ``target`` (or the one running in ``conv_id``)."""

    id: int
    target: int = 0
    conv_id: str = ""


class DeleteConversation(_Base, tag="delete"):
    id: int
    conv_id: str


class RenameConversation(_Base, tag="rename"):
    id: int
    conv_id: str
    title: str


class UpdateConversation(_Base, tag="update"):
    """Set a conversation's system prompt and default sampling."""

    id: int
    conv_id: str
    system_prompt: str | None = None
    sampling: SamplingParams | None = None


class TruncateConversation(_Base, tag="truncate"):
    """Drop messages from ``msg_id`` on (edit, retry)."""

    id: int
    conv_id: str
    msg_id: str


class ForkConversation(_Base, tag="fork"):
    """A new conversation with the messages of ``conv_id`` up to and including
    ``at_msg_id`` (all when empty); its next turn reuses the parent's state."""

    id: int
    conv_id: str
    at_msg_id: str = ""


class Status(_Base, tag="status"):
    id: int


class ListModels(_Base, tag="list_models"):
    """Every model the engine can run (installed files, remote endpoints) and which are loaded."""

    id: int


class LoadModel(_Base, tag="load_model"):
    """Load ``model`` beside the others. ``evict_idle``: unload least recently used idle
    models when it would not fit otherwise (else a refusal with the numbers)."""

    id: int
    model: str
    evict_idle: bool = False


class UnloadModel(_Base, tag="unload_model"):
    """Unload ``model`` (refused while it generates); its conversations keep it as their
    model and load it again on their next message."""

    id: int
    model: str


class SwitchModel(_Base, tag="switch_model"):
    """Run conversation ``conv_id`` on ``model`` from its next message on (the history is
    kept: the new model prefills it). Answered by ``ConversationInfo``."""

    id: int
    conv_id: str
    model: str


# ---- engine -> client ------------------------------------------------------

class Welcome(_Base, tag="welcome"):
    protocol: int
    engine: str
    model: str
    device: str
    ready: bool = True
    pid: int = 0
    journal: bool = True  # False: no Durable receipts will come (journal off)
    draft_model: str = ""  # the draft model's name ("" without one)
    # how the model writes tool calls (``model/tool_calls.FAMILIES``: its chat template's
    # family); "" from an engine that does not say (the gateway assumes "hermes")
    tool_format: str = ""
    models: list[str] = []  # every loaded model (``model`` is the default one)
    # what the engine said at startup that changes what the user asked for (a --context past
    # the model's, a --memory-budget past the machine's, ...): a client that started the
    # engine prints them, since the engine's own log is out of sight
    notices: list[str] = []


class Error(_Base, tag="error"):
    """A refused or failed request. ``code``: an ``errors.ErrorCode``."""

    id: int
    code: str
    message: str


class Ok(_Base, tag="ok"):
    id: int


class ConversationInfo(_Base, tag="conversation"):
    id: int
    conversation: ConversationView


class ConversationList(_Base, tag="conversations"):
    id: int
    conversations: list[ConversationView]


class Accepted(_Base, tag="accepted"):
    """The message is admitted: ``msg_id`` of the user's message, ``reply_id`` of the reply."""

    id: int
    conv_id: str
    msg_id: str
    reply_id: str
    seq: int
    tick: int
    prompt_ids: list[int] = []
    n_reused: int = 0
    choice: int = 0  # which of the request's n choices (each has its own conversation)


class Token(_Base, tag="token"):
    """A committed token of the reply: ``text`` is the safe-to-show delta (may be empty
    while a multi-byte character or a possible stop string is held back). With
    ``SubmitMessage.logprobs`` >= 0: ``logprob`` of the token under the model (the log
    softmax of its raw logits, before sampling filters and constraints), ``piece`` its
    bytes, and ``top``, the ``logprobs`` most likely ids as (id, logprob, bytes). ``end``:
    the token is the end-of-generation token that ended the reply (it has no text of its
    own; ``text`` may still carry text held back until then)."""

    id: int
    token_id: int
    text: str
    pos: int
    tick: int
    seq: int
    choice: int = 0
    logprob: float | None = None
    piece: bytes = b""
    top: list[tuple[int, float, bytes]] = []
    end: bool = False


class Notice(_Base, tag="notice"):
    """Admission feedback. kind: held | queued | refused | resumed | model (a model was
    loaded, unloaded or switched for this request).
    resource names what is short (slots, context, journal, memory, media, model)."""

    id: int
    kind: str
    resource: str
    message: str
    asked: int = 0
    free: int = 0
    position: int = 0


class MediaInfo(_Base, tag="media"):
    """What an attachment became before the model saw it: ``route`` "specialist"
    (a transcript or OCR text, in ``text``) or "encoder"; ``error`` when it was refused
    (the rest of the message is kept)."""

    id: int
    kind: str
    route: str
    name: str
    text: str = ""
    via: str = ""
    seconds: float = 0.0
    error: str = ""


class Committed(_Base, tag="committed"):
    """The reply finished. finish_reason: stop | length | context | cancelled | error |
    interrupted (a remote model's stream was dropped midway: what arrived is kept).
    numerics: the arithmetic that produced the tokens ("cpu-int8", "cpu-f32", "cuda-f32";
    "remote" for a remote model's): a backend's results are batch-invariant, but two
    backends need not agree bit for bit. stop: the stop string that ended the reply
    (finish_reason "stop"; "" when the model ended it or for any other reason)."""

    id: int
    msg_id: str
    finish_reason: str
    n_prompt: int
    n_completion: int
    tick: int
    seq: int
    text: str = ""
    timings: dict[str, float] = {}
    choice: int = 0
    numerics: str = ""
    stop: str = ""


class Durable(_Base, tag="durable"):
    """Records up to ``receipt.last_seq`` are on disk. ``msg_id`` names the message it
    completes durability for, when it does."""

    id: int
    receipt: Receipt
    msg_id: str = ""
    choice: int = 0


class StatusReply(_Base, tag="status_reply"):
    id: int
    model: str
    device: str
    ready: bool
    budget_bytes: int
    used_bytes: int
    budget: list[BudgetLine]
    slots: list[SlotView]
    n_ctx: int
    queue: int = 0
    tick: int = 0
    journal: dict[str, Any] = {}
    load_progress: str = ""
    profile: dict[str, float] = {}
    notes: dict[str, str] = {}          # startup notes (the CUDA kernel choice: where it came from, why)
    fingerprint: str = ""
    model_path: str = ""
    stats: dict[str, float] = {}
    capsules: dict[str, int] = {}
    draft_model: str = ""  # the draft model's name ("" without one)
    draft_model_path: str = ""
    # "" normally; while the engine holds new work because the journal's disk is full, a
    # line naming the disk, the bytes needed and the bytes free (it clears by itself)
    degraded: str = ""
    notices: list[str] = []  # engine-wide notices for users (journal damage salvaged at start)
    models: list[ModelInfo] = []  # the loaded models (``model`` is the default one)
    # what the engine was started with (0 / "": an engine that does not say); a client
    # that passes other engine flags to a running engine says they do not apply
    n_slots: int = 0
    kv_type: str = ""


class ModelList(_Base, tag="models"):
    """Answer to ``ListModels``: every model, the budget and the models folder."""

    id: int
    models: list[ModelInfo]
    budget_bytes: int = 0
    used_bytes: int = 0
    models_dir: str = ""


class TokenCount(_Base, tag="token_count"):
    """Answer to ``CountTokens``: the prompt's ``n_tokens`` on ``model``."""

    id: int
    n_tokens: int
    model: str = ""


class ModelLoaded(_Base, tag="model_loaded"):
    """Answer to ``LoadModel``: the model is loaded (``unloaded``: idle models evicted for it)."""

    id: int
    model: ModelInfo
    unloaded: list[str] = []
    already: bool = False


Message = Union[
    Hello, CreateConversation, ListConversations, ShowConversation, SubmitMessage, Cancel,
    DeleteConversation, RenameConversation, UpdateConversation, TruncateConversation, ForkConversation, Status,
    ListModels, LoadModel, UnloadModel, SwitchModel, CountTokens,
    Welcome, Error, Ok, ConversationInfo, ConversationList, Accepted, Token, Notice, MediaInfo, Committed,
    Durable, StatusReply, ModelList, ModelLoaded, TokenCount,
]

#: The operations a client asks the engine to run (everything but the handshake).
Operation = Union[
    CreateConversation, ListConversations, ShowConversation, SubmitMessage, Cancel, DeleteConversation,
    RenameConversation, UpdateConversation, TruncateConversation, ForkConversation, Status,
    ListModels, LoadModel, UnloadModel, SwitchModel, CountTokens,
]
OPERATIONS: tuple[type, ...] = Operation.__args__

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
    if isinstance(op, CreateConversation):
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
    elif isinstance(op, Cancel):
        if isinstance(op.target, bool) or not isinstance(op.target, int) or op.target < 0:
            return f"target must be a request id (an integer of at least 0), got {op.target!r}"
    return None


def validate(op: Any) -> None:
    """Raise ``RequestError`` (code bad_request) naming the first bad field of ``op``."""
    why = operation_problem(op)
    if why:
        raise RequestError(why)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode_frame(msg: Message) -> bytes:
    """Length-prefixed MessagePack frame of ``msg``."""
    body = _encoder.encode(msg)
    return _LEN.pack(len(body)) + body


def decode_payload(body: bytes) -> Message:
    """Decode one frame's payload. Raises ``ProtocolError`` naming what is wrong."""
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"invalid message: {e}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"undecodable frame: {e}") from None


def frame_length(header: bytes) -> int:
    """Payload length from a 4-byte header. Raises ``ProtocolError`` when above MAX_FRAME."""
    (n,) = _LEN.unpack(header)
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes exceeds the limit of {MAX_FRAME} bytes")
    return n
