"""The conversation table: the one state machine over journal records.

Owns: ``ConversationTable.apply(record, seq, tick)``, used by the live engine as
it publishes and by recovery as it replays, so both always agree; receipts
(which storage boundary each message is durable under); the snapshot a
Checkpoint holds. Leaves to others: the records' bytes (``records.py``), disk
(``writer.py``, ``recovery.py``), and the protocol views (the engine converts
``to_dict()`` with ``msgspec.convert`` into ``ipc.protocol.ConversationView``).

Message status: user and system messages are ``complete`` once accepted. A
reply goes ``accepted`` (no tokens yet) -> ``streaming`` (tokens committed) ->
``complete`` (finished with stop | length | context), ``cancelled``,
``failed`` (reason error) or ``interrupted`` (the engine stopped before it
finished; ``finish_recovery()`` marks these after a replay).

The table is lenient: a record naming an unknown or deleted conversation or
message changes nothing and is counted in ``ignored`` (a journal written by a
correct engine has none). It never raises on a decoded record.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import msgspec

from aotx.engine.journal.records import (
    AttachmentRef, CapsuleStored, Checkpoint, ConversationCreated, ConversationDeleted,
    ConversationRenamed, ConversationTruncated, ConversationUpdated, MessageAccepted,
    MessageFinished, Record, TokensCommitted,
)


class Receipt(msgspec.Struct, frozen=True):
    """Records up to ``last_seq`` are on disk: segment number, byte offset in that
    segment just past the covering block, last sequence number covered. Same
    fields as the protocol's ``Receipt``."""

    segment: int
    offset: int
    last_seq: int


class CapsuleRef(msgspec.Struct, omit_defaults=True):
    path: str
    fingerprint: str
    n_tokens: int


class Message(msgspec.Struct, omit_defaults=True):
    """One message. ``seq`` is the last record that changed it; ``receipt`` is the
    storage boundary it is durable under (None until a receipt covers ``seq``)."""

    msg_id: str
    role: str
    text: str = ""
    status: str = "accepted"
    token_ids: list[int] = []
    start_pos: int = 0
    finish_reason: str | None = None
    n_prompt: int = 0
    n_completion: int = 0
    attachments: list[AttachmentRef] = []
    sampling: dict[str, Any] = {}
    created_at: float = 0.0
    seq: int = 0
    receipt: Receipt | None = None
    model: str = ""  # a reply's model


class Conversation(msgspec.Struct, omit_defaults=True):
    conv_id: str
    title: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0
    system_prompt: str | None = None
    sampling: dict[str, Any] = {}
    deleted: bool = False
    messages: list[Message] = []
    capsule: CapsuleRef | None = None
    seq: int = 0
    model: str = ""  # the model its next reply runs on ("": the engine's default)

    def message(self, msg_id: str) -> Message | None:
        for m in reversed(self.messages):
            if m.msg_id == msg_id:
                return m
        return None

    @property
    def n_tokens(self) -> int:
        return sum(len(m.token_ids) for m in self.messages)

    def to_dict(self, messages: bool = True) -> dict[str, Any]:
        """Plain dict with the fields of the protocol's ``ConversationView``."""
        d = msgspec.to_builtins(self)
        d.pop("deleted", None)
        d.pop("capsule", None)
        d["n_messages"] = len(self.messages)
        if not messages:
            d.pop("messages", None)
        return d


_FINISH_STATUS = {"stop": "complete", "length": "complete", "context": "complete",
                  "cancelled": "cancelled", "error": "failed", "interrupted": "interrupted"}


class ConversationTable:
    """Conversations by id, rebuilt by applying records in sequence order."""

    def __init__(self) -> None:
        self.conversations: dict[str, Conversation] = {}
        self.last_seq = 0
        self.ignored = 0  # records that named an unknown conversation or message
        self._pending: deque[tuple[int, Message]] = deque()  # (seq, message) awaiting a receipt
        self._apply = {
            ConversationCreated: self._created, ConversationRenamed: self._renamed,
            ConversationDeleted: self._deleted, ConversationUpdated: self._updated,
            ConversationTruncated: self._truncated, MessageAccepted: self._accepted,
            TokensCommitted: self._tokens, MessageFinished: self._finished,
            CapsuleStored: self._capsule, Checkpoint: self._checkpoint,
        }

    # ---- queries --------------------------------------------------------------

    def get(self, conv_id: str) -> Conversation | None:
        """The live (not deleted) conversation ``conv_id``, or None."""
        c = self.conversations.get(conv_id)
        return None if c is None or c.deleted else c

    def live(self) -> list[Conversation]:
        """Live conversations, oldest first."""
        return sorted((c for c in self.conversations.values() if not c.deleted),
                      key=lambda c: (c.created_at, c.seq))

    def to_dict(self, messages: bool = False) -> list[dict[str, Any]]:
        return [c.to_dict(messages=messages) for c in self.live()]

    def snapshot(self) -> list[dict[str, Any]]:
        """Live conversations as plain maps, for a ``Checkpoint`` record."""
        return [msgspec.to_builtins(c) for c in self.live()]

    # ---- transitions ------------------------------------------------------------

    def apply(self, record: Record, seq: int = 0, tick: int = 0) -> None:
        """Apply one record with sequence number ``seq``. Records must come in
        sequence order; a record with ``seq`` at or below ``last_seq`` (other than
        0, meaning unnumbered) is a replay and changes nothing."""
        if seq:
            if seq <= self.last_seq:
                return
            self.last_seq = seq
        self._apply[type(record)](record, seq)

    def note_receipt(self, receipt: Receipt) -> list[Message]:
        """Mark every message whose last record is covered by ``receipt`` as
        durable under it. Returns the messages newly marked (each once)."""
        done = []
        pending = self._pending
        while pending and pending[0][0] <= receipt.last_seq:
            seq, msg = pending.popleft()
            if msg.seq == seq:
                msg.receipt = receipt
                done.append(msg)
        return done

    def finish_recovery(self) -> list[Message]:
        """After a replay: mark replies that never finished as ``interrupted``.
        Returns them (the engine may journal a MessageFinished(reason='interrupted'))."""
        cut = []
        for c in self.conversations.values():
            for m in c.messages:
                if m.status in ("accepted", "streaming"):
                    m.status = "interrupted"
                    m.finish_reason = "interrupted"
                    cut.append(m)
        return cut

    # ---- one method per record type --------------------------------------------

    def _conv(self, conv_id: str, seq: int) -> Conversation | None:
        c = self.conversations.get(conv_id)
        if c is None or c.deleted:
            self.ignored += 1
            return None
        c.seq = seq
        return c

    def _touch(self, msg: Message, seq: int) -> None:
        msg.seq = seq
        if seq:
            self._pending.append((seq, msg))

    def _created(self, r: ConversationCreated, seq: int) -> None:
        if r.conv_id in self.conversations and not self.conversations[r.conv_id].deleted:
            self.ignored += 1
            return
        self.conversations[r.conv_id] = Conversation(
            conv_id=r.conv_id, title=r.title, created_at=r.created_at, updated_at=r.created_at,
            system_prompt=r.system_prompt, sampling=dict(r.sampling), seq=seq, model=r.model)

    def _renamed(self, r: ConversationRenamed, seq: int) -> None:
        if (c := self._conv(r.conv_id, seq)) is not None:
            c.title = r.title

    def _deleted(self, r: ConversationDeleted, seq: int) -> None:
        if (c := self._conv(r.conv_id, seq)) is not None:
            c.deleted = True
            c.messages = []  # nothing of a deleted conversation is kept in memory

    def _updated(self, r: ConversationUpdated, seq: int) -> None:
        if (c := self._conv(r.conv_id, seq)) is not None:
            c.system_prompt = r.system_prompt
            c.sampling = dict(r.sampling)
            if r.model is not None:
                c.model = r.model

    def _truncated(self, r: ConversationTruncated, seq: int) -> None:
        if (c := self._conv(r.conv_id, seq)) is not None:
            for i, m in enumerate(c.messages):
                if m.msg_id == r.msg_id:
                    del c.messages[i:]
                    c.capsule = None  # the parked state no longer matches the history
                    return
            self.ignored += 1

    def _accepted(self, r: MessageAccepted, seq: int) -> None:
        if (c := self._conv(r.conv_id, seq)) is None:
            return
        if c.message(r.msg_id) is not None:
            self.ignored += 1
            return
        status = "accepted" if r.role == "assistant" else "complete"
        m = Message(msg_id=r.msg_id, role=r.role, text=r.text, status=status,
                    attachments=list(r.attachments), sampling=dict(r.sampling), created_at=r.created_at,
                    model=r.model)
        c.messages.append(m)
        if r.model:  # a reply written by a model: the conversation runs on it
            c.model = r.model
        if r.created_at:
            c.updated_at = max(c.updated_at, r.created_at)
        self._touch(m, seq)

    def _tokens(self, r: TokensCommitted, seq: int) -> None:
        if (c := self._conv(r.conv_id, seq)) is None:
            return
        m = c.message(r.msg_id)
        if m is None:  # a reply whose MessageAccepted was not journaled: start it here
            m = Message(msg_id=r.msg_id, role="assistant")
            c.messages.append(m)
        if not m.token_ids:
            m.start_pos = r.start_pos
        m.token_ids.extend(r.token_ids)
        m.text += r.text
        if m.status == "accepted":
            m.status = "streaming"
        self._touch(m, seq)

    def _finished(self, r: MessageFinished, seq: int) -> None:
        if (c := self._conv(r.conv_id, seq)) is None:
            return
        m = c.message(r.msg_id)
        if m is None:
            self.ignored += 1
            return
        m.status = _FINISH_STATUS.get(r.reason, "complete")
        m.finish_reason = r.reason
        m.n_prompt = r.n_prompt
        m.n_completion = r.n_completion
        self._touch(m, seq)

    def _capsule(self, r: CapsuleStored, seq: int) -> None:
        if (c := self._conv(r.conv_id, seq)) is not None:
            c.capsule = CapsuleRef(r.path, r.fingerprint, r.n_tokens)

    def _checkpoint(self, r: Checkpoint, seq: int) -> None:
        self.conversations = {}
        self._pending.clear()
        for d in r.conversations:
            c = msgspec.convert(d, Conversation)
            self.conversations[c.conv_id] = c
            for m in c.messages:
                m.receipt = None  # old receipts name segments compaction removed
                self._touch(m, seq)
        if r.covers_seq > self.last_seq:
            self.last_seq = r.covers_seq
