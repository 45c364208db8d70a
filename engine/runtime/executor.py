"""The executor: runs a tick's plan on the model and picks each row's tokens.

Owns everything of a tick that touches the model, its KV cache, the drafters and
the samplers: leasing a slot's KV (parking the state it held as a capsule,
restoring a better capsule), the batch layout of the plan (segments, input ids,
image rows), the device path (below), sampling and speculative acceptance, and
rolling back the KV of rejected drafts. It changes no request bookkeeping
(positions, completions, states: ``commit.py``) and publishes nothing.

The device path, chosen per tick from the path the model runs (``device_path``,
engine/model/interface.py) and what the rows need:

* ``greedy``: every row is greedy without a penalty: the model returns the argmax
  ids only (CUDA);
* ``sample``: every row's sampler is one the device chain runs exactly (the model's
  ``samples_exactly``): the model returns the ids only; the executor then advances each
  sampler's state as the host chain would have;
* ``forward``: otherwise (the CPU, image rows, speculative sampling, logprobs, the
  tick where an n > 1 request's prompt ends): logits come back and the host samples
  (``sampling.sample``, ``speculative.verify``).

All three pick the same ids for the same rows. A constrained row (``constraints.py``)
has a token bitmask per logits row (a verify window's row i after its first i drafts):
on the host ``sampling.apply_mask``, on the device the sampling kernel reads it from
the address the model's ``load_masks`` gave. Its grammar state advances past the
tokens picked. An n > 1 request forks here: at the end of choice 0's prompt every
other choice samples its first token from the same logits row and gets a capsule of
the prompt's KV (``capsule.snapshot``, with the grammar state) that its own slot
restores when it leases one, so the prompt is prefilled once for all n.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from aotx.engine.model.batch import Segment
from aotx.engine.model.interface import DEVICE_SAMPLING, KVCache
from aotx.engine.model.loader import LoadedModel
from aotx.engine.runtime.drafter import DraftModel
from aotx.engine.runtime.media_prompt import ImageStore
from aotx.engine.runtime.requests import Request, RequestState
from aotx.engine.runtime.sampling import SamplerState, log_softmax, sample, top_logprobs
from aotx.engine.runtime.scheduler import Lease, TickPlan
from aotx.engine.runtime.speculative import verify
from aotx.engine.state import capsule as C
from aotx.engine.state.cache import CapsuleCache

log = logging.getLogger("aotx.engine")
PARK_MIN_EXTRA = 16  # park a slot's state only when it holds this many tokens past the new prefix
CHECKPOINTS = 2      # recurrent-state copies a hybrid slot keeps at the end of its prompts


class DeviceError(Exception):
    """The model's device work failed (the engine fails closed: not ready)."""


@dataclass(frozen=True)
class LeaseResult:
    """What leasing a slot found: ``reuse`` prompt positions in place, and a capsule
    ``note`` for the client ("" when none) about ``restored`` positions."""

    reuse: int
    note: str = ""
    restored: int = 0


@dataclass(frozen=True)
class RowResult:
    """One logits row group of the batch (a prefill's last chunk, or a decode row and
    its verify window): ``produced`` the tokens picked (1 + accepted drafts), ``fed``
    the decode inputs whose KV is now committed (the input and the accepted drafts;
    empty for prefill), ``n_drafts`` the drafts verified."""

    request: Request
    produced: list[int]
    fed: list[int]
    n_drafts: int
    # per produced token, when asked: (logprob, its bytes, top k as (id, logprob, bytes))
    logprobs: list[tuple[float, bytes, list[tuple[int, float, bytes]]]] | None = None


@dataclass(frozen=True)
class TickResult:
    rows: list[RowResult]
    device_s: float  # seconds in the model's call


@dataclass
class _RowState:
    """A sampler state as the device sampler reads it, for one logits row, with the
    device address of the row's token bitmask (the device sampler reads ``mask_ptr``;
    0: no mask)."""

    seed: int
    step: int
    history: list[int]
    mask_ptr: int = 0


class Executor:
    """Runs plans on ``lm``'s model with KV cache ``kv``.

    device: "cpu" | "cuda" (capsules record it); capsules: a ``state.cache.CapsuleCache``
    or None; draft: the ``drafter.DraftModel`` or None; images: the ``ImageStore`` of
    pictures given to a vision encoder, or None."""

    def __init__(self, lm: LoadedModel, kv: KVCache, *, device: str, capsules: CapsuleCache | None = None,
                 draft: DraftModel | None = None):
        self.lm = lm
        self.kv = kv
        self.device = device
        self.capsules = capsules
        self.draft = draft
        self.images: ImageStore | None = None
        self._sampler_of: dict[str, SamplerState] = {}  # conv_id -> its last reply's SamplerState (capsule snapshots)
        # the arithmetic behind the tokens, named in every reply (README: CPU and CUDA differ)
        self.numerics = getattr(lm.model, "numerics", None) or ("cuda-f32" if device == "cuda" else "cpu-int8")
        if capsules is not None and not getattr(capsules, "numerics", "x"):
            capsules.numerics = self.numerics   # disk capsules of other arithmetic are not restored
        self.device_path = lm.model.device_path   # interface.HOST or DEVICE_SAMPLING
        self.d_model = lm.config.d_model
        self._row0: dict[int, int] = {}    # id(request) -> its decode rows' first batch row (MTP drafters)
        self.prefill_tokens = 0  # prompt tokens run through the model (tests count prefills with it)

    # ---- slots ------------------------------------------------------------------------

    def lease(self, lease: Lease) -> LeaseResult:
        """Put the KV in place for ``lease``: park the state of the conversation the slot
        holds (when it would be lost), restore a parked capsule sharing a longer prefix
        with the prompt (the same conversation, or a fork's parent)."""
        r, slot, reuse = lease.request, lease.slot, lease.reuse
        caps = self.capsules
        fp = self.lm.fingerprint
        st = getattr(self.kv, "state", None)
        if caps is not None and slot.conv_id and slot.conv_id != r.conv_id and len(slot.tokens) > reuse + PARK_MIN_EXTRA:
            try:
                caps.park(slot.conv_id, C.snapshot(self.kv, slot.index, slot.tokens, fingerprint=fp,
                                                   backend=self.device, numerics=self.numerics,
                                                   device=caps.device_budget > 0, drafter=self._drafter_state(slot.index),
                                                   sampler=self._sampler_of.get(slot.conv_id),
                                                   checkpoints=slot.checkpoints))
            except C.CapsuleError as e:   # a cache: the journal's tokens rebuild the state
                log.warning("state of %s not parked: %s", slot.conv_id, e)
        if slot.conv_id != r.conv_id:           # the slot's state leaves it: one entry per slot at most
            self._sampler_of.pop(slot.conv_id, None)
        if st is not None and 0 < reuse != st.position(slot.index):
            # a hybrid slot reused at a checkpoint short of its state's position
            st.restore(slot.index, slot.checkpoints[reuse], reuse)
        if r.fork_capsule is not None:  # a forked choice: the prompt's state, then its first token
            cap, r.fork_capsule = r.fork_capsule, None
            n = C.restore(cap, self.kv, slot.index, fingerprint=fp)
            if self.draft is not None and cap.draft_k is not None:
                self.draft.restore(cap, slot.index, r.prompt)
            slot.tokens[:] = cap.tokens[:n].tolist()
            slot.checkpoints = {p: c for p, c in (cap.checkpoints or {}).items() if p < n}
            return LeaseResult(n, f"choice {r.choice}: forked the prompt's state ({n} tokens) from choice 0", n)
        if caps is None:
            return LeaseResult(reuse)
        if slot.conv_id == r.conv_id and reuse > 0:
            return LeaseResult(reuse)
        cap, n, note = caps.best_for(r.conv_id, r.prompt)
        n = min(n, len(r.prompt) - 1)
        if cap is not None and n > reuse and C.restorable(cap, n):
            C.restore(cap, self.kv, slot.index, fingerprint=fp, n=n)
            if self.draft is not None:
                self.draft.restore(cap, slot.index, r.prompt)
            slot.tokens[:] = cap.tokens[:n].tolist()
            slot.checkpoints = {p: c for p, c in (cap.checkpoints or {}).items() if p < n}
            reuse = n
            # the user's words, no capsule or prefill jargon; where it came from is in `aotx status`
            note = f"picked up where this conversation left off ({n} tokens of context kept, not read again)"
        elif note.startswith("restored"):
            note = ""
        elif note:  # the saved state could not be used: the earlier messages are read again
            why = "it was made by another model" if "belongs to model" in note else note.split(": re-prefilling")[0]
            note = f"reading this conversation's earlier messages again: its saved state could not be used ({why})"
        return LeaseResult(reuse, note, n)

    def persist(self, r: Request, written: Callable[[str, str, int], None]) -> None:
        """After a reply: copy the slot's state now and write it to the capsules' disk
        home on a thread of its own; ``written(conv_id, path, n_tokens)`` once the file
        is durable (the engine journals it)."""
        caps = self.capsules
        self._sampler_of[r.conv_id] = r.sampler_state       # what a capsule of this slot carries
        if caps is None or caps.dir is None or r.slot is None or len(r.slot.tokens) < 2:
            return
        try:
            cap = C.snapshot(self.kv, r.slot.index, r.slot.tokens, fingerprint=self.lm.fingerprint,
                             backend=self.device, numerics=self.numerics, drafter=self._drafter_state(r.slot.index),
                             sampler=r.sampler_state, checkpoints=r.slot.checkpoints)
        except C.CapsuleError as e:
            log.warning("capsule of %s not written: %s", r.conv_id, e)
            return
        conv_id = r.conv_id

        def write() -> None:
            try:
                path = caps.store_on_disk(conv_id, cap)
            except OSError as e:
                log.warning("capsule of %s not written: %s", conv_id, e)
                return
            if path is not None:
                written(conv_id, str(path), cap.n_tokens)

        threading.Thread(target=write, name="aotx-capsule-write", daemon=True).start()

    def _drafter_state(self, slot: int):
        return self.draft.state(slot) if self.draft is not None else None

    # ---- the tick -------------------------------------------------------------------------

    def run(self, plan: TickPlan, tick: int) -> TickResult:
        """One forward pass over the plan's rows, then each row's tokens. Raises
        ``DeviceError`` when the model's call fails."""
        segs: list[Segment] = []
        toks: list[int] = []
        rows: list[tuple[Request, list[int]]] = []  # (request, drafts): 1 + len(drafts) logits rows
        self._row0 = {}
        for d in plan.decode:
            r = d.request
            drafts = r.drafter.propose(r.tokens, d.draft_room) if r.drafter is not None else []
            self._row0[id(r)] = len(toks)
            segs.append(Segment(r.slot.index, r.pos, 1 + len(drafts), all_logits=bool(drafts)))
            toks.append(r.next_input)
            toks.extend(drafts)
            rows.append((r, drafts))
        for c in plan.prefill:
            r = c.request
            segs.append(Segment(r.slot.index, c.start, c.n, logits=c.last))
            if r.drafter is not None:  # a draft model prefills the same chunk into its own slot
                r.drafter.prefill(c.start, c.n)
            toks.extend(r.prompt[c.start:c.start + c.n])
            self.prefill_tokens += c.n
            if c.last:
                rows.append((r, []))
        masks = {id(r): self._masks_of(r, drafts) for r, drafts in rows if r.constraint is not None}
        tok_arr = np.asarray(toks, np.int32)
        embeds = self.images.rows_for(tok_arr, self.d_model) if self.images is not None else None
        t1 = time.perf_counter()
        try:
            ids, logits = self._device_work(tok_arr, segs, rows, embeds, tick, masks)
        except Exception as e:  # noqa: BLE001 - any failure of the device is one
            raise DeviceError(str(e)) from e
        device_s = time.perf_counter() - t1
        self._checkpoint(plan)
        self._observe_prefill(plan, len(toks) - sum(c.n for c in plan.prefill))
        return TickResult(self._pick(rows, ids, logits, masks), device_s)

    def _checkpoint(self, plan: TickPlan) -> None:
        """A hybrid slot whose prompt ends this tick keeps a copy of its recurrent state
        there (the next turn, whose prompt shares this one but not the reply as the
        template renders it, resumes from it); at most CHECKPOINTS per slot."""
        st = getattr(self.kv, "state", None)
        if st is None:
            return
        for c in plan.prefill:
            if c.last:
                cks = c.request.slot.checkpoints
                cks[c.start + c.n] = st.snapshot(c.request.slot.index, c.start + c.n)
                for p in sorted(cks)[:-CHECKPOINTS]:
                    del cks[p]

    def _hidden(self) -> np.ndarray | None:
        """The last forward's hidden rows, where the model keeps them (an MTP head's input)."""
        get = getattr(self.lm.model, "last_hidden", None)
        return get() if get is not None else None

    def _observe_prefill(self, plan: TickPlan, row: int) -> None:
        """Hand each prefill chunk's rows to a drafter that follows the target's hidden
        states (the MTP drafter); ``row`` is the first prefill row of the batch."""
        for c in plan.prefill:
            r = c.request
            if hasattr(r.drafter, "observe"):
                h = self._hidden()
                if h is not None:
                    r.drafter.observe(c.start, r.prompt[c.start:c.start + c.n], h[row:row + c.n])
            row += c.n

    @staticmethod
    def _masks_of(r: Request, drafts: list[int]) -> np.ndarray:
        """(1 + len(drafts), words) int32: the bitmask of each of the row's logits rows."""
        if drafts:
            return r.constraint.window_masks(drafts)
        return r.constraint.mask()[None, :]

    def _device_work(self, tok_arr: np.ndarray, segs: list[Segment], rows: list, embeds, tick: int,
                     masks: dict[int, np.ndarray]):
        """(ids, None) when the device picked the tokens, else (None, host logits)."""
        model = self.lm.model
        if embeds is None and self.device_path == DEVICE_SAMPLING and not any(r.needs_logits for r, _ in rows):
            if all(r.plain_greedy for r, _ in rows):
                return model.greedy(tok_arr, segs, self.kv), None
            srows = self._device_rows(rows, masks)
            if srows is not None:
                return model.sample(tok_arr, segs, self.kv, srows, tick=tick), None
        if embeds is not None:
            return None, model.forward(tok_arr, segs, self.kv, embeds=embeds)
        return None, model.forward(tok_arr, segs, self.kv)

    def _device_rows(self, rows: list, masks: dict[int, np.ndarray]) -> list | None:
        """The sampler rows for ``model.sample`` (one per logits row), or None when a row
        needs the host (the model's ``samples_exactly`` says no). A constrained row's
        bitmasks go to the device first (``load_masks``); its rows carry their addresses."""
        model = self.lm.model
        for r, drafts in rows:
            if r.sampler.host_only or not model.samples_exactly(r.sampler, r.sampler_state, len(drafts)):
                return None  # (a logit bias or a frequency/presence penalty: the host's chain, exactly)
        ptrs: dict[int, list[int]] = {}
        if masks:
            order = [k for k in masks]
            addrs = model.load_masks(np.concatenate([masks[k] for k in order]))
            at = 0
            for k in order:
                ptrs[k] = addrs[at:at + masks[k].shape[0]]
                at += masks[k].shape[0]
        out = []
        for r, drafts in rows:
            st = r.sampler_state
            p = ptrs.get(id(r))
            for i in range(len(drafts) + 1):
                row_st = st if p is None else _RowState(st.seed, st.step, st.history, p[i])
                out.append((r.sampler, row_st, tuple(drafts[:i])))
        return out

    @staticmethod
    def _logprobs(r: Request, row: np.ndarray) -> tuple[np.ndarray, list[tuple[int, float]]] | None:
        if r.logprobs < 0:
            return None
        lp = log_softmax(row)
        return lp, top_logprobs(lp, r.logprobs)

    def _lp_entry(self, lp: np.ndarray, top: list[tuple[int, float]], tok: int) -> tuple:
        """(logprob of ``tok``, its bytes, the top ids with theirs and their bytes)."""
        tb = self.lm.tokenizer.token_bytes
        return float(lp[tok]), tb(tok), [(i, v, tb(i)) for i, v in top]

    def _fork(self, r: Request, raw: np.ndarray) -> list[RowResult]:
        """Choice 0's prompt is in its slot and ``raw`` is its last row's logits: every
        waiting choice samples its first token from them and takes a capsule of the
        prompt's state (the grammar state with it)."""
        forks, r.forks = [f for f in r.forks if f.state is RequestState.FORK_WAIT], []
        if not forks:
            return []
        cap = C.snapshot(self.kv, r.slot.index, r.prompt, fingerprint=self.lm.fingerprint, backend=self.device,
                         numerics=self.numerics, drafter=self._drafter_state(r.slot.index),
                         grammar=r.constraint.snapshot() if r.constraint is not None else None)
        lp = self._logprobs(forks[0], raw) if forks[0].logprobs >= 0 else None
        out = []
        for f in forks:
            mask = f.constraint.mask() if f.constraint is not None else None
            tok = sample(raw.copy(), f.sampler, f.sampler_state, mask)
            if f.constraint is not None:
                f.constraint.consume([tok])
            f.fork_capsule = cap
            got = None
            if lp is not None and f.logprobs >= 0:
                got = [self._lp_entry(lp[0], lp[1], tok)]
            out.append(RowResult(f, [tok], [], 0, got))
        return out

    def _pick(self, rows: list, ids: np.ndarray | None, logits: np.ndarray | None,
              masks: dict[int, np.ndarray] | None = None) -> list[RowResult]:
        out: list[RowResult] = []
        forked: list[RowResult] = []
        masks = masks or {}
        off = 0
        for r, drafts in rows:
            n = 1 + len(drafts)
            m = masks.get(id(r))
            lps = None
            if logits is not None and r.logprobs >= 0:
                lps = [self._logprobs(r, logits[off + i]) for i in range(n)]
            if ids is not None:  # picked on the device: accept drafts while they equal its pick
                got = [int(t) for t in ids[off:off + n]]
                n_ok = 0
                while n_ok < len(drafts) and got[n_ok] == drafts[n_ok]:
                    n_ok += 1
                produced = got[:n_ok + 1]
                st = r.sampler_state  # mirror what the host chain would have done
                if r.sampler.temperature > 0.0:
                    st.step += len(produced)  # one draw per sampled row
                st.history.extend(produced)
                last_n = r.sampler.repeat_last_n
                if last_n > 0 and len(st.history) > 4 * last_n:
                    del st.history[: len(st.history) - last_n]
            elif r.state is RequestState.PREFILL:
                raw = logits[off].copy() if r.forks else None
                produced = [sample(logits[off], r.sampler, r.sampler_state, m[0] if m is not None else None)]
                if raw is not None:
                    forked.extend(self._fork(r, raw))
            else:
                produced = verify(logits[off:off + n], drafts, r.sampler, r.sampler_state,
                                  q=r.drafter.q if drafts else None, masks=m)
            if r.constraint is not None and not r.constraint.consume(produced):
                log.warning("constrained reply of %s: the grammar refused a token (%s)", r.conv_id,
                            r.constraint.error)
            got_lp = None
            if lps is not None:
                got_lp = [self._lp_entry(lps[j][0], lps[j][1], t) for j, t in enumerate(produced)]
            fed: list[int] = []
            if r.state is RequestState.DECODE:
                fed = [r.next_input] + drafts[:len(produced) - 1]
                if hasattr(r.drafter, "observe") and id(r) in self._row0:
                    h = self._hidden()
                    if h is not None:
                        r.drafter.observe(r.pos, fed, h[self._row0[id(r)]:self._row0[id(r)] + len(fed)])
                if drafts:
                    r.drafter.update(len(drafts), len(produced) - 1)
                    if len(fed) < n:  # roll back the rejected drafts' KV cells (and recurrent state)
                        self.kv.clear(r.slot.index, r.pos + len(fed), r.pos + n)
                        if getattr(self.kv, "state", None) is not None:
                            self.kv.state.rollback(r.slot.index, r.pos + len(fed))
            out.append(RowResult(r, produced, fed, len(drafts), got_lp))
            off += n
        return out + forked
