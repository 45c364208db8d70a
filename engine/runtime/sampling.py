"""Sampling: turn one row of logits into the next token id.

Owns: the sampler chain and its state. Order as llama.cpp's default chain
(common/sampling.cpp): logit bias, penalties (repetition, frequency, presence: one
sampler over the last ``repeat_last_n`` tokens, as llama.cpp's ``penalties``), top-k,
top-p, min-p, temperature, then a draw. Temperature <= 0 is greedy (argmax, ties to the
lowest id).

A constrained reply (``constraints.py``) gives each step a token bitmask: it applies
first (``apply_mask``: every id it forbids gets logit -inf), so greedy picks the best
allowed id and the sampling filters see only allowed ones; this is the distribution
llama.cpp's grammar sampler gives (its "grammar first" order).

Randomness is counter-based: the draw at step ``n`` of a request uses Philox
keyed by the request's seed with counter ``n`` (Salmon et al. 2011, "Parallel
Random Numbers: As Easy as 1, 2, 3"), so a sampler's whole state is
``(seed, step, history)``: reproducible, and trivially captured in a capsule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from aotx.engine.protocol import SamplingParams


@dataclass
class SamplerState:
    """What a capsule must carry to continue sampling exactly: seed, step counter
    (draws made so far) and the penalty history (recent token ids)."""

    seed: int
    step: int = 0
    history: list[int] = field(default_factory=list)


_DEFAULT = SamplingParams()


@dataclass(frozen=True)
class SamplerConfig:
    """The sampler chain's part of ``protocol.SamplingParams`` (the one definition of the
    parameters and their defaults), frozen and hashable: temperature (0 = greedy),
    top_k (0 = off), top_p (1 = off), min_p (0 = off), repeat_penalty (1 = off) over the
    last ``repeat_last_n`` tokens (each distinct id once)."""

    temperature: float = _DEFAULT.temperature
    top_k: int = _DEFAULT.top_k
    top_p: float = _DEFAULT.top_p
    min_p: float = _DEFAULT.min_p
    repeat_penalty: float = _DEFAULT.repeat_penalty
    repeat_last_n: int = _DEFAULT.repeat_last_n
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id

    @classmethod
    def of(cls, sp: SamplingParams) -> SamplerConfig:
        return cls(sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.repeat_penalty, sp.repeat_last_n,
                   float(sp.frequency_penalty), float(sp.presence_penalty),
                   tuple(sorted((int(t), float(b)) for t, b in sp.logit_bias.items())))

    @property
    def host_only(self) -> bool:
        """The row needs the host's chain: a logit bias or a frequency/presence penalty
        (the device sampler has neither)."""
        return bool(self.logit_bias) or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def uniform(seed: int, step: int) -> float:
    """A float in [0, 1) from Philox(key=seed, counter=step): the same pair, the same number."""
    bg = np.random.Philox(key=seed & ((1 << 64) - 1), counter=step)
    return float(np.random.Generator(bg).random())


def apply_repeat_penalty(logits: np.ndarray, history: list[int], penalty: float, last_n: int) -> None:
    """In place: for each distinct id among the last ``last_n`` tokens, divide a positive
    logit by ``penalty`` or multiply a negative one (Keskar et al. 2019, CTRL; llama.cpp's
    penalties sampler applies it once per distinct id)."""
    if penalty == 1.0 or not history or last_n == 0:
        return
    ids = np.unique(np.asarray(history[-last_n:] if last_n > 0 else history, dtype=np.int64))
    ids = ids[(ids >= 0) & (ids < logits.shape[0])]
    v = logits[ids]
    logits[ids] = np.where(v > 0, v / penalty, v * penalty)  # -inf (masked) stays -inf


def apply_penalties(logits: np.ndarray, history: list[int], cfg: SamplerConfig) -> None:
    """In place: the logit bias (added), then llama.cpp's penalties sampler over the last
    ``repeat_last_n`` tokens: for each distinct id there, the repetition penalty (as
    ``apply_repeat_penalty``), then minus ``count * frequency_penalty + presence_penalty``
    (OpenAI's definition; llama.cpp's ``llama_sampler_penalties_apply``)."""
    if cfg.logit_bias:
        ids = np.fromiter((t for t, _ in cfg.logit_bias), np.int64, len(cfg.logit_bias))
        logits[ids] += np.fromiter((b for _, b in cfg.logit_bias), np.float32, len(cfg.logit_bias))
    if cfg.frequency_penalty == 0.0 and cfg.presence_penalty == 0.0:
        apply_repeat_penalty(logits, history, cfg.repeat_penalty, cfg.repeat_last_n)
        return
    if not history or cfg.repeat_last_n == 0:
        return
    win = history[-cfg.repeat_last_n:] if cfg.repeat_last_n > 0 else history
    ids, counts = np.unique(np.asarray(win, dtype=np.int64), return_counts=True)
    keep = (ids >= 0) & (ids < logits.shape[0])
    ids, counts = ids[keep], counts[keep]
    v = logits[ids]
    if cfg.repeat_penalty != 1.0:
        v = np.where(v > 0, v / cfg.repeat_penalty, v * cfg.repeat_penalty)
    logits[ids] = v - (counts * cfg.frequency_penalty + cfg.presence_penalty).astype(np.float32)


def apply_mask(logits: np.ndarray, mask: np.ndarray | None) -> None:
    """In place: -inf for every id the bitmask forbids (``mask``: (ceil(vocab / 32),)
    int32, bit ``i % 32`` of word ``i // 32`` set when id ``i`` is allowed; None: all)."""
    if mask is None:
        return
    vocab = logits.shape[0]
    allowed = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), bitorder="little")[:vocab]
    np.putmask(logits, allowed == 0, -np.inf)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(vocab,) float64 log probabilities of raw logits (what ``logprobs`` reports)."""
    x = logits.astype(np.float64)
    m = float(np.max(x))
    return x - (m + np.log(np.sum(np.exp(x - m))))


def top_logprobs(lp: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely ids of log probabilities ``lp`` with theirs, most likely
    first (ties to the lower id)."""
    if k <= 0:
        return []
    k = min(k, lp.shape[0])
    top = np.argpartition(-lp, k - 1)[:k]
    top = top[np.lexsort((top, -lp[top]))]
    return [(int(i), float(lp[i])) for i in top]


def sample(logits: np.ndarray, cfg: SamplerConfig, state: SamplerState, mask: np.ndarray | None = None) -> int:
    """Pick the next token from ``logits`` ((vocab,) float32; modified in place) and
    advance ``state`` (step += 1 for a draw, history append). ``mask``: the
    constraint's bitmask of this step (``apply_mask``), or None. Returns the token id."""
    apply_mask(logits, mask)
    apply_penalties(logits, state.history, cfg)
    if cfg.temperature <= 0.0:
        tok = int(np.argmax(logits))
    else:
        tok = _draw(logits, cfg, uniform(state.seed, state.step))
        state.step += 1
    state.history.append(tok)
    if cfg.repeat_last_n > 0 and len(state.history) > 4 * cfg.repeat_last_n:
        del state.history[: len(state.history) - cfg.repeat_last_n]
    return tok


def distribution(logits: np.ndarray, cfg: SamplerConfig) -> tuple[np.ndarray, np.ndarray]:
    """The sampling distribution after top-k, top-p, min-p and temperature (in that
    order, as llama.cpp): candidate ids (sorted by logit, descending, ties by id) and
    their float64 probabilities, summing to 1. Requires temperature > 0."""
    vocab = logits.shape[0]
    k = cfg.top_k if 0 < cfg.top_k < vocab else vocab
    if k < vocab:
        cand = np.argpartition(-logits, k - 1)[:k]
    else:
        cand = np.arange(vocab)
    order = np.lexsort((cand, -logits[cand]))
    cand = cand[order]
    lg = logits[cand].astype(np.float64)
    p = np.exp(lg - lg[0])
    p /= p.sum()
    keep = len(cand)
    if cfg.top_p < 1.0:
        c = np.cumsum(p)
        keep = min(keep, int(np.searchsorted(c, cfg.top_p, side="left")) + 1)
    if cfg.min_p > 0.0:
        keep = min(keep, max(1, int(np.sum(p >= cfg.min_p * p[0]))))
    cand, lg = cand[:keep], lg[:keep]
    q = np.exp((lg - lg[0]) / cfg.temperature)
    return cand, q / q.sum()


def _draw(logits: np.ndarray, cfg: SamplerConfig, u: float) -> int:
    cand, q = distribution(logits, cfg)
    c = np.cumsum(q)
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    return int(cand[min(i, len(cand) - 1)])
