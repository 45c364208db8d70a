"""Submission: one message, from its ``SubmitMessage`` to an admitted ``Request``, stage by stage.

Each stage runs once per message, in order:

1. **check** (engine thread): the model is ready, the conversation exists and is not
   generating, the sampling (the message's own, else the conversation's default) is
   valid and its speculative mode available.
2. **media** (a thread of its own, only for a message with attachments): each
   attachment becomes what the model receives, through the media profile (a
   transcript, text read by OCR, or a picture's encoder rows and its marker);
   ``MediaInfo`` tells the client; an attachment that cannot be used is left out with
   a note, the message is kept. ``MediaReady`` brings the submission back.
3. **prompt** (the preparation stage, ``prepare.py``: a worker, never the tick
   thread): the chat template over the conversation (or the raw text), pictures at
   their markers, tokenized; a text too long for the context whatever its tokens is
   refused before any work, and the template renders inside its budget. The
   conversation counts as busy meanwhile; ``Prepared`` brings the submission back.
   Pictures of earlier turns whose rows are gone (a restart, an eviction) are
   encoded again from their journaled files first, on a thread, once (then
   ``MediaReady`` again).
4. **admission** (``admission.py``): the context; then journal credit for the
   message's records and its reply (``Journal.reserve``): while the disk is behind,
   the message is held with a notice and retried from stage 3 when receipts free the
   buffer; records that could never fit are refused.
5. **accept**: the records are published, the ``Request`` is made, the client gets
   ``Accepted``; the engine puts the request in line.

A refusal at any stage is an ``AotxError`` (the engine answers it with an Error) and
writes nothing.

The gateway's fields of a ``SubmitMessage`` enter here too: a ``constraint`` compiles
in stage 1 (``constraints.Compiler``: a grammar llguidance cannot compile is refused,
the message naming the client's field); ``tools`` go to the chat template (a template
without a ``tools`` variable gets them in its system prompt, ``tool_calls``), ``role``
"tool" feeds a tool's result back, and each stored message's template fields
(``meta``) render with it (an attachment that cannot be used refuses every message,
code ``unsupported_media``, so ``strict_media`` changes nothing now); ``n`` > 1
makes choices 1..n-1 in stage 5: each a fork of the conversation at the user's message
with its own reply (``store.fork_choice``) and a request that waits for choice 0's
prompt (``RequestState.FORK_WAIT``; the executor forks the prompt's state to it).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from aotx.engine.errors import Busy, ErrorCode, NotReady, RequestError
from aotx.engine import protocol as P
from aotx.engine.model import tool_calls
from aotx.engine.model.chat_template import encode_chat
from aotx.engine.model.loader import LoadedModel
from aotx.engine.model.termination import StopChecker
from aotx.engine.model.tokenizer import StreamDecoder
from aotx.engine.runtime import admission, context, media_prompt
from aotx.engine.runtime.constraints import Compiler, GrammarState
from aotx.engine.runtime.drafter import DraftDrafter, DraftModel
from aotx.engine.runtime.envelope import Envelope
from aotx.engine.runtime.events import Inbox, MediaReady, Prepared
from aotx.engine.runtime.mtp import MtpDrafter
from aotx.engine.runtime.prepare import Preparer, check_size, longest_piece, render_budget
from aotx.engine.runtime.receipts import Covers
from aotx.engine.runtime.requests import Drafter, Request, RequestState, Sink
from aotx.engine.runtime.sampling import SamplerConfig, SamplerState
from aotx.engine.runtime.speculative import PromptLookup
from aotx.engine.runtime.store import ConversationStore
from aotx.media.kinds import MediaKind

if TYPE_CHECKING:   # media loads its encoders and profiles only when an attachment needs them
    from aotx.media.profile import MediaProfile
    from aotx.media.vision import VisionEncoder
    from aotx.engine.runtime.mtp import MtpModel

# speculative "auto" (the default): prompt lookup on the CPU, where a verify window of a few
# rows costs little more than one row, drafting only after a match of this many tokens so
# that free chat (few matches) pays nothing; off on CUDA, where a tick's host time dominates
# and drafts rarely pay (BENCHMARKS.md, speculative sections)
AUTO_MIN_NGRAM = 2


@dataclass(eq=False)
class Submission:
    """A message on its way in. ``text`` is what the model receives for the user's turn
    (the message's text, with its attachments rendered in after the media stage);
    ``restored``: earlier pictures were encoded again (done once)."""

    op: P.SubmitMessage
    sink: Sink
    sampling: P.SamplingParams
    text: str
    restored: bool = False
    held: bool = False
    need: int = 0  # journal credit asked when it was held
    prompt: list[int] = field(default_factory=list)
    constraint: GrammarState | None = None  # compiled in stage 1
    dropped: bool = False  # its client went away or cancelled it while it was being prepared
    model: str = ""  # the loaded model whose submitter runs its stages
    media_errors: list[tuple[str, str]] = field(default_factory=list)  # (file name, why) of refused attachments
    policy: str = ""  # the context policy its prompt is made under (context.py)
    fit: Any = None  # context.Fit: the prompt fitted to the context (stage 3; None: raw or with pictures)
    continuation: Any = None  # context.Continuation: how its reply goes on past the end of the context


@dataclass(eq=False)
class CountJob:
    """A ``CountTokens`` in the preparation stage (its worker makes the prompt's ids)."""

    op: P.CountTokens
    sink: Sink
    model: str = ""


class Submitter:
    """The stages of ``submit.py`` for one engine.

    lm: the ``LoadedModel``; store: the ``ConversationStore``; envelope: the engine's;
    inbox: the engine's (media stages post ``MediaReady`` to it); is_busy(conv_id):
    whether a conversation is generating; device: "cpu" | "cuda"; speculative: the
    engine's default mode; draft: the ``DraftModel`` or None; mtp: the ``mtp.MtpModel``
    (the model's own multi-token-prediction head) or None. ``vision`` and
    ``images`` are set when pictures go to an encoder."""

    def __init__(self, lm: LoadedModel, store: ConversationStore, envelope: Envelope, inbox: Inbox,
                 is_busy: Callable[[str], bool], *, device: str, speculative: str, draft: DraftModel | None = None,
                 mtp: MtpModel | None = None, context_policy: str = context.DEFAULT_POLICY):
        self.lm = lm
        self.store = store
        self.envelope = envelope
        self.inbox = inbox
        self.is_busy = is_busy
        self.device = device
        self.speculative = speculative
        self.draft = draft
        self.mtp = mtp
        self.context_policy = context_policy  # the engine's default (a conversation may set its own)
        self.vision: VisionEncoder | None = None
        self.images: media_prompt.ImageStore | None = None
        self.ready = True
        self.not_ready_reason = ""
        self.held: list[Submission] = []
        self._media_busy: set[tuple[int, int]] = set()
        self.constraints = Compiler(lm.tokenizer)  # llguidance's vocabulary is built on first use
        self.preparer = Preparer(inbox)
        self.preparer.isolate(getattr(lm, "template", None))  # chat templates render where the OS bounds their memory and CPU
        self.preparing: dict[str, Submission] = {}  # conv_id -> its message in the preparation stage
        self._longest: int | None = None  # bytes of the vocabulary's longest token
        self.model_name: str = getattr(lm, "name", "")  # the engine's name for this model (models.ModelSet)
        # the model's media.profile.MediaProfile (set by serve) and the engine's admission of a
        # specialist when an attachment first needs it: count_media(name, bytes) -> "" or why not
        self.media_profile: MediaProfile | None = None
        self.count_media: Callable[[str, int], str] | None = None

    # ---- 1. check ---------------------------------------------------------------------

    def submit(self, op: P.SubmitMessage, sink: Sink, tick: int) -> Request | None:
        """Stage 1, then media (with attachments) or straight on to the prompt."""
        sp = self._check(op)
        sub = Submission(op, sink, sp, op.text, model=self.model_name)
        if op.constraint is not None:
            c = op.constraint
            sub.constraint = self.constraints.compile(c.kind, c.grammar, c.field)
        if op.attachments:
            self._media(sub)
            return None
        return self.prompt(sub, tick)

    def _check(self, op: P.SubmitMessage) -> P.SamplingParams:
        self._ready_and_idle(op.conv_id)
        conv = self.store.get(op.conv_id)
        # the conversation keeps its default sampling as a plain dict (a journal record's field)
        sp = op.sampling or (msgspec.convert(conv.sampling, P.SamplingParams) if conv.sampling else None) \
            or P.SamplingParams()
        why = P.sampling_problem(sp)
        if why:
            raise RequestError(why)
        if op.prefill and (op.raw or op.attachments):
            raise RequestError("an assistant prefill continues a chat turn: not with a raw prompt or attachments")
        self._mode(sp)
        return sp

    def _mode(self, sp: P.SamplingParams) -> str:
        """The speculative mode of a request: its own choice, else the engine's default."""
        mode = sp.speculative or self.speculative
        if mode == "draft" and self.draft is None:
            raise RequestError("speculative mode 'draft' needs a draft model: start the engine with "
                               "--draft-model PATH (or use auto, ngram or off)")
        if mode == "mtp" and self.mtp is None:
            raise RequestError("speculative mode 'mtp' needs a model with a multi-token-prediction head (nextn "
                               "layers) on the CPU (or use auto, ngram, draft or off)")
        if mode not in P.SPECULATIVE_MODES:
            raise RequestError(f"speculative mode {mode!r} is not available (use auto, ngram, draft, mtp or off)")
        return mode

    # ---- 2. media ---------------------------------------------------------------------

    def _media(self, sub: Submission) -> None:
        """Attachments -> text through the model's media profile, on a thread. A speech or
        OCR specialist is admitted into the budget when a first attachment needs it."""
        op, sink = sub.op, sub.sink
        key = (id(sink), op.id)
        if key in self._media_busy:
            return
        self._admit_specialists(op)
        self._media_busy.add(key)

        def work() -> None:
            results, errors = [], []
            try:
                from aotx.media.profile import prepare, render_for_prompt
            except ImportError as e:
                for a in op.attachments:
                    errors.append((a.name or a.path, f"media support is not installed ({e.name}): "
                                                     "pip install 'aotx[media]'"))
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
                        why = unnamed(str(e), a.path, name)
                        errors.append((name, why))
                        sink.send(P.MediaInfo(id=op.id, kind=a.kind, route="refused", name=name, error=why))
                if not errors:
                    sub.text = render_for_prompt(results, op.text)
            sub.media_errors = errors
            self.inbox.put(MediaReady(sub))

        threading.Thread(target=work, name="aotx-media", daemon=True).start()

    def _admit_specialists(self, op: P.SubmitMessage) -> None:
        """Count each specialist this message's attachments need (Whisper, OCR) the first
        time one is needed; refuse the message, writing nothing, when one does not fit."""
        prof, count = self.media_profile, self.count_media
        if prof is None or count is None:
            return
        from aotx.media.kinds import kind_of_name

        for a in op.attachments:
            kind = a.kind or (k.value if (k := kind_of_name(a.path)) else "")
            route = prof.route(kind) if kind else None
            if route is None or route.route != "specialist" or not route.available:
                continue
            why = count(f"media: {route.model}", route.memory_bytes)
            if why:
                raise admission.Refusal(ErrorCode.UNSUPPORTED_MEDIA, "memory",
                                        f"{a.name or a.path}: {why}", asked=route.memory_bytes)

    def media_ready(self, sub: Submission, tick: int) -> Request | None:
        """The media stage is done (attachments rendered, or earlier pictures restored).
        An attachment that could not be used refuses the message, and nothing is written:
        its refusal never goes into the prompt as text for the model; the user sees why."""
        self._media_busy.discard((id(sub.sink), sub.op.id))
        if sub.media_errors:
            errors, sub.media_errors = sub.media_errors, []
            raise admission.Refusal(ErrorCode.UNSUPPORTED_MEDIA, "media",
                                    "; ".join(f"{name}: {why}" for name, why in errors) +
                                    " (nothing was sent: remove or fix the attachment and send again)")
        return self.prompt(sub, tick)

    # ---- 3. prompt ----------------------------------------------------------------------

    def prompt(self, sub: Submission, tick: int) -> None:
        """Stage 3 (and again for a held message): hand the prompt's preparation to a
        worker (``prepare.py``); ``prepared`` continues when it comes back. The
        conversation is busy until then. Returns None (nothing to enqueue yet)."""
        op = sub.op
        self._ready_and_idle(op.conv_id)
        history = [] if op.raw else self.store.chat_messages(op.conv_id)
        if not op.raw and self.images is not None and media_prompt.has_markers(history + [{"content": sub.text}]):
            if not sub.restored and self._restore_images(sub, history):
                return None
        sub.policy = context.policy_of(self.store.get(op.conv_id).context, self.context_policy)
        parts = None if op.raw else self.store.prompt_history(op.conv_id)
        self.preparing[op.conv_id] = sub
        self.preparer.submit(sub, lambda: self._prepare(sub, history, parts))
        return None

    def _prepare(self, sub: Submission, history: list[dict], parts: tuple | None = None) -> tuple[str, list[int]]:
        """The work of stage 3, on a preparation worker: (the user's turn as the prompt
        holds it, the prompt's token ids). ``parts``: ``store.prompt_history``'s, which the
        conversation's context policy fits to the context (``context.fit``: sets ``sub.fit``
        and ``sub.continuation``). Raises Refusal (too long for the context, whatever its
        tokens, or even with every earlier turn left out) or TemplateError (the template
        failed or passed its budget)."""
        op, text, tok = sub.op, sub.text, self.lm.tokenizer
        if self._longest is None:
            self._longest = longest_piece(tok)
        check_size(text, self._longest, self.envelope.context_tokens)
        if op.raw and self.images is not None and media_prompt.MARKER_RE.search(text):
            return text, media_prompt.encode_raw_with_images(tok, text, self.images)
        if op.raw:
            return text, tok.encode(text, add_special=True, parse_special=False)
        history = [tool_calls.template_message(m) for m in history]
        if self.images is not None and media_prompt.has_markers(history + [{"content": text}]):
            return self._fit_images(sub, history, text)
        turn = {**P.template_fields(op.meta), "role": op.role, "content": text}
        if parts is None:
            return text, self._chat_ids(history + [turn], op.tools, op.prefill, fit=True)
        return text, self._fit(sub, parts, turn)

    def _fit(self, sub: Submission, parts: tuple, turn: dict[str, Any]) -> list[int]:
        """The prompt's ids under the conversation's context policy (on the worker:
        ``context.fit_turn``); sets ``sub.fit`` and ``sub.continuation``."""
        op = sub.op
        sub.fit, sub.continuation = context.fit_turn(
            sub.policy, self.envelope, parts, lambda kept: self._chat_ids(kept + [turn], op.tools, op.prefill, fit=True),
            sub.sampling.max_tokens)
        return sub.fit.ids

    def _chat_ids(self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]], prefill: str,
                  fit: bool = False) -> list[int]:
        """Prompt ids of template messages ``msgs`` with ``tools`` (in the template's
        ``tools``, or described in the system prompt of a template without them) and an
        assistant ``prefill`` left open. ``fit``: a rendered prompt that cannot fit the
        context is refused before it is tokenized. Raises TemplateError or Refusal."""
        if prefill:
            msgs = msgs + [{"role": "assistant", "content": prefill}]
        extra: dict[str, Any] = {}
        if tools:
            if tool_calls.takes_tools(self.lm.template.source):
                extra["tools"] = tools
            else:  # the template knows no tools: describe them in the system prompt
                msgs = _with_system(msgs, tool_calls.fallback_system_prompt(tools))
        check = None
        if fit:
            longest, context = self._longest or longest_piece(self.lm.tokenizer), self.envelope.context_tokens
            check = lambda text: check_size(text, longest, context, "the prompt the chat template made")  # noqa: E731
            extra["budget"] = render_budget(longest, context)
        return encode_chat(self.lm.tokenizer, self.lm.template, msgs, continue_final=bool(prefill), check=check,
                           **extra)

    def count(self, op: P.CountTokens, sink: Sink) -> None:
        """``CountTokens``: the prompt's ids made on a preparation worker as stage 3 makes a
        text message's (the history as ``store.chat_messages`` gives it); ``prepared``
        answers ``TokenCount``."""
        if not self.ready:
            raise NotReady(f"the model is not ready: {self.not_ready_reason}")
        history: list[dict[str, Any]] = [{"role": "system", "content": op.system_prompt}] if op.system_prompt else []
        for m in op.messages[:-1]:
            if m.role == "assistant" and not m.text and not m.meta.get("tool_calls"):
                continue  # as a stored conversation leaves it out
            history.append(tool_calls.template_message({**P.template_fields(m.meta), "role": m.role,
                                                        "content": m.text}))
        last = op.messages[-1]
        turn = {**P.template_fields(last.meta), "role": last.role, "content": last.text}
        job = CountJob(op, sink, model=self.model_name)
        self.preparer.submit(job, lambda: ("", self._chat_ids(history + [turn], op.tools, op.prefill)))

    def prepared(self, ev: Prepared, tick: int) -> Request | None:
        """Stage 3 came back (engine thread): admission and acceptance, or its refusal."""
        sub = ev.submission
        if isinstance(sub, CountJob):  # (a count is answered whatever the client does meanwhile)
            if ev.error is not None:
                raise ev.error
            sub.sink.send(P.TokenCount(id=sub.op.id, n_tokens=len(ev.prompt), model=self.model_name))
            return None
        if self.preparing.get(sub.op.conv_id) is sub:
            del self.preparing[sub.op.conv_id]
        if sub.dropped:
            return None
        if ev.error is not None:
            raise ev.error
        self._ready_and_idle(sub.op.conv_id)
        try:
            admission.check_prompt(len(ev.prompt), self.envelope)
        except admission.Refusal as e:
            if e.resource == "context" and e.detail and not sub.op.raw and sub.policy not in context.CONTINUING:
                e.detail += (f"; this conversation's context policy is {sub.policy}: `/context rolling` in aotx "
                             f"(F4 in aotx-chat) lets older turns leave the prompt")
            raise
        sub.prompt = list(ev.prompt)
        return self._accept(sub, ev.text, tick)

    def continue_reply(self, r: Request) -> None:
        """A reply reached the end of the context under a continuing policy: its prompt is
        cut again on a preparation worker (``context.continue_reply``)."""
        context.continue_reply(r, self.preparer, self.envelope.context_tokens, self.model_name)

    def _ready_and_idle(self, conv_id: str) -> None:
        if not self.ready:
            raise NotReady(f"the model is not ready: {self.not_ready_reason}")
        if conv_id in self.preparing:
            raise Busy(f"conversation {conv_id} is preparing a message; wait for it or cancel it first")
        if self.is_busy(conv_id):
            raise Busy(f"conversation {conv_id} is generating; cancel it first")
        self.store.get(conv_id)

    def _restore_images(self, sub: Submission, history: list[dict]) -> bool:
        """Earlier turns' pictures whose rows are gone are encoded again from their
        journaled files on a thread; True when that started (once per submission)."""
        sub.restored = True
        missing = media_prompt.missing_keys(history, self.images)
        if not missing:
            return False
        files = [(a.path, a.name) for m in self.store.get(sub.op.conv_id).messages for a in m.attachments
                 if a.kind == MediaKind.IMAGE and a.path]

        def work() -> None:
            try:
                media_prompt.restore(files, missing, self.vision, self.images)
            finally:
                self.inbox.put(MediaReady(sub))

        threading.Thread(target=work, name="aotx-media-restore", daemon=True).start()
        return True

    def _fit_images(self, sub: Submission, history: list[dict], text: str) -> tuple[str, list[int]]:
        """Prompt ids with image positions; a picture of this message that does not fit
        the context is left out with a refusal notice, the rest is kept."""
        def encode(t: str) -> list[int]:
            return media_prompt.encode_chat_with_images(self.lm.tokenizer, self.lm.template,
                                                        history + [{"role": "user", "content": t}], self.images)

        def refuse(message: str, asked: int, free: int) -> None:
            sub.sink.send(admission.refused_notice(sub.op.id, "context", message, asked, free))

        return media_prompt.admit_images(text, encode, self.envelope.context_tokens, self.lm.config.n_ctx_train,
                                         self.images, refuse)

    # ---- 4, 5. credit and accept ----------------------------------------------------------------

    def _accept(self, sub: Submission, text: str, tick: int) -> Request | None:
        op, sink, sp, prompt, st = sub.op, sub.sink, sub.sampling, sub.prompt, self.store
        ctx = self.envelope.context_tokens
        has_history = bool(st.get(op.conv_id).messages)  # before this message's records
        # a reply goes on past the end of the context under a continuing policy: its own
        # max_tokens is its only limit then
        max_tokens = sp.max_tokens if sub.continuation is not None else max(1, min(sp.max_tokens, ctx - len(prompt)))
        msg_id, reply_id, recs = st.accept_records(op.conv_id, op.role, text, sp, op.attachments, raw=op.raw,
                                                   meta=op.meta, **self._model_fields())
        reply = admission.reply_credit(max_tokens, self.envelope)
        if st.journaled:
            st.check_writable()
            need = sum(st.record_bytes(r) for r in recs)
            if need > st.journal_capacity:
                raise admission.journal_refusal("this message", need, st.journal_free_bytes(), st.journal_capacity)
            if not st.reserve(need + reply * op.n):  # every choice's reply
                sub.need = need + reply * op.n
                if not sub.held:
                    sub.held = True
                    sink.send(admission.held_notice(op.id, sub.need, st.journal_free_bytes(), st.hold_reason()))
                self.held.append(sub)
                return None
        try:
            seq = st.publish_accepted(recs, tick=tick)
        except BaseException:
            st.release(need + reply * op.n if st.journaled else 0)  # the credit goes back with the refusal
            raise
        seed = sp.seed if sp.seed is not None else int(np.random.SeedSequence().entropy) & 0x7FFFFFFF
        r = self._request(sub, op.conv_id, msg_id, reply_id, seq, seed, max_tokens, reply)
        r.constraint, r.has_history = sub.constraint, has_history
        if sub.continuation is not None:
            r.continuation = sub.continuation
            r.stop.goes_on = True
        if r.drafter is not None:  # a draft model's drafter reads the request's slot and sampler
            r.drafter.bind(r)
        sink.send(P.Accepted(id=op.id, conv_id=op.conv_id, msg_id=msg_id, reply_id=reply_id, seq=seq,
                             tick=tick, prompt_ids=prompt, model=self.model_name))
        cut = sub.fit.cut if sub.fit is not None else None
        if cut is not None:
            if not cut.kept_from:  # only the newest turn stays: the next prompt starts at it
                cut.kept_from = msg_id
            r.cuts.append(cut)
            sink.send(P.Notice(id=op.id, kind="context", resource="context", message=context.cut_text(cut),
                               asked=cut.n_tokens, cut=cut))
        if st.journaled:
            st.receipts.watch(seq, r, Covers.ACCEPTED)
        else:
            r.state = RequestState.QUEUED
        for i in range(1, op.n):
            f_conv, f_msg, f_reply, f_seq = st.fork_choice(op.conv_id, msg_id, raw=op.raw, tick=tick,
                                                                 **self._model_fields())
            f = self._request(sub, f_conv, f_msg, f_reply, f_seq, (seed + i) & 0x7FFFFFFFFFFFFFFF, max_tokens, reply)
            f.choice, f.state = i, RequestState.FORK_WAIT
            f.constraint = sub.constraint.fork() if sub.constraint is not None else None
            if f.drafter is not None:
                f.drafter.bind(f)
            r.forks.append(f)
            sink.send(P.Accepted(id=op.id, conv_id=f_conv, msg_id=f_msg, reply_id=f_reply, seq=f_seq, tick=tick,
                                 prompt_ids=prompt, choice=i, model=self.model_name))
            if st.journaled:
                st.receipts.watch(f_seq, f, Covers.ACCEPTED)
        if st.journaled:
            st.flush()
        return r

    def _model_fields(self) -> dict[str, str]:
        """The reply records' model fields: its name, the file it was loaded from and its
        fingerprint (a restart finds a file loaded by path again: ``Engine._submit``)."""
        path = getattr(self.lm, "path", None)
        return {"model": self.model_name, "model_path": os.path.abspath(path) if path else "",
                "model_fingerprint": str(getattr(self.lm, "fingerprint", "") or "")}

    def _request(self, sub: Submission, conv_id: str, msg_id: str, reply_id: str, seq: int, seed: int,
                 max_tokens: int, reply_credit: int) -> Request:
        """The ``Request`` of one choice of ``sub``'s reply (the seed its own)."""
        op, sp, prompt, tok = sub.op, sub.sampling, sub.prompt, self.lm.tokenizer
        return Request(
            rid=op.id, sink=sub.sink, conv_id=conv_id, msg_id=msg_id, reply_id=reply_id, prompt=prompt,
            sampler=SamplerConfig.of(sp),
            sampler_state=SamplerState(seed=seed, history=list(prompt[-max(0, sp.repeat_last_n):])
                                       if sp.repeat_last_n > 0 else list(prompt)),
            max_tokens=max_tokens,
            stop=StopChecker(tok.eog_ids, list(sp.stop), max_tokens, self.envelope.context_tokens,
                             n_prompt=len(prompt)),
            decoder=StreamDecoder(tok),
            accepted_seq=seq,
            credit=reply_credit if self.store.journaled else 0,
            drafter=self._drafter(sp),
            logprobs=op.logprobs,
            model=self.model_name,
        )

    def _drafter(self, sp: P.SamplingParams) -> Drafter | None:
        """A fresh drafter when speculation is on for this request, else None (T = 1)."""
        mode = self._mode(sp)
        if mode == "ngram":
            return PromptLookup()
        if mode == "auto":  # where it pays: the CPU, drafting only after a match of 2+ tokens
            return PromptLookup(min_ngram=AUTO_MIN_NGRAM) if self.device == "cpu" else None
        if mode == "draft":
            return DraftDrafter(draft=self.draft)
        if mode == "mtp":
            return MtpDrafter(self.mtp)
        return None  # "off", or "" with an engine default of "off"

    # ---- held messages -------------------------------------------------------------------

    def take_held(self, free: int) -> list[Submission]:
        """The held messages whose credit now fits in ``free`` journal bytes, to retry
        from stage 3 (``prompt``) each; the others stay held, in order."""
        take = [h for h in self.held if h.need <= free]
        if take:
            self.held = [h for h in self.held if h.need > free]
        return take

    def drop(self, sink: Sink) -> None:
        """A client went away: its held messages go too, and those being prepared are
        dropped when their preparation comes back (their conversations are free now)."""
        self.held = [h for h in self.held if h.sink is not sink]
        for conv_id, sub in list(self.preparing.items()):
            if sub.sink is sink:
                sub.dropped = True
                del self.preparing[conv_id]

    def cancel_preparing(self, op: P.Cancel, sink: Sink) -> None:
        """A ``Cancel`` of a message still being prepared (by its request id on the same
        connection, or by conversation): it ends with a ``cancelled`` Error now, writes
        nothing, and its preparation's result is dropped."""
        for conv_id, sub in list(self.preparing.items()):
            if (op.target and sub.op.id == op.target and sub.sink is sink) or (op.conv_id and conv_id == op.conv_id):
                sub.dropped = True
                del self.preparing[conv_id]
                sub.sink.send(P.Error(id=sub.op.id, code=ErrorCode.CANCELLED,
                                      message="cancelled before the message was accepted; nothing was written"))

    def fail_held(self, reason: str) -> None:
        """The model failed: every held message gets a not_ready error."""
        held, self.held = self.held, []
        for sub in held:
            sub.sink.send(P.Error(id=sub.op.id, code=ErrorCode.NOT_READY, message=reason))


def _with_system(msgs: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``msgs`` with ``text`` appended to the system message (one is added first when none)."""
    if msgs and msgs[0].get("role") == "system":
        return [{**msgs[0], "content": f"{msgs[0].get('content') or ''}\n\n{text}".lstrip()}, *msgs[1:]]
    return [{"role": "system", "content": text}, *msgs]


def unnamed(why: str, path: str, name: str) -> str:
    """A media error without the file's name or path in front (``README.md: not an
    image`` -> ``not an image``): the refusal puts the name before it once."""
    for prefix in (path, name):
        if prefix and why.startswith(prefix + ": "):
            return why[len(prefix) + 2:]
    return why
