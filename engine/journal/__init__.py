"""The journal: every conversation change as a checksummed record on disk.

Records are written complete into a preallocated buffer, then published; a
flush groups them into blocks; a drain thread appends blocks to segment files,
fdatasyncs, and only then issues receipts (segment, offset, last seq), the
last of which it records in the directory's ``RECEIPT`` file. At start,
recovery replays every valid record into the conversation table, cuts a torn
tail past the acknowledged point, and salvages damage a crash does not explain
(a byte-exact copy kept, every valid record after it kept, a ``Gap`` record in
place of what was lost, the conversations and messages affected named). Online
checkpoints stream beside the live records. Every write goes through the file
layer ``aotx.engine.fileio``. See "Three positions" and "Journal" in DESIGN.md.

Modules: ``records`` (types and framing), ``conversations`` (the one state
machine), ``segments`` (files and the read-only scan, with resynchronisation),
``directory`` (the writer lock, removing segments), ``writer`` (``Journal``; its
drain's files in ``appender``, its streamed checkpoints in ``checkpoint_stream``),
``recovery`` (recover and its report; the repairs in ``salvage``), ``chain``
(which segments, in sequence order), ``damage`` (what a scan finds),
``segment_files`` (names, the acknowledged mark), ``reading`` (verify, dump, the
table for tools), ``compaction``, ``cli_support`` (plain dicts for ``aotx journal
...`` and ``aotx conversations ...``).

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
    FORMAT_VERSION, AttachmentRef, CapsuleStored, Checkpoint, CheckpointEnd, CheckpointPart, ConversationCreated,
    ConversationDeleted, ConversationRenamed, ConversationTruncated, ConversationUpdated,
    FrameError, Gap, MessageAccepted, MessageFinished, Record, TokensCommitted, decode_frame,
    encode_frame, frame_size,
)
from aotx.engine.journal.compaction import CompactReport, compact
from aotx.engine.journal.damage import Damage, Entry, Problem
from aotx.engine.journal.reading import VerifyReport, dump, read_table, verify
from aotx.engine.journal.recovery import RecoveryReport, recover
from aotx.engine.journal.writer import Journal

__all__ = [
    "FORMAT_VERSION", "AttachmentRef", "CapsuleRef", "CapsuleStored", "Checkpoint", "CheckpointEnd",
    "CheckpointPart", "CompactReport", "Damage", "Gap",
    "Conversation", "ConversationCreated", "ConversationDeleted", "ConversationRenamed",
    "ConversationTable", "ConversationTruncated", "ConversationUpdated", "Entry", "FrameError",
    "Journal", "Message", "MessageAccepted", "MessageFinished", "Problem", "Receipt", "Record",
    "RecoveryReport", "TokensCommitted", "VerifyReport", "compact", "decode_frame", "dump",
    "encode_frame", "frame_size", "read_table", "recover", "verify",
]
