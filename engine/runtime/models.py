"""Several models in one engine: each loaded model's own state, and the set of them.

Owns: ``LocalModel``, everything one loaded GGUF model has to itself (DESIGN.md,
"Several models coexist"): its ``LoadedModel`` (configuration, tokenizer, template,
termination, backend tables, graphs, fingerprint), its KV cache and slots, its
envelope, executor, commit step and submitter, its capsules (a folder per
fingerprint), its line of waiting requests and the requests running in its slots,
and its share of the budget. Nothing one model sets at load reaches another: no
object is shared between two ``LocalModel``\\ s except the conversation store.
Each model's tick is its own batch and its own forward (``LocalModel.tick``).

``ModelSet``: the loaded models by name (local and remote, ``remote.RemoteModel``),
the default one, the budget across all of them (the engine's shared terms plus each
model's: ``budget()``), loading with admission (a model that does not fit is
refused before it is read, with the numbers: needed, free, and every idle model
with what unloading it would free; ``evict_idle`` unloads the least recently used
idle ones instead), unloading, and the idle timeout (``keep_alive_s``; the default
model is never unloaded by it). Leaves the catalog of installed models to
``catalog.py``, routing of operations to ``engine.py``.

Loading runs on the engine thread, between ticks: the model's kernels are compiled
and warmed up on the thread that will run them (numba's pool belongs to the thread
that launches parallel work; see ``Engine.start``). Other conversations wait for
the load (seconds for a small model); clients get a ``loading`` notice first.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from aotx.engine.errors import AdmissionError, Busy, ErrorCode, ModelError, NotFound
from aotx.engine import protocol as P
from aotx.engine.runtime import context
from aotx.engine.model.loader import LoadedModel
from aotx.engine.runtime.admission import Budget, Refusal
from aotx.engine.runtime.catalog import Catalog, ModelEntry, entry_info, estimate_terms
from aotx.engine.runtime.commit import Commit
from aotx.engine.runtime.drafter import DEFAULT_P_MIN, DraftModel
from aotx.engine.runtime.envelope import Envelope, working_bytes
from aotx.engine.runtime.events import Inbox
from aotx.engine.runtime.executor import DeviceError, Executor
from aotx.engine.runtime.mtp import MtpModel
from aotx.engine.runtime.requests import Request, RequestState
from aotx.engine.runtime.scheduler import plan_leases, plan_tick
from aotx.engine.runtime.slots import SlotTable
from aotx.engine.runtime.store import ConversationStore
from aotx.engine.runtime.submit import Submitter
from aotx.engine.state.prefix import common_prefix
from aotx.engine.state.cache import CapsuleCache
from aotx.engine.units import fmt_bytes

log = logging.getLogger("aotx.engine")

#: budget terms of the engine itself, not of one model: kept when a model unloads
SHARED_TERMS = ("journal buffers", "capsules (host)", "media")
EXTRA_CAPSULE_HOST = 64 << 20  # host-memory capsules of a model loaded beside the default


def is_shared_term(name: str) -> bool:
    return name in SHARED_TERMS or name.startswith("media")


class ServedModel(Protocol):
    """What the engine and the ``ModelSet`` ask of a model they serve: loaded here
    (``LocalModel``) or remote (``remote.RemoteModel``). ``kind``: "gguf" | "remote";
    ``lm``: the ``LoadedModel`` (None for a remote one); ``submitter``: its way in
    (``submit.Submitter``, or ``remote.RemoteSubmitter``: the calls both answer are
    ``submit``, ``media_ready``, ``prompt``, ``take_held``, ``drop``, ``fail_held``,
    ``ready``, ``not_ready_reason``; the preparation stage's are a local model's only)."""

    kind: str
    name: str
    entry: ModelEntry | None
    default: bool
    terms: tuple[tuple[str, int], ...]
    last_used: float
    n_ctx: int
    lm: LoadedModel | None
    capsules: CapsuleCache | None
    draft: DraftModel | None
    submitter: Any
    waiting: deque[Request]
    running: list[Request]

    @property
    def fingerprint(self) -> str: ...
    @property
    def ready(self) -> bool: ...

    def in_flight(self) -> int: ...
    def has_work(self) -> bool: ...
    def touch(self) -> None: ...
    def enqueue(self, r: Request) -> None: ...
    def cancel(self, r: Request) -> bool: ...
    def finish(self, r: Request, reason: str, tick: int, capsule_written: Callable[[str, str, int], None]) -> None: ...
    def forget(self, conv_id: str) -> None: ...
    def tick(self, tick: int, finish: Callable[[Request, str], None]) -> tuple[int, float]: ...
    def fail_closed(self, reason: str, finish: Callable[[Request, str], None]) -> None: ...
    def slot_views(self) -> list[P.SlotView]: ...
    def info(self) -> P.ModelInfo: ...
    def close(self) -> None: ...


class LocalModel:
    """One loaded GGUF model's state in the engine (see the module docstring).

    name: its catalog name; lm: the ``LoadedModel``; store/inbox/is_busy: the engine's;
    terms: the budget terms (name, bytes) it holds; the rest as ``Engine``."""

    kind = "gguf"

    def __init__(self, name: str, lm: LoadedModel, store: ConversationStore, inbox: Inbox,
                 is_busy: Callable[[str], bool], *, n_slots: int, n_ctx: int, prefill_chunk: int, device: str,
                 capsules: CapsuleCache | None = None, speculative: str = "off", draft_lm: LoadedModel | None = None,
                 draft_p_min: float = DEFAULT_P_MIN,
                 terms: tuple[tuple[str, int], ...] = (), entry: ModelEntry | None = None, default: bool = False,
                 kv_type: str = "f16", context_policy: str = context.DEFAULT_POLICY):
        self.name = name
        self.lm = lm
        self.store = store
        self.entry = entry
        self.default = default
        self.device = device
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        self.prefill_chunk = prefill_chunk
        self.capsules = capsules
        self.envelope = Envelope.of(lm.config, n_slots, n_ctx, prefill_chunk, store.journal_capacity)
        self.kv = lm.model.new_kv_cache(n_slots, n_ctx, kv_type)
        self.draft = DraftModel(draft_lm, n_slots, n_ctx, p_min=draft_p_min) if draft_lm is not None else None
        self.mtp = _mtp_model(lm, n_slots, n_ctx, draft_p_min)
        self.slots = SlotTable(n_slots, whole_prefix=getattr(self.kv, "state", None) is not None)
        self.waiting: deque[Request] = deque()  # accepted, in arrival order (durable_wait or queued)
        self.running: list[Request] = []        # prefill or decode, holding a slot
        self.executor = Executor(lm, self.kv, device=device, capsules=capsules, draft=self.draft)
        self.commit = Commit(store, self.slots, self.executor.numerics)
        self.submitter = Submitter(lm, store, self.envelope, inbox, is_busy, device=device, speculative=speculative,
                                   draft=self.draft, mtp=self.mtp, context_policy=context_policy)
        self.submitter.model_name = name
        self.terms = tuple(terms)
        self.last_used = time.monotonic()

    @property
    def fingerprint(self) -> str:
        return self.lm.fingerprint

    @property
    def ready(self) -> bool:
        return self.submitter.ready

    def in_flight(self) -> int:
        """Its messages anywhere between submission and the end of their reply."""
        sub = self.submitter
        return (len(self.waiting) + len(self.running) + len(sub.held) + len(getattr(sub, "_media_busy", ()))
                + len(getattr(sub, "preparing", {})))

    def has_work(self) -> bool:
        # (a reply whose prompt a worker is cutting again waits for it, unless it was cancelled)
        return any(r.state is not RequestState.CONTINUE or r.cancelled for r in self.running) or \
            any(r.state is RequestState.QUEUED for r in self.waiting)

    def touch(self) -> None:
        self.last_used = time.monotonic()

    # ---- requests ------------------------------------------------------------------------

    def enqueue(self, r: Request) -> None:
        self.waiting.append(r)
        self.touch()
        self.commit.queue_notices(self.waiting, self.n_slots)

    def cancel(self, r: Request) -> bool:
        """Mark ``r`` cancelled; True when it was still waiting (the caller finishes it now)."""
        r.cancelled = True
        if r in self.waiting:
            self.waiting.remove(r)
            return True
        return r.state is RequestState.FORK_WAIT  # a choice waiting for choice 0's prompt

    def finish(self, r: Request, reason: str, tick: int, capsule_written: Callable[[str, str, int], None]) -> None:
        if r in self.running:
            self.running.remove(r)
        if r.slot is not None:
            # the KV holds prompt + completion[:-1]; keep that for prefix reuse
            self.slots.release(r.slot)
            if reason in ("stop", "length", "context"):
                self.executor.persist(r, capsule_written)
        self.commit.finish(r, reason, tick)
        self.commit.queue_notices(self.waiting, self.n_slots)
        self.touch()

    def forget(self, conv_id: str) -> None:
        """A conversation was deleted: drop its prefix knowledge and its capsules."""
        self.slots.forget(conv_id)
        if self.capsules is not None:
            self.capsules.drop(conv_id)

    # ---- the tick --------------------------------------------------------------------------

    def tick(self, tick: int, finish: Callable[[Request, str], None]) -> tuple[int, float]:
        """This model's part of tick ``tick``: cancellations, leases, its batch through its
        own forward, the commit. ``finish(r, reason)`` ends a request (the engine's, which
        also forgets its id). Returns (tokens produced, device seconds). Raises DeviceError."""
        for r in [r for r in self.running if r.cancelled]:  # cancellations take effect at the tick boundary
            finish(r, "cancelled")
        for lease in plan_leases(self.waiting, self.slots):
            self.waiting.remove(lease.request)
            self.commit.leased(lease, self.executor.lease(lease))
            self.running.append(lease.request)
        self.commit.queue_notices(self.waiting, self.n_slots)
        plan = plan_tick(self.running, self.envelope)
        if plan.empty:
            return 0, 0.0
        result = self.executor.run(plan, tick)
        n_out, finished = self.commit.apply(plan, result, tick)
        for r in finished:
            if r.finish_reason == "context" and r.continuation is not None and not r.cancelled:
                r.finish_reason, r.state, r.slot.state = None, RequestState.CONTINUE, "prefill"
                self.submitter.continue_reply(r)   # the context policy cuts its prompt again
                continue
            if r.finish_reason == "context":
                self._ended(r, "")
            finish(r, r.finish_reason)
        self._forked(result.rows)
        self.touch()
        return n_out, result.device_s

    def continued(self, job: Any, error: Any, finish: Callable[[Request, str], None]) -> None:
        """A reply's prompt came back cut (``context.ContinueJob``; ``error``: the worker's
        failure, or None): the reply goes on from its new prompt and its text so far,
        prefilled in its own slot (the shared start of the two prompts kept), or it ends
        at the end of the context with a notice saying why."""
        r = job.request
        if r.state is not RequestState.CONTINUE:   # it ended meanwhile
            return
        if r.cancelled:
            finish(r, "cancelled")
            return
        fit = job.fit
        if error is not None or fit is None:
            self._ended(r, str(error) if error is not None else "")
            finish(r, "context")
            return
        cut = fit.cut
        if cut is not None and not cut.kept_from:   # only the turn being answered stays
            cut.kept_from = r.msg_id
        r.prompt = list(fit.ids) + r.completion
        r.lead = len(r.completion)
        r.stop.resume(len(fit.ids))
        r.continuation.start, r.continuation.head = fit.start, fit.head
        slot = r.slot
        keep = min(common_prefix(slot.tokens, r.prompt), len(r.prompt) - 1)
        del slot.tokens[keep:]
        r.pos = keep
        r.state, slot.state = RequestState.PREFILL, "prefill"
        if cut is not None:
            r.cuts.append(cut)
            r.sink.send(P.Notice(id=r.rid, kind="context", resource="context", message=context.cut_text(cut),
                                 asked=cut.n_tokens, cut=cut, choice=r.choice))
        self.touch()

    def _ended(self, r: Request, why: str) -> None:
        """A reply ends at the end of the context: its held-back text is committed and the
        client is told why it did not go on."""
        tail = r.stop.flush() + r.decoder.flush()
        if tail:
            r.text += tail
            self.store.commit_tokens(r.conv_id, r.reply_id, r.n_prompt + len(r.completion), [], tail)
        conv = self.store.table.get(r.conv_id)
        policy = context.policy_of(conv.context if conv is not None else "", self.submitter.context_policy)
        if r.continuation is None and policy in context.CONTINUING:
            why = why or "a raw prompt, or one with pictures, is not cut"
        r.sink.send(P.Notice(id=r.rid, kind="context", resource="context", choice=r.choice,
                             message=context.ended_text(policy, self.n_ctx, why), asked=len(r.completion)))

    def _forked(self, rows) -> None:
        """Choices (n > 1) that got their first token and the prompt's capsule this tick
        join the head of the line (they have waited as long as choice 0)."""
        joined = [row.request for row in rows if row.request.state is RequestState.FORK_WAIT
                  and row.request.finish_reason is None]
        for f in reversed(joined):
            f.state = RequestState.QUEUED if (f.durable or not self.store.journaled) else RequestState.DURABLE_WAIT
            self.waiting.appendleft(f)
        if joined:
            self.commit.queue_notices(self.waiting, self.n_slots)

    def fail_closed(self, reason: str, finish: Callable[[Request, str], None]) -> None:
        """This model's device failed: it refuses new work, its requests fail; other
        models and every read go on."""
        self.submitter.ready, self.submitter.not_ready_reason = False, reason
        waiting, self.waiting = list(self.waiting), deque()
        for r in list(self.running) + waiting:
            if r.state is RequestState.DONE:  # a forked choice its parent already finished
                continue
            r.sink.send(P.Error(id=r.rid, code=ErrorCode.NOT_READY, message=reason))
            finish(r, "error")
        self.submitter.fail_held(reason)

    def slot_views(self) -> list[P.SlotView]:
        return [P.SlotView(slot=s.index, conv_id=s.conv_id if s.state != "free" else None, state=s.state,
                           position=len(s.tokens), model=self.name) for s in self.slots.slots]

    def info(self) -> P.ModelInfo:
        e, cfg = self.entry, self.lm.config
        size, quant = (e.size_bytes, e.quant) if e else self._file_facts()
        return P.ModelInfo(name=self.name, kind="gguf", path=str(self.lm.path),
                           size_bytes=size, arch=cfg.arch, quant=quant, n_ctx=self.n_ctx,
                           n_ctx_train=cfg.n_ctx_train, loaded=True, default=self.default,
                           needs_bytes=sum(v for _, v in self.terms), busy=self.in_flight(),
                           idle_s=round(time.monotonic() - self.last_used, 1) if not self.in_flight() else 0.0,
                           tool_format=self._tool_format())

    def _tool_format(self) -> str:
        template = getattr(self.lm, "template", None)
        if template is None:
            return ""
        from aotx.engine.model import tool_calls

        return tool_calls.family_of(template.source)

    def _file_facts(self) -> tuple[int, str]:
        """(size, quant) of the model file when no catalog entry came with it (the
        default model): read once from the file's header."""
        if getattr(self, "_facts", None) is None:
            from aotx.engine.model.gguf_header import read_file_header

            try:
                self._facts = (os.stat(self.lm.path).st_size, read_file_header(self.lm.path).quant)
            except (OSError, ModelError):
                self._facts = (0, "")
        return self._facts

    def close(self) -> None:
        """Let go of the KV cache and the weights (the last references), and end the
        preparation workers."""
        self.kv = None
        self.executor.kv = None
        self.draft = None
        self.submitter.preparer.close()


def _mtp_model(lm: Any, n_slots: int, n_ctx: int, p_min: float) -> MtpModel | None:
    """The model's own multi-token-prediction head for ``--speculative mtp`` (a file with
    nextn layers, on a backend that returns hidden states: the CPU), else None."""
    model = lm.model
    if not getattr(model, "has_mtp", False) or getattr(model, "device_path", "host") != "host":
        return None
    try:
        return MtpModel(model.load_mtp(), n_slots, n_ctx, p_min=p_min)
    except ModelError as e:
        log.warning("the MTP head is not used: %s", e)
        return None


def prefixed(name: str, terms: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
    return tuple((f"{name}: {n}", v) for n, v in terms)


class ModelSet:
    """The loaded models of one engine, and their budget.

    total: the budget (bytes); shared: the engine's own terms (journal, host capsules,
    media); make_local(entry) -> a loaded ``LocalModel`` (the engine's loader, with
    its slots, context and device), make_remote(entry) -> a ``RemoteModel``;
    estimate(entry) -> the terms a model would take before loading it."""

    def __init__(self, catalog: Catalog, total: int, shared: tuple[tuple[str, int], ...] = (), *,
                 keep_alive_s: float = 0.0, evict_idle: bool = False):
        self.catalog = catalog
        self.total = total
        self.shared = tuple(shared)
        self.keep_alive_s = keep_alive_s
        self.evict_idle = evict_idle
        self.loaded: dict[str, ServedModel] = {}
        self.default_name = ""
        self.context = 0  # the engine's context per slot: a model loaded beside serves this, at most its own
        self.make_local: Callable[[ModelEntry], ServedModel] | None = None
        self.make_remote: Callable[[ModelEntry], ServedModel] | None = None
        self.estimate: Callable[[ModelEntry], tuple[tuple[str, int], ...]] | None = None

    # ---- the set --------------------------------------------------------------------------

    def add(self, m: ServedModel, default: bool = False) -> None:
        self.loaded[m.name] = m
        if default or not self.default_name:
            self.default_name = m.name
        m.default = m.name == self.default_name

    @property
    def default(self) -> ServedModel | None:
        return self.loaded.get(self.default_name)

    def __iter__(self):
        return iter(list(self.loaded.values()))

    def get(self, name: str) -> ServedModel | None:
        return self.loaded.get(name)

    # ---- the budget -----------------------------------------------------------------------

    def used(self) -> int:
        return sum(v for _, v in self.shared) + sum(sum(v for _, v in m.terms) for m in self.loaded.values())

    def free(self) -> int:
        return self.total - self.used()

    def budget(self) -> Budget:
        """Every term: the default model's unprefixed, then the engine's shared ones,
        then each other model's as ``name: term``."""
        d = self.default
        terms = tuple(d.terms) if d is not None else ()
        terms += self.shared
        for m in self.loaded.values():
            if m is not d:
                terms += prefixed(m.name, m.terms)
        return Budget(self.total, terms)

    def add_shared(self, name: str, nbytes: int) -> None:
        self.shared = self.shared + ((name, nbytes),)

    def idle(self, exclude: str = "") -> list[ServedModel]:
        """Loaded models with nothing in flight, least recently used first."""
        return sorted((m for m in self.loaded.values() if m.name != exclude and not m.in_flight()),
                      key=lambda m: m.last_used)

    def refusal(self, name: str, terms: tuple[tuple[str, int], ...], *, estimated: bool) -> Refusal:
        """The refusal of loading ``name`` (terms ``terms``): needed, free, and each idle
        model with what unloading it frees."""
        need = sum(v for _, v in terms)
        free = self.free()
        parts = ", ".join(f"{n} {fmt_bytes(v)}" for n, v in terms if v)
        idle = self.idle(exclude=name)
        d = self.default
        # `aotx unload` keeps the default model: it is offered only as what --evict-idle or a
        # restart with this model as the default would free
        others = [m for m in idle if m is not d]
        if others:
            frees = "; ".join(f"{m.name} frees {fmt_bytes(sum(v for _, v in m.terms))}" for m in others)
            what = f"idle models: {frees} (`aotx unload NAME`, or start the engine with --evict-idle)"
        else:
            what = "no model loaded beside the default is idle; lower --slots or --context, or raise --memory-budget"
        if d is not None and d in idle:
            what += (f"; the default model {d.name} frees {fmt_bytes(sum(v for _, v in d.terms))} only if the "
                     f"engine runs with --evict-idle, or `aotx stop`, then `aotx run --model {name}` makes "
                     f"{name} the default")
        busy = [m.name for m in self.loaded.values() if m.in_flight()]
        if busy:
            what += f"; generating: {', '.join(busy)}"
        msg = (f"model {name} does not fit the memory budget: it needs {fmt_bytes(need)} ({need:,} bytes"
               f"{', estimated from its header' if estimated else ''}: {parts}), {fmt_bytes(max(0, free))} of "
               f"{fmt_bytes(self.total)} is free; {what}")
        return Refusal(ErrorCode.BUSY, "memory", msg, asked=need, free=max(0, free),
                       accepts=f"a model of at most {fmt_bytes(max(0, free))}", detail=msg)

    # ---- loading and unloading -----------------------------------------------------------------

    def ensure(self, name: str, *, evict_idle: bool | None = None,
               on_load: Callable[[str], None] | None = None) -> tuple[ServedModel, list[str]]:
        """The loaded model ``name`` (a catalog name or a GGUF path), loading it when it is
        not: (model, names of idle models unloaded to make room). Raises NotFound (with the
        close matches), ModelError (the file cannot be used), Refusal (it does not fit).
        ``on_load(message)`` is told before a load starts."""
        m = self.loaded.get(name)
        if m is not None:
            return m, []
        entry = self.catalog.resolve(name)
        m = self.loaded.get(entry.name)
        if m is not None:
            return m, []
        if entry.error:
            raise ModelError(entry.error)
        evict = self.evict_idle if evict_idle is None else evict_idle
        unloaded: list[str] = []
        if entry.kind == "remote":
            assert self.make_remote is not None
            m = self.make_remote(entry)
            self.add(m)
            return m, unloaded
        assert self.make_local is not None and self.estimate is not None
        terms = self.estimate(entry)
        unloaded += self._make_room(entry.name, terms, evict, estimated=True)
        if on_load:
            on_load(f"loading model {entry.name} ({fmt_bytes(entry.size_bytes)}, {entry.arch} {entry.quant})")
        t0 = time.perf_counter()
        try:
            m = self.make_local(entry)
        except ModelError as e:  # not listed as installed any more (catalog.load_failed)
            self.catalog.load_failed(entry, str(e))
            raise
        # the real terms (what the backend allocated) are checked again
        try:
            unloaded += self._make_room(entry.name, m.terms, evict, estimated=False)
        except Refusal:
            m.close()
            raise
        self.add(m)
        log.info("model %s loaded beside %s in %.2f s (%s); budget %s of %s used", entry.name,
                 ", ".join(n for n in self.loaded if n != entry.name) or "nothing", time.perf_counter() - t0,
                 fmt_bytes(sum(v for _, v in m.terms)), fmt_bytes(self.used()), fmt_bytes(self.total))
        return m, unloaded

    def _make_room(self, name: str, terms: tuple[tuple[str, int], ...], evict: bool, *, estimated: bool) -> list[str]:
        need = sum(v for _, v in terms)
        out: list[str] = []
        while need > self.free():
            idle = self.idle(exclude=name)
            if not evict or not idle:
                raise self.refusal(name, terms, estimated=estimated)
            victim = idle[0]
            self.unload(victim.name, reason=f"to make room for {name}")
            out.append(victim.name)
        return out

    def unload(self, name: str, reason: str = "") -> ServedModel:
        """Unload ``name``. Raises NotFound when it is not loaded, Busy while it generates."""
        m = self.loaded.get(name)
        if m is None:
            loaded = ", ".join(self.loaded) or "none"
            raise NotFound(f"model {name!r} is not loaded (loaded: {loaded})")
        if m.in_flight():
            raise Busy(f"model {name} is generating ({m.in_flight()} message(s) in flight); cancel them or wait")
        del self.loaded[name]
        m.close()  # the default stays the default by name: it is loaded again when a message needs it
        log.info("model %s unloaded%s; budget %s of %s used", name, f" ({reason})" if reason else "",
                 fmt_bytes(self.used()), fmt_bytes(self.total))
        return m

    def expire(self, now: float | None = None) -> list[str]:
        """Unload models idle for longer than ``keep_alive_s`` (0: never); never the default."""
        if self.keep_alive_s <= 0:
            return []
        now = time.monotonic() if now is None else now
        out = []
        for m in list(self.loaded.values()):
            if m.name != self.default_name and not m.in_flight() and now - m.last_used > self.keep_alive_s:
                self.unload(m.name, reason=f"idle for more than {self.keep_alive_s:g} s")
                out.append(m.name)
        return out

    # ---- what clients see ---------------------------------------------------------------------------

    def infos(self) -> list[P.ModelInfo]:
        """Every model: the loaded ones as they are, the others as the catalog knows them
        (with the memory they would need here)."""
        out: list[P.ModelInfo] = []
        seen = set()
        entries = self.catalog.entries()
        for name, e in entries.items():
            seen.add(name)
            m = self.loaded.get(name)
            if m is not None:
                info = m.info()
                info.default = name == self.default_name
                out.append(info)
                continue
            info = entry_info(e, self.estimate)
            info.default = name == self.default_name  # the engine's default, not the wheel's (e.default)
            if self.context and e.kind == "gguf":  # what it would serve here, once loaded
                info.n_ctx = min(self.context, e.n_ctx_train) if e.n_ctx_train else self.context
            out.append(info)
        for name, m in self.loaded.items():
            if name not in seen:
                info = m.info()
                info.default = name == self.default_name
                out.append(info)
        return out


def local_terms(lm: LoadedModel, n_slots: int, n_ctx: int, prefill_chunk: int, *, capsule_host: int = 0,
                capsule_device: int = 0, kv_type: str = "f16") -> tuple[tuple[str, int], ...]:
    """The budget terms of a loaded model beside the default one."""
    terms = [("weights", int(lm.model.weight_bytes)),
             ("prefill weights", int(getattr(lm.model, "prefill_weight_bytes", 0) or 0)),
             (f"kv cache ({kv_type})", int(lm.model.kv_cache_bytes(n_slots, n_ctx, kv_type))),
             ("working buffers", working_bytes(lm.config, prefill_chunk, n_slots, n_ctx)),
             ("runtime tables", n_slots * (n_ctx * 8 + 256)),
             ("capsules (host)", capsule_host), ("capsules (device)", capsule_device)]
    return tuple((n, v) for n, v in terms if v)


def header_terms(entry: ModelEntry, n_slots: int, n_ctx: int, prefill_chunk: int, kv_value_bytes: float,
                 capsule_host: int = EXTRA_CAPSULE_HOST) -> tuple[tuple[str, int], ...]:
    """The estimate, from the file's header, of ``local_terms``."""
    if entry.header is None:
        raise ModelError(entry.error or f"{entry.path}: no readable GGUF header")
    return estimate_terms(entry.header, n_slots, n_ctx, prefill_chunk, kv_value_bytes) + \
        ((("capsules (host)", capsule_host),) if capsule_host else ())


__all__ = ["LocalModel", "ModelSet", "ServedModel", "local_terms", "header_terms", "entry_info", "is_shared_term",
           "DeviceError", "AdmissionError"]
