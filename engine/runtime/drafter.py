"""The draft-model drafter: a smaller model with the target's vocabulary proposes drafts.

Owns: the draft model's own KV cache (one draft slot per engine slot, same
context), which tokens each draft slot holds, catching a draft slot up to the
committed tokens, drafting, rolling the draft KV back to the committed boundary
after each verify pass, the drafter state a capsule carries, and the vocabulary
check that refuses a draft model whose tokenizer differs from the target's.

Prefill: while the target prefills a prompt chunk, the draft slot prefills the
same chunk (``mirror``), with the same segment boundaries: a draft identical to
the target then holds bit-identical KV (the CPU backend's prefill numbers
depend on the chunk's shape), so it is accepted 100% under greedy.

Drafting (as llama.cpp's common/speculative.cpp): catch the draft slot up to the
committed tokens (the prefix it already holds is kept; short gaps go through
segments of at most ``SMALL_SEGMENT`` tokens, the per-row kernels that decode
and verify windows use), then up to T-1 steps of
the draft model, one token each, stopping early when the draft's top
probability (softmax of its logits at temperature 1) falls below ``p_min``
(llama.cpp ``--draft-p-min``). Under greedy decoding the draft is the argmax;
under sampling it is a draw from q, the request's sampler chain (top-k, top-p,
min-p, temperature, repetition penalty) applied to the draft's logits, and q goes
to ``speculative.verify`` for the p/q acceptance test. Draft draws use a Philox
stream of their own keyed by the request's seed, counter ``(step << 8) | i``
where ``step`` is the request's sampler step at the proposal: reproducible, and
independent of the acceptance draws.

A draft slot's ``tokens`` list only ever names committed tokens: drafts are fed
to the draft model but only the accepted ones are recorded, and the rejected
ones' KV cells are zeroed in ``update`` (the verify pass's rollback).

Leaves to others: the verify window and the target's rollback (``executor.py``),
acceptance (``speculative.py``), capsule files (``state/capsule.py``).
Limits: each request drafts on its own (draft steps of concurrent slots are not
batched, and run one after another inside the tick); a draft slot that must catch
up more than the prompt mirror gave it (a parked capsule without drafter state)
does so inside its first decode tick (chunks of ``CATCH_UP_CHUNK`` tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aotx.engine.errors import ModelError
from aotx.engine.model.batch import SMALL_SEGMENT, Segment
from aotx.engine.model.loader import LoadedModel
from aotx.engine.model.vocabulary import check_vocabulary_files, vocabulary_mismatch  # noqa: F401 (re-exported)
from aotx.engine.runtime.envelope import working_bytes
from aotx.engine.runtime.requests import Request
from aotx.engine.runtime.sampling import apply_repeat_penalty, distribution, uniform
from aotx.engine.runtime.speculative import AdaptiveWindow
from aotx.engine.state.prefix import common_prefix

CATCH_UP_CHUNK = 256  # draft tokens per forward call when catching a slot up
DRAFT_STREAM = 0x5EC0_D5A7_F00D_0001  # added to the request's seed: the draft's Philox key
DEFAULT_P_MIN = 0.75  # llama.cpp common.h, common_params_speculative.p_min


def _top_prob(logits: np.ndarray) -> float:
    """Largest softmax probability of one (vocab,) float32 logits row."""
    m = float(logits.max())
    return 1.0 / float(np.exp(logits.astype(np.float64) - m).sum())


class DraftModel:
    """The draft model and its KV cache for the engine's ``n_slots`` slots of ``n_ctx``
    tokens: ``kv`` (the draft architecture's cache, float32), ``tokens[slot]`` (the
    committed ids whose K/V the draft slot holds at positions 0..len-1).

    lm: a ``loader.LoadedModel`` (its own weights, never the target's object);
    p_min: stop drafting when the draft's top probability falls below it."""

    def __init__(self, lm: LoadedModel, n_slots: int, n_ctx: int, *, p_min: float = DEFAULT_P_MIN):
        self.lm = lm
        self.model = lm.model
        self.n_ctx = n_ctx
        self.p_min = p_min
        self.kv = lm.model.new_kv_cache(n_slots, n_ctx)
        if getattr(self.kv, "state", None) is not None:
            # its slots are cut back to the committed tokens after every verify pass, which
            # a recurrent state cannot follow
            raise ModelError(f"--draft-model {lm.path}: a {lm.config.arch} model has recurrent layers and cannot "
                             f"draft (use --speculative mtp with a model that has an MTP head, or ngram)")
        self.tokens: list[list[int]] = [[] for _ in range(n_slots)]

    @property
    def fingerprint(self) -> str:
        return self.lm.fingerprint

    @staticmethod
    def check_vocabulary(target_lm, draft_lm) -> None:
        """Raise ModelError (one line) unless the two loaded models share one vocabulary."""
        def texts(tok) -> list[str]:
            return [tok.token_to_piece(i) for i in range(tok.vocab_size)]

        why = vocabulary_mismatch(texts(target_lm.tokenizer), texts(draft_lm.tokenizer))
        if not why and target_lm.config.vocab_size != draft_lm.config.vocab_size:
            why = (f"its output layer has {draft_lm.config.vocab_size} rows, the model's has "
                   f"{target_lm.config.vocab_size}")
        if why:
            raise ModelError(f"--draft-model {draft_lm.path}: {why}; a draft model must share the model's vocabulary")

    # ---- the draft slot ----------------------------------------------------------------

    def mirror(self, slot: int, prompt: list[int], pos: int, n: int) -> None:
        """The target prefills ``prompt[pos:pos+n]`` into its slot ``slot`` this tick: prefill
        the same segment into the draft slot (after catching up ``prompt[:pos]`` when the
        draft slot holds less of it). No logits."""
        have = self.tokens[slot]
        c = common_prefix(have, prompt[:pos + n])
        del have[c:]
        if c < pos:
            self._feed(slot, prompt, c, pos, CATCH_UP_CHUNK)
            c = pos
        if c < pos + n:
            self.model.forward(np.asarray(prompt[c:pos + n], np.int32), [Segment(slot, c, pos + n - c, logits=False)],
                               self.kv)
            have.extend(prompt[c:pos + n])

    def _feed(self, slot: int, tokens: list[int], start: int, stop: int, chunk: int) -> np.ndarray | None:
        """Prefill tokens[start:stop] into the draft slot in chunks; logits after the last."""
        have = self.tokens[slot]
        logits = None
        n = start
        while n < stop:
            m = min(chunk, stop - n)
            last = n + m == stop
            out = self.model.forward(np.asarray(tokens[n:n + m], np.int32), [Segment(slot, n, m, logits=last)],
                                     self.kv)
            have.extend(tokens[n:n + m])
            n += m
            if last:
                logits = out[0]
        return logits

    def catch_up(self, slot: int, tokens: list[int]) -> np.ndarray:
        """Make draft slot ``slot`` hold ``tokens`` (committed ids) and return the draft's
        (vocab,) float32 logits after the last one. The shared prefix already in the slot
        is kept; the last token always runs (its logits are not stored). A gap of at most
        4 x SMALL_SEGMENT tokens runs in per-row segments, as the target's decode did."""
        have = self.tokens[slot]
        n = min(common_prefix(have, tokens), len(tokens) - 1)
        del have[n:]
        gap = len(tokens) - n
        return np.asarray(self._feed(slot, tokens, n, len(tokens),
                                     SMALL_SEGMENT if gap <= 4 * SMALL_SEGMENT else CATCH_UP_CHUNK), np.float32)

    def step(self, slot: int, pos: int, token: int) -> np.ndarray:
        """Feed one (uncommitted) draft token at ``pos``; return the draft's logits after it."""
        out = self.model.forward(np.asarray([token], np.int32), [Segment(slot, pos, 1)], self.kv)
        return np.asarray(out[0], np.float32)

    def settle(self, slot: int, base: int, fed: list[int], n_accepted: int) -> None:
        """After a verify pass: draft tokens ``fed`` sat at positions base..; the first
        ``n_accepted`` of them are committed now (recorded), the rest are rolled back
        (their KV cells zeroed)."""
        keep = min(n_accepted, len(fed))
        if len(self.tokens[slot]) == base:
            self.tokens[slot].extend(fed[:keep])
        if keep < len(fed):
            self.kv.clear(slot, base + keep, base + len(fed))

    # ---- capsules ---------------------------------------------------------------------------

    def state(self, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Drafter state of ``slot`` for a capsule: K, V (n_layers, n_kv_heads, n, head_dim)
        float32 copies of the draft KV, its committed ids (n,) int32, and a header map
        (the draft model's fingerprint)."""
        toks = self.tokens[slot]
        k, v = self.kv.snapshot_slot(slot, len(toks))
        return k, v, np.asarray(toks, np.int32), {"fingerprint": self.fingerprint, "model": self.lm.name}

    def restore(self, cap, slot: int, prompt: list[int]) -> int:
        """Restore the capsule's drafter state into draft slot ``slot``, up to its prefix
        shared with ``prompt``. A capsule without drafter state, or of another draft model,
        leaves the slot as it is (drafting then catches up by prefill). Returns positions."""
        if cap.draft_k is None or cap.header.drafter.get("fingerprint") != self.fingerprint:
            return 0
        n = min(common_prefix(cap.draft_tokens.tolist(), prompt), self.n_ctx)
        if n == 0:
            return 0
        self.kv.restore_slot(slot, cap.draft_k, cap.draft_v, n)
        self.tokens[slot][:] = cap.draft_tokens[:n].tolist()
        return n

    # ---- admission ----------------------------------------------------------------------------

    @staticmethod
    def budget_terms(draft_lm, n_slots: int, n_ctx: int) -> tuple[tuple[str, int], ...]:
        """Bytes the draft model adds: its weights, its KV for every slot, and one
        catch-up chunk's working buffers (activations, scores, logits)."""
        return (("draft weights", int(draft_lm.model.weight_bytes)),
                ("draft kv cache", int(draft_lm.model.kv_cache_bytes(n_slots, n_ctx))),
                ("draft working", int(working_bytes(draft_lm.config, CATCH_UP_CHUNK, 1, n_ctx))))


@dataclass
class DraftDrafter(AdaptiveWindow):
    """One request's drafter over the shared ``DraftModel``; ``bind(request)`` gives it
    the request (its slot, sampler configuration and state) before the first proposal."""

    draft: DraftModel | None = None
    req: Request | None = None
    q: list | None = None
    _base: int = 0
    _fed: list[int] = field(default_factory=list)

    def bind(self, request: Request) -> None:
        self.req = request

    def prefill(self, pos: int, n: int) -> None:
        """The target prefills ``req.prompt[pos:pos+n]`` this tick: the draft slot does too."""
        self.draft.mirror(self.req.slot.index, self.req.prompt, pos, n)

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to min(window - 1, limit) drafts continuing ``tokens`` (the committed ids,
        the last one not yet fed to the target). Sets ``q`` (None under greedy)."""
        self.q = None
        self._fed = []
        self._base = len(tokens)
        k = min(self.window - 1, limit)
        if k <= 0:
            return []
        dm, r = self.draft, self.req
        slot, cfg, st = r.slot.index, r.sampler, r.sampler_state
        greedy = cfg.temperature <= 0.0
        logits = dm.catch_up(slot, tokens)
        drafts: list[int] = []
        qs: list[tuple[np.ndarray, np.ndarray]] = []
        hist = list(st.history) if cfg.repeat_penalty != 1.0 else []
        key = (st.seed + DRAFT_STREAM) & ((1 << 64) - 1)
        for i in range(k):
            if i > 0:
                logits = dm.step(slot, self._base + i - 1, drafts[-1])
                self._fed.append(drafts[-1])
            if _top_prob(logits) < dm.p_min:
                break
            if greedy:
                d = int(np.argmax(logits))
            else:
                row = logits.copy()
                apply_repeat_penalty(row, hist, cfg.repeat_penalty, cfg.repeat_last_n)
                ids, p = distribution(row, cfg)
                c = np.cumsum(p)
                j = int(np.searchsorted(c, uniform(key, (st.step << 8) | i) * c[-1], side="right"))
                d = int(ids[min(j, len(ids) - 1)])
                qs.append((ids, p))
                if hist:
                    hist.append(d)
            drafts.append(d)
        self.q = None if greedy else qs
        return drafts

    def update(self, n_drafts: int, n_accepted_drafts: int) -> None:
        """Adapt the window, then roll the draft slot back to the committed boundary."""
        super().update(n_drafts, n_accepted_drafts)
        self.draft.settle(self.req.slot.index, self._base, self._fed, n_accepted_drafts)
        self._fed = []
