"""Expert tiers: where each routed expert of a mixture-of-experts model lives, decided by measurement.

Owns:
* ``moe_layers(program)``: the moe nodes of a traced Program as ``MoeLayer`` facts (experts,
  experts per token, bytes per expert).
* the calibration (``calibrate``, ``gpu_split``, ``step_seconds``, ``device_fingerprint``):
  what the ``Costs`` measure on this machine, per moe layer: seconds for one expert's FFN
  on n rows on the CPU tier (the CPU expert pool; a share of a layer-shaped call) and on
  the GPU tier (its marginal cost: the GPU tier's call of a layer costs a fixed part, its
  launches, table upload, copy down and sync, once, plus each expert's), the GPU call's
  fixed seconds, and seconds to copy one expert from pinned host memory into the GPU
  cache; each per-expert cost a line a + b n fitted to timings at two row counts. Keyed
  by a device fingerprint; stored under the cache dir and reused when the fingerprint and
  ``PLAN_VERSION`` match (no re-timing: ``load_stored``, ``store``).
* ``setup(model, ...)``: the whole sequence at engine start: calibrate (or reuse), plan,
  place (the backend allocates the cache, pins host memory, pins the CPU pool and touches
  the pages), then a second pass against the memory that was actually obtained and the
  pool's costs after pinning, and place again if the plan changed. The stages and their
  seconds go to the startup profile, the plan's one-line summary to the notes.

The plan itself (``Plan``, ``plan``, ``Costs``, ``Line``, ``decode_layer_s``) lives in
expert_plan.py and the caches (``ExpertCache``, ``simulate``, ``LearnedPolicy``,
``rebalance``, ``LearnedCache``) in expert_cache.py; the names setup uses are importable
from here too. Leaves to the backends the measurements themselves and every copy and
kernel (``compiled.measure_experts``, ``compiled.place_experts``,
``compiled.expert_stats``: duck typed; the CPU backend has only the CPU tiers), to
admission the budget table.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aotx.engine.model.expert_cache import LEARNED, ExpertCache, LearnedCache, LearnedPolicy
from aotx.engine.model.expert_plan import Costs, Line, MoeLayer, Plan, decode_layer_s, plan

PLAN_VERSION = 2               # 2: Costs.gpu is the marginal cost beside gpu_fixed (1: one expert's call)
CALIBRATION_ROWS = (1, 16)     # each cost line is fitted to timings at these row counts


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


# ------------------------------------------------------------------ calibration

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
