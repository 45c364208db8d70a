"""Speculative decoding: drafters and exact acceptance inside the tick.

Owns: the drafter interface and prompt lookup (n-gram matching against the
conversation's own tokens; Saxena 2023, "Prompt Lookup Decoding", as in
llama.cpp's lookup decoding), the adaptive window, and acceptance:

* greedy: a draft token is accepted exactly when it equals the argmax the model
  gives at its position, so the output is token-identical to plain greedy;
* sampling: speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et
  al. 2023): accept draft d with probability min(1, p(d)/q(d)), else draw from
  the residual norm(max(p - q, 0)). q is the drafter's own distribution for
  each draft (a draft model's, ``drafter.q``); a deterministic drafter such as
  prompt lookup has q one-hot on d (``q`` None), so acceptance is p(d) and the
  residual is p without d. Either way the output distribution is exactly the
  model's. Draws use the request's counter-based Philox stream, so a seed
  reproduces the result.

The drafter interface (``requests.Drafter``): ``window`` (the verify width T),
``bind(request)`` before the first proposal, ``prefill(pos, n)`` while the
target prefills, ``propose(tokens, limit) -> list[int]``, ``update(n_drafts,
n_accepted)`` after each verify pass, and ``q`` (None, or one (ids, probs) pair
per draft of the last proposal). The draft-model drafter lives in ``drafter.py``.

Leaves the batch layout and the KV rollback to ``executor.py``, publication to ``commit.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aotx.engine.runtime.sampling import (
    SamplerConfig, SamplerState, apply_mask, apply_penalties, distribution, uniform,
)


@dataclass
class AdaptiveWindow:
    """The adaptive verify width T (1 + drafts) and acceptance counters, shared by
    every drafter: T grows by one after a fully accepted window and shrinks by one
    after a rejection at the first draft, within [min_window, max_window]."""

    window: int = 4
    min_window: int = 2
    max_window: int = 8
    proposed: int = 0
    accepted: int = 0
    passes: int = 0

    #: per-draft distributions of the last proposal; None: each draft is certain (one-hot)
    q = None

    def bind(self, request) -> None:
        """Given the request before its first proposal (a draft model reads its slot and
        sampler); prompt lookup needs nothing."""

    def prefill(self, pos: int, n: int) -> None:
        """The target prefills prompt[pos:pos+n] this tick (a draft model mirrors it)."""

    def update(self, n_drafts: int, n_accepted_drafts: int) -> None:
        """Adapt the window after a verify pass of ``n_drafts`` drafts."""
        if n_drafts == 0:
            return
        self.passes += 1
        self.proposed += n_drafts
        self.accepted += n_accepted_drafts
        if n_accepted_drafts == n_drafts:
            self.window = min(self.max_window, self.window + 1)
        elif n_accepted_drafts == 0:
            self.window = max(self.min_window, self.window - 1)


@dataclass
class PromptLookup(AdaptiveWindow):
    """Propose the continuation of the most recent earlier occurrence of the
    longest suffix (``max_ngram`` down to ``min_ngram`` tokens) of the history.
    Deterministic: q is one-hot on each draft."""

    max_ngram: int = 3
    min_ngram: int = 1

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to min(window - 1, limit) draft ids continuing ``tokens`` (may be empty)."""
        k = min(self.window - 1, limit)
        if k <= 0:
            return []
        n_tok = len(tokens)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            suffix = tokens[n_tok - n:]
            # most recent earlier occurrence
            for start in range(n_tok - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    cont = tokens[start + n:start + n + k]
                    if cont:
                        return list(cont)
                    break
        return []


def verify(rows: np.ndarray, drafts: list[int], cfg: SamplerConfig, st: SamplerState,
           q: list[tuple[np.ndarray, np.ndarray]] | None = None, masks: np.ndarray | None = None) -> list[int]:
    """Tokens produced by one verify pass: rows (len(drafts)+1, vocab) float32 logits
    (modified), row i predicting the token after input i. Returns 1..len(drafts)+1
    tokens: the accepted drafts, then the model's own token (the correction at the
    first rejection, or the bonus token after full acceptance). Advances ``st``.

    q: the drafter's distribution for each draft, (ids int, probs float64 summing to
    1), or None when every draft is one-hot (prompt lookup). Under sampling, draft
    d_i is accepted with probability min(1, p(d_i)/q_i(d_i)) (one Philox draw), else
    the correction is drawn from norm(max(p - q_i, 0)) (a second draw): Leviathan et
    al. 2023, Algorithm 1. Greedy ignores q: accept while d_i is the argmax.

    masks: a constrained reply's (len(drafts)+1, words) bitmasks, row i's after drafts[:i]
    (``GrammarState.window_masks``): applied before everything, so a draft the grammar
    forbids has p = 0 and is rejected (greedy: it cannot be the argmax)."""
    out: list[int] = []
    for i in range(len(drafts) + 1):
        logits = rows[i]
        if masks is not None:
            apply_mask(logits, masks[i])
        apply_penalties(logits, st.history, cfg)
        d = drafts[i] if i < len(drafts) else None
        if cfg.temperature <= 0.0:
            tok = int(np.argmax(logits))
        else:
            ids, p = distribution(logits, cfg)
            if d is not None:
                u = uniform(st.seed, st.step)
                st.step += 1
                pd = float(p[ids == d].sum())
                qi = q[i] if q is not None else None
                qd = 1.0 if qi is None else float(qi[1][qi[0] == d].sum())
                if qd <= 0.0 or u * qd < pd:  # u < min(1, pd / qd)
                    tok = d
                else:
                    r_ids, r_p = _residual(ids, p, d, qi)
                    tok = _draw(r_ids, r_p, uniform(st.seed, st.step))
                    st.step += 1
            else:
                tok = _draw(ids, p, uniform(st.seed, st.step))
                st.step += 1
        st.history.append(tok)
        out.append(tok)
        if d is None or tok != d:
            break
    if cfg.repeat_last_n > 0 and len(st.history) > 4 * cfg.repeat_last_n:
        del st.history[: len(st.history) - cfg.repeat_last_n]
    return out


def _residual(ids: np.ndarray, p: np.ndarray, d: int,
              qi: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray, np.ndarray]:
    """max(p - q, 0) over p's support (ids, probabilities; unnormalized: ``_draw``
    scales by the total). q one-hot on d (qi None): p without d. If rounding leaves
    nothing (p == q to the last bit, so a rejection had probability ~0), p itself."""
    if qi is None:
        r = np.where(ids == d, 0.0, p)
    else:
        q_ids, q_p = qi
        order = np.argsort(q_ids)
        sq = q_ids[order]
        pos = np.clip(np.searchsorted(sq, ids), 0, max(0, len(sq) - 1))
        q_at = np.where((len(sq) > 0) & (sq[pos] == ids), q_p[order][pos], 0.0)
        r = np.maximum(p - q_at, 0.0)
    if not r.sum() > 0.0:
        return ids, p
    return ids, r


def _draw(ids: np.ndarray, p: np.ndarray, u: float) -> int:
    c = np.cumsum(p)
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    return int(ids[min(i, len(ids) - 1)])
