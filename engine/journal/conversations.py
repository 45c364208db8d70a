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

The table is lenient and keeps every record it is given reachable. A record
naming a conversation it does not know (its ``ConversationCreated`` was lost to
damage, or the checkpoint part that held it) rebuilds that conversation from the
record, every record naming its conversation: the conversation is marked
``salvaged`` with what is missing (title, system prompt, settings, earlier
messages), and so is a message rebuilt from its tokens or its finish. A record
naming a deleted conversation, a message that is already there, or a truncation
of a message it does not know changes nothing and is counted in ``ignored`` (a
journal written by a correct engine has none). It never raises on a decoded record.

Checkpoints. A ``Checkpoint`` replaces the table only when it is the first record
replayed (the chain starts there); met later in a replay it is a summary of
history already applied and is skipped with its parts. While a streamed
checkpoint loads (until its ``CheckpointEnd``), records naming a conversation
whose part is still to come are expected and skipped silently: that part holds
them already.

Gaps. A ``Gap`` (records lost to damage, written by salvage) is noted in
``gaps`` with what it affected: the conversations and messages its lost records
named as far as they could be read, the replies that were being written when the
records were lost, and every inconsistency met after it (a record naming a
conversation or message the table does not know, tokens that do not continue
where the message's last tokens ended).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import msgspec

from aotx.engine.journal.records import (
    AttachmentRef, CapsuleStored, Checkpoint, CheckpointEnd, CheckpointPart, ConversationCreated,
    ConversationDeleted, ConversationRenamed, ConversationTruncated, ConversationUpdated, Gap, MessageAccepted,
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
    meta: dict[str, Any] = {}  # chat-template fields (MessageAccepted.meta)
    model: str = ""  # a reply's model
    context: dict[str, Any] = {}  # a reply whose prompt left earlier messages out (MessageFinished.context)
    salvaged: str = ""  # rebuilt after damage: what of it is missing ("": nothing)


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
    # the file that model was loaded from and its fingerprint, as its last reply recorded
    # them ("": unknown; a model switch clears them): a restart loads it from there when
    # the name is not installed but the file is still there (Engine._submit)
    model_path: str = ""
    model_fingerprint: str = ""
    origin: str = ""  # what made it ("" a chat, "run" a one-shot aotx run, "gateway" an API request)
    context: str = ""  # its context policy ("": the engine's default)
    salvaged: str = ""  # rebuilt from later records after damage: what of it is missing ("": nothing)

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


class GapNote(msgspec.Struct):
    """A ``Gap`` met in a replay: records ``first_seq..last_seq`` are lost; ``affected``
    lists maps of ``conv_id``, ``msg_id`` (may be absent) and ``what``."""

    first_seq: int
    last_seq: int
    segment: int = 0
    offset: int = 0
    nbytes: int = 0
    copy: str = ""
    reason: str = ""
    created_at: float = 0.0
    affected: list[dict[str, Any]] = []


_conv_decoder = msgspec.msgpack.Decoder(Conversation)
_msg_decoder = msgspec.msgpack.Decoder(Message)
_raw_encoder = msgspec.msgpack.Encoder()
MAX_ANOMALIES = 1000


def checkpoint_parts(c: Conversation, max_bytes: int = 1 << 20) -> list[CheckpointPart]:
    """``c`` as the ``CheckpointPart`` records of a streamed checkpoint: the first holds
    the conversation's fields and its first messages, later ones (``more`` on every
    part but the last) the following messages, each part about ``max_bytes`` at most
    (a single message larger than that gets a part of its own)."""
    head = msgspec.Raw(_raw_encoder.encode(msgspec.structs.replace(c, messages=[])))
    parts: list[CheckpointPart] = []
    cur: list[msgspec.Raw] = []
    size = len(head)
    for m in c.messages:
        raw = msgspec.Raw(_raw_encoder.encode(m))
        if cur and size + len(raw) > max_bytes:
            parts.append(_part(c.conv_id, head if not parts else None, cur, True))
            cur, size = [], 0
        cur.append(raw)
        size += len(raw)
    parts.append(_part(c.conv_id, head if not parts else None, cur, False))
    return parts


def _part(conv_id: str, head: msgspec.Raw | None, messages: list[msgspec.Raw], more: bool) -> CheckpointPart:
    # a continuation leaves ``conversation`` at its default, so that it is omitted: an
    # empty Raw passed explicitly would be written as a key with no value
    if head is None:
        return CheckpointPart(conv_id=conv_id, messages=messages, more=more)
    return CheckpointPart(conv_id=conv_id, conversation=head, messages=messages, more=more)


LOST_CREATION = "its creation was lost: title, system prompt and settings are unknown"

_FINISH_STATUS = {"stop": "complete", "length": "complete", "context": "complete",
                  "cancelled": "cancelled", "error": "failed", "interrupted": "interrupted"}


class ConversationTable:
    """Conversations by id, rebuilt by applying records in sequence order."""

    def __init__(self) -> None:
        self.conversations: dict[str, Conversation] = {}
        self.last_seq = 0
        self.ignored = 0  # records that named an unknown conversation or message
        self.gaps: list[GapNote] = []  # records lost to damage (``Gap`` records met)
        self.anomalies: list[dict[str, Any]] = []  # inconsistencies met (at most MAX_ANOMALIES)
        self.loading = False  # a streamed checkpoint is being loaded
        self._pending: deque[tuple[int, Message]] = deque()  # (seq, message) awaiting a receipt
        self._apply = {
            ConversationCreated: self._created, ConversationRenamed: self._renamed,
            ConversationDeleted: self._deleted, ConversationUpdated: self._updated,
            ConversationTruncated: self._truncated, MessageAccepted: self._accepted,
            TokensCommitted: self._tokens, MessageFinished: self._finished,
            CapsuleStored: self._capsule, Checkpoint: self._checkpoint, CheckpointPart: self._part,
            CheckpointEnd: self._checkpoint_end, Gap: self._gap,
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
            fresh = self.last_seq == 0 and not self.conversations
            self.last_seq = seq
        else:
            fresh = not self.conversations
        if isinstance(record, Checkpoint):
            if fresh:
                self._checkpoint(record, seq)
            return
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

    def _anomaly(self, seq: int, conv_id: str, msg_id: str | None, what: str) -> None:
        if len(self.anomalies) < MAX_ANOMALIES:
            d = {"seq": seq, "conv_id": conv_id, "what": what}
            if msg_id:
                d["msg_id"] = msg_id
            self.anomalies.append(d)
            if self.gaps:
                self.gaps[-1].affected.append(dict(d))

    def _conv(self, conv_id: str, seq: int, created_at: float = 0.0) -> Conversation | None:
        c = self.conversations.get(conv_id)
        if c is None:
            # its creation (or the checkpoint part holding it) was lost: rebuild it from this
            # record on. While a streamed checkpoint loads, its part may still come: the part
            # then replaces this one whole (it holds this record's change already).
            c = self.conversations[conv_id] = Conversation(
                conv_id=conv_id, created_at=created_at, updated_at=created_at, salvaged=LOST_CREATION)
            if not self.loading:
                self._anomaly(seq, conv_id, None, "a record names a conversation whose creation was lost: "
                              "rebuilt from its later records")
        elif c.deleted:
            self.ignored += 1
            self._anomaly(seq, conv_id, None, "a record names a deleted conversation")
            return None
        c.seq = seq
        return c

    def _stub(self, c: Conversation, msg_id: str, seq: int, what: str) -> Message:
        """A reply whose ``MessageAccepted`` was lost, rebuilt from a later record of it."""
        m = Message(msg_id=msg_id, role="assistant", salvaged=what)
        c.messages.append(m)
        if not self.loading:
            self._anomaly(seq, c.conv_id, msg_id, f"a record names a message whose start was lost: {what}")
        return m

    def _touch(self, msg: Message, seq: int) -> None:
        msg.seq = seq
        if seq:
            self._pending.append((seq, msg))

    def _created(self, r: ConversationCreated, seq: int) -> None:
        old = self.conversations.get(r.conv_id)
        if old is not None and old.salvaged == LOST_CREATION and not old.deleted:
            # rebuilt from records a checkpoint's replay met before this one: fill it in
            old.title, old.created_at, old.system_prompt = r.title, r.created_at, r.system_prompt
            old.sampling, old.model, old.salvaged = dict(r.sampling), r.model, ""
            return
        if old is not None and not old.deleted:
            self.ignored += 1
            return
        self.conversations[r.conv_id] = Conversation(
            conv_id=r.conv_id, title=r.title, created_at=r.created_at, updated_at=r.created_at,
            system_prompt=r.system_prompt, sampling=dict(r.sampling), seq=seq, model=r.model, origin=r.origin,
            context=r.context)

    def _renamed(self, r: ConversationRenamed, seq: int) -> None:
        if (c := self._conv(r.conv_id, seq)) is not None:
            c.title = r.title

    def _deleted(self, r: ConversationDeleted, seq: int) -> None:
        if r.conv_id not in self.conversations:  # deleted, whatever it was: nothing to rebuild
            self.conversations[r.conv_id] = Conversation(conv_id=r.conv_id, deleted=True, seq=seq)
            return
        if (c := self._conv(r.conv_id, seq)) is not None:
            c.deleted = True
            c.messages = []  # nothing of a deleted conversation is kept in memory

    def _updated(self, r: ConversationUpdated, seq: int) -> None:
        if (c := self._conv(r.conv_id, seq)) is not None:
            c.system_prompt = r.system_prompt
            c.sampling = dict(r.sampling)
            if r.context is not None:
                c.context = r.context
            if r.model is not None and r.model != c.model:
                c.model, c.model_path, c.model_fingerprint = r.model, "", ""

    def _truncated(self, r: ConversationTruncated, seq: int) -> None:
        if (c := self._conv(r.conv_id, seq)) is not None:
            for i, m in enumerate(c.messages):
                if m.msg_id == r.msg_id:
                    del c.messages[i:]
                    c.capsule = None  # the parked state no longer matches the history
                    return
            self.ignored += 1

    def _accepted(self, r: MessageAccepted, seq: int) -> None:
        if (c := self._conv(r.conv_id, seq, r.created_at)) is None:
            return
        if c.message(r.msg_id) is not None:
            self.ignored += 1
            return
        status = "accepted" if r.role == "assistant" else "complete"
        m = Message(msg_id=r.msg_id, role=r.role, text=r.text, status=status,
                    attachments=list(r.attachments), sampling=dict(r.sampling), created_at=r.created_at,
                    meta=dict(r.meta), model=r.model)
        c.messages.append(m)
        if r.model:  # a reply written by a model: the conversation runs on it
            c.model, c.model_path, c.model_fingerprint = r.model, r.model_path, r.model_fingerprint
        if r.created_at:
            c.updated_at = max(c.updated_at, r.created_at)
        self._touch(m, seq)

    def _tokens(self, r: TokensCommitted, seq: int) -> None:
        if (c := self._conv(r.conv_id, seq)) is None:
            return
        m = c.message(r.msg_id)
        if m is None:  # a reply whose MessageAccepted was lost: start it here
            m = self._stub(c, r.msg_id, seq, "its start was lost (its sampling; any tokens before these)")
        if not m.token_ids:
            m.start_pos = r.start_pos
        elif r.start_pos != m.start_pos + len(m.token_ids):
            end = m.start_pos + len(m.token_ids)
            what = (f"tokens at positions {end}..{r.start_pos - 1} were lost" if r.start_pos > end else
                    f"tokens at position {r.start_pos} follow tokens ending at {end}")
            m.salvaged = f"{m.salvaged}; {what}" if m.salvaged else what
            self._anomaly(seq, r.conv_id, r.msg_id, f"{what}: tokens are missing")
        m.token_ids.extend(r.token_ids)
        m.text += r.text
        if m.status == "accepted":
            m.status = "streaming"
        self._touch(m, seq)

    def _finished(self, r: MessageFinished, seq: int) -> None:
        if (c := self._conv(r.conv_id, seq)) is None:
            return
        m = c.message(r.msg_id)
        if m is None:  # its start and tokens were lost: the finish is what is left of it
            m = self._stub(c, r.msg_id, seq, "its start and its tokens were lost")
        m.status = _FINISH_STATUS.get(r.reason, "complete")
        m.finish_reason = r.reason
        m.n_prompt = r.n_prompt
        m.n_completion = r.n_completion
        if r.context:
            m.context = dict(r.context)
        self._touch(m, seq)

    def _capsule(self, r: CapsuleStored, seq: int) -> None:
        if (c := self._conv(r.conv_id, seq)) is not None:
            c.capsule = CapsuleRef(r.path, r.fingerprint, r.n_tokens)

    def _checkpoint(self, r: Checkpoint, seq: int) -> None:
        self.conversations = {}
        self._pending.clear()
        for d in r.conversations:  # format 1: inline
            c = msgspec.convert(d, Conversation)
            self.conversations[c.conv_id] = c
            for m in c.messages:
                m.receipt = None  # old receipts name segments compaction removed
                self._touch(m, seq)
        self.loading = r.streamed
        if r.covers_seq > self.last_seq:
            self.last_seq = r.covers_seq

    def _part(self, r: CheckpointPart, seq: int) -> None:
        if not self.loading:
            return  # a checkpoint met after the start of the replay: its history was applied
        msgs = [_msg_decoder.decode(m) for m in r.messages]
        for m in msgs:
            m.receipt = None
        if len(bytes(r.conversation)):
            c = _conv_decoder.decode(r.conversation)
            c.messages = msgs
            self.conversations[c.conv_id] = c
        else:
            c = self.conversations.get(r.conv_id)
            if c is None:  # the part that began it was lost: rebuild it from this one on
                c = self.conversations[r.conv_id] = Conversation(
                    conv_id=r.conv_id, salvaged=LOST_CREATION + "; its first messages were lost")
                self._anomaly(seq, r.conv_id, None, "a checkpoint continues a conversation whose first part was lost")
            c.messages.extend(msgs)
        for m in msgs:
            self._touch(m, seq)

    def _checkpoint_end(self, r: CheckpointEnd, seq: int) -> None:
        self.loading = False

    def _gap(self, r: Gap, seq: int) -> None:
        if r.opens_checkpoint and len(self.conversations) == 0 and len(self.gaps) == 0:
            self.loading = True  # the lost record opened the checkpoint whose parts follow
        copy = r.copy or (f"{r.segment:010d}.seg.{int(r.created_at)}.damaged" if r.created_at and r.segment else "")
        note = GapNote(seq, r.last_seq, r.segment, r.offset, r.nbytes, copy, r.reason.rstrip(), r.created_at,
                       [dict(a) for a in r.affected])
        for c in self.conversations.values():  # replies being written when the records were lost
            if c.deleted:
                continue
            for m in c.messages:
                if m.status in ("accepted", "streaming"):
                    note.affected.append({"conv_id": c.conv_id, "msg_id": m.msg_id,
                                          "what": "a reply being written when the records were lost"})
        self.gaps.append(note)
        if r.last_seq > self.last_seq:
            self.last_seq = r.last_seq
