"""The MTP drafter: a model's own multi-token-prediction head (its ``nextn`` block) drafts.

Owns: the head's KV cache (one slot per engine slot, as the drafter of a draft model has),
catching it up with every committed token, the hidden state each slot's next draft starts
from, and drafting. Leaves the head's forward to the model (``TransformerModel.load_mtp``:
the architecture's ``mtp_forward`` traced over the file's nextn tensors), verification,
acceptance and the target's rollback to ``executor.py`` / ``speculative.py``.

How the head runs (llama.cpp common/speculative.cpp, draft-mtp, as for Qwen3.5): the row
of position t pairs the target's final-normed hidden state at t-1 with the embedding of
the token at t; its output predicts the token at t+1. So after the target commits tokens
x_p .. x_q (a prefill chunk, or a decode step's input and its accepted drafts) the head
runs over them with the target's hidden states of positions p-1 .. q-1 (``observe``: its
KV follows the committed tokens), and keeps h_q. A proposal then starts at the pending
token (position q+1): the row (h_q, x_{q+1}) gives the first draft and the head's own
hidden state, which pairs with that draft for the next step, up to T-1 drafts; it stops
early when the head's top probability falls below ``p_min``.

Drafts are the head's argmax, a deterministic function of the context, so ``q`` is
one-hot (None): greedy output is token-identical to plain greedy, and speculative
sampling stays exact (speculative.verify). The draft rows' KV cells are overwritten
when the verify pass's committed tokens are observed.
"""

from __future__ import annotations

import numpy as np

from aotx.engine.model.batch import Segment
from aotx.engine.runtime.drafter import DEFAULT_P_MIN, _top_prob
from aotx.engine.runtime.speculative import AdaptiveWindow


class MtpModel:
    """The MTP head of the engine's model and its per-slot state: ``head`` (the model's
    ``load_mtp()``: ``forward(tokens, segments, kv, hidden)`` returning logits and
    leaving the rows' hidden states in ``last_hidden``), its KV cache for ``n_slots``
    slots of ``n_ctx``, and ``pending[slot]``: the target's hidden state at the slot's
    last committed position ((d_model,) float32, zero before any)."""

    def __init__(self, head, n_slots: int, n_ctx: int, *, p_min: float = DEFAULT_P_MIN):
        self.head = head
        self.n_ctx = n_ctx
        self.p_min = p_min
        self.kv = head.new_kv_cache(n_slots, n_ctx)
        self.pending = np.zeros((n_slots, head.d_model), np.float32)

    def observe(self, slot: int, pos: int, tokens: list[int], hidden: np.ndarray) -> None:
        """The target committed ``tokens`` at positions pos.. of ``slot`` and computed
        ``hidden`` ((len(tokens), d_model): its final-normed hidden state of each): run the
        head over them (no logits) and keep the last hidden state."""
        n = len(tokens)
        if n == 0:
            return
        if pos == 0:
            self.pending[slot] = 0.0
        h = np.empty((n, self.pending.shape[1]), np.float32)
        h[0] = self.pending[slot]
        h[1:] = hidden[:n - 1]
        self.head.forward(np.asarray(tokens, np.int32), [Segment(slot, pos, n, logits=False)], self.kv, h)
        self.pending[slot] = hidden[n - 1]

    def draft(self, slot: int, pos: int, token: int, k: int) -> list[int]:
        """Up to ``k`` drafts after ``token`` (the pending token, at position ``pos``)."""
        out: list[int] = []
        h = self.pending[slot][None, :].copy()
        while len(out) < k and pos < self.n_ctx:
            logits = self.head.forward(np.asarray([token], np.int32), [Segment(slot, pos, 1)], self.kv, h)[0]
            if self.p_min > 0.0 and _top_prob(logits) < self.p_min:
                break
            token = int(np.argmax(logits))
            out.append(token)
            h = self.head.last_hidden()[-1:].copy()
            pos += 1
        return out


class MtpDrafter(AdaptiveWindow):
    """One request's drafter over the engine's ``MtpModel`` (``--speculative mtp``)."""

    def __init__(self, mtp: MtpModel):
        super().__init__()
        self.mtp = mtp
        self.req = None

    def bind(self, request) -> None:
        """Given the request before its first proposal (its slot is read when drafting)."""
        self.req = request

    def observe(self, pos: int, tokens: list[int], hidden: np.ndarray) -> None:
        """Called by the executor with every committed row group of this request."""
        self.mtp.observe(self.req.slot.index, pos, tokens, hidden)

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        k = min(self.window - 1, limit)
        if k <= 0 or self.req is None or self.req.slot is None:
            return []
        return self.mtp.draft(self.req.slot.index, len(tokens) - 1, tokens[-1], k)
