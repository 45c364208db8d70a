"""A remote OpenAI-compatible engine as a model: generation there, the journal here.

Owns: ``RemoteModel``, a model of the ``ModelSet`` whose replies come from an endpoint
(a vLLM or SGLang cluster, llama-server, Ollama, another AOTX gateway) through
``/v1/chat/completions`` (``/v1/completions`` for a raw prompt) with ``stream: true``;
its submission stages (``RemoteSubmitter``); the stream worker (``RemoteStream``, a
thread per reply, reading the server-sent events with httpx-sse, so an event's several
``data:`` lines are one event, over the model's one shared ``httpx.Client``) and the tick
step that commits what arrived.

Everything a client sees is what a local model gives (DESIGN.md, "Three positions"):
the user's message is published and journaled first, and the request goes out only
once its receipt came back (``DURABLE_WAIT`` -> ``QUEUED``); the text that arrives is
committed tick by tick as ``TokensCommitted`` records and ``Token`` events (token id
-1: a remote server sends text, not our ids), with receipts as it reaches disk; the
finish is a ``MessageFinished`` and ``Committed``. A stream the server drops midway
finishes ``interrupted`` (what arrived is kept; the conversation goes on with it in
its history), as a reply cut by a crash of this engine does after recovery. A server
that refuses (HTTP 4xx/5xx: 429 and 503 are retried a few times, after their
``Retry-After``), is not there, or answers something that is not an OpenAI stream
fails that reply with a one-line error; other conversations and models go on.

Leaves to others: the endpoint's entry (``catalog.py``), the loaded set and the
budget (``models.py``: a remote model takes none of it), routing (``engine.py``).
Not done: attachments (refused with a message), token ids, capsules.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from aotx.engine.errors import Busy, ErrorCode, NotReady, RequestError
from aotx.engine import protocol as P
from aotx.engine.runtime import admission
from aotx.engine.runtime.catalog import ModelEntry, RemoteSpec
from aotx.engine.runtime.events import Inbox
from aotx.engine.runtime.receipts import Covers
from aotx.engine.runtime.requests import Request, RequestState, Sink
from aotx.engine.runtime.sampling import SamplerConfig, SamplerState
from aotx.engine.runtime.store import ConversationStore
from aotx.engine.runtime.submit import Submission

log = logging.getLogger("aotx.engine")

RETRY_STATUSES = (429, 503)
MAX_RETRIES = 3
MAX_RETRY_WAIT_S = 10.0
UNBOUNDED_MAX_TOKENS = 1 << 20  # a max_tokens at or above this is left to the server
CONNECT_TIMEOUT_S = 10.0


class RemoteStream:
    """One reply's request to the endpoint, on a thread of its own. ``items`` gets
    ("text", str), ("usage", prompt_tokens, completion_tokens), ("done", reason) or
    ("fail", kind, message) with kind dropped | http | refused | garbage; ``wake()`` after each."""

    def __init__(self, spec: RemoteSpec, body: dict[str, Any], chat: bool, model_name: str, wake: Callable[[], None],
                 client: Any = None):
        self.spec = spec
        self.body = body
        self.chat = chat
        self.name = model_name
        self.wake = wake
        self.client = client  # the remote model's shared httpx.Client (None: one of its own, for this reply)
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"aotx-remote-{model_name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _put(self, *item: Any) -> None:
        self.items.put(item)
        self.wake()

    def _run(self) -> None:
        try:
            self._request()
        except Exception as e:  # noqa: BLE001 - the worker must always end the reply
            log.exception("remote stream of %s failed", self.name)
            self._put("fail", "garbage", f"internal error while reading the stream: {e}")

    def _request(self) -> None:
        import httpx

        try:
            key = self.spec.key()
        except Exception as e:  # noqa: BLE001 - UsageError: the key's variable or file
            self._put("fail", "refused", str(e))
            return
        headers = {"Accept": "text/event-stream"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        url = f"{self.spec.url}/{'chat/completions' if self.chat else 'completions'}"
        timeout = httpx.Timeout(self.spec.timeout_s, connect=CONNECT_TIMEOUT_S)
        where = f"remote model {self.name} at {self.spec.url}"
        for attempt in range(MAX_RETRIES + 1):
            if self.cancelled.is_set():
                self._put("done", "cancelled")
                return
            try:
                with contextlib.ExitStack() as stack:
                    client = self.client or stack.enter_context(httpx.Client(timeout=timeout))
                    resp = stack.enter_context(client.stream("POST", url, json=self.body, headers=headers,
                                                             timeout=timeout))
                    if resp.status_code in RETRY_STATUSES and attempt < MAX_RETRIES:
                        wait = _retry_after(resp.headers.get("retry-after"), attempt)
                        log.info("%s answered %d; retrying in %.1f s", where, resp.status_code, wait)
                        self.cancelled.wait(wait)
                        continue
                    if resp.status_code != 200:
                        resp.read()
                        self._put("fail", "http", f"{where} refused the request: HTTP {resp.status_code}"
                                                  f"{_error_text(resp)}")
                        return
                    self._read(resp, where)
                    return
            except httpx.ConnectError as e:
                self._put("fail", "refused", f"{where} does not answer ({_reason(e)}); is the server running?")
                return
            except (httpx.RemoteProtocolError, httpx.ReadError) as e:
                self._put("fail", "dropped", f"{where} dropped the stream midway ({_reason(e)})")
                return
            except httpx.TimeoutException as e:
                self._put("fail", "dropped", f"{where} stopped answering ({type(e).__name__})")
                return
            except httpx.HTTPError as e:
                self._put("fail", "refused", f"{where}: {_reason(e)}")
                return

    def _read(self, resp: Any, where: str) -> None:
        """The server-sent events of an OpenAI stream (httpx-sse: an event's ``data:`` lines
        joined, comments and other fields skipped): text deltas, usage, the finish."""
        from httpx_sse import EventSource, SSEError

        finish = None
        try:
            events = EventSource(resp).iter_sse()
            for sse in events:
                if self.cancelled.is_set():
                    self._put("done", "cancelled")
                    return
                data = sse.data.strip()
                if not data:
                    continue
                if data == "[DONE]":
                    self._put("done", finish or "stop")
                    for _ in events:  # read to the end of the body, so the connection goes back to the pool
                        pass
                    return
                try:
                    ev = json.loads(data)
                except ValueError:
                    self._put("fail", "garbage", f"{where} sent an event that is not JSON ({data[:60]!r})")
                    return
                if not isinstance(ev, dict):
                    self._put("fail", "garbage", f"{where} sent an event that is not a JSON object ({data[:60]!r})")
                    return
                if "error" in ev:
                    err = ev["error"]
                    msg = err.get("message") if isinstance(err, dict) else err
                    self._put("fail", "http", f"{where} failed the reply: {str(msg)[:300]}")
                    return
                usage = ev.get("usage")
                if isinstance(usage, dict):
                    self._put("usage", int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))
                choices = ev.get("choices")
                if not isinstance(choices, list):
                    self._put("fail", "garbage", f"{where} sent an event without choices ({data[:60]!r})")
                    return
                for ch in choices[:1]:
                    if not isinstance(ch, dict):
                        continue
                    delta = ch.get("delta") if self.chat else None
                    text = (delta or {}).get("content") if self.chat else ch.get("text")
                    if isinstance(text, str) and text:
                        self._put("text", text)
                    if ch.get("finish_reason"):
                        finish = str(ch["finish_reason"])
        except SSEError as e:
            self._put("fail", "garbage", f"{where} answered something that is not an OpenAI event stream ({e})")
            return
        if finish is not None:  # some servers end without [DONE]
            self._put("done", finish)
        else:
            self._put("fail", "dropped", f"{where} ended the stream before the reply finished")


def _reason(e: Exception) -> str:
    s = str(e).strip()
    return s.splitlines()[0][:200] if s else type(e).__name__


def _retry_after(header: str | None, attempt: int) -> float:
    try:
        v = float(header) if header else 0.0
    except ValueError:
        v = 0.0
    return min(MAX_RETRY_WAIT_S, v if v > 0 else 0.5 * (2 ** attempt))


def _error_text(resp: Any) -> str:
    try:
        d = resp.json()
        err = d.get("error", d) if isinstance(d, dict) else d
        msg = err.get("message") if isinstance(err, dict) else err
        return f": {str(msg)[:300]}" if msg else ""
    except Exception:  # noqa: BLE001 - not JSON
        text = resp.text.strip() if hasattr(resp, "text") else ""
        return f": {text[:200]}" if text else ""


def finish_reason_of(remote: str) -> str:
    """An OpenAI finish_reason as AOTX's: stop | length (others are stop)."""
    return "length" if remote == "length" else "stop"


class RemoteSubmitter:
    """The stages of a message on a remote model (``submit.py``'s, without tokens):
    check, the history as chat messages, journal credit, accept."""

    def __init__(self, owner: "RemoteModel"):
        self.owner = owner
        self.store = owner.store
        self.model_name = owner.name
        self.ready = True
        self.not_ready_reason = ""
        self.held: list[Submission] = []   # stays empty: a remote message is never held
        self.vision: Any = None
        self.images: Any = None

    def submit(self, op: P.SubmitMessage, sink: Sink, tick: int) -> Request | None:
        if not self.ready:
            raise NotReady(f"the model is not ready: {self.not_ready_reason}")
        if self.owner.is_busy(op.conv_id):
            raise Busy(f"conversation {op.conv_id} is generating; cancel it first")
        conv = self.store.get(op.conv_id)
        if op.attachments:
            raise RequestError(f"attachments are not sent to the remote model {self.model_name} (AOTX reads them "
                               f"for local models only): send the text, or switch to a local model")
        if op.prefill:
            raise RequestError(f"an assistant prefill is not sent to the remote model {self.model_name}: send the "
                               f"conversation without it, or switch to a local model")
        sp = op.sampling or (msgspec.convert(conv.sampling, P.SamplingParams) if conv.sampling else None) \
            or P.SamplingParams()
        why = P.sampling_problem(sp)
        if why:
            raise RequestError(why)
        self.owner.spec.key()  # a missing key variable or file: refused before the message is journaled
        return self._accept(op, sink, sp, tick)

    def _accept(self, op: P.SubmitMessage, sink: Sink, sp: P.SamplingParams, tick: int) -> Request | None:
        st = self.store
        history = [] if op.raw else st.chat_messages(op.conv_id)
        msg_id, reply_id, recs = st.accept_records(op.conv_id, "user", op.text, sp, [], raw=op.raw,
                                                   model=self.model_name)
        ctx = self.owner.spec.context
        max_tokens = sp.max_tokens if not ctx else min(sp.max_tokens, ctx)
        credit = need = 0
        if st.journaled:
            st.check_writable()
            need = sum(st.record_bytes(r) for r in recs)
            cap = st.journal_capacity
            credit = min(min(max_tokens, 4096) * admission.REPLY_BYTES_PER_TOKEN + admission.REPLY_FINISH_BYTES,
                         cap // 16)
            if need > cap:
                raise admission.journal_refusal("this message", need, st.journal_free_bytes(), cap)
            if not st.reserve(need + credit):
                raise admission.journal_refusal("this message", need + credit, st.journal_free_bytes(), cap)
        try:
            seq = st.publish_accepted(recs, tick=tick)
        except BaseException:
            st.release(need + credit if st.journaled else 0)  # the credit goes back with the refusal
            raise
        seed = sp.seed if sp.seed is not None else int(np.random.SeedSequence().entropy) & 0x7FFFFFFF
        r = Request(rid=op.id, sink=sink, conv_id=op.conv_id, msg_id=msg_id, reply_id=reply_id, prompt=[],
                    sampler=SamplerConfig.of(sp), sampler_state=SamplerState(seed=seed), max_tokens=max_tokens,
                    stop=None, decoder=None, accepted_seq=seq, credit=credit, model=self.model_name)
        body: dict[str, Any] = {"model": self.owner.spec.model, "stream": True, "temperature": sp.temperature,
                                "top_p": sp.top_p, "stream_options": {"include_usage": True}}
        if sp.top_k:
            body["top_k"] = sp.top_k
        if sp.min_p:
            body["min_p"] = sp.min_p
        if sp.repeat_penalty != 1.0:
            body["repeat_penalty"] = sp.repeat_penalty
        if sp.frequency_penalty:
            body["frequency_penalty"] = sp.frequency_penalty
        if sp.presence_penalty:
            body["presence_penalty"] = sp.presence_penalty
        if sp.logit_bias:  # the remote model's own token ids
            body["logit_bias"] = {str(t): b for t, b in sp.logit_bias.items()}
        if max_tokens < UNBOUNDED_MAX_TOKENS:
            body["max_tokens"] = max_tokens
        if sp.stop:
            body["stop"] = list(sp.stop)
        if sp.seed is not None:
            body["seed"] = sp.seed
        if op.raw:
            body["prompt"] = op.text
        else:
            body["messages"] = history + [{"role": "user", "content": op.text}]
        self.owner.bodies[id(r)] = (body, not op.raw)
        sink.send(P.Accepted(id=op.id, conv_id=op.conv_id, msg_id=msg_id, reply_id=reply_id, seq=seq, tick=tick,
                             prompt_ids=[], model=self.model_name))
        if st.journaled:
            st.receipts.watch(seq, r, Covers.ACCEPTED)
            st.flush()
        else:
            r.state = RequestState.QUEUED
        return r

    # the submitter interface the engine calls; a remote model has no media stage or held line
    def media_ready(self, sub: Submission, tick: int) -> None:
        return None

    def prompt(self, sub: Submission, tick: int) -> None:
        return None

    def take_held(self, free: int) -> list[Submission]:
        return []

    def drop(self, sink: Sink) -> None:
        pass

    def fail_held(self, reason: str) -> None:
        pass


class RemoteModel:
    """A remote endpoint in the engine's ``ModelSet`` (see the module docstring)."""

    kind = "remote"

    def __init__(self, entry: ModelEntry, store: ConversationStore, inbox: Inbox, is_busy: Callable[[str], bool]):
        from aotx.engine.runtime.events import RemoteEvent

        self.name = entry.name
        self.entry = entry
        self.spec = entry.remote
        self.store = store
        self.inbox = inbox
        self.is_busy = is_busy
        self.default = False
        self.terms: tuple[tuple[str, int], ...] = ()
        self.capsules = None
        self.draft = None
        self.lm = None
        self.n_ctx = self.spec.context
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.bodies: dict[int, tuple[dict, bool]] = {}
        self.streams: dict[int, RemoteStream] = {}
        self._pending = threading.Event()  # a stream has items
        self._event = RemoteEvent(self.name)
        self.submitter = RemoteSubmitter(self)
        self.last_used = time.monotonic()
        self._http: Any = None

    @property
    def http(self) -> Any:
        """The one httpx.Client of this remote model (its connection pool, kept alive
        between replies; thread-safe: each reply's stream thread uses it), made on first use."""
        if self._http is None:
            import httpx

            self._http = httpx.Client(timeout=httpx.Timeout(self.spec.timeout_s, connect=CONNECT_TIMEOUT_S))
        return self._http

    @property
    def fingerprint(self) -> str:
        return f"remote:{self.spec.url}#{self.spec.model}"

    @property
    def ready(self) -> bool:
        return self.submitter.ready

    def in_flight(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_work(self) -> bool:
        return self._pending.is_set() or any(r.cancelled for r in self.running) or \
            any(r.state is RequestState.QUEUED for r in self.waiting)

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def _wake(self) -> None:
        self._pending.set()
        self.inbox.put(self._event)

    def enqueue(self, r: Request) -> None:
        self.waiting.append(r)
        self.touch()

    def cancel(self, r: Request) -> bool:
        r.cancelled = True
        s = self.streams.get(id(r))
        if s is not None:
            s.cancelled.set()
        if r in self.waiting:
            self.waiting.remove(r)
            return True
        return False

    def forget(self, conv_id: str) -> None:
        pass

    def tick(self, tick: int, finish: Callable[[Request, str], None]) -> tuple[int, float]:
        """Start the requests whose user message is durable; commit what arrived."""
        self._pending.clear()
        for r in [r for r in self.waiting if r.state is RequestState.QUEUED and not r.cancelled]:
            self.waiting.remove(r)
            body, chat = self.bodies.pop(id(r))
            s = RemoteStream(self.spec, body, chat, self.name, self._wake, self.http)
            self.streams[id(r)] = s
            r.state = RequestState.DECODE
            r.t_start = time.perf_counter()
            self.running.append(r)
            s.start()
        n_out = 0
        st = self.store
        for r in list(self.running):
            s = self.streams[id(r)]
            texts: list[str] = []
            end: tuple | None = None
            while end is None:
                try:
                    item = s.items.get_nowait()
                except queue.Empty:
                    break
                if item[0] == "text":
                    texts.append(item[1])
                elif item[0] == "usage":
                    r.remote_usage = (item[1], item[2])
                else:
                    end = item
            if texts:
                if not r.t_first:
                    r.t_first = time.perf_counter()
                text = "".join(texts)
                start = len(r.completion)
                seq, nbytes = st.commit_tokens(r.conv_id, r.reply_id, start, [], text, tick=tick)
                r.credit -= nbytes
                r.completion.extend([-1] * len(texts))
                r.text += text
                n_out += len(texts)
                for j, t in enumerate(texts):
                    r.sink.send(P.Token(id=r.rid, token_id=-1, text=t, pos=start + j, tick=tick, seq=seq))
                if st.journaled:
                    st.receipts.watch(seq, r, Covers.TOKENS)
            if end is None and r.cancelled:
                s.cancelled.set()
                end = ("done", "cancelled")
            if end is not None:
                if end[0] == "fail":
                    _, kind, message = end
                    if kind == "dropped":
                        r.sink.send(P.Notice(id=r.rid, kind="refused", resource="model", message=f"{message}; "
                                             f"the part that arrived is kept, and the conversation goes on"))
                        finish(r, "interrupted")
                    else:
                        r.sink.send(P.Error(id=r.rid, code=ErrorCode.BUSY if "HTTP 429" in message or "HTTP 503"
                                            in message else ErrorCode.NOT_READY, message=message))
                        finish(r, "error")
                else:
                    finish(r, end[1] if end[1] == "cancelled" else finish_reason_of(end[1]))
        if n_out:
            st.flush()
            self.touch()
        return n_out, 0.0

    def finish(self, r: Request, reason: str, tick: int, capsule_written: Callable | None = None) -> None:
        if r in self.running:
            self.running.remove(r)
        s = self.streams.pop(id(r), None)
        if s is not None:
            s.cancelled.set()
        self.bodies.pop(id(r), None)
        r.state = RequestState.DONE
        r.t_end = time.perf_counter()
        n_prompt, n_comp = getattr(r, "remote_usage", (0, len(r.completion)))
        n_comp = n_comp or len(r.completion)
        st = self.store
        seq, nbytes = st.finish(r.conv_id, r.reply_id, reason, n_prompt, n_comp, tick=tick)
        st.release(r.credit - nbytes)
        r.credit = 0
        r.final_seq = seq
        t = r.timings()
        t["prompt_tokens"] = float(n_prompt)
        t["completion_tokens"] = float(n_comp)
        r.sink.send(P.Committed(id=r.rid, msg_id=r.reply_id, finish_reason=reason, n_prompt=n_prompt,
                                n_completion=n_comp, tick=tick, seq=seq, text=r.text, timings=t, numerics="remote"))
        if st.journaled:
            st.receipts.watch(seq, r, Covers.FINAL)
        st.flush()
        self.touch()

    def fail_closed(self, reason: str, finish: Callable[[Request, str], None]) -> None:
        for r in list(self.running) + list(self.waiting):
            r.sink.send(P.Error(id=r.rid, code=ErrorCode.NOT_READY, message=reason))
            finish(r, "error")
        self.waiting.clear()

    def slot_views(self) -> list[P.SlotView]:
        return []

    def info(self) -> P.ModelInfo:
        return P.ModelInfo(name=self.name, kind="remote", url=self.spec.url, arch="remote",
                           n_ctx_train=self.spec.context, loaded=True, busy=self.in_flight(),
                           idle_s=round(time.monotonic() - self.last_used, 1) if not self.in_flight() else 0.0)

    def close(self) -> None:
        for s in self.streams.values():
            s.cancelled.set()
        if self._http is not None:
            self._http.close()
            self._http = None
