"""Context policies: what a conversation's prompt holds once its history outgrows the context.

Owns: the policies (``protocol.CONTEXT_POLICIES``): "rolling" (the default: the oldest
turns leave the prompt, the system prompt and the newest turns stay), "middle" (the first
exchange stays too, the turns after it leave) and "stop" (nothing leaves: a prompt that
does not fit is refused, a reply ends at the end of the context); where a prompt is cut
(``fit``); the numbers of a cut (``protocol.ContextCut``) and the sentences clients show.
The journal keeps every message whatever the policy: a cut only changes what the model
reads.

Where a cut falls. A prompt is cut only at the start of a user turn, so roles still
alternate and a tool's result stays with the call that asked for it. Once a prompt leaves
less than ``room`` tokens for the reply, the oldest turns leave until the prompt holds at
most half the context (llama.cpp's context shift discards half too): the next turns then
extend the same prompt, so their KV is reused from the slot or a capsule (prefix reuse)
instead of being prefilled again at every turn. The cut is journaled with the reply
(``MessageFinished.context``), and the next prompt starts where it left off.

A reply that reaches the end of the context goes on under the same policy: its prompt is
cut again (``fit`` with ``extra``, the reply's tokens, kept whole) and prefilled with the
reply so far, and decoding continues (``models.LocalModel``). When even the newest user
turn and the reply leave no room, the reply ends with a notice saying so.

Leaves to others: rendering and tokenizing (the caller's ``render``: ``submit.py``), the
journal (``store.py``), the continuation's mechanics (``models.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aotx.engine import protocol as P
from aotx.engine.runtime import admission
from aotx.engine.model import tool_calls

DEFAULT_POLICY = "rolling"
CONTINUING = ("rolling", "middle")  # the policies under which a conversation (and a reply) goes on


def policy_of(conv_policy: str, engine_policy: str) -> str:
    """The policy a conversation runs under: its own, else the engine's."""
    return conv_policy or engine_policy or DEFAULT_POLICY


def reply_room(n_ctx: int, max_tokens: int) -> int:
    """Tokens a prompt must leave for its reply before it is cut: a quarter of the
    context, or the reply's whole ``max_tokens`` when that is less."""
    return max(1, min(n_ctx // 4, max_tokens))


@dataclass
class History:
    """A conversation as its next prompt sees it: the system message (a template message,
    or None), the other messages as (msg_id, template message) in order, and ``start``:
    the index of the first message after the last journaled cut (0: none)."""

    system: dict[str, Any] | None
    messages: list[tuple[str, dict[str, Any]]]
    start: int = 0

    def head(self, policy: str) -> int:
        """Messages kept before a cut: 0 ("rolling"), or "middle"'s first exchange (every
        message before the second user turn)."""
        if policy != "middle":
            return 0
        users = [i for i, (_, m) in enumerate(self.messages) if m.get("role") == "user"]
        return users[1] if len(users) > 1 else 0

    def starts(self, lo: int) -> list[int]:
        """Where a prompt's tail may start, from ``lo`` on: each user turn, and the end
        (nothing but the turn being answered)."""
        n = len(self.messages)
        return [i for i in range(lo, n) if self.messages[i][1].get("role") == "user"] + [n]

    def kept(self, start: int, head: int) -> list[dict[str, Any]]:
        """The template messages a prompt with its tail from ``start`` holds (system first)."""
        msgs = [m for _, m in self.messages]
        body = msgs[:head] + msgs[start:] if start > head else msgs[start:]
        return ([self.system] if self.system else []) + body


class TooLong:
    """A prompt whose render was refused for its size before it was tokenized (``refusal``:
    the preparation stage's ``check_size``): at least ``len()`` tokens, more than the
    context holds. ``fit`` only compares lengths, so it stands for the ids."""

    def __init__(self, refusal: Any):
        self.refusal = refusal
        self.n = int(getattr(refusal, "asked", 0) or 1 << 30)

    def __len__(self) -> int:
        return self.n


@dataclass
class Fit:
    """A prompt fitted to the context: its ``ids``, where its tail starts (``start``,
    ``head``), and ``cut`` when this fit left messages out that the last prompt held."""

    ids: list[int]
    start: int
    head: int
    cut: P.ContextCut | None = None


@dataclass
class Continuation:
    """What a reply needs to go on past the end of the context under its policy: the
    conversation as its prompt saw it, where that prompt started, and ``render(kept)``
    (template messages -> the prompt's ids, the turn being answered added by it). Made by
    ``submit.py`` at acceptance; ``fit`` runs it again on a preparation worker."""

    policy: str
    history: History
    start: int
    head: int
    render: Callable[[list[dict[str, Any]]], list[int]]
    cuts: list[P.ContextCut] = field(default_factory=list)


def fit(policy: str, n_ctx: int, history: History, render: Callable[[list[dict[str, Any]]], list[int]], *,
        room: int, extra: int = 0, must_cut: bool = False, min_room: int = 1) -> Fit | None:
    """The prompt of the next turn (``render(kept messages)`` -> ids) fitted to ``n_ctx``.

    Without a cut when the prompt from ``history.start`` (plus ``extra`` tokens that come
    after it: a reply being continued) leaves ``room`` tokens and ``must_cut`` is False.
    Otherwise the smallest cut whose prompt (plus ``extra``) holds at most half the
    context; failing that, the smallest that leaves ``room``, then ``min_room``. Returns
    None when none does (the caller refuses the message or ends the reply). "stop" never
    cuts (a prompt that does not fit is the caller's to refuse)."""
    lens: dict[tuple[int, int], list[int]] = {}

    def ids_at(start: int, head: int) -> list[int]:
        key = (start, head)
        if key not in lens:
            lens[key] = render(history.kept(start, head))
        return lens[key]

    head0 = history.head(policy) if history.start > 0 else 0
    here = ids_at(history.start, head0)
    if policy not in CONTINUING or (not must_cut and len(here) + extra + room <= n_ctx):
        return Fit(here, history.start, head0)
    for head in dict.fromkeys((history.head(policy), 0)):  # "middle" without its head when that cannot fit
        cands = [s for s in history.starts(max(history.start, head))
                 if (s > history.start or not must_cut) and (s > head or head == 0)]
        if not cands:
            continue
        for limit in (n_ctx // 2, n_ctx - room, n_ctx - min_room):
            s = _smallest(cands, lambda s: len(ids_at(s, head)) + extra <= limit)
            if s is not None:
                if s == history.start and head == head0:
                    return Fit(here, s, head)
                ids = ids_at(s, head)
                return Fit(ids, s, head, _cut(policy, history, (history.start, head0), (s, head),
                                              len(here) - len(ids), bool(extra)))
    return None


def _smallest(cands: list[int], ok: Callable[[int], bool]) -> int | None:
    """The first of ``cands`` (ascending) where ``ok`` holds, by bisection (a prompt only
    shrinks as its tail starts later); None when it holds for none."""
    if not ok(cands[-1]):
        return None
    lo, hi = 0, len(cands) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(cands[mid]):
            hi = mid
        else:
            lo = mid + 1
    return cands[lo]


def _held(n: int, start: int, head: int) -> set[int]:
    """Indices of the messages a prompt with its tail from ``start`` holds."""
    return (set(range(head)) if start > head else set()) | set(range(start, n))


def _cut(policy: str, history: History, was: tuple[int, int], now: tuple[int, int], n_tokens: int,
         during: bool) -> P.ContextCut:
    msgs = history.messages
    n = len(msgs)
    left = sorted(_held(n, *was) - _held(n, *now))
    out = n - len(_held(n, *now))
    start = now[0]
    return P.ContextCut(policy=policy, n_messages=len(left), n_out=out, n_tokens=max(0, n_tokens),
                        first=msgs[left[0]][0] if left else "", last=msgs[left[-1]][0] if left else "",
                        kept_from=msgs[start][0] if start < n else "", during_reply=during)


def start_of(messages: list[tuple[str, dict[str, Any]]], kept_from: list[str]) -> int:
    """Where the next prompt's tail starts: the latest journaled cut's ``kept_from``
    (``kept_from``: the ids in journal order) whose message is still in the conversation
    (an edit may have dropped it), else 0."""
    index = {mid: i for i, (mid, _) in enumerate(messages)}
    for mid in reversed(kept_from):
        i = index.get(mid)
        if i is not None:
            return i
    return 0


def cut_text(cut: P.ContextCut) -> str:
    """The sentence a client shows where a cut happened."""
    n = cut.n_messages
    what = "message" if n == 1 else "messages"
    stays = "the first exchange, " if cut.policy == "middle" else ""
    when = "the reply reached the end of the context and goes on: " if cut.during_reply else ""
    return (f"{when}{n} earlier {what} ({cut.n_tokens:,} tokens) left the prompt, {cut.n_out} in all; the system "
            f"prompt, {stays}the newest turns{' and the reply' if cut.during_reply else ''} stay (context policy "
            f"{cut.policy}); the journal keeps every message")


def ended_text(policy: str, n_ctx: int, why: str = "") -> str:
    """Why a reply that reached the end of the context ended there."""
    if policy not in CONTINUING:
        return (f"the reply reached the end of the context ({n_ctx:,} tokens) and stopped: this conversation's "
                f"context policy is {policy} (`/context rolling` in aotx, F4 in aotx-chat, lets older turns leave "
                f"the prompt)")
    return (f"the reply reached the end of the context ({n_ctx:,} tokens) and stopped: "
            f"{why or 'the newest turn and the reply alone fill it'} (a larger --context, or a shorter reply, "
            f"leaves room)")


def merged(cuts: list[P.ContextCut]) -> P.ContextCut | None:
    """One reply's cuts as the one its journal record keeps: the messages and tokens of
    all of them, where the last left the prompt."""
    if not cuts:
        return None
    last = cuts[-1]
    return P.ContextCut(policy=last.policy, n_messages=sum(c.n_messages for c in cuts), n_out=last.n_out,
                        n_tokens=sum(c.n_tokens for c in cuts), first=cuts[0].first or last.first, last=last.last,
                        kept_from=last.kept_from, during_reply=any(c.during_reply for c in cuts))


@dataclass(eq=False)
class ContinueJob:
    """A reply that reached the end of the context, its prompt being cut again on a
    preparation worker (``continue_reply``); ``fit`` is the result (None: no cut leaves
    room, the reply ends). The engine hands it back to the model (``LocalModel.continued``)."""

    request: Any
    sink: Any
    model: str = ""
    fit: Fit | None = None


def continue_reply(r: Any, preparer: Any, n_ctx: int, model: str) -> None:
    """Cut the prompt of request ``r`` (a ``requests.Request`` whose ``continuation`` is a
    ``Continuation``) again on one of ``preparer``'s workers: ``fit`` with the reply's
    tokens kept whole after it; a ``Prepared`` of a ``ContinueJob`` brings the result back."""
    c: Continuation = r.continuation
    job = ContinueJob(r, r.sink, model=model)
    n_reply = len(r.completion)
    left = max(1, r.max_tokens - n_reply)

    def work() -> tuple[str, list[int]]:
        hist = History(c.history.system, c.history.messages, c.start)
        job.fit = fit(c.policy, n_ctx, hist, c.render, room=reply_room(n_ctx, left), extra=n_reply, must_cut=True,
                      min_room=max(1, min(left, n_ctx // 16)))
        return "", job.fit.ids if job.fit is not None else []

    preparer.submit(job, work)


def fit_turn(policy: str, envelope: Any, parts: tuple, chat_ids: Callable[[list[dict[str, Any]]], list[int]],
             max_tokens: int) -> tuple[Fit, Continuation | None]:
    """A turn's prompt under ``policy`` (``submit.py``'s stage 3, on a worker): ``parts`` is
    ``store.prompt_history``'s (system message, (msg_id, message) pairs, start),
    ``chat_ids(kept)`` the template's ids of the kept messages plus the turn (refusing a
    render too long for the context whatever its tokens: ``TooLong`` stands for it here).
    Returns the fit and, under a continuing policy, how the reply goes on. Raises the
    refusal of a turn that does not fit even alone (or, under "stop", of any that does not
    fit)."""
    system, msgs, start = parts
    hist = History(system, [(mid, tool_calls.template_message(m)) for mid, m in msgs], start)

    def render(kept: list[dict[str, Any]]):
        try:
            return chat_ids(kept)
        except admission.Refusal as e:
            if e.resource != "context":
                raise
            return TooLong(e)

    ctx = envelope.context_tokens
    got = fit(policy, ctx, hist, render, room=reply_room(ctx, max_tokens))
    if got is None:  # even alone the newest turn leaves no room: today's refusal, with its numbers
        alone = render([system] if system else [])
        if isinstance(alone, TooLong):
            raise alone.refusal
        admission.check_prompt(len(alone), envelope)
        raise AssertionError("context.fit found no cut for a turn that fits alone")
    if isinstance(got.ids, TooLong):       # "stop": nothing leaves, the size refusal stands
        raise got.ids.refusal
    return got, (Continuation(policy, hist, got.start, got.head, render) if policy in CONTINUING else None)
