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
    Welcome,
)
from aotx.engine.protocol.operations import (
    Cancel,
    CountTokens,
    CreateConversation,
    DeleteConversation,
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
    ListModels, LoadModel, UnloadModel, SwitchModel, CountTokens, SetContextPolicy,
    Welcome, Error, Ok, ConversationInfo, ConversationList, Accepted, Token, Notice, MediaInfo, Committed,
    Durable, StatusReply, ModelList, ModelLoaded, TokenCount,
]


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
