"""The engine's conversation store: every state change is a journal record.

Owns: ids, turning client operations into records, journal credit for them (an
operation's records are published all or none: credit for every one is reserved
first, ``Journal.reserve``), publishing them through the journal (or numbering
them in memory when the journal is off, for benchmarks) and applying them to the
journal's ``ConversationTable``, the one state machine that recovery replays too.
So what a client sees is exactly what a restart rebuilds. ``open_store`` wires the
receipts one way: the journal's drain hands each receipt to ``receipts.Receipts``,
which tells the clients and the engine's inbox. Leaves files, fsync and receipts'
making to ``engine/journal``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from aotx.engine.errors import AotxError, ErrorCode, JournalError, NotFound
from aotx.engine import protocol as P
from aotx.engine.journal import records as R
from aotx.engine.journal.conversations import ConversationTable, Receipt
from aotx.engine.runtime.admission import Refusal, journal_refusal
from aotx.engine.runtime.events import Inbox
from aotx.engine.runtime.receipts import Receipts

log = logging.getLogger("aotx.store")


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:10]


def _sampling_dict(sp: P.SamplingParams | None) -> dict[str, Any]:
    return msgspec.to_builtins(sp) if sp is not None else {}


class ConversationStore:
    """Conversations, journaled. ``journal`` None keeps them in memory only.

    ``receipts``: where the journal's receipts go (``open_store`` gives the same object
    to the Journal); ``receipts.inbox`` is the engine's inbox."""

    def __init__(self, table: ConversationTable, journal=None, recovery_note: str = "",
                 receipts: Receipts | None = None, notices: list[str] | None = None):
        self.table = table
        self.journal = journal
        self.recovery_note = recovery_note
        self.notices: list[str] = list(notices or [])  # for users: damage recovery salvaged at start
        self.receipts = receipts if receipts is not None else Receipts(Inbox())
        self._seq = table.last_seq
        self._segments_at_checkpoint = 0
        self._checkpoint = None  # a journal.writer.CheckpointRun in progress
        self._tick = 0

    @property
    def journaled(self) -> bool:
        return self.journal is not None

    @property
    def inbox(self) -> Inbox:
        return self.receipts.inbox

    def _record(self, rec, tick: int) -> int:
        if self.journal is not None:
            seq = self.journal.publish(rec, tick)
        else:
            self._seq += 1
            seq = self._seq
        self.table.apply(rec, seq, tick)
        return seq

    def _publish(self, recs: Sequence[Any], tick: int, what: str) -> list[int]:
        """Publish ``recs`` all or none: credit for every one is reserved first, else
        ``admission.Refusal`` (resource journal) and nothing is written."""
        if self.journal is not None:
            self.check_writable()
            need = sum(self.record_bytes(r) for r in recs)
            if not self.journal.reserve(need):
                if self.journal.degraded:  # the disk is full: say which, and what it needs
                    raise Refusal(ErrorCode.BUSY, "disk", f"{what} was not written: {self.journal.degraded}",
                                  asked=need, free=0, accepts="nothing until space returns")
                raise journal_refusal(what, need, self.journal.free_bytes, self.journal.capacity)
        return [self._record(r, tick) for r in recs]

    def note_receipt(self, receipt: Receipt) -> None:
        """On the engine thread: mark the messages the receipt covers as durable (and
        write the next chunk of an online checkpoint whose last chunk it covers)."""
        self.table.note_receipt(receipt)
        if self._checkpoint is not None and receipt.last_seq >= self._checkpoint.waiting_seq:
            self._step_checkpoint(self._tick)

    # ---- journal credit ---------------------------------------------------------------

    @staticmethod
    def record_bytes(rec) -> int:
        """Bytes ``rec`` takes in the journal's buffer (its frame)."""
        return R.FRAME_OVERHEAD + len(R.encode_payload(rec))

    def check_writable(self) -> None:
        """Raise ``JournalError`` when the journal failed (no credit will ever come back)."""
        if self.journal is not None and self.journal.failed is not None:
            raise JournalError(f"the journal failed and takes no more records: {self.journal.failed}")

    def reserve(self, nbytes: int) -> bool:
        """Take journal credit for ``nbytes`` (always True without a journal)."""
        return self.journal is None or self.journal.reserve(nbytes)

    def release(self, nbytes: int) -> None:
        """Give back credit that will not be used."""
        if self.journal is not None and nbytes > 0:
            self.journal.release(nbytes)

    @property
    def journal_capacity(self) -> int:
        return self.journal.capacity if self.journal is not None else 0

    def journal_free_bytes(self) -> int:
        return self.journal.free_bytes if self.journal is not None else 0

    def flush(self) -> None:
        if self.journal is not None:
            self.journal.flush()

    def maybe_checkpoint(self, tick: int, every_segments: int = 2) -> None:
        """Compact online once ``every_segments`` new segments have been created since
        the last checkpoint: the journal streams the live conversations into a fresh
        segment, one chunk per call or receipt (never waiting on disk), and drops the
        older segments once it is durable (deleted conversations go)."""
        if self.journal is None:
            return
        self._tick = tick
        if self._checkpoint is not None:
            self._step_checkpoint(tick)
            return
        created = self.journal.stats().get("segments_created", 0)
        if created - self._segments_at_checkpoint >= every_segments:
            try:
                run = self.journal.begin_checkpoint(self.table, tick)
            except AotxError as e:
                log.warning("online checkpoint not started: %s", e)
                self._segments_at_checkpoint = created
                return
            if run is not None:
                self._segments_at_checkpoint = created + 1
                self._checkpoint = run

    def _step_checkpoint(self, tick: int) -> None:
        try:
            if self.journal.checkpoint_step(self._checkpoint, self.table, tick):
                self._checkpoint = None
        except AotxError as e:  # never let compaction take the engine down: try again later
            log.warning("online checkpoint abandoned: %s", e)
            self.journal.abort_checkpoint(self._checkpoint)
            self._checkpoint = None

    def hold_reason(self) -> str:
        """"" normally; while the journal's disk is full, the line saying which disk,
        how much is needed and how much is free (new work is held meanwhile)."""
        return self.journal.degraded if self.journal is not None else ""

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()

    def journal_status(self) -> dict[str, Any]:
        if self.journal is None:
            return {"enabled": False}
        d = dict(self.journal.stats())
        d["last_seq"] = self.journal.last_seq
        d["durable_seq"] = self.journal.durable_seq
        d["enabled"] = True
        return d

    # ---- reads ------------------------------------------------------------------

    def get(self, conv_id: str):
        c = self.table.get(conv_id)
        if c is None:
            raise NotFound(f"no conversation {conv_id!r}")
        return c

    def view(self, conv_id: str, busy: set[str] | frozenset = frozenset(), messages: bool = True) -> P.ConversationView:
        c = self.get(conv_id)
        d = c.to_dict(messages=messages)
        d["busy"] = conv_id in busy
        if not d.get("sampling"):
            d.pop("sampling", None)
        return msgspec.convert(d, P.ConversationView)

    def list_views(self, busy: set[str] | frozenset = frozenset()) -> list[P.ConversationView]:
        out = []
        for c in self.table.live():
            d = c.to_dict(messages=False)
            d["busy"] = c.conv_id in busy
            if not d.get("sampling"):
                d.pop("sampling", None)
            out.append(msgspec.convert(d, P.ConversationView))
        return out

    def chat_messages(self, conv_id: str) -> list[dict[str, Any]]:
        """The conversation as chat-template messages: the system prompt (when set), then
        every user message and every reply with text (interrupted ones included), tool
        results, and each message's template fields (``meta``: an assistant's
        ``tool_calls``, a tool result's ``tool_call_id`` and ``name``)."""
        c = self.get(conv_id)
        msgs: list[dict[str, Any]] = []
        if c.system_prompt:
            msgs.append({"role": "system", "content": c.system_prompt})
        for m in c.messages:
            if m.role == "assistant" and ((not m.text and not m.meta.get("tool_calls")) or m.status == "failed"):
                continue
            msgs.append({**P.template_fields(m.meta), "role": m.role, "content": m.text})
        return msgs

    def prompt_history(self, conv_id: str) -> tuple[dict[str, Any] | None, list[tuple[str, dict[str, Any]]], int]:
        """What the conversation's next prompt is made of (``context.History``): the system
        message (or None), the other messages as ``chat_messages`` gives them with their
        ids, and the index where the last journaled cut left the prompt starting (0: none)."""
        from aotx.engine.runtime.context import start_of

        c = self.get(conv_id)
        system = {"role": "system", "content": c.system_prompt} if c.system_prompt else None
        msgs: list[tuple[str, dict[str, Any]]] = []
        for m in c.messages:
            if m.role == "assistant" and ((not m.text and not m.meta.get("tool_calls")) or m.status == "failed"):
                continue
            msgs.append((m.msg_id, {**P.template_fields(m.meta), "role": m.role, "content": m.text}))
        kept_from = [m.context["kept_from"] for m in c.messages if m.context.get("kept_from")]
        return system, msgs, start_of(msgs, kept_from)

    # ---- writes -----------------------------------------------------------------

    def create(self, title: str, system_prompt: str | None, sampling: P.SamplingParams | None,
               tick: int = 0, messages: Sequence[tuple] = (), model: str = "", origin: str = "",
               context: str = "") -> P.ConversationView:
        """A new conversation on ``model`` with context policy ``context`` ("": the engine's),
        with ``messages`` (role, text[, meta]) stored as finished history."""
        cid = _new_id("c")
        now = time.time()
        recs: list[Any] = [R.ConversationCreated(conv_id=cid, title=title or "New conversation", created_at=now,
                                                 system_prompt=system_prompt, sampling=_sampling_dict(sampling),
                                                 model=model, origin=origin, context=context)]
        for role, text, *meta in messages:
            mid = _new_id("m")
            recs.append(R.MessageAccepted(conv_id=cid, msg_id=mid, role=role, text=text, created_at=now,
                                          meta=dict(meta[0]) if meta and meta[0] else {}))
            if role == "assistant":
                recs.append(R.MessageFinished(conv_id=cid, msg_id=mid, reason="stop"))
        self._publish(recs, tick, "a new conversation")
        self.flush()
        return self.view(cid)

    def rename(self, conv_id: str, title: str, tick: int = 0) -> None:
        self.get(conv_id)
        self._publish([R.ConversationRenamed(conv_id=conv_id, title=title)], tick, "a rename")
        self.flush()

    def update(self, conv_id: str, system_prompt: str | None, sampling: P.SamplingParams | None,
               tick: int = 0) -> None:
        self.get(conv_id)
        self._publish([R.ConversationUpdated(conv_id=conv_id, system_prompt=system_prompt,
                                             sampling=_sampling_dict(sampling))], tick, "an update")
        self.flush()

    def switch_model(self, conv_id: str, model: str, tick: int = 0) -> None:
        """Run the conversation on ``model`` from its next reply on (history kept)."""
        c = self.get(conv_id)
        self._publish([R.ConversationUpdated(conv_id=conv_id, system_prompt=c.system_prompt, sampling=dict(c.sampling),
                                             model=model)], tick, "a model switch")
        self.flush()

    def set_context(self, conv_id: str, policy: str, tick: int = 0) -> None:
        """Run the conversation under context policy ``policy`` ("": the engine's) from its
        next message on."""
        c = self.get(conv_id)
        self._publish([R.ConversationUpdated(conv_id=conv_id, system_prompt=c.system_prompt, sampling=dict(c.sampling),
                                             context=policy)], tick, "a context policy")
        self.flush()

    def delete(self, conv_id: str, tick: int = 0) -> None:
        self.get(conv_id)
        self._publish([R.ConversationDeleted(conv_id=conv_id)], tick, "a deletion")
        self.flush()

    def truncate(self, conv_id: str, msg_id: str, tick: int = 0) -> None:
        c = self.get(conv_id)
        if c.message(msg_id) is None:
            raise NotFound(f"conversation {conv_id} has no message {msg_id!r}")
        self._publish([R.ConversationTruncated(conv_id=conv_id, msg_id=msg_id)], tick, "a truncation")
        self.flush()

    def capsule_stored(self, conv_id: str, path: str, fingerprint: str, n_tokens: int, tick: int = 0) -> int:
        (seq,) = self._publish([R.CapsuleStored(conv_id=conv_id, path=path, fingerprint=fingerprint,
                                                n_tokens=n_tokens)], tick, "a capsule record")
        self.flush()
        return seq

    def fork(self, conv_id: str, at_msg_id: str | None, tick: int = 0) -> P.ConversationView:
        """Copy ``conv_id`` (messages up to and including ``at_msg_id``) into a new
        conversation, as records, so the fork is journaled like any other."""
        c = self.get(conv_id)
        msgs = list(c.messages)
        if at_msg_id:
            idx = next((i for i, m in enumerate(msgs) if m.msg_id == at_msg_id), None)
            if idx is None:
                raise NotFound(f"conversation {conv_id} has no message {at_msg_id!r}")
            msgs = msgs[:idx + 1]
        nid = _new_id("c")
        recs: list[Any] = [R.ConversationCreated(conv_id=nid, title=f"{c.title} (fork)", created_at=time.time(),
                                                 system_prompt=c.system_prompt, sampling=dict(c.sampling),
                                                 model=c.model, context=c.context)]
        ids: dict[str, str] = {}  # the parent's message ids -> the fork's
        for m in msgs:
            mid = ids[m.msg_id] = _new_id("m")
            recs.append(R.MessageAccepted(conv_id=nid, msg_id=mid, role=m.role, text=m.text if m.role != "assistant"
                                          else "", attachments=list(m.attachments), sampling=dict(m.sampling),
                                          created_at=m.created_at, meta=dict(m.meta), model=m.model))
            if m.role == "assistant":
                recs.append(R.TokensCommitted(conv_id=nid, msg_id=mid, start_pos=m.start_pos,
                                              token_ids=list(m.token_ids), text=m.text))
                recs.append(R.MessageFinished(conv_id=nid, msg_id=mid, reason=m.finish_reason or "stop",
                                              n_prompt=m.n_prompt, n_completion=m.n_completion,
                                              context=_renamed_cut(m.context, ids)))
        if c.model:  # the parent's model, even when its last reply ran on another one
            recs.append(R.ConversationUpdated(conv_id=nid, system_prompt=c.system_prompt, sampling=dict(c.sampling),
                                              model=c.model))
        self._publish(recs, tick, "a fork")
        self.flush()
        return self.view(nid)

    def accept_records(self, conv_id: str, role: str, text: str, sp: P.SamplingParams,
                       attachments: list[P.Attachment], raw: bool = False,
                       meta: dict[str, Any] | None = None, model: str = "", model_path: str = "",
                       model_fingerprint: str = "") -> tuple[str, str, list[Any]]:
        """The records of a user's message (or a tool's result: ``role`` "tool", its
        ``meta``) and the start of its reply (written by ``model``, loaded from ``model_path``,
        of fingerprint ``model_fingerprint``: "" for a remote model), not yet published:
        (message id, reply id, records). ``publish_accepted`` publishes them once the
        caller holds credit for them (``record_bytes``)."""
        now = time.time()
        mid, rid = _new_id("m"), _new_id("m")
        atts = [R.AttachmentRef(sha256=a.sha256, kind=a.kind, name=a.name, path=a.path) for a in attachments]
        return mid, rid, [R.MessageAccepted(conv_id=conv_id, msg_id=mid, role=role, text=text,
                                            sampling=_sampling_dict(sp), attachments=atts, created_at=now,
                                            meta=dict(meta or {})),
                          R.MessageAccepted(conv_id=conv_id, msg_id=rid, role="assistant", text="",
                                            sampling={"raw": True} if raw else {}, created_at=now, model=model,
                                            model_path=model_path, model_fingerprint=model_fingerprint)]

    def fork_choice(self, conv_id: str, msg_id: str, raw: bool = False, tick: int = 0,
                    model: str = "", model_path: str = "", model_fingerprint: str = "") -> tuple[str, str, str, int]:
        """Another choice of the reply to ``msg_id`` (n > 1): a fork of ``conv_id`` up to and
        including that message, with the start of its own reply, published in one go.
        Returns (the fork's conversation id, its copy of the message's id, the reply's id,
        the seq covering them)."""
        view = self.fork(conv_id, msg_id, tick=tick)
        mid = view.messages[-1].msg_id
        rid = _new_id("m")
        (seq,) = self._publish([R.MessageAccepted(conv_id=view.conv_id, msg_id=rid, role="assistant", text="",
                                                  sampling={"raw": True} if raw else {}, created_at=time.time(),
                                                  model=model, model_path=model_path,
                                                  model_fingerprint=model_fingerprint)],
                               tick, "a choice's reply")
        return view.conv_id, mid, rid, seq

    def publish_accepted(self, recs: Sequence[Any], tick: int = 0) -> int:
        """Publish ``accept_records``' records (credit reserved); the seq covering both."""
        seq = 0
        for rec in recs:
            seq = self._record(rec, tick)
        return seq

    def commit_tokens(self, conv_id: str, msg_id: str, start_pos: int, ids: list[int], text: str,
                      tick: int = 0) -> tuple[int, int]:
        """Publish one tick's tokens of a reply: (seq, bytes of credit it took)."""
        rec = R.TokensCommitted(conv_id=conv_id, msg_id=msg_id, start_pos=start_pos, token_ids=list(ids), text=text)
        return self._record(rec, tick), self.record_bytes(rec) if self.journal is not None else 0

    def finish(self, conv_id: str, msg_id: str, reason: str, n_prompt: int, n_completion: int,
               tick: int = 0, context: P.ContextCut | None = None) -> tuple[int, int]:
        """Publish a reply's finish (``context``: where its prompt left earlier messages
        out): (seq, bytes of credit it took)."""
        rec = R.MessageFinished(conv_id=conv_id, msg_id=msg_id, reason=reason, n_prompt=n_prompt,
                                n_completion=n_completion, context=msgspec.to_builtins(context) if context else {})
        return self._record(rec, tick), self.record_bytes(rec) if self.journal is not None else 0


def _renamed_cut(cut: dict[str, Any], ids: dict[str, str]) -> dict[str, Any]:
    """A reply's cut with the message ids a fork gave its copies (ids it lacks: "")."""
    if not cut:
        return {}
    return {k: (ids.get(v, "") if k in ("first", "last", "kept_from") else v) for k, v in cut.items()}


def open_store(directory: Path | None, *, buffer_bytes: int = 8 << 20,
               segment_bytes: int = 64 << 20, fs=None) -> ConversationStore:
    """Recover the journal in ``directory`` (None: no journal) and return a store on it.

    The receipts' way is fixed here: the Journal gets ``Receipts.deliver`` as its
    ``on_receipt``, the store the same ``Receipts`` (whose inbox the engine reads).
    Replies cut by a crash are marked interrupted, and that is journaled too.
    ``fs``: the journal's file layer (``aotx.engine.fileio``; tests inject faults)."""
    receipts = Receipts(Inbox())
    if directory is None:
        return ConversationStore(ConversationTable(), None, "journal off", receipts)
    from aotx.engine.journal.writer import Journal

    journal = Journal(directory, segment_bytes=segment_bytes, buffer_bytes=buffer_bytes, on_receipt=receipts.deliver,
                      **({} if fs is None else {"fs": fs}))
    report = journal.recovery
    table = report.table
    cut = table.finish_recovery()  # recovery marks them already; this catches any it left
    store = ConversationStore(table, journal, report.summary(), receipts, notices=report.notices())
    # journal the interruption, so the reply's end is on disk like any other finish
    for conv in table.live():
        for m in conv.messages:
            if m.status == "interrupted" and (m.msg_id in report.interrupted or m in cut):
                store._record(R.MessageFinished(conv_id=conv.conv_id, msg_id=m.msg_id, reason="interrupted",
                                                n_completion=len(m.token_ids)), report.last_tick)
    store.flush()
    return store
