"""Framing: a 4-byte big-endian payload length, then MessagePack of one ``Message``."""

from __future__ import annotations

import struct
from typing import Union

import msgspec
from aotx.engine.errors import ProtocolError
from aotx.engine.protocol.events import (
    Accepted,
    Committed,
    ConversationInfo,
    Detokenized,
    Embeddings,
    ConversationList,
    Durable,
    Error,
    MediaInfo,
    ModelList,
    ModelLoaded,
    Notice,
    Ok,
    StatusReply,
    Token,
    TokenCount,
    TokenList,
    Welcome,
)
from aotx.engine.protocol.operations import (
    Cancel,
    CountTokens,
    CreateConversation,
    DeleteConversation,
    Detokenize,
    Embed,
    ForkConversation,
    Hello,
    ListConversations,
    ListModels,
    LoadModel,
    RenameConversation,
    SetContextPolicy,
    ShowConversation,
    Status,
    SubmitMessage,
    SwitchModel,
    Tokenize,
    TruncateConversation,
    UnloadModel,
    UpdateConversation,
)

PROTOCOL_VERSION = 1
MAX_FRAME = 16 << 20  # bytes
_LEN = struct.Struct(">I")

Message = Union[
    Hello, CreateConversation, ListConversations, ShowConversation, SubmitMessage, Cancel,
    DeleteConversation, RenameConversation, UpdateConversation, TruncateConversation, ForkConversation, Status,
    ListModels, LoadModel, UnloadModel, SwitchModel, CountTokens, Embed, Tokenize, Detokenize, SetContextPolicy,
    Welcome, Error, Ok, ConversationInfo, ConversationList, Accepted, Token, Notice, MediaInfo, Committed,
    Durable, StatusReply, ModelList, ModelLoaded, TokenCount, Embeddings, TokenList, Detokenized,
]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode_frame(msg: Message) -> bytes:
    """Length-prefixed MessagePack frame of ``msg``. Raises ``ProtocolError`` naming the
    field when a text is not valid Unicode (a lone surrogate: bytes that were not UTF-8
    on a command line or a pipe), a number does not fit 64 bits, or the frame would be
    over ``MAX_FRAME``."""
    try:
        body = _encoder.encode(msg)
    except UnicodeEncodeError as e:
        where = _bad_text(msgspec.structs.asdict(msg) if isinstance(msg, msgspec.Struct) else msg, "")
        raise ProtocolError(f"{type(msg).__name__}: {where or 'a text'} is not valid UTF-8 "
                            f"(character {e.start}: {e.object[e.start:e.end]!r})") from None
    except OverflowError as e:
        raise ProtocolError(f"{type(msg).__name__}: a number is out of range: {e}") from None
    if len(body) > MAX_FRAME:  # the peer would close the connection at the header: say why here
        raise ProtocolError(f"{type(msg).__name__} is {len(body):,} bytes; the engine takes at most "
                            f"{MAX_FRAME:,} ({MAX_FRAME >> 20} MiB) in one message")
    return _LEN.pack(len(body)) + body


def _bad_text(obj: object, path: str) -> str:
    """The path of the first text in ``obj`` that cannot be UTF-8 ("" when none)."""
    if isinstance(obj, str):
        try:
            obj.encode()
        except UnicodeEncodeError:
            return path or "a text"
        return ""
    if isinstance(obj, msgspec.Struct):
        obj = msgspec.structs.asdict(obj)
    if isinstance(obj, dict):
        for k, v in obj.items():
            got = _bad_text(k, f"{path}.{k!r}" if path else repr(k)) or _bad_text(v, f"{path}.{k}" if path else str(k))
            if got:
                return got
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            got = _bad_text(v, f"{path}[{i}]")
            if got:
                return got
    return ""


def decode_payload(body: bytes) -> Message:
    """Decode one frame's payload. Raises ``ProtocolError`` naming what is wrong."""
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"invalid message: {e}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"undecodable frame: {e}") from None
    except RecursionError:
        raise ProtocolError("undecodable frame: its values are nested too deeply") from None


def frame_length(header: bytes) -> int:
    """Payload length from a 4-byte header. Raises ``ProtocolError`` when above MAX_FRAME."""
    (n,) = _LEN.unpack(header)
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes exceeds the limit of {MAX_FRAME} bytes")
    return n
