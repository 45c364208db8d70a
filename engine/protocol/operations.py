"""Client -> engine: the operations a client submits (a tagged union)."""

from __future__ import annotations

from typing import Any, Union

import msgspec
from aotx.engine.protocol.values import Attachment, Constraint, SamplingParams, _Base

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
    """A new conversation; ``model`` names the model it runs on ("": the engine's default);
    ``origin`` what made it (``CONVERSATION_ORIGINS``: "" a chat, "run" a one-shot ``aotx
    run "..."``, "gateway" an API request): a client's list may group or hide one-shots."""

    id: int
    title: str = ""
    system_prompt: str | None = None
    sampling: SamplingParams | None = None
    messages: list[PriorMessage] = []
    model: str = ""
    origin: str = ""
    context: str = ""  # its context policy (values.CONTEXT_POLICIES; "": the engine's default)


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


class SetContextPolicy(_Base, tag="context_policy"):
    """Set conversation ``conv_id``'s context policy (``values.CONTEXT_POLICIES``; "": the
    engine's default) from its next message on. Answered by ``ConversationInfo``."""

    id: int
    conv_id: str
    policy: str


class SwitchModel(_Base, tag="switch_model"):
    """Run conversation ``conv_id`` on ``model`` from its next message on (the history is
    kept: the new model prefills it). Answered by ``ConversationInfo``."""

    id: int
    conv_id: str
    model: str



POOLINGS = ("mean", "last", "cls")  # Embed.pooling: llama.cpp's pooling types, by the same names


class Embed(_Base, tag="embed"):
    """One embedding vector per text of ``texts`` from ``model``'s last hidden state (after
    its output norm; "": the engine's default model, loaded when it is not), pooled over the
    text's tokens as llama.cpp's ``--pooling`` does: "mean" (every token), "last" (the last
    token) or "cls" (the first); ``normalize``: divided by its L2 norm. The text is tokenized
    with the model's BOS/EOS (``add_special``), special-token text kept plain. Nothing is
    stored. Answered with ``Embeddings``."""

    id: int
    texts: list[str]
    model: str = ""
    pooling: str = "mean"
    normalize: bool = True
    truncate: bool = False  # a text past the context: cut to it (else refused, naming it)


class Tokenize(_Base, tag="tokenize"):
    """``text`` as ``model``'s token ids ("": the default model): ``add_special`` adds BOS/EOS
    as the model's metadata says, ``parse_special`` reads special-token text (``<|im_end|>``)
    as its one id. Answered with ``TokenList`` (each id with its bytes)."""

    id: int
    text: str
    model: str = ""
    add_special: bool = False
    parse_special: bool = False


class Detokenize(_Base, tag="detokenize"):
    """The text of ``ids`` on ``model`` ("": the default model). Answered with ``Detokenized``."""

    id: int
    ids: list[int]
    model: str = ""


#: The operations a client asks the engine to run (everything but the handshake).
Operation = Union[
    CreateConversation, ListConversations, ShowConversation, SubmitMessage, Cancel, DeleteConversation,
    RenameConversation, UpdateConversation, TruncateConversation, ForkConversation, Status,
    ListModels, LoadModel, UnloadModel, SwitchModel, CountTokens, Embed, Tokenize, Detokenize, SetContextPolicy,
]
OPERATIONS: tuple[type, ...] = Operation.__args__
