"""Journal records and their on-disk framing: pure functions, no files.

Owns: the record types (msgspec Structs, one per state change), the segment
header and the record frame, and their encode/decode. Leaves to others: files
and fsync (``writer.py``), scanning whole segments (``segments.py``), meaning
(``conversations.py``).

Segment header, 32 bytes, little-endian::

    magic   8s   b"AOTXJRNL"
    version u16  FORMAT_VERSION (a reader refuses a newer one)
    flags   u16  bit 0: the segment opens with a Checkpoint record
    number  u64  segment number (also in the file name)
    base    u64  sequence number of the segment's first record
    crc     u32  CRC32C of the 28 bytes before it

Record frame, 26 + n bytes, little-endian::

    type    u16  record type id (``RECORD_TYPES``); 0 is never written
    tick    u64  engine tick that produced the record
    seq     u64  global sequence number: 1, 2, 3, ... across all segments
    length  u32  payload length n in bytes (at most MAX_PAYLOAD)
    payload n    MessagePack (msgspec) of the record Struct, as a map
    crc     u32  CRC32C (Castagnoli, google-crc32c) of type..payload

Payloads are maps so a later version can add fields with defaults; an older
reader ignores fields it does not know. A new record *type* needs a new format
version, because an old reader cannot tell it from corruption.

Format versions: 1 (the first), 2 (streamed checkpoints: ``CheckpointPart`` and
``CheckpointEnd``; salvage: ``Gap``). This reader reads both and writes 2.

Streamed checkpoint. A checkpoint segment opens with ``Checkpoint(streamed=True)``;
``CheckpointPart`` records follow, each holding one conversation (or a run of a
long conversation's messages: the parts of one conversation are consecutive),
interleaved with live records published meanwhile; ``CheckpointEnd`` closes it,
in the same segment. Replayed from its start, the checkpoint resets the table and
each part (re)creates its conversation as it was when the part was written; a
live record for a conversation whose part comes later is already in that part.
A checkpoint segment without its ``CheckpointEnd`` (a crash mid-checkpoint) is
not a starting point: the older segments it would replace are still there.
"""

from __future__ import annotations

import struct
from typing import Any, ClassVar, Union

import google_crc32c
import msgspec

FORMAT_VERSION = 2  # what this reader reads (and its writer writes); 1 is read too
MAGIC = b"AOTXJRNL"
FLAG_CHECKPOINT = 1

SEGMENT_HEADER = struct.Struct("<8sHHQQI")  # 32 bytes
RECORD_HEADER = struct.Struct("<HQQI")  # 22 bytes
CRC = struct.Struct("<I")
HEADER_BYTES = SEGMENT_HEADER.size
FRAME_OVERHEAD = RECORD_HEADER.size + CRC.size  # 26 bytes around every payload
MAX_PAYLOAD = 1 << 30  # bytes; a checkpoint of many conversations is the largest record

crc32c = google_crc32c.value


# ---- record types ------------------------------------------------------------

class _Record(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    type_id: ClassVar[int]


class AttachmentRef(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """A file attached to a message, by content hash (sha256 hex). Field names match
    the protocol's ``Attachment`` so the two convert with ``msgspec.convert``."""

    sha256: str
    kind: str  # "image" | "audio"
    name: str = ""
    path: str = ""


class ConversationCreated(_Record):
    type_id: ClassVar[int] = 1
    conv_id: str
    title: str = ""
    created_at: float = 0.0  # seconds since the epoch
    system_prompt: str | None = None
    sampling: dict[str, Any] = {}
    model: str = ""  # the model it runs on ("": the engine's default; journals before several models)
    origin: str = ""  # what made it ("" a chat, "run" a one-shot aotx run, "gateway" an API request)
    context: str = ""  # its context policy ("": the engine's default)


class ConversationRenamed(_Record):
    type_id: ClassVar[int] = 2
    conv_id: str
    title: str


class ConversationDeleted(_Record):
    type_id: ClassVar[int] = 3
    conv_id: str


class ConversationUpdated(_Record):
    """New system prompt and default sampling (protocol ``UpdateConversation``), and
    the model its next replies run on when ``model`` is set (None: unchanged)."""

    type_id: ClassVar[int] = 4
    conv_id: str
    system_prompt: str | None = None
    sampling: dict[str, Any] = {}
    model: str | None = None
    context: str | None = None  # its context policy ("": the engine's default; None: unchanged)


class ConversationTruncated(_Record):
    """Messages from ``msg_id`` on are dropped (edit, retry)."""

    type_id: ClassVar[int] = 5
    conv_id: str
    msg_id: str


class MessageAccepted(_Record):
    """A message entered the conversation: a user's message (text complete) or the
    start of a reply (role ``assistant``, text usually empty)."""

    type_id: ClassVar[int] = 6
    conv_id: str
    msg_id: str
    role: str  # "system" | "user" | "assistant" | "tool"
    text: str = ""
    sampling: dict[str, Any] = {}
    attachments: list[AttachmentRef] = []
    created_at: float = 0.0  # seconds since the epoch
    # the message's chat-template fields beside its text (protocol.PriorMessage.meta: an
    # assistant's tool_calls, a tool result's tool_call_id and name); absent for most
    meta: dict[str, Any] = {}
    model: str = ""  # a reply's: the model that writes it ("" in journals before several models)
    # a reply's, by a local GGUF model: the file it was loaded from (absolute) and its
    # fingerprint (loader.fingerprint), so a restart finds a file loaded by path again
    model_path: str = ""
    model_fingerprint: str = ""


class TokensCommitted(_Record):
    """Tokens of a reply produced in one tick. ``start_pos`` is the conversation
    position (KV index) of ``token_ids[0]``; ``text`` is the text they add."""

    type_id: ClassVar[int] = 7
    conv_id: str
    msg_id: str
    start_pos: int
    token_ids: list[int]
    text: str = ""


class MessageFinished(_Record):
    """A reply ended. reason: stop | length | context | cancelled | error | interrupted."""

    type_id: ClassVar[int] = 8
    conv_id: str
    msg_id: str
    reason: str
    n_prompt: int = 0
    n_completion: int = 0
    # the reply's prompt left earlier messages out: the protocol's ContextCut as a map
    # (its "kept_from" is where the conversation's next prompt starts again)
    context: dict[str, Any] = {}


class CapsuleStored(_Record):
    """An execution-state capsule of the conversation was written to ``path``."""

    type_id: ClassVar[int] = 9
    conv_id: str
    path: str
    fingerprint: str
    n_tokens: int


class Checkpoint(_Record):
    """Opens a checkpoint segment: the live conversation table as of ``covers_seq``.

    ``streamed`` (format 2): the conversations follow as ``CheckpointPart`` records
    and a ``CheckpointEnd`` closes the checkpoint; ``n_conversations`` is how many
    were live when it began. Format 1 (``streamed`` False) held them inline in
    ``conversations``, ``conversations.Conversation`` values as plain maps (kept as
    builtins here so this module does not import the state machine)."""

    type_id: ClassVar[int] = 10
    covers_seq: int
    conversations: list[dict[str, Any]] = []
    created_at: float = 0.0
    streamed: bool = False
    n_conversations: int = 0


class CheckpointPart(_Record):
    """One conversation of a streamed checkpoint, as of the record before this one.

    ``conversation``: the ``Conversation`` map without its messages (first part of
    a conversation), or empty (a continuation); ``messages``: encoded ``Message``
    maps in order; ``more``: further parts of this conversation follow at once."""

    type_id: ClassVar[int] = 11
    conv_id: str
    conversation: msgspec.Raw = msgspec.Raw(b"")
    messages: list[msgspec.Raw] = []
    more: bool = False


class CheckpointEnd(_Record):
    """Closes the streamed checkpoint opened by the Checkpoint record ``begin_seq``."""

    type_id: ClassVar[int] = 12
    begin_seq: int
    n_conversations: int = 0
    n_parts: int = 0


class Gap(_Record):
    """Records ``seq .. last_seq`` were lost to damage and salvage wrote this in their place.

    The frame's own seq is the first lost seq. ``segment``/``offset``/``nbytes``:
    where the damaged bytes were; ``copy``: the file (in the journal directory)
    that keeps the damaged segment byte for byte; ``affected``: what the lost
    records were, as far as could be told (maps with ``conv_id``, ``msg_id``,
    ``what``); ``opens_checkpoint``: the lost record opened a streamed checkpoint
    (its parts follow); ``pad``: filler so the frame takes the damaged bytes' place."""

    type_id: ClassVar[int] = 13
    # short names on disk: a Gap often takes the place of one small record
    last_seq: int = msgspec.field(name="last")
    segment: int = msgspec.field(default=0, name="seg")
    offset: int = msgspec.field(default=0, name="off")
    nbytes: int = msgspec.field(default=0, name="n")
    copy: str = ""
    reason: str = msgspec.field(default="", name="why")
    created_at: int = msgspec.field(default=0, name="at")  # seconds since the epoch
    affected: list[dict[str, Any]] = msgspec.field(default_factory=list, name="aff")
    opens_checkpoint: bool = msgspec.field(default=False, name="cp")
    pad: bytes = b""


Record = Union[
    ConversationCreated, ConversationRenamed, ConversationDeleted, ConversationUpdated,
    ConversationTruncated, MessageAccepted, TokensCommitted, MessageFinished, CapsuleStored,
    Checkpoint, CheckpointPart, CheckpointEnd, Gap,
]
#: records that belong to a checkpoint, not to the history it summarises
CHECKPOINT_RECORDS = (Checkpoint, CheckpointPart, CheckpointEnd)
RECORD_TYPES: dict[int, type] = {cls.type_id: cls for cls in Record.__args__}  # type: ignore[attr-defined]
assert len(RECORD_TYPES) == len(Record.__args__), "duplicate record type id"  # type: ignore[attr-defined]

_encoder = msgspec.msgpack.Encoder()
_decoders = {tid: msgspec.msgpack.Decoder(cls) for tid, cls in RECORD_TYPES.items()}


# ---- framing -------------------------------------------------------------------

class FrameError(Exception):
    """A frame cannot be decoded. ``kind`` is one of: torn (it runs past the end
    of the data), zeros (zero-filled space), corrupt (bad CRC, length, type or
    payload). ``offset`` is where the frame starts, in bytes."""

    def __init__(self, kind: str, offset: int, message: str):
        super().__init__(message)
        self.kind = kind
        self.offset = offset


def encode_payload(record: Record) -> bytes:
    """MessagePack bytes of ``record`` (a map of its non-default fields)."""
    return _encoder.encode(record)


def encode_frame(record: Record, tick: int, seq: int) -> bytes:
    """The complete frame of ``record``: header, payload, CRC32C. Raises
    ``ValueError`` when the payload exceeds ``MAX_PAYLOAD`` bytes."""
    payload = _encoder.encode(record)
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"record payload of {len(payload)} bytes exceeds {MAX_PAYLOAD} bytes")
    head = RECORD_HEADER.pack(record.type_id, tick, seq, len(payload))
    crc = google_crc32c.extend(google_crc32c.value(head), payload)
    return head + payload + CRC.pack(crc)


def fit_frame(record: Gap, tick: int, seq: int, size: int) -> bytes | None:
    """The frame of ``record`` padded (its ``pad`` field) to exactly ``size`` bytes, so
    that it can take the place of ``size`` damaged bytes without moving any later
    record; None when even the unpadded frame is larger than ``size``."""
    base = frame_size(record)
    if base > size:
        return None
    want = size - base
    # msgpack: a bin header grows with the length (2, 3 or 5 bytes) and the field's
    # name is only written when pad is not empty; try the few lengths near the target
    for extra in range(0, 40):  # trailing spaces on ``reason`` fill what ``pad`` cannot
        r = msgspec.structs.replace(record, reason=record.reason + " " * extra)
        for n in range(max(0, want - extra - 16), want - extra + 1):
            f = encode_frame(msgspec.structs.replace(r, pad=b"\0" * n) if n else r, tick, seq)
            if len(f) == size:
                return f
    return None


def peek_frame(data: bytes | memoryview, offset: int) -> tuple[int, int, int, int, Record | None]:
    """Best-effort look at a frame whose CRC may be wrong: ``(type, tick, seq, end,
    record or None)``; the record is decoded ignoring the CRC when the header's type
    and length are plausible and the payload still decodes. For damage reports only:
    never replay what this returns. Raises ``FrameError`` (torn) when not even the
    header fits."""
    n = len(data)
    if offset + RECORD_HEADER.size > n:
        raise FrameError("torn", offset, "no room for a record header")
    type_id, tick, seq, length = RECORD_HEADER.unpack_from(data, offset)
    end = offset + RECORD_HEADER.size + length + CRC.size
    record = None
    decoder = _decoders.get(type_id)
    if decoder is not None and end <= n:
        try:
            record = decoder.decode(data[offset + RECORD_HEADER.size:end - CRC.size])
        except (msgspec.DecodeError, msgspec.ValidationError):
            record = None
    return type_id, tick, seq, end, record


def frame_size(record: Record) -> int:
    """Bytes the frame of ``record`` takes on disk (encodes it once)."""
    return FRAME_OVERHEAD + len(_encoder.encode(record))


def decode_frame(data: bytes | memoryview, offset: int = 0) -> tuple[Record, int, int, int]:
    """Decode the frame starting at ``offset`` of ``data``.

    Returns ``(record, tick, seq, end_offset)``. Raises ``FrameError`` (kind
    torn | zeros | corrupt) naming the offset; never returns a record whose CRC
    does not match."""
    n = len(data)
    if offset + RECORD_HEADER.size > n:
        if not any(bytes(data[offset:])):
            raise FrameError("zeros", offset, f"{n - offset} zero bytes at offset {offset}, too few for a record")
        raise FrameError("torn", offset, f"record header cut at offset {offset} ({n - offset} of 22 bytes)")
    type_id, tick, seq, length = RECORD_HEADER.unpack_from(data, offset)
    if type_id == 0:
        kind = "zeros" if not any(bytes(data[offset:offset + 4096])) else "corrupt"
        raise FrameError(kind, offset, f"record type 0 at offset {offset} ({'zero-filled' if kind == 'zeros' else 'garbage'})")
    if length > MAX_PAYLOAD:
        raise FrameError("corrupt", offset, f"record length {length} at offset {offset} exceeds {MAX_PAYLOAD} bytes")
    end = offset + RECORD_HEADER.size + length + CRC.size
    if end > n:
        raise FrameError("torn", offset, f"record at offset {offset} needs {end - offset} bytes, only {n - offset} remain")
    body_end = end - CRC.size
    (stored,) = CRC.unpack_from(data, body_end)
    actual = google_crc32c.value(bytes(data[offset:body_end]))
    if stored != actual:
        raise FrameError("corrupt", offset, f"CRC32C mismatch at offset {offset}: stored {stored:#010x}, computed {actual:#010x}")
    decoder = _decoders.get(type_id)
    if decoder is None:
        raise FrameError("corrupt", offset, f"unknown record type {type_id} at offset {offset} (written by a newer AOTX?)")
    try:
        record = decoder.decode(data[offset + RECORD_HEADER.size:body_end])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise FrameError("corrupt", offset, f"record at offset {offset} (type {type_id}) does not decode: {e}") from None
    return record, tick, seq, end


# ---- segment header ----------------------------------------------------------

class SegmentHeader(msgspec.Struct, frozen=True):
    version: int
    flags: int
    number: int
    base_seq: int

    @property
    def checkpoint(self) -> bool:
        return bool(self.flags & FLAG_CHECKPOINT)


def encode_segment_header(number: int, base_seq: int, flags: int = 0, version: int = FORMAT_VERSION) -> bytes:
    """The 32-byte header of segment ``number`` whose first record has ``base_seq``."""
    head = SEGMENT_HEADER.pack(MAGIC, version, flags, number, base_seq, 0)[:-4]
    return head + CRC.pack(crc32c(head))


def decode_segment_header(data: bytes | memoryview) -> SegmentHeader:
    """Parse a segment header. Raises ``FrameError``: torn (shorter than 32 bytes),
    zeros (all zero), corrupt (bad magic or CRC). The version is returned as read;
    the caller decides whether it can read it."""
    if len(data) < HEADER_BYTES:
        kind = "zeros" if not any(bytes(data)) else "torn"
        raise FrameError(kind, 0, f"segment header is {len(data)} of {HEADER_BYTES} bytes")
    magic, version, flags, number, base, stored = SEGMENT_HEADER.unpack_from(data, 0)
    if not any(bytes(data[:HEADER_BYTES])):
        raise FrameError("zeros", 0, "segment header is zero-filled")
    if magic != MAGIC:
        raise FrameError("corrupt", 0, f"bad magic {magic!r} (expected {MAGIC!r})")
    actual = crc32c(bytes(data[:HEADER_BYTES - CRC.size]))
    if stored != actual:
        raise FrameError("corrupt", 0, f"segment header CRC32C mismatch: stored {stored:#010x}, computed {actual:#010x}")
    return SegmentHeader(version, flags, number, base)


# ---- the receipt file ----------------------------------------------------------

#: The journal directory's ``RECEIPT`` file: the last receipt the writer issued,
#: overwritten in place after every fsync (40 bytes, little-endian): magic 8s
#: ``AOTXRCPT``, version u16, reserved u16, segment u64, offset u64, last_seq u64,
#: CRC32C u32 of the 36 bytes before it. Recovery reads it to tell a torn tail
#: (past it) from damage (at or before it). It may lag behind after a power loss
#: (it is fsynced at most once a second), never run ahead of the data.
RECEIPT_FILE = "RECEIPT"
#: The mark is kept twice: ``RECEIPT`` and ``RECEIPT.2``, the same bytes written after the
#: same fsync, so that losing one (alone, or with the last segment) leaves the other.
#: A journal from before the second copy has only ``RECEIPT``; the writer creates the
#: second at its next start, and an older AOTX ignores it.
RECEIPT_FILES = (RECEIPT_FILE, RECEIPT_FILE + ".2")
RECEIPT_MAGIC = b"AOTXRCPT"
RECEIPT_STRUCT = struct.Struct("<8sHHQQQI")


def encode_receipt(segment: int, offset: int, last_seq: int) -> bytes:
    body = RECEIPT_STRUCT.pack(RECEIPT_MAGIC, 1, 0, segment, offset, last_seq, 0)[:-4]
    return body + CRC.pack(crc32c(body))


def decode_receipt(data: bytes) -> tuple[int, int, int] | None:
    """``(segment, offset, last_seq)`` from a receipt file's bytes; None when it is
    missing, short or fails its check (then recovery knows no acknowledged point)."""
    if len(data) < RECEIPT_STRUCT.size:
        return None
    magic, version, _, segment, offset, last_seq, stored = RECEIPT_STRUCT.unpack_from(data)
    if magic != RECEIPT_MAGIC or version != 1 or stored != crc32c(data[:RECEIPT_STRUCT.size - 4]):
        return None
    return segment, offset, last_seq
