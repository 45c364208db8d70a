"""The engine: one loop over typed events on one thread, and the tick.

Owns: the engine thread, its tables of requests (waiting in line, running in a
slot, by client request id) and the dispatch of every event by its type
(``events.py``): client operations (each validated first: ``protocol.validate``,
whoever the client is, so a refused operation writes nothing), receipts, media
and preparation stages that finished (a message's prompt is made on a worker,
never in the loop: ``prepare.py``), capsule files written, clients gone.

A tick is one bounded step (DESIGN.md, "The tick"): cancellations take effect;
**admit**: queued requests take free slots (``scheduler.plan_leases``, the KV put in
place by ``executor.lease``); **schedule**: the batch's rows inside the
``envelope`` (``scheduler.plan_tick``); **device work**: one batched forward pass
with sampling (``executor.run``: continuous batching, speculative verify windows);
**publish**: records and events (``commit.apply``) and the finish of replies that
ended; the journal groups the tick's records into one block and a tick never waits
on disk. Records and events carry ``(tick, seq)``.

Several models (``models.py``): each loaded model has its own slots, KV, line and
running requests; a tick runs each model's batch through its own forward, one after
the other. Operations name a model or follow their conversation's (the default
model's when it names none); a model not loaded is loaded on demand (admission
across all of them: ``ModelSet.ensure``). Remote models (``remote.py``) join the same
way: their stream's arrivals are committed in the tick like a local model's tokens.

Leaves to others: what each client operation does (``operations.py``: its handlers and
the dispatch table, checked complete), sockets (``ipc/server.py``), a message's way in
(``submit.py``),
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
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aotx.engine.errors import AotxError, ErrorCode
from aotx.engine import protocol as P
from aotx.engine.model.interface import KVCache
from aotx.engine.model.loader import LoadedModel
from aotx.engine.runtime.admission import Budget, Refusal
from aotx.engine.runtime.catalog import Catalog, ModelEntry
from aotx.engine.runtime.commit import Commit
from aotx.engine.runtime.drafter import DEFAULT_P_MIN, DraftModel
from aotx.engine.runtime.envelope import Envelope
from aotx.engine.runtime.events import (
    CapsuleWritten, ClientOp, Disconnected, MediaReady, Prepared, ReceiptArrived, RemoteEvent, Wake,
)
from aotx.engine.runtime.executor import DeviceError, Executor
from aotx.engine.runtime.media_prompt import ImageStore
from aotx.engine.runtime.models import (
    EXTRA_CAPSULE_HOST, LocalModel, ModelSet, ServedModel, header_terms, is_shared_term, local_terms,
)
from aotx.engine.runtime.operations import Operations
from aotx.engine.runtime.requests import Request, RequestState, Sink
from aotx.engine.runtime.slots import SlotTable
from aotx.engine.runtime.store import ConversationStore
from aotx.engine.runtime.context import ContinueJob
from aotx.engine.runtime.submit import Submission, Submitter
from aotx.engine.state.cache import CapsuleCache
from aotx.engine.units import fmt_bytes

if TYPE_CHECKING:   # media loads its encoders only when an image needs them
    from aotx.media.vision import VisionEncoder

log = logging.getLogger("aotx.engine")

IDLE_WAIT_S = 0.5  # an idle loop wakes this often, so a signal handler on the main thread gets to run


class Engine:
    """Runs several models for many conversations and clients.

    lm: the default model's ``loader.LoadedModel``; store: a ``store.ConversationStore``
    (journaled or in-memory; its inbox is the engine's); n_slots, n_ctx: slot count and
    tokens of context per slot (of every model; a model's context is at most its
    trained one); prefill_chunk: most prompt tokens prefilled per tick (others keep
    decoding); budget: admission's start-up ``Budget`` (the default model's terms and the
    engine's shared ones; None: no accounting); kv_type: the KV cache's element type
    of every model, "f16" (default) or "f32"; speculative: the default drafter (auto |
    ngram | draft | off); draft_lm: a draft model's ``LoadedModel`` for the default model
    (same vocabulary; its own slots and KV: ``drafter.DraftModel``). ``vision`` (a
    ``media.vision.VisionEncoder``) and ``images`` (a ``media_prompt.ImageStore``) are set
    by ``serve`` when images go to the default model's encoder.

    Several models: ``catalog`` (``catalog.Catalog``) names the installed ones;
    ``loader(entry)`` loads one (default: ``loader.load_model`` on ``device``);
    ``capsule_root``: the folder of capsule folders (one per model fingerprint; None:
    models loaded later keep capsules in memory only); ``keep_alive_s``: unload a model
    idle that long (0: never; never the default one); ``evict_idle``: unload idle models
    when a load would not fit (else the load is refused with the numbers).
    """

    def __init__(self, lm: LoadedModel, store: ConversationStore, *, n_slots: int = 8, n_ctx: int = 4096,
                 prefill_chunk: int = 256, budget: Budget | None = None, device: str = "cpu",
                 capsules: CapsuleCache | None = None, speculative: str = "off", draft_lm: LoadedModel | None = None,
                 draft_p_min: float = DEFAULT_P_MIN, catalog: Catalog | None = None,
                 loader: Callable[[ModelEntry], LoadedModel] | None = None, capsule_root: Path | None = None,
                 keep_alive_s: float = 0.0, evict_idle: bool = False, name: str = "",
                 kv_type: str = "f16", context_policy: str = "rolling"):
        self.store = store
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        self.prefill_chunk = prefill_chunk
        self.device = device
        self.speculative = speculative
        self.capsule_root = capsule_root
        self._loader = loader
        self.kv_type = kv_type
        self.context_policy = context_policy  # what a conversation without its own runs under (context.py)
        self.tick = 0
        self.stats = {"ticks": 0, "tokens": 0, "device_s": 0.0, "host_s": 0.0}
        self._inbox = store.inbox
        self._by_rid: dict[tuple[int, int, int], Request] = {}  # Request.key: (sink, request id, choice)
        self.catalog = catalog if catalog is not None else Catalog()
        entries = self.catalog.entries()
        # a file the catalog has (in the folder, or installed by link) runs under its catalog name
        name = name or next((e.name for e in entries.values()
                             if e.path is not None and e.path.resolve() == Path(lm.path).resolve()), lm.name)
        if name not in entries:  # opened by path: installed, so its name resolves after a restart
            self.catalog.install(name, lm.path)
        self.has_budget = budget is not None
        self._capsules_on = capsules is not None
        default = LocalModel(name, lm, store, self._inbox, self.is_busy, n_slots=n_slots, n_ctx=n_ctx,
                             prefill_chunk=prefill_chunk, device=device, capsules=capsules, speculative=speculative,
                             draft_lm=draft_lm, draft_p_min=draft_p_min, default=True, kv_type=kv_type,
                             context_policy=context_policy,
                             terms=tuple((n, v) for n, v in budget.terms if not is_shared_term(n)) if budget else
                             local_terms(lm, n_slots, n_ctx, prefill_chunk, kv_type=kv_type))
        self.models = ModelSet(self.catalog, budget.total if budget else 1 << 62,
                               tuple((n, v) for n, v in budget.terms if is_shared_term(n)) if budget else (),
                               keep_alive_s=keep_alive_s, evict_idle=evict_idle)
        self.models.context = n_ctx
        self.models.make_local = self._make_local
        self.models.make_remote = self._make_remote
        self.models.estimate = self._estimate
        self.models.add(default, default=True)
        default.submitter.count_media = self.count_media
        kv1 = lm.model.kv_cache_bytes(1, 16, kv_type)
        cfg = lm.config
        # bytes per cached value (2 for f16, 34/32 for q8_0's blocks, ...): other models' estimates
        self._kv_value_bytes = kv1 / max(1, 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 16)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._handlers: dict[type, Callable[[Any], None]] = {
            ClientOp: self._on_client_op, ReceiptArrived: self._on_receipt, MediaReady: self._on_media_ready,
            Prepared: self._on_prepared, CapsuleWritten: self._on_capsule_written,
            Disconnected: self._on_disconnect, RemoteEvent: lambda ev: None, Wake: lambda ev: None,
        }
        self._operations = Operations(self).table   # every protocol operation's handler (checked complete)

    # ---- the default model's parts (what single-model callers read) ---------------------------

    @property
    def default_model(self) -> LocalModel:
        return self.models.default

    @property
    def lm(self) -> LoadedModel:
        return self.default_model.lm

    @property
    def kv(self) -> KVCache:
        return self.default_model.kv

    @property
    def slots(self) -> SlotTable:
        return self.default_model.slots

    @property
    def envelope(self) -> Envelope:
        return self.default_model.envelope

    @property
    def executor(self) -> Executor:
        return self.default_model.executor

    @property
    def commit(self) -> Commit:
        return self.default_model.commit

    @property
    def submitter(self) -> Submitter:
        return self.default_model.submitter

    @property
    def draft(self) -> DraftModel | None:
        return self.default_model.draft

    @property
    def capsules(self) -> CapsuleCache | None:
        return self.default_model.capsules

    @property
    def budget(self) -> Budget | None:
        return self.models.budget() if self.has_budget else None

    @property
    def _waiting(self) -> list[Request]:
        return [r for m in self.models for r in m.waiting]

    @property
    def _running(self) -> list[Request]:
        return [r for m in self.models for r in m.running]

    # ---- what other parts set and read ----------------------------------------------

    @property
    def ready(self) -> bool:
        d = self.models.default
        return d.ready if d is not None else True

    @property
    def not_ready_reason(self) -> str:
        d = self.models.default
        return d.submitter.not_ready_reason if d is not None else ""

    @property
    def vision(self) -> VisionEncoder | None:
        return self.submitter.vision

    @vision.setter
    def vision(self, enc: VisionEncoder | None) -> None:
        self.submitter.vision = enc

    @property
    def images(self) -> ImageStore | None:
        return self.executor.images

    @images.setter
    def images(self, store: ImageStore | None) -> None:
        self.submitter.images = self.executor.images = store

    # ---- loading models ------------------------------------------------------------------

    def _estimate(self, entry: ModelEntry) -> tuple[tuple[str, int], ...]:
        ctx = min(self.n_ctx, entry.n_ctx_train) if entry.n_ctx_train else self.n_ctx
        return header_terms(entry, self.n_slots, ctx, self.prefill_chunk, self._kv_value_bytes,
                            EXTRA_CAPSULE_HOST if self._capsules_on else 0)

    def _make_local(self, entry: ModelEntry) -> LocalModel:
        """Load ``entry`` beside the others, with the engine's slots and context."""
        if self._loader is not None:
            lm = self._loader(entry)
        else:
            from aotx.engine.model.loader import load_model

            lm = load_model(entry.path, device=self.device)
        n_ctx = min(self.n_ctx, lm.config.n_ctx_train) if lm.config.n_ctx_train else self.n_ctx
        caps = None
        if self._capsules_on:
            from aotx.engine.state.cache import CapsuleCache

            root = self.capsule_root
            caps = CapsuleCache(root / lm.fingerprint if root is not None else None, host_bytes=EXTRA_CAPSULE_HOST,
                                fingerprint=lm.fingerprint, kv_type=self.kv_type)
        terms = local_terms(lm, self.n_slots, n_ctx, self.prefill_chunk,
                            capsule_host=EXTRA_CAPSULE_HOST if caps is not None else 0, kv_type=self.kv_type)
        # the device it was loaded on: serve's loader falls back to the CPU for a file CUDA cannot run
        device = lm.backend if getattr(lm, "backend", "") in ("cpu", "cuda") else self.device
        m = LocalModel(entry.name, lm, self.store, self._inbox, self.is_busy, n_slots=self.n_slots, n_ctx=n_ctx,
                       prefill_chunk=self.prefill_chunk, device=device, capsules=caps,
                       speculative="auto" if self.speculative == "draft" else self.speculative, terms=terms,
                       entry=entry, kv_type=self.kv_type, context_policy=self.context_policy)
        m.submitter.count_media = self.count_media
        return m

    def _make_remote(self, entry: ModelEntry) -> ServedModel:
        from aotx.engine.runtime.remote import RemoteModel

        return RemoteModel(entry, self.store, self._inbox, self.is_busy)

    def _model_of(self, r: Request) -> ServedModel:
        return self.models.get(r.model) or self.models.default

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
        for m in self.models:
            if m.kind == "remote":
                m.close()
        self._close_preparers()

    def _close_preparers(self) -> None:
        """The preparation workers end with the loop: a stopped engine leaves no thread."""
        for m in self.models:
            if m.kind != "remote":
                m.submitter.preparer.close()

    def post(self, op: P.Operation, sink: Sink) -> None:
        """Queue a client operation (a protocol ``Operation``), answered through ``sink.send``."""
        self._inbox.put(ClientOp(op, sink))

    def post_disconnect(self, sink: Sink) -> None:
        """The client behind ``sink`` went away: its accepted replies finish (``_on_disconnect``)."""
        self._inbox.put(Disconnected(sink))

    def _has_work(self) -> bool:
        return any(m.has_work() for m in self.models)

    def run(self) -> None:
        """The loop, on the calling thread, until ``request_stop``: every event that
        arrived, then a tick while there is work; idle models past their keep-alive
        unload between ticks."""
        while not self._stop.is_set():
            ev = self._inbox.get(0 if self._has_work() else IDLE_WAIT_S)
            while ev is not None:
                self._handlers[type(ev)](ev)
                ev = self._inbox.get(0)
            if self.models.keep_alive_s > 0:
                try:
                    self.models.expire()
                except AotxError:  # noqa: BLE001 - it became busy meanwhile: next time
                    pass
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
                            m = self._model_of(r)
                            if r in m.running:
                                m.running.remove(r)
        self._end_replies_on_stop()
        self._close_preparers()

    STOP_RECEIPT_WAIT_S = 2.0

    def _end_replies_on_stop(self) -> None:
        """The stop's last step (``aotx stop``, SIGTERM, SIGINT): each reply in progress is
        told why and ends as cancelled, its text so far committed and, with a journal, made
        durable (``STOP_RECEIPT_WAIT_S`` at most), so its client gets the usual Committed and
        receipt before the socket closes, instead of a connection closed mid-reply that
        reads like a crash."""
        live = [r for r in list(self._by_rid.values()) if r.state is not RequestState.DONE]
        for r in live:
            r.sink.send(P.Notice(id=r.rid, kind="stopping", resource="engine",
                                 message="the engine is stopping: this reply ends here, and what it wrote is kept"))
            try:
                self.cancel(r)
            except Exception:  # noqa: BLE001 - on the way out: the journal's recovery ends it instead
                log.exception("could not end request %d on stop", r.rid)
        for _ in range(3):    # a running reply ends at its model's next tick (as a client's cancel)
            if all(r.state is RequestState.DONE for r in live) or not self._has_work():
                break
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - on the way out: the journal's recovery ends it instead
                log.exception("the stop's last tick failed")
                break
        journal = self.store.journal
        if live and journal is not None:
            try:
                self.store.flush()
                journal.wait_durable(journal.last_seq, timeout=self.STOP_RECEIPT_WAIT_S)
            except AotxError as e:  # a failed journal: what was not receipted was never promised
                log.error("journal at stop: %s", e)

    # ---- events ------------------------------------------------------------------------

    def _guarded(self, fn: Callable[[], None], op: P.Operation, sink: Sink) -> None:
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

    def _submitter_of(self, sub: Submission) -> tuple[Submitter, ServedModel]:
        m = self.models.get(getattr(sub, "model", "")) or self.models.default
        return m.submitter, m

    def _on_media_ready(self, ev: MediaReady) -> None:
        sub = ev.submission
        submitter, m = self._submitter_of(sub)
        self._guarded(lambda: self.enqueue(submitter.media_ready(sub, self.tick), m), sub.op, sub.sink)

    def _on_prepared(self, ev: Prepared) -> None:
        sub = ev.submission
        submitter, m = self._submitter_of(sub)
        if isinstance(sub, ContinueJob):  # a reply's prompt cut again by its context policy
            m.continued(sub, ev.error, self._finish)
            return
        self._guarded(lambda: self.enqueue(submitter.prepared(ev, self.tick), m), sub.op, sub.sink)

    def _on_receipt(self, ev: ReceiptArrived) -> None:
        """Mark messages durable, let requests whose user message is now durable into the
        line, retry the messages held for journal credit that now fits."""
        self.store.note_receipt(ev.receipt)
        for r in ev.accepted:
            r.durable = True
            if r.state is RequestState.DURABLE_WAIT:
                r.state = RequestState.QUEUED
        for m in self.models:
            for sub in m.submitter.take_held(self.store.journal_free_bytes()):
                self._guarded(lambda sub=sub, m=m: self.enqueue(m.submitter.prompt(sub, self.tick), m), sub.op,
                              sub.sink)

    def _on_capsule_written(self, ev: CapsuleWritten) -> None:
        if self.store.table.get(ev.conv_id) is None:
            return
        try:
            self.store.capsule_stored(ev.conv_id, ev.path, ev.fingerprint, ev.n_tokens,
                                      tick=self.tick)
        except AotxError as e:  # no credit: the file stays, unjournaled (it is found again by name)
            log.warning("capsule of %s not journaled: %s", ev.conv_id, e)

    def _on_disconnect(self, ev: Disconnected) -> None:
        """A client went away (closed, or killed mid-reply). Its accepted messages are
        the user's: their replies run to the end here and are journaled, so the reply is
        there when the user comes back (finished, not cancelled: nobody cancelled it); events
        for the closed connection are dropped. Work not yet accepted is dropped."""
        for m in self.models:
            m.submitter.drop(ev.sink)

    # ---- what the operations ask of the engine ---------------------------------------------

    def requests(self) -> list[Request]:
        """Every accepted request not finished yet (each choice of each), in acceptance order."""
        return list(self._by_rid.values())

    def preparing(self) -> set[str]:
        """Conversations whose message is in some local model's preparation stage."""
        return {c for m in self.models for c in getattr(m.submitter, "preparing", ())}

    def is_busy(self, conv_id: str) -> bool:
        """Whether a message of ``conv_id`` is being prepared or its reply is running."""
        return conv_id in self.preparing() or any(r.conv_id == conv_id for r in self._by_rid.values())

    # ---- requests --------------------------------------------------------------------

    def enqueue(self, r: Request | None, m: ServedModel | None = None) -> None:
        """An accepted request joins its model's line (None: the submission is not done
        yet); its forked choices (n > 1) wait beside it for its prompt."""
        if r is None:
            return
        self._by_rid[r.key] = r
        for f in r.forks:
            self._by_rid[f.key] = f
        (m or self._model_of(r)).enqueue(r)

    def cancel(self, r: Request) -> None:
        if r.state is RequestState.DONE:
            return
        if self._model_of(r).cancel(r):
            self._finish(r, "cancelled")

    def _finish(self, r: Request, reason: str) -> None:
        for f in [f for f in r.forks if f.state is RequestState.FORK_WAIT]:
            f.fork_capsule = None  # choice 0 ended before its prompt did: its forks end with it
            self._finish(f, reason)
        r.forks = []  # (a waiting choice that ends is DONE: the fork skips it)
        m = self._model_of(r)
        fp = getattr(m, "fingerprint", "")
        m.finish(r, reason, self.tick, lambda conv_id, path, n: self._inbox.put(CapsuleWritten(conv_id, path, n, fp)))
        self._by_rid.pop(r.key, None)

    # ---- the tick ------------------------------------------------------------------------

    def _tick(self) -> None:
        """One tick: each model with work runs its own batch (its own forward)."""
        t0 = time.perf_counter()
        self.tick += 1
        n_out, device_s = 0, 0.0
        for m in self.models:
            if not m.has_work():
                continue
            try:
                n, d = m.tick(self.tick, self._finish)
            except DeviceError as e:
                self._fail_closed(m, e)
                continue
            n_out += n
            device_s += d
        self.stats["ticks"] += 1
        self.stats["tokens"] += n_out
        self.stats["device_s"] += device_s
        self.stats["host_s"] += time.perf_counter() - t0 - device_s

    def _fail_closed(self, m: ServedModel, e: DeviceError) -> None:
        """A model's device work failed: that model refuses new work and fails its
        requests; the other models and every read go on."""
        log.error("device work of model %s failed at tick %d", m.name, self.tick, exc_info=e.__cause__)
        m.fail_closed(f"device work failed at tick {self.tick}: {e}", self._finish)

    # ---- media loaded when first needed ----------------------------------------------------

    def count_media(self, name: str, nbytes: int) -> str:
        """Admit a media specialist (``name``, e.g. "media: whisper-base") into the budget
        the first time an attachment needs it: "" when it fits (the budget now counts it,
        ``aotx status`` shows it), else why not. A text-only chat never counts it (counted at
        start-up, the specialists took 1.1 GiB of the budget before any audio or picture)."""
        b = self.budget
        if b is None or any(n == name for n, _ in b.terms):
            return ""
        if nbytes > b.free:
            return (f"{name.removeprefix('media: ')} needs {fmt_bytes(nbytes)} ({nbytes:,} bytes) of the memory "
                    f"budget, {fmt_bytes(max(0, b.free))} is free: start the engine with a larger --memory-budget")
        self.models.add_shared(name, nbytes)  # the engine's, not one model's: kept when a model unloads
        log.info("budget: %s counted now (%d bytes), %d of %d bytes used", name, nbytes, self.budget.used, b.total)
        return ""

    # ---- status --------------------------------------------------------------------------

    def status_reply(self, rid: int) -> P.StatusReply:
        b = self.budget
        d = self.models.default
        slots = [v for m in self.models for v in m.slot_views()]
        lm = d.lm if d is not None else None
        return P.StatusReply(
            id=rid, model=self.models.default_name, device=self.device, ready=self.ready,
            budget_bytes=b.total if b else 0, used_bytes=b.used if b else 0,
            budget=[P.BudgetLine(name=n, bytes=v) for n, v in (b.terms if b else ())],
            slots=slots, n_ctx=self.n_ctx, queue=sum(1 for r in self._waiting if r.state is RequestState.QUEUED),
            tick=self.tick, journal=self.store.journal_status(), profile=dict(lm.profile) if lm else {},
            notes=dict(getattr(lm, "notes", {})) if lm else {},
            capsules=d.capsules.usage() if d is not None and d.capsules is not None else {},
            fingerprint=lm.fingerprint if lm else "", model_path=str(lm.path) if lm else "",
            draft_model=d.draft.lm.name if d is not None and d.draft else "",
            draft_model_path=str(d.draft.lm.path) if d is not None and d.draft else "",
            stats={**{k: float(v) for k, v in self.stats.items()},
                   "prefill_tokens": float(sum(getattr(getattr(m, "executor", None), "prefill_tokens", 0)
                                               for m in self.models))},
            degraded=self.store.hold_reason(), notices=list(self.store.notices),
            models=[m.info() for m in self.models], n_slots=self.n_slots, kv_type=self.kv_type,
            context_policy=self.context_policy,
        )
