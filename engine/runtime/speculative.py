"""Speculative decoding: drafters and exact acceptance inside the tick.

Owns: the drafter interface and prompt lookup (n-gram matching against the
conversation's own tokens; Saxena 2023, "Prompt Lookup Decoding", as in
llama.cpp's lookup decoding), the adaptive window, and acceptance:

* greedy: a draft token is accepted exactly when it equals the argmax the model
  gives at its position, so the output is token-identical to plain greedy;
* sampling: speculative sampling (Leviathan et al. 2023; Chen et al. 2023):
  accept draft d with probability min(1, p(d)/q(d)), else draw from the
  residual max(p - q, 0). Prompt lookup is deterministic (q is one-hot on d),
  so acceptance is p(d) and the residual is p without d: the output
  distribution is exactly the model's. Draws use the request's counter-based
  Philox stream, so a seed reproduces the result.

Leaves the batch layout, KV rollback and publication to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aotx.engine.runtime.sampling import SamplerConfig, SamplerState, apply_repeat_penalty, distribution, uniform


@dataclass
class PromptLookup:
    """Propose the continuation of the most recent earlier occurrence of the
    longest suffix (``max_ngram`` down to ``min_ngram`` tokens) of the history.

    ``window`` is the adaptive verify width T (1 + drafts): it grows by one after a
    fully accepted window and shrinks after a rejection at the first draft."""

    max_ngram: int = 3
    min_ngram: int = 1
    window: int = 4
    min_window: int = 2
    max_window: int = 8
    proposed: int = 0
    accepted: int = 0
    passes: int = 0

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


def verify(rows: np.ndarray, drafts: list[int], cfg: SamplerConfig, st: SamplerState) -> list[int]:
    """Tokens produced by one verify pass: rows (len(drafts)+1, vocab) float32 logits
    (modified), row i predicting the token after input i. Returns 1..len(drafts)+1
    tokens: the accepted drafts, then the model's own token (the correction at the
    first rejection, or the bonus token after full acceptance). Advances ``st``."""
    out: list[int] = []
    for i in range(len(drafts) + 1):
        logits = rows[i]
        apply_repeat_penalty(logits, st.history, cfg.repeat_penalty, cfg.repeat_last_n)
        d = drafts[i] if i < len(drafts) else None
        if cfg.temperature <= 0.0:
            tok = int(np.argmax(logits))
        else:
            ids, p = distribution(logits, cfg)
            if d is not None:
                u = uniform(st.seed, st.step)
                st.step += 1
                pd = float(p[ids == d].sum())
                if u < pd:
                    tok = d
                else:  # residual: p without d, renormalized
                    p = np.where(ids == d, 0.0, p)
                    tok = _draw(ids, p, uniform(st.seed, st.step))
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


def _draw(ids: np.ndarray, p: np.ndarray, u: float) -> int:
    c = np.cumsum(p)
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    return int(ids[min(i, len(ids) - 1)])
