"""The protocol's shared value types: sampling parameters, constraints, attachments,
receipts and the views of messages, conversations, slots and models."""

from __future__ import annotations

from typing import Any

import msgspec


class _Base(msgspec.Struct, tag_field="type", forbid_unknown_fields=False, omit_defaults=True):
    pass


# ---- shared value types ---------------------------------------------------

UNTIL_CONTEXT = 1_000_000
"""The default ``max_tokens``: more than any context, so a reply runs until it ends by
itself or the context is full (a requested 1000-word story is ~1,300 tokens: a
512-token default cut it)."""


REPEAT_PENALTY = 1.1
"""The default repetition penalty (over the last 64 tokens). Measured on llama.cpp's
reference prompts for the default model (tests/tools/measure_repeat_penalty.py,
greedy; its docstring has the tables): without a penalty "What is the capital of
France?" loops ("la femme, la femme, ...") to the token limit in llama.cpp's greedy
reply and did in AOTX's (its first token is a near-tie: today's executor answers
instead), and 1.05 still looped; 1.1 ended it with a real answer, keeps the code
answer's start and halves a list's repeated phrasing; from 1.15 the code answer itself
changes. (Ollama's default is 1.1 too.)"""


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
    # OpenAI's penalties, as llama.cpp applies them with the repetition penalty (over the same
    # last ``repeat_last_n`` tokens): a logit loses count * frequency_penalty + presence_penalty
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = {}  # token id -> added to its logit (-100 bans it, 100 forces it)



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
CONVERSATION_ORIGINS = ("", "run", "gateway")  # CreateConversation.origin: a chat, a one-shot run, an API request
MAX_GRAMMAR_CHARS = 1 << 20
MAX_CHOICES = 16       # SubmitMessage.n
MAX_TOP_LOGPROBS = 20  # SubmitMessage.logprobs (OpenAI's limit)
MESSAGE_ROLES = ("user", "tool")  # who a SubmitMessage speaks as


CONTEXT_POLICIES = ("rolling", "middle", "stop")
"""What a conversation's prompt does once its history outgrows the context
(``runtime/context.py``): "rolling" (the default) lets the oldest turns leave the prompt
(the system prompt and the newest turns stay), "middle" keeps the first exchange too and
lets the turns after it leave, "stop" keeps everything and refuses a prompt that does not
fit (a reply then ends at the end of the context). The journal keeps every message."""


class ContextCut(msgspec.Struct, omit_defaults=True):
    """Where a reply's prompt left earlier messages out (``CONTEXT_POLICIES``): ``policy``;
    ``n_messages`` messages (``n_tokens`` tokens) left the prompt with this cut, ``n_out``
    messages of the conversation are out of it in all (the journal keeps them); ``first`` ..
    ``last`` the ids of the first and last message this cut left out, ``kept_from`` the id
    of the first message the prompt holds again after them ("": only the newest turn);
    ``during_reply``: the reply reached the end of the context and went on after the cut
    (its own text stays in the prompt)."""

    policy: str
    n_messages: int = 0
    n_out: int = 0
    n_tokens: int = 0
    first: str = ""
    last: str = ""
    kept_from: str = ""
    during_reply: bool = False


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
    context: ContextCut | None = None  # a reply whose prompt left earlier messages out
    salvaged: str = ""  # rebuilt by the journal's recovery after damage: what of it is missing


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
    origin: str = ""  # what made it ("" a chat, "run" a one-shot aotx run, "gateway" an API request)
    context: str = ""  # its context policy (CONTEXT_POLICIES; "": the engine's default)
    salvaged: str = ""  # rebuilt by the journal's recovery after damage: what of it is missing


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
    seconds since a loaded model last generated; ``n_ctx``: the context the model serves
    (a loaded one's, what ``aotx status`` shows; one not loaded: what it would serve once
    loaded in this engine, its trained context capped at the engine's; 0 when not known);
    ``busy``: its requests in flight;
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
    n_ctx: int = 0  # the context it serves (its slots' length) or would serve once loaded here; 0: not known
    tool_format: str = ""  # a loaded model's tool-call family (its chat template's; as Welcome.tool_format)
    busy: int = 0
    idle_s: float = 0.0
    error: str = ""
