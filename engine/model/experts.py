"""Expert tiers: where each routed expert of a mixture-of-experts model lives, decided by measurement.

Owns:
* ``moe_layers(program)``: the moe nodes of a traced Program as ``MoeLayer`` facts (experts,
  experts per token, bytes per expert).
* ``Costs``: what the calibration measured on this machine, per moe layer: seconds for one
  expert's FFN on n rows on the CPU tier (the CPU expert pool; a share of a layer-shaped
  call) and on the GPU tier (its marginal cost: the GPU tier's call of a layer costs a fixed
  part, its launches, table upload, copy down and sync, once, plus each expert's), the GPU
  call's fixed seconds, and seconds to copy one expert from pinned host memory into the
  GPU cache; each per-expert cost a line a + b n fitted to timings at two row counts. Keyed
  by a device fingerprint; stored under the cache dir and reused when the fingerprint and
  ``PLAN_VERSION`` match (no re-timing).
* ``plan(layers, costs, ...)``: the placement. Every expert gets a tier: "gpu" (the GPU
  expert cache, sized from the budget left after weights, KV and working memory), "host"
  (pinned host memory: the CPU pool computes it, or it is copied to the GPU when a tick
  routes many rows to it) or "mmap" (computed by the CPU pool from the memory-mapped file).
  The cache's slots go first to the experts that save the most modeled decode time per
  byte (a layer's time as a function of its GPU-held traffic share, the GPU's fixed cost
  included), so layers share it evenly when traffic is uniform; then, while it lasts, to
  the rest (no decode saving; a prefill still gains). Where the backend runs a layer with
  every expert on the GPU as a device step (the CUDA backend: no host round trip), whole
  layers first is the other candidate, taken when modeled no slower; ``copy_min_rows``
  is the row count from which copying a cold expert and running it on the GPU beats the
  CPU; ``decode_tok_s`` / ``prefill_tok_s`` are the speeds the measured costs predict.
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
* ``setup(model, ...)``: the whole sequence at engine start: calibrate (or reuse), plan,
  place (the backend allocates the cache, pins host memory, pins the CPU pool and touches
  the pages), then a second pass against the memory that was actually obtained and the
  pool's costs after pinning, and place again if the plan changed. The stages and their
  seconds go to the startup profile, the plan's one-line summary to the notes.

Leaves to the backends the measurements themselves and every copy and kernel
(``compiled.measure_experts``, ``compiled.place_experts``, ``compiled.expert_stats``: duck
typed; the CPU backend has only the CPU tiers), to admission the budget table.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TIERS = ("gpu", "host", "mmap")
POLICIES = ("static", "lru", "lfu")
PLAN_VERSION = 2               # 2: Costs.gpu is the marginal cost beside gpu_fixed (1: one expert's call)
CALIBRATION_ROWS = (1, 16)     # each cost line is fitted to timings at these row counts
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


def _stack_bytes(st: Any) -> int:
    n = getattr(st, "nbytes_per_expert", None)
    if n is not None:
        return int(n)
    return int(st.m) * int(st.k) * 4


def moe_layers(program: Any) -> list[MoeLayer]:
    """The moe nodes of ``program`` (an ops.Program) as MoeLayer facts, in order."""
    out = []
    for n in program.moe_nodes():
        a = n.attrs
        out.append(MoeLayer(a["moe_layer"], a["n_expert"], a["n_used"],
                            sum(_stack_bytes(a[k]) for k in ("gate", "up", "down")), n.out.width, a["ffn_dim"]))
    return out


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


def device_fingerprint(compiled: Any) -> str:
    """What the costs depend on: the CPU (model name, cores the process may use, numba
    threads), the GPU when the backend has one (``compiled.device_facts()``), and the
    backend's name. sha256, 16 hex chars."""
    import numba

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    facts = {"cpu": cpu, "cores": cores, "numba_threads": numba.get_num_threads(),
             "backend": type(compiled).__name__}
    dev = getattr(compiled, "device_facts", None)
    if dev is not None:
        facts["gpu"] = dev()
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


PREFILL_ROWS = 32   # the prefill step the calibration times


def step_seconds(model: Any, reps: int = 3) -> tuple[float, float]:
    """The best of ``reps`` timings of a decode step (one token, one slot, a short context)
    and of two PREFILL_ROWS-token prefill chunks (a large model's chunk can take seconds),
    through ``model.forward``, with the experts wherever they are now."""
    import numpy as np

    from aotx.engine.model.batch import Segment

    kv = model.new_kv_cache(1, PREFILL_ROWS + 16)
    toks = (np.arange(PREFILL_ROWS, dtype=np.int64) * 7919 % max(2, model.cfg.vocab_size)).astype(np.int32)
    best_p = math.inf
    for _ in range(min(reps, 2)):
        t0 = time.perf_counter()
        model.forward(toks, [Segment(0, 0, PREFILL_ROWS, logits=False)], kv)
        best_p = min(best_p, time.perf_counter() - t0)
    # the decode step: one token at one position, repeated (the first run warms the experts it
    # routes to): each new token would route to experts not yet used, whose first use costs
    # their materialization, and the dense part (this time less the modeled expert work) was
    # then priced at that cost (timed cold it read 0.107 s a token where 0.017 s ran)
    best_d = math.inf
    for i in range(reps + 2):
        t0 = time.perf_counter()
        model.forward(toks[:1], [Segment(0, PREFILL_ROWS, 1)], kv)
        if i >= 2:
            best_d = min(best_d, time.perf_counter() - t0)
    return best_d, best_p


def gpu_split(one: float, layer: dict[int, float], k: int, rows: tuple[int, int]) -> tuple[float, Line]:
    """The GPU tier's costs of a moe layer from its calibration timings: ``one`` (seconds of
    the tier's call of one expert on ``rows[0]`` rows) and ``layer[n]`` (a layer-shaped call:
    n rows, each routed to the same ``k`` experts, for n in ``rows``). A call is modeled as
    fixed + (experts) x m(n), m(n) = a + b n: k experts' call less one expert's is k - 1
    experts' marginal cost at rows[0], one expert's call less that is the fixed part, and
    the call at rows[1] less the fixed part, over k, is the marginal cost there. Returns
    (fixed seconds, the marginal Line), never negative. ``k`` 1: no fixed part separable
    (0; the call is the expert's)."""
    r0, r1 = rows
    if k <= 1:
        return 0.0, Line.fit(layer[r0], r0, layer[r1], r1)
    m0 = max(0.0, (layer[r0] - one) / (k - 1))
    fixed = max(0.0, one - m0)
    m1 = max(0.0, (layer[r1] - fixed) / k)
    return fixed, Line.fit(m0, r0, m1, r1)


def calibrate(compiled: Any, layers: list[MoeLayer], rows: tuple[int, int] = CALIBRATION_ROWS,
              model: Any = None, on_gpu: list[int] | None = None, device_layers: tuple[bool, ...] = ()) -> Costs:
    """Measure ``Costs`` on this machine through the backend: ``compiled.measure_experts(layer,
    rows) -> {"cpu": {n: s}, "copy": s, "gpu_one": s, "gpu_layer": {n: s}, "gpu_k": k}``
    (the best of a few runs each; "cpu": seconds per expert; "gpu_one": the GPU tier's call of
    one expert on rows[0] rows; "gpu_layer": its call of n rows each routed to the same gpu_k
    experts; the GPU keys absent without a GPU tier), split by ``gpu_split``. With ``model``
    (the TransformerModel), also a decode step, whose time less the modeled expert work is
    ``dense_decode_s``: the experts as placed now, ``on_gpu[l]`` of layer l on the GPU tier
    (None: every expert on the CPU), priced as ``_speeds`` prices them (``device_layers``: a
    full one as the device step), so the plan's prediction at this placement is the step
    that ran."""
    t0 = time.perf_counter()
    cpu, gpu, copy, fixed = [], [], [], []
    for L in layers:
        m = compiled.measure_experts(L.index, rows)
        c = m["cpu"]
        cpu.append(Line.fit(c[rows[0]], rows[0], c[rows[1]], rows[1]))
        if m.get("gpu_layer"):
            f, g = gpu_split(float(m["gpu_one"]), m["gpu_layer"], int(m["gpu_k"]), rows)
            gpu.append(g)
            fixed.append(f)
            copy.append(float(m["copy"]))
    dense = dense_p = 0.0
    ok = len(gpu) == len(layers)
    if model is not None:
        dec, pre = step_seconds(model)
        n = PREFILL_ROWS * 1.0
        exp_d = exp_p = 0.0
        for i, (L, c) in enumerate(zip(layers, cpu)):
            g = on_gpu[i] if (ok and on_gpu) else 0
            r = n * L.n_used / L.n_expert           # rows per expert of the timed prefill chunk
            if g == L.n_expert and L.index < len(device_layers) and device_layers[L.index]:
                exp_d += L.n_used * gpu[i](1)            # the device step: no fixed cost
                exp_p += L.n_expert * gpu[i](r)
            elif g:
                exp_d += decode_layer_s(L.n_used, g / L.n_expert, c(1), fixed[i], gpu[i](1))
                exp_p += max((L.n_expert - g) * c(r), fixed[i] + g * gpu[i](r))
            else:
                exp_d += L.n_used * c(1)
                exp_p += L.n_expert * c(r)
        dense = max(0.0, dec - exp_d)
        dense_p = max(0.0, pre - exp_p) / n
    return Costs(tuple(cpu), tuple(gpu) if ok else (), tuple(copy) if ok else (), dense, device_fingerprint(compiled),
                 time.perf_counter() - t0, dense_p, tuple(fixed) if ok else ())


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

    @property
    def cpu_only_fit(self) -> bool:
        """True when some experts run off the GPU on a machine that has one."""
        return self.count("gpu") < self.n_experts

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


# ------------------------------------------------------------------ the cache at run time

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


# ------------------------------------------------------------------ stored plans and setup

def _store_path(root: Path, model_fp: str, device_fp: str) -> Path:
    return Path(root) / "expert_plans" / f"{model_fp}-{device_fp}.json"


def load_stored(root: Path, model_fp: str, device_fp: str) -> tuple[Costs | None, str]:
    """The costs stored for this model on this device, or (None, why not)."""
    p = _store_path(root, model_fp, device_fp)
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, "no stored calibration for this device"
    except (OSError, ValueError) as e:
        return None, f"stored calibration unreadable ({type(e).__name__}); measured again"
    if d.get("version") != PLAN_VERSION or d.get("device") != device_fp:
        return None, "stored calibration is for another device or version; measured again"
    try:
        return Costs.from_dict(d["costs"]), "stored calibration reused"
    except (KeyError, TypeError, ValueError):
        return None, "stored calibration malformed; measured again"


def store(root: Path, model_fp: str, device_fp: str, costs: Costs, p: Plan) -> None:
    """Write the costs and the plan (atomically: a temporary file renamed). Never raises:
    a read-only data dir only costs a calibration next time."""
    path = _store_path(root, model_fp, device_fp)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": PLAN_VERSION, "device": device_fp, "costs": costs.to_dict(),
                                   "plan": p.to_dict()}, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


@dataclass
class Setup:
    """What ``setup`` did: the final plan, the costs, the stages' seconds (for the startup
    profile), a note for --profile, the placement the backend reported, the cache."""

    plan: Plan
    costs: Costs
    stages: dict[str, float] = field(default_factory=dict)
    note: str = ""
    placed: dict[str, Any] = field(default_factory=dict)
    cache: Any = None


def setup(model: Any, *, model_fp: str, gpu_bytes: int = 0, host_bytes: int | None = None, policy: str = "static",
          root: Path | None = None, reuse: bool = True, learned: LearnedPolicy | None = None) -> Setup:
    """Calibrate (or reuse the stored costs), plan, place, re-plan against what was placed,
    and place again when the plan changed. ``model``: a TransformerModel with moe nodes;
    ``gpu_bytes``: the GPU budget left for the expert cache (0 on the CPU); ``host_bytes``:
    pinned host memory for experts (None: unlimited); ``root``: where stored calibrations
    live (default the cache dir); ``policy`` "lfu" / "lru": the learned GPU cache
    (``LearnedCache`` with ``learned``, default ``LearnedPolicy(kind=policy)``) is attached
    to a backend that can run it (``compiled.attach_expert_cache``), else (and for
    "static") none is. Returns a Setup (its ``cache``: the LearnedCache when attached)."""
    compiled = model.compiled
    layers = moe_layers(model.program)
    stages: dict[str, float] = {}
    t = time.perf_counter()
    dev = device_fingerprint(compiled)
    if root is None:
        from aotx.engine import paths

        try:
            root = paths.cache_dir()
        except Exception:  # noqa: BLE001 - an unwritable data dir must not stop a load
            root = None
    costs, why = (load_stored(root, model_fp, dev) if (reuse and root is not None) else (None, "calibration forced"))
    reused = costs is not None and len(costs.cpu) == len(layers)
    if not reused:
        # the layers only: the decode step (the dense part) is timed in the second pass, after
        # placement, when the experts it routes to are in place (timed now, each first use
        # repacked an expert inside the timing: ~1.2 s per layer of the 30B-A3B shape, 2 cores)
        costs = calibrate(compiled, layers)
    stages["experts calibrate"] = round(time.perf_counter() - t, 4)
    t = time.perf_counter()
    # the layers the backend runs as a device step once every expert is on the GPU (none on the CPU)
    dev_layers = tuple(bool(x) for x in getattr(compiled, "moe_device_layers", ()))
    p1 = plan(layers, costs, gpu_bytes=gpu_bytes, host_bytes=host_bytes, policy=policy, device_layers=dev_layers)
    stages["experts plan"] = round(time.perf_counter() - t, 4)
    t = time.perf_counter()
    placed = compiled.place_experts(p1)
    stages["experts place"] = round(time.perf_counter() - t, 4)
    # second pass: the memory that actually exists, the CPU pool's costs after pinning
    t = time.perf_counter()
    got_gpu = int(placed.get("gpu_bytes", p1.gpu_bytes))
    got_host = placed.get("host_bytes")
    # (reused costs were stored by an earlier setup's second pass, i.e. measured after pinning
    # already: not timed again, as DESIGN.md's kernel choice reuses its artifact)
    need_dense = not costs.dense_decode_s
    re = calibrate(compiled, layers, model=model if need_dense else None, on_gpu=[t.count("gpu") for t in p1.tiers],
                   device_layers=dev_layers) \
        if ((placed.get("recalibrate", True) and not reused) or need_dense) else costs
    # a timing can only be slowed down by other work on the machine: per layer, the faster
    # of the two passes' lines (at the larger calibration row count) is the better estimate
    n = CALIBRATION_ROWS[-1]
    cpu = tuple(a if a(n) <= b(n) else b for a, b in zip(costs.cpu, re.cpu))
    g = costs if costs.gpu else re        # the GPU tier's lines and fixed part come from one calibration
    costs2 = Costs(cpu, g.gpu, g.copy, re.dense_decode_s or costs.dense_decode_s, dev,
                   costs.measured_s + re.measured_s, re.dense_prefill_s or costs.dense_prefill_s, g.gpu_fixed)
    p2 = plan(layers, costs2, gpu_bytes=got_gpu, host_bytes=host_bytes if got_host is None else int(got_host),
              policy=policy, device_layers=dev_layers)
    if p2.tiers != p1.tiers:
        placed = compiled.place_experts(p2)
    stages["experts replan"] = round(time.perf_counter() - t, 4)
    if root is not None:
        store(root, model_fp, dev, costs2, p2)
    # the learned cache (opt-in) starts from this plan's GPU experts; a backend without one
    # (the CPU's: no GPU tier) keeps the static placement
    cache: Any = ExpertCache(p2)
    attach = getattr(compiled, "attach_expert_cache", None)
    if attach is not None:
        if policy in LEARNED and p2.count("gpu"):
            cache = LearnedCache(p2.tiers, learned or LearnedPolicy(kind=policy))
            attach(cache)
        else:
            attach(None)
    return Setup(p2, costs2, stages, f"{p2.summary()}; calibration: {why}", placed, cache)
