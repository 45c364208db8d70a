"""A request in flight: one submitted message and the reply being generated.

Owns the per-request state the tick loop advances: prompt, slot lease,
positions, sampler state, stop checking, streaming detokenization, timings,
the journal credit still reserved for the reply, and the request's state
(``RequestState``). Leaves scheduling to ``scheduler.py``, device work to
``executor.py`` and publication to ``commit.py``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from aotx.engine import protocol as P
from aotx.engine.model.termination import StopChecker
from aotx.engine.model.tokenizer import StreamDecoder
from aotx.engine.runtime.constraints import GrammarState
from aotx.engine.runtime.sampling import SamplerConfig, SamplerState
from aotx.engine.runtime.slots import Slot
from aotx.engine.state.capsule import Capsule


class RequestState(enum.Enum):
    """Where a request stands. In order: DURABLE_WAIT (accepted; the user's message is
    not on disk yet), QUEUED (ready; waiting for a slot), PREFILL (holding a slot,
    its prompt going through the model chunk by chunk), DECODE (one reply token, or a
    verify window, per tick), DONE (finished: stop, length, context, cancelled, error).
    Without a journal a request starts QUEUED. A choice i > 0 of an n > 1 request is
    FORK_WAIT, outside the line, until choice 0's prompt is prefilled: then it has its
    first token and a capsule of the prompt's KV (``fork_capsule``) and joins the line
    (its durable wait, if any, still applies). A reply that reached the end of the context
    under a policy that goes on (``context.py``) is CONTINUE while a preparation worker
    cuts its prompt again; it keeps its slot and goes back to PREFILL (its new prompt
    followed by the reply so far), then DECODE."""

    FORK_WAIT = "fork_wait"
    DURABLE_WAIT = "durable_wait"
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    CONTINUE = "continue"
    DONE = "done"


class Sink(Protocol):
    """Where a request's events go (a client connection); ``send`` is thread-safe."""

    def send(self, message: P.Message) -> None: ...


class Drafter(Protocol):
    """A speculative drafter (``speculative.py``: prompt lookup; ``drafter.py``: a draft
    model). ``window`` is the verify width T; ``q`` the per-draft distributions of the
    last proposal (None: one-hot)."""

    window: int
    q: list | None

    def bind(self, request: Request) -> None: ...
    def prefill(self, pos: int, n: int) -> None: ...
    def propose(self, tokens: list[int], limit: int) -> list[int]: ...
    def update(self, n_drafts: int, n_accepted_drafts: int) -> None: ...


@dataclass(eq=False)
class Request:
    """One message's generation. ``pos``: tokens of prompt + completion whose K/V are
    in the slot; ``credit``: journal bytes still reserved for the reply's records."""

    rid: int
    sink: Sink
    conv_id: str
    msg_id: str
    reply_id: str
    prompt: list[int]
    sampler: SamplerConfig
    sampler_state: SamplerState
    max_tokens: int
    stop: StopChecker
    decoder: StreamDecoder
    state: RequestState = RequestState.DURABLE_WAIT
    slot: Slot | None = None
    pos: int = 0
    completion: list[int] = field(default_factory=list)
    text: str = ""
    cancelled: bool = False
    finish_reason: str | None = None
    accepted_seq: int = 0
    final_seq: int = 0
    queued_position: int = 0
    credit: int = 0
    t_submit: float = field(default_factory=time.perf_counter)
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    n_reused: int = 0
    drafter: Drafter | None = None
    n_drafted: int = 0
    n_draft_accepted: int = 0
    constraint: GrammarState | None = None  # a constrained reply's grammar state
    logprobs: int = -1      # -1: none; k >= 0: each token's logprob and the top k
    choice: int = 0         # which of the request's n choices
    forks: list[Request] = field(default_factory=list)  # choice 0: the choices waiting for its prompt
    fork_capsule: Capsule | None = None  # a waiting choice: the prompt's state, restored when it leases a slot
    durable: bool = False     # the user's message is on disk (a forked choice may learn it while waiting)
    model: str = ""  # the name of the loaded model it runs on (``models.ModelSet``)
    has_history: bool = False  # the conversation had messages before this one (a capsule notice helps then)
    # the context policy's way on past the end of the context (context.Continuation; None:
    # the reply ends there), the cuts its prompt took (journaled with its finish), and how
    # many tokens at the end of ``prompt`` are the reply's own (prefilled again after a cut)
    continuation: Any = None
    cuts: list[Any] = field(default_factory=list)
    lead: int = 0

    @property
    def key(self) -> tuple[int, int, int]:
        """The request's key in the engine's tables: (sink, client request id, choice)."""
        return id(self.sink), self.rid, self.choice

    @property
    def tokens(self) -> list[int]:
        """The ids whose K/V the slot holds or will hold: the prompt, then the reply's
        tokens not already in it."""
        return self.prompt + self.completion[self.lead:]

    @property
    def n_prompt(self) -> int:
        """Prompt tokens before the reply's own (its prompt as the model reads it now)."""
        return len(self.prompt) - self.lead

    @property
    def next_input(self) -> int:
        """The token to feed in decode: the last sampled one."""
        return self.completion[-1]

    @property
    def plain_greedy(self) -> bool:
        """Greedy without a repetition penalty or a constraint: the argmax of the logits."""
        return (self.sampler.temperature <= 0.0 and self.sampler.repeat_penalty == 1.0 and self.constraint is None
                and not self.sampler.host_only)

    @property
    def needs_logits(self) -> bool:
        """The tick must bring this request's logits to the host: logprobs are asked,
        or choice 0's prompt ends this tick and its forks sample from the same row."""
        return self.logprobs >= 0 or (bool(self.forks) and self.state is RequestState.PREFILL)

    def timings(self) -> dict[str, float]:
        prefill_s = max(1e-9, (self.t_first or self.t_end) - (self.t_start or self.t_submit))
        decode_s = max(1e-9, self.t_end - self.t_first) if self.t_first else 0.0
        n_pref = max(0, len(self.prompt) - self.n_reused)
        n_dec = max(0, len(self.completion) - 1)
        return {
            "prompt_tokens": float(self.n_prompt),
            "prompt_tokens_reused": float(self.n_reused),
            "prompt_tokens_per_s": round(n_pref / prefill_s, 2),
            "ttft_s": round((self.t_first or self.t_end) - self.t_submit, 4),
            "completion_tokens": float(len(self.completion)),
            "decode_tokens_per_s": round(n_dec / decode_s, 2) if decode_s else 0.0,
            "queue_s": round((self.t_start or self.t_end) - self.t_submit, 4),
            "draft_tokens": float(self.n_drafted),
            "draft_accepted": float(self.n_draft_accepted),
        }
