"""The expert-tier plan: where each routed expert lives, from measured costs.

Owns: ``MoeLayer`` (a moe node's facts), the costs the plan reads (``Line``: seconds(n) =
a + b n, ``Costs``: per layer, the CPU tier's and the GPU tier's per-expert lines, the GPU
call's fixed seconds, the copy cost), ``Plan`` and ``plan(layers, costs, ...)``: every
expert gets a tier, "gpu" (the GPU expert cache, sized from the budget left after
weights, KV and working memory), "host" (pinned host memory: the CPU pool computes it,
or it is copied to the GPU when a tick routes many rows to it) or "mmap" (computed by the
CPU pool from the memory-mapped file). The cache's slots go first to the experts that
save the most modeled decode time per byte (a layer's time as a function of its
GPU-held traffic share, the GPU's fixed cost included: ``decode_layer_s``), so layers
share it evenly when traffic is uniform; then, while it lasts, to the rest (no decode
saving; a prefill still gains). Where the backend runs a layer with every expert on the
GPU as a device step (the CUDA backend: no host round trip), whole layers first is the
other candidate, taken when modeled no slower; ``copy_min_rows`` is the row count from
which copying a cold expert and running it on the GPU beats the CPU; ``decode_tok_s`` /
``prefill_tok_s`` are the speeds the measured costs predict.

Leaves to others: measuring the costs and the sequence at engine start (experts.py),
the caches at run time (expert_cache.py), applying a plan (the backends).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

TIERS = ("gpu", "host", "mmap")
POLICIES = ("static", "lru", "lfu")
WHOLE_LAYER_TOL = 0.02         # plan: whole GPU layers win modeled decode ties within this fraction


@dataclass(frozen=True)
class MoeLayer:
    """One moe node: ``index`` (its moe_layer), ``n_expert``, ``n_used`` (experts per
    token), ``expert_bytes`` (gate + up + down of one expert, in the file's types),
    ``d_model``, ``ffn_dim``."""

    index: int
    n_expert: int
    n_used: int
    expert_bytes: int
    d_model: int
    ffn_dim: int


# ------------------------------------------------------------------ costs

@dataclass(frozen=True)
class Line:
    """seconds(n) = a + b * n (n rows), fitted to two timings; never negative."""

    a: float
    b: float

    def __call__(self, n: float) -> float:
        return max(0.0, self.a + self.b * n)

    @classmethod
    def fit(cls, t1: float, n1: int, t2: float, n2: int) -> Line:
        b = max(0.0, (t2 - t1) / max(1, n2 - n1))
        return cls(max(0.0, t1 - b * n1), b)


@dataclass(frozen=True)
class Costs:
    """Per moe layer: ``cpu[l]`` (CPU pool, one expert), ``gpu[l]`` (one more expert in the
    GPU tier's call: its marginal seconds on n rows; empty without a GPU), ``gpu_fixed[l]``
    (the GPU tier's call's fixed seconds, paid once per layer and forward when any row goes
    to the GPU: the launches, the table upload, the copy down, the sync; empty: 0) and
    ``copy[l]`` (seconds to copy one expert into the GPU cache; empty without a GPU);
    ``dense_decode_s``: the rest of a decode step (attention and dense layers) when
    measured, else 0; ``dense_prefill_s``: the same per token of a prefill chunk;
    ``device``: the device fingerprint they were measured on; ``measured_s``: how long the
    calibration took (0 when reused)."""

    cpu: tuple[Line, ...]
    gpu: tuple[Line, ...] = ()
    copy: tuple[float, ...] = ()
    dense_decode_s: float = 0.0
    device: str = ""
    measured_s: float = 0.0
    dense_prefill_s: float = 0.0
    gpu_fixed: tuple[float, ...] = ()

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpu)

    def fixed_s(self, layer: int) -> float:
        """The GPU tier's fixed seconds per call of moe layer ``layer`` (0 when not measured)."""
        return self.gpu_fixed[layer] if self.gpu_fixed else 0.0

    def to_dict(self) -> dict:
        return {"cpu": [[c.a, c.b] for c in self.cpu], "gpu": [[c.a, c.b] for c in self.gpu], "copy": list(self.copy),
                "gpu_fixed": list(self.gpu_fixed), "dense_decode_s": self.dense_decode_s,
                "dense_prefill_s": self.dense_prefill_s, "device": self.device}

    @classmethod
    def from_dict(cls, d: dict) -> Costs:
        return cls(tuple(Line(float(a), float(b)) for a, b in d["cpu"]),
                   tuple(Line(float(a), float(b)) for a, b in d.get("gpu", [])),
                   tuple(float(x) for x in d.get("copy", [])), float(d.get("dense_decode_s", 0.0)),
                   str(d.get("device", "")), 0.0, float(d.get("dense_prefill_s", 0.0)),
                   tuple(float(x) for x in d.get("gpu_fixed", [])))


# ------------------------------------------------------------------ the plan

@dataclass(frozen=True)
class Plan:
    """Where every expert lives: ``tiers[l][e]`` in TIERS; ``policy`` of the GPU cache;
    ``copy_min_rows``: a tick that routes at least this many rows to an expert off the GPU
    copies it in and runs it there (0: never); bytes per tier; the speeds the costs predict
    (decode batch 1, prefill of 512 tokens); ``reason``: why the plan is what it is."""

    tiers: tuple[tuple[str, ...], ...]
    policy: str = "static"
    copy_min_rows: int = 0
    gpu_bytes: int = 0
    host_bytes: int = 0
    mmap_bytes: int = 0
    decode_tok_s: float = 0.0
    prefill_tok_s: float = 0.0
    reason: str = ""

    def count(self, tier: str) -> int:
        return sum(t.count(tier) for t in self.tiers)

    @property
    def n_experts(self) -> int:
        return sum(len(t) for t in self.tiers)

    def summary(self) -> str:
        n = self.n_experts or 1
        parts = [f"{self.count(t)} {t} ({self.count(t) / n:.0%})" for t in TIERS if self.count(t)]
        speed = f"; expected decode {self.decode_tok_s:.1f} tok/s, prefill {self.prefill_tok_s:.0f} tok/s" \
            if self.decode_tok_s else ""
        copy = f", copy a cold expert at >= {self.copy_min_rows} rows" if self.copy_min_rows else ""
        return (f"experts: {self.n_experts} in {len(self.tiers)} layers: {', '.join(parts)}; cache policy "
                f"{self.policy}{copy}{speed}" + (f" ({self.reason})" if self.reason else ""))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        d = dict(d)
        d["tiers"] = tuple(tuple(t) for t in d["tiers"])
        return cls(**d)


def decode_layer_s(k: int, f: float, cpu1: float, fixed: float, gpu1: float) -> float:
    """Expected seconds of one moe layer in a batch-1 decode step. Each of the token's ``k``
    routed experts is on the GPU with probability ``f`` (the GPU-held share of the layer's
    traffic; independently: the k distinct picks of uniform routing are close to it for
    k << n_expert, and exact at f = 0 and 1); with j of them there, the CPU tier's
    (k - j) ``cpu1`` and, when j > 0, the GPU tier's ``fixed`` + j ``gpu1`` run at once
    (the slower counts)."""
    f = min(1.0, max(0.0, f))
    t = 0.0
    for j in range(k + 1):
        p = math.comb(k, j) * f ** j * (1.0 - f) ** (k - j)
        if p:
            t += p * max((k - j) * cpu1, fixed + j * gpu1 if j else 0.0)
    return t


def _speeds(layers: list[MoeLayer], costs: Costs, on_gpu: list[int], copy_min_rows: int,
            device_layers: tuple[bool, ...] = (), held: list[float] | None = None) -> tuple[float, float]:
    """Modeled decode tok/s (batch 1; ``decode_layer_s`` per layer at the GPU-held traffic
    share ``held[l]``, default on_gpu[l] / n_expert: uniform routing) and prefill tok/s (512
    tokens, uniform routing: every expert gets 512 n_used / n_expert rows) of a placement
    with ``on_gpu[l]`` experts of layer l on the GPU. Within a layer the CPU and the GPU run
    at once (the slower one counts); the GPU tier's fixed cost is paid once per layer when
    any row goes to it, except in a layer of ``device_layers`` with every expert on the
    GPU: that one runs as the backend's device step (no host round trip, no fixed cost)."""
    dec = costs.dense_decode_s
    pre = 512 * costs.dense_prefill_s
    for i, (L, g) in enumerate(zip(layers, on_gpu)):
        cpu = costs.cpu[L.index]
        rows = 512 * L.n_used / L.n_expert     # rows per expert in a 512-token prefill
        n_cpu = L.n_expert - g
        if not costs.has_gpu:
            dec += L.n_used * cpu(1)
            pre += L.n_expert * cpu(rows)
            continue
        gpu, fixed = costs.gpu[L.index], costs.fixed_s(L.index)
        if g == L.n_expert and L.index < len(device_layers) and device_layers[L.index]:
            dec += L.n_used * gpu(1)
            pre += L.n_expert * gpu(rows)
            continue
        dec += decode_layer_s(L.n_used, held[i] if held is not None else g / L.n_expert, cpu(1), fixed, gpu(1))
        if copy_min_rows and rows >= copy_min_rows:
            pre += fixed + L.n_expert * gpu(rows) + n_cpu * costs.copy[L.index]
        else:
            pre += max(n_cpu * cpu(rows), fixed + g * gpu(rows) if g else 0.0)
    return (1.0 / dec if dec > 0 else 0.0), (512.0 / pre if pre > 0 else 0.0)


def plan(layers: list[MoeLayer], costs: Costs, *, gpu_bytes: int = 0, host_bytes: int | None = None,
         policy: str = "static", traffic: list[list[float]] | None = None,
         device_layers: tuple[bool, ...] = ()) -> Plan:
    """Place every expert (module docstring). ``gpu_bytes``: the GPU expert cache's budget
    (0 without a GPU); ``host_bytes``: pinned host memory for experts (None: unlimited;
    experts past it stay in the memory-mapped file); ``traffic[l][e]``: the expected share
    of layer l's routed rows that go to expert e (default uniform), e.g. learned from an
    earlier run's counters; ``device_layers[l]``: layer l runs as the backend's device step
    once every one of its experts is on the GPU (no host round trip: ``_speeds``), which
    makes whole layers on the GPU a candidate placement beside the budget spread over
    layers: every count of whole layers (the best savers first) is scored, and the most whole
    layers within ``WHOLE_LAYER_TOL`` of the best modeled decode taken (their saved host round
    trips the costs leave out). Raises ValueError on an unknown policy."""
    if policy not in POLICIES:
        raise ValueError(f"expert cache policy {policy!r} (known: {', '.join(POLICIES)})")
    share = [list(traffic[i]) if traffic else [1.0 / L.n_expert] * L.n_expert for i, L in enumerate(layers)]
    budget = gpu_bytes if costs.has_gpu else 0
    tiers, on_gpu, reason = _place_gpu(layers, costs, share, budget, ())
    whole = [i for i, L in enumerate(layers) if L.index < len(device_layers) and device_layers[L.index]]
    if budget > 0 and whole and any(g < L.n_expert for g, L in zip(on_gpu, layers)):
        # whole layers first: the device-capable layers by modeled decode saving per byte (their
        # host step's time less the device step's), while they fit; the budget left spread over the rest
        def saving(i: int) -> float:
            L = layers[i]
            c1, g1, fx = costs.cpu[L.index](1), costs.gpu[L.index](1), costs.fixed_s(L.index)
            return (decode_layer_s(L.n_used, 0.0, c1, fx, g1) - L.n_used * g1) / (L.n_expert * L.expert_bytes)

        full, left = [], budget
        for i in sorted(whole, key=lambda i: (-saving(i), i)):
            nb = layers[i].n_expert * layers[i].expert_bytes
            if saving(i) > 0 and nb <= left:
                full.append(i)
                left -= nb
        # every prefix of them (0: the budget spread), scored by modeled decode; within WHOLE_LAYER_TOL
        # of the best, the most whole layers (the model leaves out the host step's round trip and the
        # eager tick it forces, which a device-step layer saves: ~1.5 ms a layer on the H100, 30B-A3B)
        spread = _speeds(layers, costs, on_gpu, 0, device_layers, _held(tiers, share))[0]
        cands = [(spread, 0, tiers, on_gpu, reason)]
        for j in range(1, len(full) + 1):
            t2, g2, r2 = _place_gpu(layers, costs, share, budget, tuple(full[:j]))
            cands.append((_speeds(layers, costs, g2, 0, device_layers, _held(t2, share))[0], j, t2, g2, r2))
        best = max(c[0] for c in cands)
        dec2, j, t2, g2, r2 = max((c for c in cands if c[0] >= best * (1.0 - WHOLE_LAYER_TOL)), key=lambda c: c[1])
        if j and t2 != tiers:
            tiers, on_gpu = t2, g2
            reason = (f"{r2}; {j} whole layer{'s' if j > 1 else ''} on the GPU (device steps), modeled decode "
                      f"{dec2:.1f} tok/s against {spread:.1f} with the budget spread over every layer")
    host_left = math.inf if host_bytes is None else host_bytes
    for i, L in enumerate(layers):
        for e in sorted(range(L.n_expert), key=lambda e: -share[i][e]):
            if tiers[i][e] == "mmap" and L.expert_bytes <= host_left:
                tiers[i][e] = "host"
                host_left -= L.expert_bytes
    copy_min = 0
    if costs.has_gpu and any(g < L.n_expert for g, L in zip(on_gpu, layers)):
        # the fewest rows from which copy + GPU beats the CPU for one expert (max over the layers
        # with experts off the GPU: a whole layer there has nothing to copy)
        need = []
        for L, g in zip(layers, on_gpu):
            if g == L.n_expert:
                continue
            cpu, gpu, cp = costs.cpu[L.index], costs.gpu[L.index], costs.copy[L.index]
            slope = cpu.b - gpu.b
            if slope <= 0:
                need.append(0)
                continue
            n = max(1, math.ceil((cp + gpu.a - cpu.a) / slope))
            need.append(n if n <= 1 << 16 else 0)
        copy_min = 0 if 0 in need else max(need)
    dec, pre = _speeds(layers, costs, on_gpu, copy_min, device_layers, _held(tiers, share))
    by_tier = {t: sum(L.expert_bytes for i, L in enumerate(layers) for x in tiers[i] if x == t) for t in TIERS}
    return Plan(tuple(tuple(t) for t in tiers), policy, copy_min, by_tier["gpu"], by_tier["host"], by_tier["mmap"],
                round(dec, 2), round(pre, 1), reason)


def _held(tiers: list, share: list[list[float]]) -> list[float]:
    """Per layer: the share of its routed rows that go to its experts on the GPU."""
    return [sum(s for t, s in zip(ts, sh) if t == "gpu") for ts, sh in zip(tiers, share)]


def _place_gpu(layers: list[MoeLayer], costs: Costs, share: list[list[float]], budget: int,
               full: tuple[int, ...]) -> tuple[list[list[str]], list[int], str]:
    """The GPU's experts: every expert of the layers ``full`` (indices into layers), then the
    budget left spread over the others by modeled decode saving (below). Returns the tiers
    ("gpu" or "mmap"), the GPU count per layer and the plan's reason."""
    tiers = [["mmap"] * L.n_expert for L in layers]
    on_gpu = [0] * len(layers)
    left = budget
    reason = "no GPU expert tier: every expert on the CPU tier" if not costs.has_gpu else ""
    for i in full:
        tiers[i] = ["gpu"] * layers[i].n_expert
        on_gpu[i] = layers[i].n_expert
        left -= layers[i].n_expert * layers[i].expert_bytes
    if left > 0 or full:
        # each layer's experts hottest first; the saving of its (g+1)-th on the GPU: the layer's modeled
        # decode seconds (decode_layer_s, the GPU's fixed cost included) with g of them there less with g + 1.
        # While positive these fall as g grows (decode_layer_s is a Bernstein polynomial in f of a function
        # convex in the GPU's count j whenever any placement saves, i.e. fixed <= k cpu1, and Bernstein's
        # operator keeps convexity; hot experts first add ever less traffic), so the largest savings first,
        # each layer's in its order, split the budget best when every expert weighs the same
        order = [sorted(range(L.n_expert), key=lambda e: (-share[i][e], e)) for i, L in enumerate(layers)]
        cand = []
        for i, L in enumerate(layers):
            if i in full:
                continue
            cpu1, gpu1, fixed = costs.cpu[L.index](1), costs.gpu[L.index](1), costs.fixed_s(L.index)
            f, t = 0.0, decode_layer_s(L.n_used, 0.0, cpu1, fixed, gpu1)
            for g, e in enumerate(order[i]):
                f += share[i][e]
                t2 = decode_layer_s(L.n_used, f, cpu1, fixed, gpu1)
                if t2 >= t:
                    break
                # savings within measurement noise (2 significant digits) count as equal; ties go
                # round-robin over layers (uniform traffic, equal layers: the cache is shared evenly)
                cand.append((-float(f"{(t - t2) / max(1, L.expert_bytes):.2g}"), g, i))
                t = t2
        cand.sort()

        def take(i: int) -> None:
            nonlocal left
            tiers[i][order[i][on_gpu[i]]] = "gpu"
            left -= layers[i].expert_bytes
            on_gpu[i] += 1

        for _, g, i in cand:
            if on_gpu[i] == g and layers[i].expert_bytes <= left:
                take(i)
        # the rest (no modeled decode saving: the GPU still runs them in a prefill), round-robin
        rest = sorted((g, i) for i, L in enumerate(layers) for g in range(on_gpu[i], L.n_expert))
        for g, i in rest:
            if on_gpu[i] == g and layers[i].expert_bytes <= left:
                take(i)
        if all(g == L.n_expert for g, L in zip(on_gpu, layers)):
            reason = "every expert fits the GPU cache"
        else:
            reason = "the GPU budget holds part of the experts; the CPU pool computes the others"
    return tiers, on_gpu, reason

