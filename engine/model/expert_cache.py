"""The expert caches at run time: a copy-in policy model, and the learned GPU cache the CUDA backend runs.

Owns:
* ``ExpertCache``: a model of a copy-in replacement policy, for ``simulate`` only (no
  backend runs it): "static" (the plan's experts stay), "lru" or "lfu" (a cold expert that
  a forward routes ``copy_min_rows`` rows or more to is copied in, evicting the least
  recently / least frequently used one). ``simulate(trace, ...)`` replays a routing trace
  against a policy: hits, copies and the modeled time.
* ``LearnedPolicy``, ``rebalance`` and ``LearnedCache``: the learned GPU cache that the
  CUDA backend runs (``--expert-cache lfu|lru``, opt-in; default static): each layer keeps
  the static plan's number of GPU slots (the same memory), and between ticks the slots go
  to the experts with the highest score (lfu: routed rows with exponential decay per tick;
  lru: the tick of last use), at most ``copies_per_tick`` copies per tick over all layers.
  ``rebalance`` is the pure decision, ``LearnedCache`` its state (scores, residents,
  counters); the backend applies the moves (``CudaProgram._learn_experts``).
Leaves to others: the plan (expert_plan.py), the setup that attaches a cache
(experts.py), every copy (the backend).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from aotx.engine.model.expert_plan import Costs, MoeLayer, Plan

class ExpertCache:
    """The GPU cache's residents and its replacement policy (``Plan.policy``).

    ``slots[l]``: how many experts of layer l the cache holds (the plan's gpu count);
    ``resident(l)``: the set of resident experts. ``route(l, rows_by_expert)`` is called once
    per moe layer and forward with {expert: rows routed to it}; it returns the experts to
    copy in now, each with the expert it evicts (or None), and records hits: a routed row of
    a resident expert is a hit. "static" never copies; "lru" / "lfu" copy a cold expert once
    it got ``copy_min_rows`` rows since it last left the cache (in one call, as a prefill
    chunk, or over many decode steps), or (lfu) once it has been used more than twice as
    often as the least used resident; the victim is the least recently (lru) or least
    frequently (lfu) used resident."""

    def __init__(self, p: Plan, copy_min_rows: int | None = None):
        self.policy = p.policy
        self.copy_min_rows = p.copy_min_rows if copy_min_rows is None else copy_min_rows
        self._res: list[OrderedDict[int, None]] = []
        self.freq: list[list[int]] = []
        self.pending: list[list[int]] = []
        for t in p.tiers:
            od: OrderedDict[int, None] = OrderedDict()
            for e, tier in enumerate(t):
                if tier == "gpu":
                    od[e] = None
            self._res.append(od)
            self.freq.append([0] * len(t))
            self.pending.append([0] * len(t))
        self.slots = [len(r) for r in self._res]
        self.hits = 0
        self.misses = 0
        self.copies = 0

    def resident(self, layer: int) -> set[int]:
        return set(self._res[layer])

    def route(self, layer: int, rows_by_expert: dict[int, int]) -> list[tuple[int, int | None]]:
        res, freq = self._res[layer], self.freq[layer]
        todo: list[tuple[int, int | None]] = []
        for e, n in rows_by_expert.items():
            freq[e] += n
        for e, n in sorted(rows_by_expert.items(), key=lambda kv: -kv[1]):
            if e in res:
                self.hits += n
                res.move_to_end(e)
                continue
            want = False
            if self.policy != "static" and self.slots[layer] > 0:
                # rows a cold expert got since it last left the cache (decode sends one row at a time)
                self.pending[layer][e] += n
                want = bool(self.copy_min_rows) and self.pending[layer][e] >= self.copy_min_rows
                if self.policy == "lfu" and not want:
                    coldest = min(res, key=lambda r: freq[r]) if res else None
                    want = coldest is not None and freq[e] > 2 * freq[coldest] + 1
            if not want:
                self.misses += n
                continue
            victim = None
            if len(res) >= self.slots[layer]:
                victim = next(iter(res)) if self.policy == "lru" else min(res, key=lambda r: freq[r])
                del res[victim]
            res[e] = None
            self.pending[layer][e] = 0
            self.copies += 1
            self.hits += n
            todo.append((e, victim))
        return todo

    @property
    def hit_rate(self) -> float:
        tot = self.hits + self.misses
        return self.hits / tot if tot else 0.0


def simulate(trace: list[list[Any]], p: Plan, layers: list[MoeLayer], costs: Costs | None = None,
             policy: str | None = None) -> dict[str, float]:
    """Replay ``trace`` (per forward: per moe layer, the (n, k) selected expert ids of its
    rows) against the plan's cache with ``policy`` (default the plan's). Returns hits,
    misses, copies, hit_rate and, with ``costs``, the modeled seconds of the expert work
    (per layer and forward: max(CPU rows' cost, GPU rows' cost, its fixed part included when
    it has rows) + copies' cost)."""
    import dataclasses

    import numpy as np

    cache = ExpertCache(dataclasses.replace(p, policy=policy or p.policy))
    secs = 0.0
    for step in trace:
        for li, sel in enumerate(step):
            sel = np.asarray(sel).reshape(-1)
            counts = np.bincount(sel, minlength=layers[li].n_expert)
            rows = {int(e): int(c) for e, c in enumerate(counts) if c}
            copies = cache.route(li, rows)
            if costs is not None:
                res = cache.resident(li)
                cpu_t = sum(costs.cpu[li](n) for e, n in rows.items() if e not in res)
                on = [n for e, n in rows.items() if e in res] if costs.has_gpu else []
                gpu_t = costs.fixed_s(li) + sum(costs.gpu[li](n) for n in on) if on else 0.0
                secs += max(cpu_t, gpu_t) + len(copies) * (costs.copy[li] if costs.copy else 0.0)
    out = {"hits": cache.hits, "misses": cache.misses, "copies": cache.copies, "hit_rate": round(cache.hit_rate, 4)}
    if costs is not None:
        out["modeled_s"] = round(secs, 6)
    return out


# ------------------------------------------------------------------ the learned cache (run by the backend)

LEARNED = ("lfu", "lru")


@dataclass(frozen=True)
class LearnedPolicy:
    """How the learned GPU expert cache (``LearnedCache``) re-assigns its slots between ticks.

    ``kind``: "lfu" (the default: an expert's score is its routed rows, the score multiplied
    by ``decay`` each tick first, so a burst fades in about 1 / (1 - decay) ticks) or "lru"
    (the score is the last tick that routed a row to it). LFU is the one to use: with
    routing near uniform (the usual case within a layer), LRU sees new "most recent"
    experts every tick and spends its whole copy budget every tick for nothing, while LFU's
    decayed counts only move an expert whose traffic clearly exceeds a resident's.
    ``copies_per_tick``: at most this many experts copied in per tick over ALL layers, so a
    tick's added latency stays bounded (Qwen3-30B-A3B's experts are 1.7-2.0 MB: 8 copies
    are ~16 MB through the pinned staging buffer, a few ms); ``margin`` and ``ratio`` (lfu
    only): a non-resident replaces a resident only when its score exceeds the resident's by
    more than ``margin`` (decayed rows) and by more than ``ratio`` times, so equal traffic
    never churns."""

    kind: str = "lfu"
    decay: float = 0.9
    copies_per_tick: int = 8
    margin: float = 1.0
    ratio: float = 1.5

    def __post_init__(self) -> None:
        if self.kind not in LEARNED:
            raise ValueError(f"learned expert cache kind {self.kind!r} (known: {', '.join(LEARNED)})")
        if not 0.0 <= self.decay <= 1.0 or self.copies_per_tick < 0:
            raise ValueError(f"learned expert cache: decay {self.decay} (0..1), copies_per_tick "
                             f"{self.copies_per_tick} (>= 0)")


def rebalance(scores: list[Any], resident: list[Any], max_copies: int, margin: float = 0.0,
              ratio: float = 1.0) -> list[tuple[int, int, int]]:
    """The learned cache's decision, a pure function. ``scores[l]``: (E,) float, how much
    layer l's experts deserve a GPU slot; ``resident[l]``: (E,) bool, the experts there now
    (the layer's capacity is their count and never changes). Within a layer, the i-th best
    non-resident (score descending, then lower id) replaces the i-th worst resident (score
    ascending, then higher id) while its score exceeds the resident's by more than
    ``margin`` and by more than ``ratio`` times; over all layers the ``max_copies`` swaps
    of the largest gain (score difference; ties: lower layer, then rank) are kept, each
    layer's a prefix of its list (its gains fall with the rank). Returns
    [(layer, promoted, evicted)], largest gain first."""
    import numpy as np

    cand: list[tuple[float, int, int, int, int]] = []
    for li, (sc, on) in enumerate(zip(scores, resident)):
        sc = np.asarray(sc, np.float64)
        on = np.asarray(on, bool)
        if not on.any() or on.all():
            continue
        ids = np.arange(sc.shape[0])
        out_ids, in_ids = ids[~on], ids[on]
        best = out_ids[np.lexsort((out_ids, -sc[out_ids]))]          # hottest outside first
        worst = in_ids[np.lexsort((-in_ids, sc[in_ids]))]            # coldest inside first
        for rank, (e, v) in enumerate(zip(best, worst)):
            a, b = float(sc[e]), float(sc[v])
            if not (a > b + margin and a > ratio * b):
                break
            cand.append((-(a - b), li, rank, int(e), int(v)))
    cand.sort()
    return [(li, e, v) for _, li, _, e, v in cand[:max(0, int(max_copies))]]


class LearnedCache:
    """The learned GPU expert cache's state: per moe layer the resident experts (the static
    plan's "gpu" experts at first; their count, the layer's capacity, never changes, so the
    cache uses the plan's memory), the scores and the counters. ``tick(traffic)`` takes the
    backend's cumulative routed-row counters (``expert_stats()["traffic"]``: one (E,) array
    per layer), scores the rows routed since the last call, decides the moves
    (``rebalance``), applies them to ``resident`` and returns them; the backend copies the
    promoted experts' weights into the evicted ones' slots before the next tick's first
    launch. ``hits`` / ``misses``: routed rows whose expert was / was not resident when
    they ran.

    Batch invariance (DESIGN.md): the GPU tier's and the CPU pool's kernels agree to ~3e-6,
    not bit for bit, so under a learned cache a row's bits depend on which tier held its
    experts, i.e. on the traffic of earlier ticks (other users' requests included); under
    the static plan they do not (the placement is fixed at load). That is why it is opt-in."""

    def __init__(self, plan_tiers: tuple[tuple[str, ...], ...], policy: LearnedPolicy):
        import numpy as np

        self.policy = policy
        self.resident = [np.array([t == "gpu" for t in tiers], bool) for tiers in plan_tiers]
        self.capacity = [int(r.sum()) for r in self.resident]
        self.score = [np.zeros(r.shape[0], np.float64) for r in self.resident]
        self._last: list[Any] = [None] * len(self.resident)
        self.ticks = self.copies = self.hits = self.misses = 0

    def tick(self, traffic: list[Any]) -> list[tuple[int, int, int]]:
        """Moves [(layer, promoted, evicted)] after the tick whose cumulative counters are
        ``traffic`` (class docstring); [] when nothing moves. The first call only takes
        the counters as its baseline (traffic before the cache existed is not scored)."""
        import numpy as np

        p = self.policy
        self.ticks += 1
        for li, tr in enumerate(traffic):
            tr = np.array(tr, np.int64)
            last, self._last[li] = self._last[li], tr
            if last is None or last.shape != tr.shape or (tr < last).any():
                continue                                   # a baseline, or counters reset: no evidence
            delta = tr - last
            on = self.resident[li]
            self.hits += int(delta[on].sum())
            self.misses += int(delta[~on].sum())
            if p.kind == "lfu":
                self.score[li] = self.score[li] * p.decay + delta
            else:
                self.score[li] = np.where(delta > 0, float(self.ticks), self.score[li])
        margin, ratio = (p.margin, p.ratio) if p.kind == "lfu" else (0.0, 1.0)
        moves = rebalance(self.score, self.resident, p.copies_per_tick, margin, ratio)
        for li, e, v in moves:
            self.resident[li][e], self.resident[li][v] = True, False
        self.copies += len(moves)
        return moves

    def stats(self) -> dict[str, Any]:
        tot = self.hits + self.misses
        return {"policy": self.policy.kind, "ticks": self.ticks, "copies": self.copies, "hits": self.hits,
                "misses": self.misses, "hit_rate": round(self.hits / tot, 4) if tot else 0.0}

