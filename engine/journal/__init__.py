"""The journal: every conversation change as a checksummed record on disk.

Records are written complete into a preallocated buffer, then published; a
flush groups them into blocks; a drain thread appends blocks to segment files,
fdatasyncs, and only then issues receipts (segment, offset, last seq). At
start, recovery replays every good record into the conversation table, cuts a
torn tail and refuses damage a crash does not explain. See "Three positions"
and "Journal" in DESIGN.md.

Modules: ``records`` (types and framing), ``conversations`` (the one state
machine), ``segments`` (files and the read-only scan), ``directory`` (the writer lock, removing
segments), ``writer`` (``Journal``),
``recovery`` (recover, verify, dump, compact), ``cli_support`` (plain dicts
for ``aotx journal ...`` and ``aotx conversations ...``).

Typical engine use::

    journal = Journal(journal_dir(), on_receipt=receipt_cb)   # runs recovery
    table = journal.recovery.table
    log.info(journal.recovery.summary())
    # in a tick:
    if journal.reserve(nbytes):
        seq = journal.publish(record, tick); table.apply(record, seq, tick)
    journal.flush()
"""

from aotx.engine.journal.conversations import (
    CapsuleRef, Conversation, ConversationTable, Message, Receipt,
)
from aotx.engine.journal.records import (
    FORMAT_VERSION, AttachmentRef, CapsuleStored, Checkpoint, ConversationCreated,
    ConversationDeleted, ConversationRenamed, ConversationTruncated, ConversationUpdated,
    FrameError, MessageAccepted, MessageFinished, Record, TokensCommitted, decode_frame,
    encode_frame, frame_size,
)
from aotx.engine.journal.recovery import (
    CompactReport, RecoveryReport, VerifyReport, compact, dump, read_table, recover, verify,
)
from aotx.engine.journal.segments import Entry, Problem
from aotx.engine.journal.writer import Journal

__all__ = [
    "FORMAT_VERSION", "AttachmentRef", "CapsuleRef", "CapsuleStored", "Checkpoint", "CompactReport",
    "Conversation", "ConversationCreated", "ConversationDeleted", "ConversationRenamed",
    "ConversationTable", "ConversationTruncated", "ConversationUpdated", "Entry", "FrameError",
    "Journal", "Message", "MessageAccepted", "MessageFinished", "Problem", "Receipt", "Record",
    "RecoveryReport", "TokensCommitted", "VerifyReport", "compact", "decode_frame", "dump",
    "encode_frame", "frame_size", "read_table", "recover", "verify",
]
