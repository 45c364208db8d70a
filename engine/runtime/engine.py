"""The engine: one host loop that admits, schedules, runs the device and publishes.

Owns: the tick loop (a thread), slots, the request queue, and the dispatch of
every client operation. Each tick is one bounded step: **admit** (requests whose
user message is durable take free slots, in order), **schedule** (one decode row
per decoding slot plus prefill chunks up to ``prefill_chunk`` tokens), **device
work** (one batched forward pass: continuous batching), **publish** (a
TokensCommitted record per conversation per tick, token events, finish records)
and **flush** (the journal groups the tick's records into one block; a tick
never waits on disk). Records and events carry ``(tick, seq)``.

Leaves to others: sockets (``ipc/server.py``), the journal's files
(``journal/``), conversation state (``runtime/store.py``), the math (model).
Thread model: client operations arrive through ``post`` from any thread and run
on the engine thread; events leave through each request's ``sink.send``, which
must be thread-safe.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec
import numpy as np

from aotx.engine.errors import AotxError
from aotx.engine.ipc import protocol as P
from aotx.engine.model.batch import Segment
from aotx.engine.runtime import media_prompt
from aotx.engine.runtime.requests import Request
from aotx.engine.runtime.sampling import SamplerConfig, SamplerState, sample
from aotx.engine.runtime.drafter import DEFAULT_P_MIN, DraftDrafter, DraftModel
from aotx.engine.runtime.speculative import PromptLookup, verify
from aotx.engine.runtime.slots import SlotTable

log = logging.getLogger("aotx.engine")

MAX_STOP_STRINGS = 64
# speculative "auto" (the default): prompt lookup on the CPU, where a verify window of a few
# rows costs little more than one row, drafting only after a match of this many tokens so
# that free chat (few matches) pays nothing; off on CUDA, where a tick's host time dominates
# and drafts rarely pay (BENCHMARKS.md, speculative sections)
AUTO_MIN_NGRAM = 2
MAX_STOP_CHARS = 1024


class Engine:
    """Runs one model for many conversations and clients.

    lm: a ``loader.LoadedModel``; store: a ``store.ConversationStore`` (journaled or
    in-memory); n_slots, n_ctx: slot count and tokens of context per slot;
    prefill_chunk: most prompt tokens prefilled per tick (others keep decoding);
    speculative: the default drafter (ngram | draft | off); draft_lm: a draft model's
    ``LoadedModel`` (same vocabulary; its own slots and KV: ``drafter.DraftModel``).
    ``vision`` (a ``media.vision.VisionEncoder``) and ``images`` (a
    ``media_prompt.ImageStore``) are set by ``serve`` when images go to an encoder.
    """

    vision = None
    images = None

    def __init__(self, lm, store, *, n_slots: int = 8, n_ctx: int = 4096, prefill_chunk: int = 256,
                 budget=None, device: str = "cpu", capsules=None, speculative: str = "off", draft_lm=None,
                 draft_p_min: float = DEFAULT_P_MIN):
        self.lm = lm
        self.store = store
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        self.prefill_chunk = prefill_chunk
        self.budget = budget
        self.device = device
        self.kv = lm.model.new_kv_cache(n_slots, n_ctx)
        self.capsules = capsules  # state.cache.CapsuleCache or None
        self.speculative = speculative  # default drafter: "ngram", "draft" or "off"
        self.draft = DraftModel(draft_lm, n_slots, n_ctx, p_min=draft_p_min) if draft_lm is not None else None
        self.slots = SlotTable(n_slots)
        self.tick = 0
        self.ready = True
        self.not_ready_reason = ""
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque[Request] = deque()   # durable_wait or queued, in arrival order
        self._running: list[Request] = []         # prefill or decode, holding a slot
        self._by_rid: dict[tuple[int, int], Request] = {}
        self._durable_watch: list[tuple[int, Request, str]] = []
        self._held: list[tuple[Any, Any, str | None]] = []  # (op, sink, media text) waiting for journal credit
        self._media_busy: dict[int, set[int]] = {}  # sink id -> request ids whose media are being prepared
        self._restored: set[tuple[int, int]] = set()  # (sink id, request id) whose pictures were re-encoded
        self._segments_at_checkpoint = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.stats = {"ticks": 0, "tokens": 0, "device_s": 0.0, "host_s": 0.0}
        # the arithmetic behind the tokens, reported with every reply (README: CPU and CUDA differ)
        self.numerics = getattr(getattr(lm.model, "backend", None), "numerics", None) or (
            "cuda-f32" if device == "cuda" else "cpu-int8")
        self._sampler_of: dict[str, Any] = {}  # conv_id -> its last reply's SamplerState (capsules)
        self._watch_lock = threading.Lock()
        store.on_receipt = self._receipt_from_drain

    # ---- thread plumbing ---------------------------------------------------

    def start(self) -> None:
        """Run the tick loop on a thread of its own (tests, tools). ``aotx serve`` calls
        ``run()`` on the main thread instead: numba's OpenMP pool belongs to the thread
        that launches parallel work, and the model was loaded (and warmed up) there; a
        second launching thread brings a second spinning pool and halves decode speed."""
        self._thread = threading.Thread(target=self._run, name="aotx-tick", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Run the tick loop on the calling thread until ``request_stop``."""
        self._run()

    def request_stop(self) -> None:
        """Ask the loop to stop after the current tick (safe from a signal handler)."""
        self._stop.set()
        self._ops.put(("wake", None, None))

    def stop(self) -> None:
        self.request_stop()
        if self._thread:
            self._thread.join(timeout=10)

    def post(self, op: Any, sink: Any) -> None:
        """Queue a client operation (a protocol request) answered through ``sink.send``."""
        self._ops.put(("op", op, sink))

    def post_disconnect(self, sink: Any) -> None:
        """The client behind ``sink`` went away: cancel its generations within one tick."""
        self._ops.put(("disconnect", sink, None))

    def _has_work(self) -> bool:
        return bool(self._running) or any(r.state == "queued" for r in self._waiting)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._has_work():
                try:
                    item = self._ops.get_nowait()
                except queue.Empty:
                    item = None
            else:
                try:  # a timeout, so a signal handler on the main thread gets to run
                    item = self._ops.get(timeout=0.5)
                except queue.Empty:
                    continue
            while item is not None:
                self._handle(item)
                try:
                    item = self._ops.get_nowait()
                except queue.Empty:
                    item = None
            if not self._stop.is_set() and self._has_work():
                try:
                    self._tick()
                except Exception as e:  # noqa: BLE001 - a bug in publishing must not stop the engine
                    log.exception("tick %d failed", self.tick)
                    for r in list(self._running):
                        r.sink.send(P.Error(id=r.rid, code="internal", message=f"internal error at tick "
                                                                                f"{self.tick}: {e}"))
                        try:
                            self._finish(r, "error")
                        except Exception:  # noqa: BLE001
                            log.exception("could not finish request %d", r.rid)
                            self._running.remove(r) if r in self._running else None

    def _handle(self, item) -> None:
        kind, obj, sink = item
        if kind == "wake":
            return
        if kind == "receipt":
            self._on_receipt(obj)
            return
        if kind == "media":
            op, text = obj
            self._media_busy.get(id(sink), set()).discard(op.id)
            self._guarded(lambda: self._submit(op, sink, media_text=text), op, sink)
            return
        if kind == "capsule":
            conv_id, path, n = obj
            if self.store.table.get(conv_id) is not None:
                self.store.capsule_stored(conv_id, path, self.lm.fingerprint, n, tick=self.tick)
            return
        if kind == "disconnect":
            for r in list(self._by_rid.values()):
                if r.sink is obj:
                    self._cancel(r)
            self._held = [h for h in self._held if h[1] is not obj]
            return
        self._guarded(lambda: self._dispatch(obj, sink), obj, sink)

    def _guarded(self, fn, obj, sink) -> None:
        """Run one client operation; refusals and bugs become an Error reply."""
        try:
            fn()
        except AotxError as e:
            code = getattr(e, "code", "bad_request")
            if isinstance(obj, P.SubmitMessage):
                log.info("refused a message for %s (%s): %s", getattr(obj, "conv_id", "?"), code, e)
            sink.send(P.Error(id=getattr(obj, "id", 0), code=code, message=str(e)))
        except Exception as e:  # noqa: BLE001 - a bug must not kill the engine thread
            log.exception("operation %s failed", type(obj).__name__)
            sink.send(P.Error(id=getattr(obj, "id", 0), code="internal", message=f"internal error: {e}"))

    # ---- client operations ------------------------------------------------

    def _dispatch(self, op, sink) -> None:
        st = self.store
        if isinstance(op, P.CreateConversation):
            bad = [m.role for m in op.messages if m.role not in ("user", "assistant")]
            if bad:
                raise _Refused("bad_request", f"prior message role {bad[0]!r}: use user or assistant")
            view = st.create(op.title, op.system_prompt, op.sampling, tick=self.tick,
                             messages=[(m.role, m.text) for m in op.messages])
            sink.send(P.ConversationInfo(id=op.id, conversation=view))
        elif isinstance(op, P.ListConversations):
            sink.send(P.ConversationList(id=op.id, conversations=st.list_views(busy=self._busy_convs())))
        elif isinstance(op, P.ShowConversation):
            sink.send(P.ConversationInfo(id=op.id, conversation=st.view(op.conv_id, busy=self._busy_convs())))
        elif isinstance(op, P.SubmitMessage):
            self._submit(op, sink)
        elif isinstance(op, P.Cancel):
            for r in list(self._by_rid.values()):
                if (op.target and r.rid == op.target and r.sink is sink) or (op.conv_id and r.conv_id == op.conv_id):
                    self._cancel(r)
            sink.send(P.Ok(id=op.id))
        elif isinstance(op, P.DeleteConversation):
            self._require_idle(op.conv_id)
            st.delete(op.conv_id, tick=self.tick)
            self.slots.forget(op.conv_id)
            if self.capsules is not None:
                self.capsules.drop(op.conv_id)
            sink.send(P.Ok(id=op.id))
        elif isinstance(op, P.RenameConversation):
            st.rename(op.conv_id, op.title, tick=self.tick)
            sink.send(P.Ok(id=op.id))
        elif isinstance(op, P.UpdateConversation):
            st.update(op.conv_id, op.system_prompt, op.sampling, tick=self.tick)
            sink.send(P.Ok(id=op.id))
        elif isinstance(op, P.TruncateConversation):
            self._require_idle(op.conv_id)
            st.truncate(op.conv_id, op.msg_id, tick=self.tick)
            sink.send(P.Ok(id=op.id))
        elif isinstance(op, P.ForkConversation):
            view = st.fork(op.conv_id, op.at_msg_id or None, tick=self.tick)
            sink.send(P.ConversationInfo(id=op.id, conversation=view))
        elif isinstance(op, P.Status):
            sink.send(self.status_reply(op.id))
        else:
            sink.send(P.Error(id=getattr(op, "id", 0), code="bad_request",
                              message=f"unexpected message type {type(op).__name__}"))

    def _busy_convs(self) -> set[str]:
        return {r.conv_id for r in self._by_rid.values()}

    def _require_idle(self, conv_id: str) -> None:
        if conv_id in self._busy_convs():
            raise _Refused("busy", f"conversation {conv_id} is generating; cancel it first")

    def _submit(self, op: P.SubmitMessage, sink, media_text: str | None = None) -> None:
        if not self.ready:
            raise _Refused("not_ready", f"the model is not ready: {self.not_ready_reason}")
        if op.attachments and media_text is None:
            self.store.get(op.conv_id)
            self._require_idle(op.conv_id)
            self._prepare_media(op, sink)
            return
        text = op.text if media_text is None else media_text
        conv = self.store.get(op.conv_id)
        self._require_idle(op.conv_id)
        # the conversation keeps its default sampling as a plain dict (a journal record's field)
        sp = op.sampling or (msgspec.convert(conv.sampling, P.SamplingParams) if conv.sampling else None) \
            or P.SamplingParams()
        # the stop checker keeps every prefix of every stop string: bound them, or one long
        # string costs quadratic memory and time on the engine thread
        if len(sp.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in sp.stop):
            raise _Refused("bad_request", f"stop strings: at most {MAX_STOP_STRINGS} of at most {MAX_STOP_CHARS} "
                           f"characters each (got {len(sp.stop)}, the longest "
                           f"{max(map(len, sp.stop), default=0)} characters)")
        tok = self.lm.tokenizer
        if op.raw and self.images is not None and media_prompt.MARKER_RE.search(text):
            prompt = media_prompt.encode_raw_with_images(tok, text, self.images)
        elif op.raw:
            prompt = tok.encode(text, add_special=True, parse_special=False)
        else:
            history = self.store.chat_messages(op.conv_id)
            if self.images is not None and media_prompt.has_markers(history + [{"content": text}]):
                if self._restore_images(op, sink, text, history):
                    return
                text, prompt = self._admit_images(op, sink, history, text)
            else:
                prompt = self._encode_chat(history + [{"role": "user", "content": text}])
        if len(prompt) + 1 > self.n_ctx:
            sink.send(P.Notice(id=op.id, kind="refused", resource="context",
                               message=f"the prompt is {len(prompt)} tokens; the context holds {self.n_ctx} "
                                       f"(a reply needs at least 1 more)", asked=len(prompt) + 1, free=self.n_ctx))
            raise _Refused("too_long", f"prompt of {len(prompt)} tokens does not fit the context of "
                           f"{self.n_ctx} tokens")
        if not prompt:
            raise _Refused("bad_request", "the prompt is empty")
        if not self.store.has_credit():
            if not any(o is op for o, _, _ in self._held):
                free = self.store.journal_free_bytes()
                sink.send(P.Notice(id=op.id, kind="held", resource="journal", asked=64 << 10, free=free,
                                   message=f"the journal's buffers are full (the disk is behind: {free} bytes "
                                           f"free); the message is held until they drain"))
                self._held.append((op, sink, media_text))
            return
        msg_id, reply_id, seq = self.store.accept(op.conv_id, "user", text, sp, op.attachments, raw=op.raw,
                                                  tick=self.tick)
        from aotx.engine.model.termination import StopChecker
        from aotx.engine.model.tokenizer import StreamDecoder

        max_tokens = max(1, min(sp.max_tokens, self.n_ctx - len(prompt)))
        seed = sp.seed if sp.seed is not None else int(np.random.SeedSequence().entropy) & 0x7FFFFFFF
        r = Request(
            rid=op.id, sink=sink, conv_id=op.conv_id, msg_id=msg_id, reply_id=reply_id, prompt=prompt,
            sampler=SamplerConfig(sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.repeat_penalty, sp.repeat_last_n),
            sampler_state=SamplerState(seed=seed, history=list(prompt[-max(0, sp.repeat_last_n):])
                                       if sp.repeat_last_n > 0 else list(prompt)),
            max_tokens=max_tokens,
            stop=StopChecker(tok.eog_ids, list(sp.stop), max_tokens, self.n_ctx, n_prompt=len(prompt)),
            decoder=StreamDecoder(tok),
            accepted_seq=seq,
            drafter=self._drafter_for(sp),
        )
        if hasattr(r.drafter, "bind"):  # a draft model's drafter reads the request's slot and sampler
            r.drafter.bind(r)
        self._by_rid[(id(sink), op.id)] = r
        sink.send(P.Accepted(id=op.id, conv_id=op.conv_id, msg_id=msg_id, reply_id=reply_id, seq=seq,
                             tick=self.tick, prompt_ids=prompt))
        if self.store.journaled:
            self._watch(seq, r, "accepted")
            self.store.flush()
        else:
            r.state = "queued"
        self._waiting.append(r)
        self._notify_queue()

    def _prepare_media(self, op: P.SubmitMessage, sink) -> None:
        """Turn attachments into text through the model's media profile, off the tick
        thread; then the submission continues with the text the model receives. An
        attachment that cannot be used is reported and left out; the message is kept."""
        if op.id in self._media_busy.get(id(sink), set()):
            return
        self._media_busy.setdefault(id(sink), set()).add(op.id)

        def work() -> None:
            results, errors = [], []
            try:
                from aotx.media.profile import prepare, render_for_prompt
            except ImportError as e:
                for a in op.attachments:
                    errors.append((a.name or a.path, f"media support is not installed ({e.name}): "
                                                     "pip install 'aotx[media]'"))
                text = op.text + "".join(f"\n[Attachment {n} could not be used: {why}]" for n, why in errors)
            else:
                for a in op.attachments:
                    name = a.name or a.path.rsplit("/", 1)[-1]
                    try:
                        res = prepare(a.path, a.kind or None, device=self.device, vision=self.vision,
                                      images=self.images)
                        results.append(res)
                        sink.send(P.MediaInfo(id=op.id, kind=res.kind, route=res.route, name=name, text=res.text,
                                              via=str(res.model or ""), seconds=float(res.seconds or 0.0)))
                    except Exception as e:  # noqa: BLE001 - MediaError, or a decoder's own failure
                        errors.append((name, str(e)))
                        sink.send(P.MediaInfo(id=op.id, kind=a.kind, route="refused", name=name, error=str(e)))
                text = render_for_prompt(results, op.text, errors)
            self._ops.put(("media", (op, text), sink))

        threading.Thread(target=work, name="aotx-media", daemon=True).start()

    def _drafter_for(self, sp: P.SamplingParams):
        """A fresh drafter when speculation is on for this request (the request's own
        choice, else the engine's default), else None (verify window T = 1)."""
        mode = sp.speculative or self.speculative
        if mode == "ngram":
            return PromptLookup()
        if mode == "auto":  # where it pays: the CPU, drafting only after a match of 2+ tokens
            return PromptLookup(min_ngram=AUTO_MIN_NGRAM) if self.device == "cpu" else None
        if mode in ("off", "none", ""):
            return None
        if mode == "draft":
            if self.draft is None:
                raise _Refused("bad_request", "speculative mode 'draft' needs a draft model: start the engine with "
                                              "--draft-model PATH (or use ngram or off)")
            return DraftDrafter(draft=self.draft)
        raise _Refused("bad_request", f"speculative mode {mode!r} is not available (use auto, ngram, draft or off)")

    def _encode_chat(self, messages: list[dict]) -> list[int]:
        from aotx.engine.model.chat_template import encode_chat

        return encode_chat(self.lm.tokenizer, self.lm.template, messages)

    def _restore_images(self, op, sink, text: str, history: list[dict]) -> bool:
        """Earlier turns' pictures whose rows are gone (a restart, an eviction) are encoded
        again from their journaled files off the tick thread, then the submission comes
        back as a "media" op. True when it went to do that (once per submission)."""
        once = (id(sink), op.id)
        if once in self._restored:
            self._restored.discard(once)
            return False
        missing = media_prompt.missing_keys(history, self.images)
        if not missing:
            return False
        files = [(a.path, a.name) for m in self.store.get(op.conv_id).messages for a in m.attachments
                 if a.kind == "image" and a.path]
        self._restored.add(once)

        def work() -> None:
            try:
                media_prompt.restore(files, missing, self.vision, self.images)
            finally:
                self._ops.put(("media", (op, text), sink))

        threading.Thread(target=work, name="aotx-media-restore", daemon=True).start()
        return True

    def _admit_images(self, op, sink, history: list[dict], text: str) -> tuple[str, list[int]]:
        """Prompt ids with image positions (media_prompt); an image of this message that
        does not fit the context is left out with a refusal notice, the rest is kept."""
        def encode(t: str) -> list[int]:
            return media_prompt.encode_chat_with_images(self.lm.tokenizer, self.lm.template,
                                                        history + [{"role": "user", "content": t}], self.images)

        def refuse(message: str, asked: int, free: int) -> None:
            sink.send(P.Notice(id=op.id, kind="refused", resource="context", message=message, asked=asked,
                               free=free))

        return media_prompt.admit_images(text, encode, self.n_ctx, self.lm.config.n_ctx_train, self.images, refuse)

    def _cancel(self, r: Request) -> None:
        if r.state == "done":
            return
        r.cancelled = True
        if r.state in ("durable_wait", "queued"):
            self._waiting.remove(r)
            self._finish(r, "cancelled")

    # ---- durability --------------------------------------------------------

    def _watch(self, seq: int, r: Request, what: str) -> None:
        """Tell ``r``'s client when record ``seq`` is durable (what: accepted | tokens | final)."""
        with self._watch_lock:
            self._durable_watch.append((seq, r, what))

    def _receipt_from_drain(self, rc) -> None:
        """On the journal's drain thread, right after the fsync: hand each covered client
        its ``Durable`` at once (sinks are thread-safe), so a long tick never delays a
        receipt; then let the engine thread update its state."""
        with self._watch_lock:
            covered = [w for w in self._durable_watch if w[0] <= rc.last_seq]
            self._durable_watch = [w for w in self._durable_watch if w[0] > rc.last_seq]
        receipt = P.Receipt(segment=rc.segment, offset=rc.offset, last_seq=rc.last_seq)
        sent: set[int] = set()
        accepted = []
        for seq, r, what in covered:
            if what == "accepted":
                r.sink.send(P.Durable(id=r.rid, receipt=receipt, msg_id=r.msg_id))
                accepted.append(r)
            elif what == "final":
                r.sink.send(P.Durable(id=r.rid, receipt=receipt, msg_id=r.reply_id))
            elif id(r) not in sent:
                r.sink.send(P.Durable(id=r.rid, receipt=receipt))
            sent.add(id(r))
        self._ops.put(("receipt", (rc, accepted), None))

    def _on_receipt(self, obj) -> None:
        """On the engine thread: mark messages durable in the table, let requests whose
        user message is now durable be scheduled, retry submissions held for credit."""
        rc, accepted = obj
        self.store.note_receipt(rc)
        for r in accepted:
            if r.state == "durable_wait":
                r.state = "queued"
        if self._held and self.store.has_credit():
            held, self._held = self._held, []
            for op, sink, media_text in held:
                self._guarded(lambda: self._submit(op, sink, media_text=media_text), op, sink)

    # ---- the tick ------------------------------------------------------------

    def _notify_queue(self) -> None:
        pos = 0
        free = self.slots.free_count()
        for r in self._waiting:
            pos += 1
            if pos > free and r.queued_position != pos - free:
                r.queued_position = pos - free
                r.sink.send(P.Notice(id=r.rid, kind="queued", resource="slots", position=r.queued_position,
                                     asked=1, free=0,
                                     message=f"all {self.n_slots} slots are busy; queued at position "
                                             f"{r.queued_position}"))

    def _admit(self) -> None:
        while self._waiting:
            r = self._waiting[0]
            if r.cancelled:
                self._waiting.popleft()
                continue
            if r.state != "queued":
                break
            got = self.slots.choose(r.conv_id, r.prompt)
            if got is None:
                break
            self._waiting.popleft()
            slot, reuse = got
            reuse = self._lease_with_capsules(r, slot, reuse)
            r.slot, r.pos = slot, reuse
            r.n_reused = reuse
            r.state = "prefill"
            r.t_start = time.perf_counter()
            if r.queued_position:
                r.sink.send(P.Notice(id=r.rid, kind="resumed", resource="slots",
                                     message=f"got slot {r.slot.index}"))
            self._running.append(r)
        self._notify_queue()

    def _lease_with_capsules(self, r: Request, slot, reuse: int) -> int:
        """Lease ``slot`` to ``r``: park the state of the conversation whose KV the slot
        holds (when it would be lost), restore a parked capsule when it shares a longer
        prefix with the prompt (same conversation, or a fork's parent). Returns the
        number of prompt positions whose KV is in place."""
        from aotx.engine.state import capsule as C

        caps = self.capsules
        if caps is not None and slot.conv_id and slot.conv_id != r.conv_id and len(slot.tokens) > reuse + 16:
            caps.park(slot.conv_id, C.snapshot(self.kv, slot.index, slot.tokens, fingerprint=self.lm.fingerprint,
                                               backend=self.device, device=caps.device_budget > 0,
                                               sampler=self._sampler_of.get(slot.conv_id),
                                               drafter=self.draft.state(slot.index) if self.draft else None))
        if slot.conv_id != r.conv_id:           # the slot's state leaves it: at most one entry per slot
            self._sampler_of.pop(slot.conv_id, None)
        own_state = slot.conv_id == r.conv_id and reuse > 0
        if caps is not None and not own_state:
            cap, n, note = caps.best_for(r.conv_id, r.prompt)
            n = min(n, len(r.prompt) - 1)
            if cap is not None and n > reuse:
                C.restore(cap, self.kv, slot.index, fingerprint=self.lm.fingerprint, n=n)
                if self.draft is not None:
                    self.draft.restore(cap, slot.index, r.prompt)
                slot.tokens[:] = cap.tokens[:n].tolist()
                reuse = n
                note = (f"restored {n} tokens of context from the capsule on disk" if cap.home == "disk" else
                        f"restored {n} tokens of context from a parked capsule ({cap.home} memory)")
            elif note.startswith("restored"):
                note = ""
            if note:
                r.sink.send(P.Notice(id=r.rid, kind="capsule", resource="capsule", message=note, asked=n))
        self.slots.take(slot, r.conv_id, reuse)
        return reuse

    def _persist_capsule(self, r: Request) -> None:
        """After a reply: copy the slot's state and write it to the disk home in the
        background; the engine journals CapsuleStored once the file is durable."""
        from aotx.engine.state import capsule as C

        if self.capsules is None or self.capsules.dir is None or not r.slot or len(r.slot.tokens) < 2:
            return
        cap = C.snapshot(self.kv, r.slot.index, r.slot.tokens, fingerprint=self.lm.fingerprint, backend=self.device,
                         sampler=r.sampler_state, drafter=self.draft.state(r.slot.index) if self.draft else None)
        conv_id = r.conv_id

        def write() -> None:
            try:
                path = self.capsules.store_on_disk(conv_id, cap)
            except OSError as e:
                log.warning("capsule of %s not written: %s", conv_id, e)
                return
            if path is not None:
                self._ops.put(("capsule", (conv_id, str(path), cap.n_tokens), None))

        threading.Thread(target=write, name="aotx-capsule-write", daemon=True).start()

    def _tick(self) -> None:
        t0 = time.perf_counter()
        self.tick += 1
        # cancellations take effect at the tick boundary
        for r in [r for r in self._running if r.cancelled]:
            self._finish(r, "cancelled")
        self._admit()
        segs: list[Segment] = []
        toks: list[int] = []
        rows: list[tuple[Request, list[int]]] = []  # (request, drafts): 1 + len(drafts) logits rows
        for r in self._running:
            if r.state == "decode":
                drafts: list[int] = []
                if r.drafter is not None:
                    room = min(self.n_ctx - r.pos - 1, r.max_tokens - len(r.completion) - 1)
                    drafts = r.drafter.propose(r.prompt + r.completion, room)
                segs.append(Segment(r.slot.index, r.pos, 1 + len(drafts), all_logits=bool(drafts)))
                toks.append(r.next_input)
                toks.extend(drafts)
                rows.append((r, drafts))
        budget = self.prefill_chunk
        for r in self._running:
            if r.state != "prefill" or budget <= 0:
                continue
            n = min(budget, len(r.prompt) - r.pos)
            last = r.pos + n == len(r.prompt)
            segs.append(Segment(r.slot.index, r.pos, n, logits=last))
            if hasattr(r.drafter, "prefill"):  # a draft model prefills the same chunk into its own slot
                r.drafter.prefill(r.pos, n)
            toks.extend(r.prompt[r.pos:r.pos + n])
            r.slot.tokens.extend(r.prompt[r.pos:r.pos + n])
            r.pos += n
            budget -= n
            if last:
                rows.append((r, []))
        if not segs:
            return
        tok_arr = np.asarray(toks, np.int32)
        embeds = self.images.rows_for(tok_arr, self.lm.config.d_model) if self.images is not None else None
        t1 = time.perf_counter()
        # sampling on the device: when the model can (CUDA: sample()) and every row's
        # sampler is one the device chain runs exactly, only the ids come back, not the
        # logits; sample()/verify() on the host would pick the same ids
        model = self.lm.model
        ids = None
        logits = None
        try:
            srows = self._device_rows(model, rows) if embeds is None else None
            if srows is not None:
                ids = model.sample(tok_arr, segs, self.kv, srows, tick=self.tick)
            elif embeds is None and hasattr(model, "greedy") and all(
                    r.sampler.temperature <= 0.0 and r.sampler.repeat_penalty == 1.0 for r, _ in rows):
                ids = model.greedy(tok_arr, segs, self.kv)
            elif embeds is not None:
                logits = model.forward(tok_arr, segs, self.kv, embeds=embeds)
            else:
                logits = model.forward(tok_arr, segs, self.kv)
        except Exception as e:  # noqa: BLE001 - fail closed: refuse new work, keep reads
            log.exception("device work failed at tick %d", self.tick)
            self.ready = False
            self.not_ready_reason = f"device work failed at tick {self.tick}: {e}"
            # the queued ones too: they would otherwise run on a model marked not ready
            waiting, self._waiting = list(self._waiting), deque()
            for r in list(self._running) + waiting:
                r.sink.send(P.Error(id=r.rid, code="not_ready", message=self.not_ready_reason))
                self._finish(r, "error")
            held, self._held = self._held, []
            for op, sink, _ in held:
                sink.send(P.Error(id=op.id, code="not_ready", message=self.not_ready_reason))
            return
        t2 = time.perf_counter()
        per_conv: dict[Request, list[tuple[int, str]]] = {}
        off = 0
        n_out = 0
        for r, drafts in rows:
            if ids is not None:  # greedy on the device: accept drafts while they equal the argmax
                got = [int(t) for t in ids[off:off + 1 + len(drafts)]]
                n_ok = 0
                while n_ok < len(drafts) and got[n_ok] == drafts[n_ok]:
                    n_ok += 1
                produced = got[:n_ok + 1]
                if r.sampler.temperature > 0.0:
                    r.sampler_state.step += len(produced)  # one draw per sampled row
                hist, last_n = r.sampler_state.history, r.sampler.repeat_last_n
                hist.extend(produced)
                if last_n > 0 and len(hist) > 4 * last_n:
                    del hist[: len(hist) - last_n]
            if r.state == "prefill":
                if ids is None:
                    produced = [sample(logits[off], r.sampler, r.sampler_state)]
                r.state = "decode"
                r.slot.state = "decode"
                r.t_first = time.perf_counter()
            else:
                if ids is None:
                    produced = verify(logits[off:off + 1 + len(drafts)], drafts, r.sampler, r.sampler_state,
                                      q=r.drafter.q if drafts else None)
                fed = [r.next_input] + drafts[:len(produced) - 1]
                r.slot.tokens.extend(fed)
                r.pos += len(fed)
                if drafts:
                    r.drafter.update(len(drafts), len(produced) - 1)
                    r.n_drafted += len(drafts)
                    r.n_draft_accepted += len(produced) - 1
                    if len(fed) < 1 + len(drafts):  # roll back the rejected drafts' KV cells
                        self.kv.clear(r.slot.index, r.pos, r.pos + 1 + len(drafts) - len(fed))
            off += 1 + len(drafts)
            for tok in produced:
                r.completion.append(tok)
                n_out += 1
                delta = r.decoder.feed(tok)
                emit, reason = r.stop.feed(tok, delta)
                if reason in ("length", "context"):
                    emit += r.decoder.flush()
                r.text += emit
                per_conv.setdefault(r, []).append((tok, emit))
                if reason is not None:
                    r.finish_reason = reason
                    break
        for r, items in per_conv.items():
            seq = self.store.commit_tokens(r.conv_id, r.reply_id, len(r.prompt) + len(r.completion) - len(items),
                                           [t for t, _ in items], "".join(e for _, e in items), tick=self.tick)
            for j, (t, e) in enumerate(items):
                r.sink.send(P.Token(id=r.rid, token_id=t, text=e, pos=len(r.prompt) + len(r.completion) - len(items) + j,
                                    tick=self.tick, seq=seq))
            if self.store.journaled:
                self._watch(seq, r, "tokens")
            if r.finish_reason is not None:
                self._finish(r, r.finish_reason)
        self.store.flush()
        t3 = time.perf_counter()
        self.stats["ticks"] += 1
        self.stats["tokens"] += n_out
        self.stats["device_s"] += t2 - t1
        self.stats["host_s"] += (t1 - t0) + (t3 - t2)

    def _device_rows(self, model, rows) -> list | None:
        """The sampler rows for ``model.sample`` (one per logits row), or None when the
        model has no device sampler or a row needs the host (``cuda_sampling.device_ok``)."""
        if not hasattr(model, "sample"):
            return None
        from aotx.engine.backend.cuda_sampling import device_ok, fits_history

        out = []
        for r, drafts in rows:
            if not (device_ok(r.sampler, len(drafts)) and
                    fits_history(r.sampler, r.sampler_state, self.lm.config.vocab_size)):
                return None
            out.append((r.sampler, r.sampler_state, ()))
            out.extend((r.sampler, r.sampler_state, drafts[:i]) for i in range(1, len(drafts) + 1))
        return out

    def _finish(self, r: Request, reason: str) -> None:
        if reason in ("cancelled", "error") and r.completion:
            r.text += r.stop.flush()
        r.state = "done"
        r.t_end = time.perf_counter()
        if r in self._running:
            self._running.remove(r)
        if r.slot is not None:
            # the KV holds prompt + completion[:-1]; keep that for prefix reuse
            self.slots.release(r.slot)
            self._sampler_of[r.conv_id] = r.sampler_state
            if reason in ("stop", "length", "context"):
                self._persist_capsule(r)
        self._by_rid.pop((id(r.sink), r.rid), None)
        seq = self.store.finish(r.conv_id, r.reply_id, reason, len(r.prompt), len(r.completion), tick=self.tick)
        r.final_seq = seq
        r.sink.send(P.Committed(id=r.rid, msg_id=r.reply_id, finish_reason=reason, n_prompt=len(r.prompt),
                                n_completion=len(r.completion), tick=self.tick, seq=seq, text=r.text,
                                timings=r.timings(), numerics=self.numerics))
        if self.store.journaled:
            self._watch(seq, r, "final")
        self.store.flush()
        self.store.maybe_checkpoint(self.tick)
        self._notify_queue()

    # ---- status ---------------------------------------------------------------

    def status_reply(self, rid: int) -> P.StatusReply:
        b = self.budget
        slots = [P.SlotView(slot=s.index, conv_id=s.conv_id if s.state != "free" else None, state=s.state,
                            position=len(s.tokens)) for s in self.slots.slots]
        return P.StatusReply(
            id=rid, model=self.lm.name, device=self.device, ready=self.ready,
            budget_bytes=b.total if b else 0, used_bytes=b.used if b else 0,
            budget=[P.BudgetLine(name=n, bytes=v) for n, v in (b.terms if b else ())],
            slots=slots, n_ctx=self.n_ctx, queue=sum(1 for r in self._waiting if r.state == "queued"),
            tick=self.tick, journal=self.store.journal_status(), profile=dict(self.lm.profile),
            capsules=self.capsules.usage() if self.capsules is not None else {},
            fingerprint=self.lm.fingerprint, model_path=str(self.lm.path),
            draft_model=self.draft.lm.name if self.draft else "",
            draft_model_path=str(self.draft.lm.path) if self.draft else "",
            stats={k: float(v) for k, v in self.stats.items()},
        )


class _Refused(AotxError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
