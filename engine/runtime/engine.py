"""The engine: one loop over typed events on one thread, and the tick.

Owns: the engine thread, its tables of requests (waiting in line, running in a
slot, by client request id) and the dispatch of every event by its type
(``events.py``): client operations (each validated first: ``protocol.validate``,
whoever the client is, so a refused operation writes nothing), receipts, media
stages that finished, capsule files written, clients gone.

A tick is one bounded step (DESIGN.md, "The tick"): cancellations take effect;
**admit**: queued requests take free slots (``scheduler.plan_leases``, the KV put in
place by ``executor.lease``); **schedule**: the batch's rows inside the
``envelope`` (``scheduler.plan_tick``); **device work**: one batched forward pass
with sampling (``executor.run``: continuous batching, speculative verify windows);
**publish**: records and events (``commit.apply``) and the finish of replies that
ended; the journal groups the tick's records into one block and a tick never waits
on disk. Records and events carry ``(tick, seq)``.

Leaves to others: sockets (``ipc/server.py``), a message's way in (``submit.py``),
admission (``admission.py``), conversation state (``store.py``), receipts
(``receipts.py``), the math (the model). Thread model: events arrive through
``post``/``post_disconnect`` from any thread (``events.Inbox``) and run on the
engine thread; events leave through each request's ``sink.send``, which must be
thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from aotx.engine.errors import AotxError, Busy, ErrorCode
from aotx.engine.ipc import protocol as P
from aotx.engine.runtime.admission import Budget, Refusal
from aotx.engine.runtime.commit import Commit
from aotx.engine.runtime.drafter import DEFAULT_P_MIN, DraftModel
from aotx.engine.runtime.envelope import Envelope
from aotx.engine.runtime.events import (
    CapsuleWritten, ClientOp, Disconnected, MediaReady, ReceiptArrived, Wake,
)
from aotx.engine.runtime.executor import DeviceError, Executor
from aotx.engine.runtime.requests import Request, RequestState, Sink
from aotx.engine.runtime.scheduler import plan_leases, plan_tick
from aotx.engine.runtime.slots import SlotTable
from aotx.engine.runtime.submit import Submitter
from aotx.engine.units import fmt_bytes

log = logging.getLogger("aotx.engine")

IDLE_WAIT_S = 0.5  # an idle loop wakes this often, so a signal handler on the main thread gets to run


class Engine:
    """Runs one model for many conversations and clients.

    lm: a ``loader.LoadedModel``; store: a ``store.ConversationStore`` (journaled or
    in-memory; its inbox is the engine's); n_slots, n_ctx: slot count and tokens of
    context per slot; prefill_chunk: most prompt tokens prefilled per tick (others keep
    decoding); budget: admission's start-up ``Budget`` (for status); kv_type: the KV
    cache's element type, "f16" (default) or "f32"; speculative: the
    default drafter (auto | ngram | draft | off); draft_lm: a draft model's
    ``LoadedModel`` (same vocabulary; its own slots and KV: ``drafter.DraftModel``).
    ``vision`` (a ``media.vision.VisionEncoder``) and ``images`` (a
    ``media_prompt.ImageStore``) are set by ``serve`` when images go to an encoder.
    """

    def __init__(self, lm: Any, store: Any, *, n_slots: int = 8, n_ctx: int = 4096, prefill_chunk: int = 256,
                 budget: Budget | None = None, device: str = "cpu", capsules: Any = None, speculative: str = "off",
                 draft_lm: Any = None, draft_p_min: float = DEFAULT_P_MIN, kv_type: str = "f16"):
        self.lm = lm
        self.store = store
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        self.prefill_chunk = prefill_chunk
        self.budget = budget
        self.device = device
        self.capsules = capsules  # state.cache.CapsuleCache or None
        self.speculative = speculative
        self.envelope = Envelope.of(lm.config, n_slots, n_ctx, prefill_chunk, store.journal_capacity)
        self.kv = lm.model.new_kv_cache(n_slots, n_ctx, kv_type)
        self.draft = DraftModel(draft_lm, n_slots, n_ctx, p_min=draft_p_min) if draft_lm is not None else None
        self.slots = SlotTable(n_slots)
        self.tick = 0
        self.stats = {"ticks": 0, "tokens": 0, "device_s": 0.0, "host_s": 0.0}
        self._inbox = store.inbox
        self._waiting: deque[Request] = deque()   # accepted, in arrival order (durable_wait or queued)
        self._running: list[Request] = []         # prefill or decode, holding a slot
        self._by_rid: dict[tuple[int, int], Request] = {}
        self.executor = Executor(lm, self.kv, device=device, capsules=capsules, draft=self.draft)
        self.commit = Commit(store, self.slots, self.executor.numerics)
        self.submitter = Submitter(lm, store, self.envelope, self._inbox, self._is_busy, device=device,
                                   speculative=speculative, draft=self.draft)
        self.submitter.count_media = self.count_media
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._handlers: dict[type, Callable[[Any], None]] = {
            ClientOp: self._on_client_op, ReceiptArrived: self._on_receipt, MediaReady: self._on_media_ready,
            CapsuleWritten: self._on_capsule_written, Disconnected: self._on_disconnect, Wake: lambda ev: None,
        }
        self._operations: dict[type, Callable[[Any, Sink], None]] = {
            P.CreateConversation: self._create, P.ListConversations: self._list, P.ShowConversation: self._show,
            P.SubmitMessage: self._submit, P.Cancel: self._cancel_op, P.DeleteConversation: self._delete,
            P.RenameConversation: self._rename, P.UpdateConversation: self._update,
            P.TruncateConversation: self._truncate, P.ForkConversation: self._fork, P.Status: self._status,
        }
        assert set(self._operations) == set(P.OPERATIONS), "every protocol operation has a handler"

    # ---- what other parts set and read ----------------------------------------------

    @property
    def ready(self) -> bool:
        return self.submitter.ready

    @property
    def not_ready_reason(self) -> str:
        return self.submitter.not_ready_reason

    @property
    def vision(self) -> Any:
        return self.submitter.vision

    @vision.setter
    def vision(self, enc: Any) -> None:
        self.submitter.vision = enc

    @property
    def images(self) -> Any:
        return self.executor.images

    @images.setter
    def images(self, store: Any) -> None:
        self.submitter.images = self.executor.images = store

    # ---- thread plumbing ---------------------------------------------------------------

    def start(self) -> None:
        """Run the loop on a thread of its own (tests, tools). ``aotx serve`` calls
        ``run()`` on the main thread instead: numba's OpenMP pool belongs to the thread
        that launches parallel work, and the model was loaded (and warmed up) there; a
        second launching thread brings a second spinning pool and halves decode speed."""
        self._thread = threading.Thread(target=self.run, name="aotx-tick", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the loop to stop after the current tick (safe from a signal handler)."""
        self._stop.set()
        self._inbox.put(Wake())

    def stop(self) -> None:
        self.request_stop()
        if self._thread:
            self._thread.join(timeout=10)

    def post(self, op: Any, sink: Sink) -> None:
        """Queue a client operation (a protocol ``Operation``), answered through ``sink.send``."""
        self._inbox.put(ClientOp(op, sink))

    def post_disconnect(self, sink: Sink) -> None:
        """The client behind ``sink`` went away: its accepted replies finish (``_on_disconnect``)."""
        self._inbox.put(Disconnected(sink))

    def _has_work(self) -> bool:
        return bool(self._running) or any(r.state is RequestState.QUEUED for r in self._waiting)

    def run(self) -> None:
        """The loop, on the calling thread, until ``request_stop``: every event that
        arrived, then a tick while there is work."""
        while not self._stop.is_set():
            ev = self._inbox.get(0 if self._has_work() else IDLE_WAIT_S)
            while ev is not None:
                self._handlers[type(ev)](ev)
                ev = self._inbox.get(0)
            if not self._stop.is_set() and self._has_work():
                try:
                    self._tick()
                except Exception as e:  # noqa: BLE001 - a bug in publishing must not stop the engine
                    log.exception("tick %d failed", self.tick)
                    for r in list(self._running):
                        r.sink.send(P.Error(id=r.rid, code=ErrorCode.INTERNAL,
                                            message=f"internal error at tick {self.tick}: {e}"))
                        try:
                            self._finish(r, "error")
                        except Exception:  # noqa: BLE001
                            log.exception("could not finish request %d", r.rid)
                            self._running.remove(r) if r in self._running else None

    # ---- events ------------------------------------------------------------------------

    def _guarded(self, fn: Callable[[], None], op: Any, sink: Sink) -> None:
        """Run one client operation; refusals and bugs become an Error reply."""
        try:
            fn()
        except AotxError as e:
            if isinstance(e, Refusal) and (notice := e.notice(op.id)) is not None:
                sink.send(notice)
            if isinstance(op, P.SubmitMessage):
                log.info("refused a message for %s (%s): %s", op.conv_id, e.code, e)
            sink.send(P.Error(id=getattr(op, "id", 0), code=e.code, message=str(e)))
        except Exception as e:  # noqa: BLE001 - a bug must not kill the engine thread
            log.exception("operation %s failed", type(op).__name__)
            sink.send(P.Error(id=getattr(op, "id", 0), code=ErrorCode.INTERNAL, message=f"internal error: {e}"))

    def _on_client_op(self, ev: ClientOp) -> None:
        def run() -> None:
            P.validate(ev.op)
            self._operations[type(ev.op)](ev.op, ev.sink)

        self._guarded(run, ev.op, ev.sink)

    def _on_media_ready(self, ev: MediaReady) -> None:
        sub = ev.submission
        self._guarded(lambda: self._enqueue(self.submitter.media_ready(sub, self.tick)), sub.op, sub.sink)

    def _on_receipt(self, ev: ReceiptArrived) -> None:
        """Mark messages durable, let requests whose user message is now durable into the
        line, retry the messages held for journal credit that now fits."""
        self.store.note_receipt(ev.receipt)
        for r in ev.accepted:
            if r.state is RequestState.DURABLE_WAIT:
                r.state = RequestState.QUEUED
        for sub in self.submitter.take_held(self.store.journal_free_bytes()):
            self._guarded(lambda sub=sub: self._enqueue(self.submitter.prompt(sub, self.tick)), sub.op, sub.sink)

    def _on_capsule_written(self, ev: CapsuleWritten) -> None:
        if self.store.table.get(ev.conv_id) is None:
            return
        try:
            self.store.capsule_stored(ev.conv_id, ev.path, self.lm.fingerprint, ev.n_tokens, tick=self.tick)
        except AotxError as e:  # no credit: the file stays, unjournaled (it is found again by name)
            log.warning("capsule of %s not journaled: %s", ev.conv_id, e)

    def _on_disconnect(self, ev: Disconnected) -> None:
        """A client went away (closed, or killed mid-reply). Its accepted messages are
        the user's: their replies run to the end here and are journaled, so the reply is
        there when the user comes back (nobody cancelled it: issue 17, defect 6); events
        for the closed connection are dropped. Work not yet accepted is dropped."""
        self.submitter.drop(ev.sink)

    # ---- client operations ---------------------------------------------------------------

    def _create(self, op: P.CreateConversation, sink: Sink) -> None:
        view = self.store.create(op.title, op.system_prompt, op.sampling, tick=self.tick,
                                 messages=[(m.role, m.text) for m in op.messages])
        sink.send(P.ConversationInfo(id=op.id, conversation=view))

    def _list(self, op: P.ListConversations, sink: Sink) -> None:
        sink.send(P.ConversationList(id=op.id, conversations=self.store.list_views(busy=self._busy_convs())))

    def _show(self, op: P.ShowConversation, sink: Sink) -> None:
        sink.send(P.ConversationInfo(id=op.id, conversation=self.store.view(op.conv_id, busy=self._busy_convs())))

    def _submit(self, op: P.SubmitMessage, sink: Sink) -> None:
        self._enqueue(self.submitter.submit(op, sink, self.tick))

    def _cancel_op(self, op: P.Cancel, sink: Sink) -> None:
        for r in list(self._by_rid.values()):
            if (op.target and r.rid == op.target and r.sink is sink) or (op.conv_id and r.conv_id == op.conv_id):
                self._cancel(r)
        sink.send(P.Ok(id=op.id))

    def _delete(self, op: P.DeleteConversation, sink: Sink) -> None:
        self._require_idle(op.conv_id)
        self.store.delete(op.conv_id, tick=self.tick)
        self.slots.forget(op.conv_id)
        if self.capsules is not None:
            self.capsules.drop(op.conv_id)
        sink.send(P.Ok(id=op.id))

    def _rename(self, op: P.RenameConversation, sink: Sink) -> None:
        self.store.rename(op.conv_id, op.title, tick=self.tick)
        sink.send(P.Ok(id=op.id))

    def _update(self, op: P.UpdateConversation, sink: Sink) -> None:
        self.store.update(op.conv_id, op.system_prompt, op.sampling, tick=self.tick)
        sink.send(P.Ok(id=op.id))

    def _truncate(self, op: P.TruncateConversation, sink: Sink) -> None:
        self._require_idle(op.conv_id)
        self.store.truncate(op.conv_id, op.msg_id, tick=self.tick)
        sink.send(P.Ok(id=op.id))

    def _fork(self, op: P.ForkConversation, sink: Sink) -> None:
        view = self.store.fork(op.conv_id, op.at_msg_id or None, tick=self.tick)
        sink.send(P.ConversationInfo(id=op.id, conversation=view))

    def _status(self, op: P.Status, sink: Sink) -> None:
        sink.send(self.status_reply(op.id))

    def _busy_convs(self) -> set[str]:
        return {r.conv_id for r in self._by_rid.values()}

    def _is_busy(self, conv_id: str) -> bool:
        return any(r.conv_id == conv_id for r in self._by_rid.values())

    def _require_idle(self, conv_id: str) -> None:
        if self._is_busy(conv_id):
            raise Busy(f"conversation {conv_id} is generating; cancel it first")

    # ---- requests --------------------------------------------------------------------

    def _enqueue(self, r: Request | None) -> None:
        """An accepted request joins the line (None: the submission is not done yet)."""
        if r is None:
            return
        self._by_rid[(id(r.sink), r.rid)] = r
        self._waiting.append(r)
        self.commit.queue_notices(self._waiting, self.n_slots)

    def _cancel(self, r: Request) -> None:
        if r.state is RequestState.DONE:
            return
        r.cancelled = True
        if r.state in (RequestState.DURABLE_WAIT, RequestState.QUEUED):
            self._waiting.remove(r)
            self._finish(r, "cancelled")

    def _finish(self, r: Request, reason: str) -> None:
        if r in self._running:
            self._running.remove(r)
        if r.slot is not None:
            # the KV holds prompt + completion[:-1]; keep that for prefix reuse
            self.slots.release(r.slot)
            if reason in ("stop", "length", "context"):
                self.executor.persist(r, lambda conv_id, path, n: self._inbox.put(CapsuleWritten(conv_id, path, n)))
        self._by_rid.pop((id(r.sink), r.rid), None)
        self.commit.finish(r, reason, self.tick)
        self.commit.queue_notices(self._waiting, self.n_slots)

    # ---- the tick ------------------------------------------------------------------------

    def _tick(self) -> None:
        t0 = time.perf_counter()
        self.tick += 1
        for r in [r for r in self._running if r.cancelled]:  # cancellations take effect at the tick boundary
            self._finish(r, "cancelled")
        for lease in plan_leases(self._waiting, self.slots):
            self._waiting.remove(lease.request)
            self.commit.leased(lease, self.executor.lease(lease))
            self._running.append(lease.request)
        self.commit.queue_notices(self._waiting, self.n_slots)
        plan = plan_tick(self._running, self.envelope)
        if plan.empty:
            return
        try:
            result = self.executor.run(plan, self.tick)
        except DeviceError as e:
            self._fail_closed(e)
            return
        n_out, finished = self.commit.apply(plan, result, self.tick)
        for r in finished:
            self._finish(r, r.finish_reason)
        self.stats["ticks"] += 1
        self.stats["tokens"] += n_out
        self.stats["device_s"] += result.device_s
        self.stats["host_s"] += time.perf_counter() - t0 - result.device_s

    def _fail_closed(self, e: DeviceError) -> None:
        """The device failed: refuse new work, fail every request, keep reads."""
        log.error("device work failed at tick %d", self.tick, exc_info=e.__cause__)
        reason = f"device work failed at tick {self.tick}: {e}"
        self.submitter.ready, self.submitter.not_ready_reason = False, reason
        # the queued ones too: they would otherwise run on a model marked not ready
        waiting, self._waiting = list(self._waiting), deque()
        for r in list(self._running) + waiting:
            r.sink.send(P.Error(id=r.rid, code=ErrorCode.NOT_READY, message=reason))
            self._finish(r, "error")
        self.submitter.fail_held(reason)

    # ---- media loaded when first needed ----------------------------------------------------

    def count_media(self, name: str, nbytes: int) -> str:
        """Admit a media specialist (``name``, e.g. "media: whisper-base") into the budget
        the first time an attachment needs it: "" when it fits (the budget now counts it,
        ``aotx status`` shows it), else why not. A text-only chat never counts it (issue 17,
        defect 8: the specialists took 1.1 GiB of the budget before any audio or picture)."""
        b = self.budget
        if b is None or any(n == name for n, _ in b.terms):
            return ""
        if nbytes > b.free:
            return (f"{name.removeprefix('media: ')} needs {fmt_bytes(nbytes)} ({nbytes:,} bytes) of the memory "
                    f"budget, {fmt_bytes(max(0, b.free))} is free: start the engine with a larger --memory-budget")
        self.budget = Budget(b.total, b.terms + ((name, nbytes),))
        log.info("budget: %s counted now (%d bytes), %d of %d bytes used", name, nbytes, self.budget.used, b.total)
        return ""

    # ---- status --------------------------------------------------------------------------

    def status_reply(self, rid: int) -> P.StatusReply:
        b = self.budget
        slots = [P.SlotView(slot=s.index, conv_id=s.conv_id if s.state != "free" else None, state=s.state,
                            position=len(s.tokens)) for s in self.slots.slots]
        return P.StatusReply(
            id=rid, model=self.lm.name, device=self.device, ready=self.ready,
            budget_bytes=b.total if b else 0, used_bytes=b.used if b else 0,
            budget=[P.BudgetLine(name=n, bytes=v) for n, v in (b.terms if b else ())],
            slots=slots, n_ctx=self.n_ctx, queue=sum(1 for r in self._waiting if r.state is RequestState.QUEUED),
            tick=self.tick, journal=self.store.journal_status(), profile=dict(self.lm.profile),
            notes=dict(getattr(self.lm, "notes", {})),
            capsules=self.capsules.usage() if self.capsules is not None else {},
            fingerprint=self.lm.fingerprint, model_path=str(self.lm.path),
            draft_model=self.draft.lm.name if self.draft else "",
            draft_model_path=str(self.draft.lm.path) if self.draft else "",
            stats={k: float(v) for k, v in self.stats.items()},
            degraded=self.store.hold_reason(), notices=list(self.store.notices),
        )
