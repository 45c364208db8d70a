"""The commit step: a tick's results -> request bookkeeping, records, events, finished requests.

Owns: what becomes true once the device work of a tick is done. The positions a
slot's KV now holds (prefill chunks, accepted decode inputs), request state
changes (PREFILL -> DECODE at the first token), streaming detokenization and stop
checking, one ``TokensCommitted`` record per request per tick (published within the
request's journal credit) and its ``Token`` events, the finish of a reply (its
record, ``Committed``, the credit it did not use given back), and the notices of
leases and of the line (queued, resumed, capsule). Records are written complete,
then published; the tick's records go to the journal in one flush, and nothing
here waits on disk. Leaves the choice of rows to ``scheduler.py`` and the device to
``executor.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from aotx.engine import protocol as P
from aotx.engine.runtime import admission
from aotx.engine.runtime.context import merged
from aotx.engine.runtime.executor import LeaseResult, TickResult
from aotx.engine.runtime.receipts import Covers
from aotx.engine.runtime.requests import Request, RequestState
from aotx.engine.runtime.scheduler import Lease, TickPlan, queue_positions
from aotx.engine.runtime.slots import SlotTable
from aotx.engine.runtime.store import ConversationStore


class Commit:
    """The commit step of one engine: ``store`` a ``ConversationStore``, ``slots`` its table."""

    def __init__(self, store: ConversationStore, slots: SlotTable, numerics: str = ""):
        self.store = store
        self.slots = slots
        self.numerics = numerics  # the arithmetic behind the tokens, named in every Committed

    def leased(self, lease: Lease, got: LeaseResult) -> None:
        """A queued request took its slot: ``got.reuse`` prompt positions are in place."""
        r, slot = lease.request, lease.slot
        # only a conversation with earlier messages has anything to pick up: a new one's
        # shared start (the system prompt) found in another's capsule is no news to its user
        if got.note and r.has_history:
            r.sink.send(P.Notice(id=r.rid, kind="capsule", resource="capsule", message=got.note, asked=got.restored))
        self.slots.take(slot, r.conv_id, got.reuse)
        r.slot, r.pos, r.n_reused = slot, got.reuse, got.reuse
        r.t_start = r.t_start or time.perf_counter()
        if r.completion:  # a forked choice: its prompt restored, its first token sampled
            r.state = RequestState.DECODE
            slot.state = "decode"
        else:
            r.state = RequestState.PREFILL
        if r.queued_position:
            r.sink.send(P.Notice(id=r.rid, kind="resumed", resource="slots", message=f"got slot {slot.index}"))

    def queue_notices(self, waiting: Iterable[Request], n_slots: int) -> None:
        """Tell each waiting request its new place in line (once per change)."""
        for r, position in queue_positions(waiting, self.slots.free_count()):
            if r.queued_position != position:
                r.queued_position = position
                r.sink.send(admission.queued_notice(r.rid, position, n_slots))

    def apply(self, plan: TickPlan, result: TickResult, tick: int) -> tuple[int, list[Request]]:
        """Commit a tick: returns (tokens produced, requests whose reply ended: each has
        ``finish_reason`` set; the engine finishes them with ``finish``)."""
        for c in plan.prefill:
            r = c.request
            r.slot.tokens.extend(r.prompt[c.start:c.start + c.n])
            r.pos += c.n
        per_req: dict[Request, list[tuple[int, str]]] = {}
        n_out = 0
        for row in result.rows:
            r = row.request
            if r.state is RequestState.PREFILL:
                r.state = RequestState.DECODE
                r.slot.state = "decode"
                r.t_first = r.t_first or time.perf_counter()   # (a continued reply keeps its first)
            elif r.state is RequestState.FORK_WAIT:  # a forked choice's first token, before it has a slot
                r.t_start = r.t_first = time.perf_counter()
            else:
                r.slot.tokens.extend(row.fed)
                r.pos += len(row.fed)
                if row.n_drafts:
                    r.n_drafted += row.n_drafts
                    r.n_draft_accepted += len(row.produced) - 1
            items = per_req.setdefault(r, [])
            for j, tok in enumerate(row.produced):
                r.completion.append(tok)
                n_out += 1
                delta = r.decoder.feed(tok)
                emit, reason = r.stop.feed(tok, delta)
                if reason == "length" or (reason == "context" and not r.stop.goes_on):
                    emit += r.decoder.flush()
                r.text += emit
                # the end-of-generation token that ended the reply is flagged: it is no token of the
                # reply's text (OpenAI's logprobs leave it out: the gateway reads the flag)
                items.append((tok, emit, row.logprobs[j] if row.logprobs else None,
                              reason == "stop" and tok in r.stop.eog_ids))
                if reason is not None:
                    r.finish_reason = reason
                    break
            if r.finish_reason is None and r.constraint is not None and r.constraint.error:
                r.finish_reason = "error"  # the grammar refused a token: a bug, the reply cannot go on
        finished = []
        st = self.store
        for r, items in per_req.items():
            start = r.n_prompt + len(r.completion) - len(items)
            seq, nbytes = st.commit_tokens(r.conv_id, r.reply_id, start, [t for t, _, _, _ in items],
                                           "".join(e for _, e, _, _ in items), tick=tick)
            r.credit -= nbytes
            for j, (t, e, lp, end) in enumerate(items):
                if lp is None:
                    r.sink.send(P.Token(id=r.rid, token_id=t, text=e, pos=start + j, tick=tick, seq=seq,
                                        choice=r.choice, end=end))
                else:
                    r.sink.send(P.Token(id=r.rid, token_id=t, text=e, pos=start + j, tick=tick, seq=seq,
                                        choice=r.choice, logprob=lp[0], piece=lp[1], top=lp[2], end=end))
            if st.journaled:
                st.receipts.watch(seq, r, Covers.TOKENS)
            if r.finish_reason is not None:
                finished.append(r)
        st.flush()
        return n_out, finished

    def finish(self, r: Request, reason: str, tick: int) -> None:
        """The reply ended (stop | length | context | cancelled | error): its finish
        record, ``Committed``, and the journal credit it did not use back."""
        if reason in ("cancelled", "error") and r.completion:
            r.text += r.stop.flush()
        r.state = RequestState.DONE
        r.t_end = time.perf_counter()
        st = self.store
        seq, nbytes = st.finish(r.conv_id, r.reply_id, reason, r.n_prompt, len(r.completion), tick=tick,
                                context=merged(r.cuts))
        st.release(r.credit - nbytes)
        r.credit = 0
        r.final_seq = seq
        r.sink.send(P.Committed(id=r.rid, msg_id=r.reply_id, finish_reason=reason, n_prompt=r.n_prompt,
                                n_completion=len(r.completion), tick=tick, seq=seq, text=r.text,
                                timings=r.timings(), choice=r.choice, numerics=self.numerics,
                                stop=r.stop.matched if reason == "stop" else ""))
        if st.journaled:
            st.receipts.watch(seq, r, Covers.FINAL)
        st.flush()
        st.maybe_checkpoint(tick)
