"""Engine -> client: replies and the events of a submitted message."""

from __future__ import annotations

from typing import Any

from aotx.engine.protocol.values import (
    BudgetLine,
    ContextCut,
    ConversationView,
    ModelInfo,
    Receipt,
    SlotView,
    _Base,
)

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
    # the ``aotx serve`` flags that start an engine like this one again (its model by absolute
    # path, its slots, context, device, ...; never its socket): a client that saw it stopped
    # starts the next one with them, not with its own
    engine_args: list[str] = []


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
    model: str = ""  # the model that writes the reply (the engine's name for it; "" from an older engine)


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
    loaded, unloaded or switched for this request) | stopping (the engine is stopping:
    for a reply in progress, its id; with id 0, to every connection just before the
    engine closes it, so a client tells a stop from a crash) | context (earlier messages
    left the prompt: ``cut`` says which, or a reply ended at the end of the context: why).
    resource names what is short (slots, context, journal, memory, media, model)."""

    id: int
    kind: str
    resource: str
    message: str
    asked: int = 0
    free: int = 0
    position: int = 0
    cut: ContextCut | None = None
    choice: int = 0


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
    context_policy: str = ""  # what a conversation without its own runs under


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


class Embeddings(_Base, tag="embeddings"):
    """Answer to ``Embed``: ``vectors`` (one list of floats per text, in order), the token
    count of each text and the ``model`` that made them (its name)."""

    id: int
    vectors: list[list[float]]
    n_tokens: list[int]
    model: str = ""


class TokenList(_Base, tag="token_list"):
    """Answer to ``Tokenize``: the ``ids`` and each one's bytes (``pieces``)."""

    id: int
    ids: list[int]
    pieces: list[bytes] = []
    model: str = ""


class Detokenized(_Base, tag="detokenized"):
    """Answer to ``Detokenize``: the ids' text (invalid UTF-8 as U+FFFD)."""

    id: int
    text: str
    model: str = ""
