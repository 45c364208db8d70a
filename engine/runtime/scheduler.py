"""The scheduler: a pure planner. Waiting and running requests + the envelope -> a plan.

Owns: which queued requests get which free slot this tick (``plan_leases``: in
arrival order, each slot once, stopping at the first request that is not ready, so
the line keeps its order), which rows the tick's batch holds (``plan_tick``: one
decode row per decoding request, with room for drafts, then prefill chunks up to
the envelope's ``prefill_tokens``), and where each waiting request stands in the
line (``queue_positions``). It reads requests and slots and never changes them,
and it never calls the model: the executor runs the plan, the commit step applies
its results. (vLLM's ``Scheduler.schedule`` is the model: plan, execute, commit.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from aotx.engine.runtime.envelope import Envelope
from aotx.engine.runtime.requests import Request, RequestState
from aotx.engine.runtime.slots import Slot, SlotTable


@dataclass(frozen=True)
class Lease:
    """A queued request gets ``slot``; ``reuse`` prompt positions of its KV are in place."""

    request: Request
    slot: Slot
    reuse: int


@dataclass(frozen=True)
class DecodeRow:
    """One decoding request's row: its next input token, plus up to ``draft_room``
    drafts (the context and ``max_tokens`` leave that much room)."""

    request: Request
    draft_room: int


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt positions ``start .. start + n`` of a prefilling request; ``last`` when
    the chunk ends the prompt (its last row's logits give the first reply token)."""

    request: Request
    start: int
    n: int

    @property
    def last(self) -> bool:
        return self.start + self.n == len(self.request.prompt)


@dataclass(frozen=True)
class TickPlan:
    """The batch of one tick: decode rows first, then prefill chunks (the order of the
    batch's segments and of its logits rows)."""

    decode: tuple[DecodeRow, ...]
    prefill: tuple[PrefillChunk, ...]

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


def plan_leases(waiting: Iterable[Request], slots: SlotTable) -> list[Lease]:
    """The leases of this tick: queued requests at the head of the line, in order, each
    with the free slot ``SlotTable.choose`` picks for it (no slot twice). Stops at the
    first request still waiting for its message to be durable, or when no slot is free."""
    taken: set[int] = set()
    out: list[Lease] = []
    for r in waiting:
        if r.cancelled:
            continue
        if r.state is not RequestState.QUEUED:
            break
        got = slots.choose(r.conv_id, r.prompt, exclude=taken)
        if got is None:
            break
        taken.add(got[0].index)
        out.append(Lease(r, got[0], got[1]))
    return out


def plan_tick(running: Sequence[Request], envelope: Envelope) -> TickPlan:
    """The rows of this tick's batch for the requests holding slots (continuous
    batching: decoding requests go on while others prefill). Prefill chunks share the
    envelope's ``prefill_tokens``, first come first served."""
    decode = tuple(DecodeRow(r, min(envelope.context_tokens - r.pos - 1, r.max_tokens - len(r.completion) - 1))
                   for r in running if r.state is RequestState.DECODE)
    prefill: list[PrefillChunk] = []
    budget = envelope.prefill_tokens
    for r in running:
        if r.state is not RequestState.PREFILL or budget <= 0:
            continue
        n = min(budget, len(r.prompt) - r.pos)
        prefill.append(PrefillChunk(r, r.pos, n))
        budget -= n
    return TickPlan(decode, tuple(prefill))


def queue_positions(waiting: Iterable[Request], free_slots: int) -> list[tuple[Request, int]]:
    """(request, place in the line) of each waiting request that no free slot is left
    for: the first ``free_slots`` requests of the line would get one; place 1 is next."""
    return [(r, i + 1 - free_slots) for i, r in enumerate(waiting) if i + 1 > free_slots]
