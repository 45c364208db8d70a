"""Expert tiers (engine/model/experts.py): the placement from measured costs, the
GPU cache's policies replayed on routing traces, stored calibrations, admission's lines,
and the whole setup on a tiny MoE file on the CPU (every expert on the CPU tier).

The planner is device-independent: its GPU cases use costs written here (lines a + b n,
chosen so each answer can be worked out by hand in the test), the CPU case the costs this
machine measures.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from aotx.engine.errors import AdmissionError
from aotx.engine.model import expert_cache as XC
from aotx.engine.model import expert_plan as XP
from aotx.engine.model import experts as X
from aotx.engine.runtime import admission

EB = 1000                                  # bytes per expert in the synthetic layers


def layers(n_layers=2, n_expert=8, n_used=2):
    return [X.MoeLayer(i, n_expert, n_used, EB, 64, 128) for i in range(n_layers)]


def gpu_costs(n_layers=2, cpu=(1e-4, 1e-4), gpu=(2e-5, 1e-6), copy=1e-3):
    return X.Costs(tuple(X.Line(*cpu) for _ in range(n_layers)), tuple(X.Line(*gpu) for _ in range(n_layers)),
                   tuple(copy for _ in range(n_layers)), dense_decode_s=1e-3, device="test")


def test_without_a_gpu_every_expert_is_on_the_cpu_tier_host_first_then_the_file():
    L = layers()
    c = X.Costs(tuple(X.Line(1e-4, 1e-4) for _ in L))
    p = X.plan(L, c)
    assert p.count("host") == 16 and p.count("gpu") == 0 and p.copy_min_rows == 0
    assert "no GPU" in p.reason
    p = X.plan(L, c, host_bytes=5 * EB + 10)          # pinned host memory for five experts
    assert p.count("host") == 5 and p.count("mmap") == 11 and p.host_bytes == 5 * EB and p.mmap_bytes == 11 * EB


def test_a_gpu_budget_for_part_of_the_experts_is_shared_evenly_over_layers():
    L = layers()
    p = X.plan(L, gpu_costs(), gpu_bytes=6 * EB + 999)
    assert p.count("gpu") == 6 and p.gpu_bytes == 6 * EB
    assert [t.count("gpu") for t in p.tiers] == [3, 3]           # uniform traffic: the cache split evenly
    assert p.count("host") == 10
    # copy + GPU beats the CPU for one expert from n rows: 1e-3 + 2e-5 + 1e-6 n < 1e-4 + 1e-4 n -> n >= 10
    assert p.copy_min_rows == 10
    assert "part of the experts" in p.reason
    lines = admission.check_experts(p, 16 * EB, 64 << 30, gpu=True)
    assert "6 gpu (38%)" in lines[0] and "10 host" in lines[0]
    assert "only with 10 of its 16 experts on the CPU" in lines[1] and "tokens/s decode" in lines[1]


def test_no_gpu_room_says_the_cpu_tier_computes_every_expert_and_how_to_change_it():
    """Regression: with no GPU room for experts the line said the CUDA backend had "no GPU
    expert cache yet", after the GPU tier existed (the H200 MoE benchmark's admission)."""
    p = X.plan(layers(), gpu_costs(), gpu_bytes=0)
    assert p.count("gpu") == 0
    lines = admission.check_experts(p, 16 * EB, 64 << 30, gpu=True)
    assert "yet" not in lines[1]
    assert "the CPU tier computes all 16 of them" in lines[1] and "--memory-budget" in lines[1]
    assert "tokens/s decode" in lines[1]


def test_everything_fits_the_gpu_cache():
    p = X.plan(layers(), gpu_costs(), gpu_bytes=100 * EB)
    assert p.count("gpu") == 16 and p.copy_min_rows == 0 and p.reason == "every expert fits the GPU cache"
    assert len(admission.check_experts(p, 16 * EB, 64 << 30, gpu=True)) == 1


def test_traffic_puts_the_hot_experts_on_the_gpu():
    L = layers(1)
    share = [[0.02] * 8]
    share[0][5], share[0][2] = 0.5, 0.38
    p = X.plan(L, gpu_costs(1), gpu_bytes=2 * EB, traffic=share)
    assert [e for e, t in enumerate(p.tiers[0]) if t == "gpu"] == [2, 5]


def test_modeled_speeds_follow_the_costs():
    # one layer, no GPU: decode = dense + n_used * cpu(1) = 1e-3 + 2 * 2e-4
    L = layers(1)
    c = X.Costs((X.Line(1e-4, 1e-4),), dense_decode_s=1e-3)
    p = X.plan(L, c)
    assert p.decode_tok_s == pytest.approx(1 / 1.4e-3, rel=1e-2)
    # prefill 512 tokens: 8 experts x cpu(128 rows) = 8 x (1e-4 + 1.28e-2)
    assert p.prefill_tok_s == pytest.approx(512 / (8 * (1e-4 + 128e-4)), rel=1e-2)


def test_gpu_split_takes_the_calls_fixed_part_once_and_each_experts_share():
    """The GPU tier's calibration times one expert's call (1 row) and a layer-shaped call of k
    experts (1 and 16 rows): call = fixed + experts x (a + b n). Here fixed 40 us, a 2 us,
    b 0.5 us, k 4: one = 42.5 us, layer(1) = 50 us, layer(16) = 40 + 4 x 10 = 80 us."""
    fixed, line = X.gpu_split(42.5e-6, {1: 50e-6, 16: 80e-6}, 4, (1, 16))
    assert fixed == pytest.approx(40e-6) and line.a == pytest.approx(2e-6) and line.b == pytest.approx(0.5e-6)
    # noise making k experts' call no slower than one expert's: no marginal cost at 1 row, all fixed;
    # 10 us per expert at 16 rows ((90 - 50) / 4), the line through (1, 0) and (16, 10 us) with a >= 0
    fixed, line = X.gpu_split(50e-6, {1: 49e-6, 16: 90e-6}, 4, (1, 16))
    assert fixed == pytest.approx(50e-6) and line.a == 0.0 and line.b == pytest.approx(10e-6 / 15)
    # one expert per token and one expert in all: nothing separable, the call is the expert's
    fixed, line = X.gpu_split(30e-6, {1: 30e-6, 16: 45e-6}, 1, (1, 16))
    assert fixed == 0.0 and line(1) == pytest.approx(30e-6) and line(16) == pytest.approx(45e-6)


def test_bug_decode_speed_counts_the_gpu_tiers_fixed_cost_once_per_layer():
    """Regression: the GPU tier was priced per expert from one expert's call, so
    its fixed cost (launches, table upload, copy down, sync: one per layer call, for all its
    experts) was counted n_used times, and a layer with a few experts on the GPU paid a
    fraction of it, though any row there pays all of it. One layer, 8 experts, 2 per token,
    CPU 2e-4 s per expert, GPU 1e-5 s per expert, fixed 5e-5 s, dense 1e-3 s."""
    L = layers(1)
    c = X.Costs((X.Line(1e-4, 1e-4),), (X.Line(1e-5, 0.0),), (1e-3,), dense_decode_s=1e-3, gpu_fixed=(5e-5,))
    # all on the GPU: fixed once + 2 x 1e-5 = 7e-5 (per expert from one call: 2 x 6e-5 = 1.2e-4, 893 tok/s)
    p = X.plan(L, c, gpu_bytes=8 * EB)
    assert p.count("gpu") == 8 and p.decode_tok_s == pytest.approx(1 / 1.07e-3, rel=1e-3)
    # prefill 512: 128 rows per expert, all 8 in one GPU call: fixed + 8 x 1e-5
    assert p.prefill_tok_s == pytest.approx(512 / (5e-5 + 8e-5), rel=1e-3)
    # half on the GPU: j of the token's 2 experts there, P(j) 1/4, 1/2, 1/4: max(CPU, GPU) =
    # 4e-4, max(2e-4, 6e-5), 7e-5 -> 2.175e-4 (the old max(2 x 1/2 x 2e-4, 2 x 1/2 x 6e-5) = 2e-4)
    p = X.plan(L, c, gpu_bytes=4 * EB)
    assert p.count("gpu") == 4 and p.decode_tok_s == pytest.approx(1 / 1.2175e-3, rel=1e-3)
    # two experts there, fixed 3e-4 (more than one CPU expert): P(j) 9/16, 6/16, 1/16 of 4e-4,
    # max(2e-4, 3.1e-4), 3.2e-4 -> 3.6125e-4 (the old max(2 x 3/4 x 2e-4, 2 x 1/4 x 3.1e-4) said 3e-4)
    c = X.Costs((X.Line(1e-4, 1e-4),), (X.Line(1e-5, 0.0),), (1e-3,), dense_decode_s=1e-3, gpu_fixed=(3e-4,))
    p = X.plan(L, c, gpu_bytes=2 * EB)
    assert p.count("gpu") == 2 and p.decode_tok_s == pytest.approx(1 / 1.36125e-3, rel=1e-3)
    assert X.decode_layer_s(2, 0.25, 2e-4, 3e-4, 1e-5) == pytest.approx(3.6125e-4)
    assert X.decode_layer_s(2, 0.0, 2e-4, 3e-4, 1e-5) == pytest.approx(4e-4)        # no GPU call at all
    assert X.decode_layer_s(2, 1.0, 2e-4, 3e-4, 1e-5) == pytest.approx(3.2e-4)      # no CPU call at all


def test_bug_a_layer_whose_gpu_call_is_mostly_fixed_cost_gets_its_share_of_the_cache():
    """Regression: priced by one expert's call, layer 1 (fixed 1.9e-4 s, 1e-6 s per
    expert) looked no faster than its CPU (2e-4 s per expert) and layer 0 (no fixed cost, 1.5e-4
    s per expert) took the whole budget: 8 experts there, a modeled 7e-4 s of expert work per
    token. With the fixed part paid once, the best split of 8 experts (every split tried) is
    3 + 5, 5.17e-4 s; the plan finds it, and beyond the decode saving it fills the rest."""
    L = layers(2)
    c = X.Costs((X.Line(1e-4, 1e-4),) * 2, (X.Line(1.5e-4, 0.0), X.Line(1e-6, 0.0)), (1e-3, 1e-3),
                dense_decode_s=1e-3, gpu_fixed=(0.0, 1.9e-4))

    def secs(g0, g1):
        return (X.decode_layer_s(2, g0 / 8, 2e-4, 0.0, 1.5e-4) + X.decode_layer_s(2, g1 / 8, 2e-4, 1.9e-4, 1e-6))

    best = min(range(9), key=lambda g0: secs(g0, 8 - g0))
    assert (best, 8 - best) == (3, 5) and secs(3, 5) == pytest.approx(5.171875e-4) and secs(8, 0) == pytest.approx(7e-4)
    p = X.plan(L, c, gpu_bytes=8 * EB)
    assert [t.count("gpu") for t in p.tiers] == [3, 5]
    assert p.decode_tok_s == pytest.approx(1 / (1e-3 + 5.171875e-4), rel=1e-3)
    p = X.plan(L, c, gpu_bytes=16 * EB)
    assert p.count("gpu") == 16 and p.reason == "every expert fits the GPU cache"


def test_simulate_pays_the_gpu_fixed_cost_once_per_layer_call_with_gpu_rows():
    L = layers(1)
    c = X.Costs((X.Line(1e-4, 1e-4),), (X.Line(1e-5, 1e-6),), (1e-3,), gpu_fixed=(5e-5,))
    p = X.Plan((("gpu", "gpu", "gpu", "gpu", "host", "host", "host", "host"),))
    # step 1: experts 0 and 1 (GPU), 3 rows each: 5e-5 + 2 x (1e-5 + 3e-6) = 7.6e-5; CPU nothing
    # step 2: experts 0 (GPU, 1 row) and 5 (CPU, 1 row): max(2e-4, 5e-5 + 1.1e-5) = 2e-4
    # step 3: expert 6 only (CPU, 2 rows): 3e-4, no GPU call
    trace = [[np.array([[0, 1]] * 3)], [np.array([[0, 5]])], [np.array([[6, 6]])]]
    assert XC.simulate(trace, p, L, c)["modeled_s"] == pytest.approx(7.6e-5 + 2e-4 + 3e-4, abs=1e-9)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="expert cache policy 'mru'"):
        X.plan(layers(), gpu_costs(), policy="mru")


def _zipf_trace(n_steps=200, n_expert=8, k=2, hot=(6, 7), seed=0):
    """Per forward (decode, one row): one layer's (1, k) experts, mostly the ``hot`` ones."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_steps):
        if rng.random() < 0.9:
            sel = np.array(hot[:k])
        else:
            sel = rng.choice(n_expert, k, replace=False)
        out.append([sel.reshape(1, k)])
    return out


def test_learned_cache_beats_a_static_plan_that_guessed_wrong():
    L = layers(1)
    costs = gpu_costs(1)
    p = X.plan(L, costs, gpu_bytes=2 * EB)                 # uniform guess: experts 0 and 1
    assert [e for e, t in enumerate(p.tiers[0]) if t == "gpu"] == [0, 1]
    trace = _zipf_trace()
    static = XC.simulate(trace, p, L, costs)
    assert static["copies"] == 0 and static["hit_rate"] < 0.2
    learned_s = []
    for policy in ("lfu", "lru"):
        got = XC.simulate(trace, X.plan(L, costs, gpu_bytes=2 * EB, policy=policy), L, costs, policy=policy)
        assert got["hit_rate"] > 0.8 and got["copies"] >= 2, (policy, got)
        assert got["modeled_s"] < static["modeled_s"], (policy, got, static)
        learned_s.append(got["modeled_s"])
    # the static plan made from the learned traffic (counters of an earlier run) is the best of all
    counts = np.bincount(np.concatenate([s[0].reshape(-1) for s in trace]), minlength=8)
    learned = X.plan(L, costs, gpu_bytes=2 * EB, traffic=[list(counts / counts.sum())])
    best = XC.simulate(trace, learned, L, costs)
    assert best["hit_rate"] > 0.85 and best["copies"] == 0 and best["modeled_s"] < min(learned_s)


def test_lru_evicts_the_least_recently_used_resident():
    p = X.Plan((("gpu", "gpu", "host", "host"),), policy="lru", copy_min_rows=4)
    cache = X.ExpertCache(p)
    assert cache.route(0, {0: 1, 2: 3}) == []              # 3 rows < copy_min_rows: computed on the CPU
    assert cache.route(0, {2: 4}) == [(2, 1)]              # expert 1 was used least recently
    assert cache.resident(0) == {0, 2}
    assert cache.route(0, {3: 9}) == [(3, 0)]
    assert (cache.hits, cache.misses, cache.copies) == (1 + 4 + 9, 3, 2)
    static = X.ExpertCache(X.Plan(p.tiers, policy="static", copy_min_rows=4))
    assert static.route(0, {3: 100}) == [] and static.resident(0) == {0, 1}


def test_stored_calibration_is_reused_only_on_the_same_device(tmp_path):
    c = gpu_costs()
    p = X.plan(layers(), c, gpu_bytes=4 * EB)
    X.store(tmp_path, "model1", "dev1", c, p)
    got, why = X.load_stored(tmp_path, "model1", "dev1")
    assert why == "stored calibration reused" and got.cpu == c.cpu and got.gpu == c.gpu and got.copy == c.copy
    assert got.gpu_fixed == c.gpu_fixed
    fixed = X.Costs(c.cpu, c.gpu, c.copy, dense_decode_s=1e-3, device="test", gpu_fixed=(4e-5, 5e-5))
    X.store(tmp_path, "model2", "dev1", fixed, p)
    assert X.load_stored(tmp_path, "model2", "dev1")[0].gpu_fixed == (4e-5, 5e-5)
    # a calibration stored before the GPU tier's fixed cost was measured (version 1: its GPU lines are one
    # expert's call, the fixed cost inside) is measured again, not read as marginal costs
    f = tmp_path / "expert_plans" / "model2-dev1.json"
    d = json.loads(f.read_text())
    assert d["version"] == X.PLAN_VERSION == 2
    d["version"] = 1
    del d["costs"]["gpu_fixed"]
    f.write_text(json.dumps(d))
    assert X.load_stored(tmp_path, "model2", "dev1") == (None, "stored calibration is for another device or version; "
                                                                "measured again")
    assert X.load_stored(tmp_path, "model1", "dev2") == (None, "no stored calibration for this device")
    f = tmp_path / "expert_plans" / "model1-dev1.json"
    d = json.loads(f.read_text())
    assert X.Plan.from_dict(d["plan"]) == p
    d["device"] = "other"
    f.write_text(json.dumps(d))
    assert X.load_stored(tmp_path, "model1", "dev1")[0] is None
    f.write_text("{not json")
    got, why = X.load_stored(tmp_path, "model1", "dev1")
    assert got is None and "unreadable" in why


def test_experts_that_fit_no_host_memory_are_refused_with_the_numbers():
    p = X.plan(layers(), gpu_costs(), gpu_bytes=2 * EB)
    with pytest.raises(AdmissionError, match="the experts do not fit") as e:
        admission.check_experts(p, 40 << 30, 16 << 30, gpu=True)
    assert "\n" not in str(e.value) and "16.0 GiB of RAM" in str(e.value)
    # on the CPU the experts are weights, which the budget table counts: no second refusal
    assert len(admission.check_experts(X.plan(layers(), X.Costs(gpu_costs().cpu)), 40 << 30, 16 << 30,
                                       gpu=False)) == 1


# ------------------------------------------------------------------ on a tiny file, CPU

def test_setup_on_a_tiny_moe_file_places_every_expert_on_the_cpu_tier(request, tmp_path):
    from aotx.engine.model.loader import load_model

    path = request.getfixturevalue("tiny_model_path")("qwen3moe")
    lm = load_model(path)
    m = lm.model
    L = X.moe_layers(m.program)
    assert [(x.n_expert, x.n_used) for x in L] == [(m.cfg.n_expert, m.cfg.n_expert_used)] * len(L)
    assert all(x.expert_bytes > 0 for x in L)
    st = X.setup(m, model_fp=lm.fingerprint, root=tmp_path)
    assert set(st.stages) == {"experts calibrate", "experts plan", "experts place", "experts replan"}
    assert st.plan.count("host") == st.plan.n_experts == sum(x.n_expert for x in L)
    assert all(line.b >= 0 and line(1) > 0 for line in st.costs.cpu) and not st.costs.has_gpu
    assert st.placed["gpu_bytes"] == 0 and st.placed["host_bytes"] > 0
    assert st.plan.decode_tok_s > 0 and "calibration: no stored calibration" in st.note
    again = X.setup(m, model_fp=lm.fingerprint, root=tmp_path)
    assert again.note.endswith("calibration: stored calibration reused")
    # the logits do not depend on the placement: host (materialized) against the file's map
    from aotx.engine.model.batch import Segment

    ids = np.array([1, 200, 3000, 42, 7], np.int32)
    kv = m.new_kv_cache(1, 8)
    a = m.forward(ids, [Segment(0, 0, 5, all_logits=True)], kv)
    fresh = load_model(path)
    kv = fresh.model.new_kv_cache(1, 8)
    b = fresh.model.forward(ids, [Segment(0, 0, 5, all_logits=True)], kv)
    assert np.array_equal(a, b)
    stats = m.compiled.expert_stats()
    assert len(stats["traffic"]) == len(L) and sum(stats["traffic"][0]) >= 5 * m.cfg.n_expert_used
    with pytest.raises(ValueError, match="tiers"):
        m.compiled.place_experts(X.Plan(tuple(("gpu",) * x.n_expert for x in L)))


def test_bug_the_dense_decode_step_is_timed_warm_on_one_repeated_token(monkeypatch):
    """Regression (a Qwen3-30B-A3B-shaped file): the calibration's decode step
    fed a new token each time, each routing to experts never used yet, whose first use
    (materializing them) then counted as the dense part: 0.107 s per token where 0.017 s ran,
    and the plan's speed was 7x low. Now one token at one position is repeated and only the
    runs after two warm ones are timed."""
    from types import SimpleNamespace

    calls = []
    slow_first = iter([5.0, 5.0] + [0.01] * 20 + [0.5] * 10)   # decode: two cold runs, then warm ones
    clock = [0.0]

    class Model:
        cfg = SimpleNamespace(vocab_size=1000)

        def new_kv_cache(self, slots, n):
            return object()

        def forward(self, toks, segs, kv):
            seg = segs[0]
            calls.append((tuple(int(t) for t in toks), seg.pos, seg.n))
            clock[0] += 0.02 if seg.n > 1 else next(slow_first)

    monkeypatch.setattr(X.time, "perf_counter", lambda: clock[0])
    dec, pre = X.step_seconds(Model(), reps=3)
    decode = [c for c in calls if c[2] == 1]
    assert len(decode) == 5 and len(set(decode)) == 1            # one token at one position, repeated
    assert dec == pytest.approx(0.01) and pre == pytest.approx(0.02)


def test_bug_the_decode_step_is_timed_after_placement_not_on_cold_experts(request, tmp_path, monkeypatch):
    """The first calibration timed the decode step before any expert was placed, so each
    expert it routed to was repacked inside the timing (on the 30B-A3B shape ~1.2 s per layer
    on 2 cores: about a minute of a 48-layer load). Now the layers are timed first and the
    step in the second pass, after placement, when every host expert is in place."""
    from aotx.engine.model.loader import load_model

    path = request.getfixturevalue("tiny_model_path")("qwen3moe")
    lm = load_model(path)
    m = lm.model
    seen = []
    real = X.step_seconds

    def spy(model, reps=3):
        seen.append(all(bool(n.attrs["gate"].ready.all()) for n in model.compiled.moe_nodes))
        return real(model, reps)

    monkeypatch.setattr(X, "step_seconds", spy)
    st = X.setup(m, model_fp=lm.fingerprint, root=tmp_path)
    assert seen == [True]                       # once, with every expert already placed
    assert st.costs.dense_decode_s > 0 and st.plan.decode_tok_s > 0
    again = X.setup(m, model_fp=lm.fingerprint, root=tmp_path)
    assert seen == [True] and again.costs.dense_decode_s == st.costs.dense_decode_s   # stored: not timed again


def test_bug_the_dense_part_timed_after_placement_subtracts_the_experts_as_placed(monkeypatch):
    """With the decode step timed after placement (above), the modeled expert work taken from
    it still priced every expert on the CPU; with part of them on a faster GPU tier the dense
    part came out too small (0 here), and the plan's predicted speed too high. Now the
    experts are priced as placed, as the plan prices them: its prediction at this placement
    is the step that ran."""
    layers = [X.MoeLayer(i, 8, 2, EB, 64, 128) for i in range(2)]

    class Compiled:
        def measure_experts(self, layer, rows):
            return {"cpu": {1: 1e-3, 16: 4e-3}, "copy": 1e-4, "gpu_one": 2e-4, "gpu_k": 2,
                    "gpu_layer": {1: 3e-4, 16: 6e-4}}

    monkeypatch.setattr(X, "device_fingerprint", lambda c: "dev")
    monkeypatch.setattr(X, "step_seconds", lambda model: (4.0e-3, 0.05))
    c = X.calibrate(Compiled(), layers, model=object(), on_gpu=[4, 4])
    fixed, g = X.gpu_split(2e-4, {1: 3e-4, 16: 6e-4}, 2, X.CALIBRATION_ROWS)
    per_layer = X.decode_layer_s(2, 0.5, 1e-3, fixed, g(1))
    assert c.dense_decode_s == pytest.approx(4.0e-3 - 2 * per_layer)
    assert c.dense_decode_s > 4.0e-3 - 2 * 2 * 1e-3          # more than the all-CPU pricing left
    dec, _ = XP._speeds(layers, c, [4, 4], 0)
    assert dec == pytest.approx(1 / 4.0e-3)                  # the plan predicts the step that ran
    cpu_only = X.calibrate(Compiled(), layers, model=object())
    assert cpu_only.dense_decode_s == pytest.approx(0.0)     # 4 ms less 2 layers x 2 experts x 1 ms


# ------------------------------------------------------------------ the learned cache the backend runs

def _on(n, *ids):
    m = np.zeros(n, bool)
    m[list(ids)] = True
    return m


# (name, scores per layer, residents per layer, max copies, margin, ratio, expected [(layer, in, out)])
REBALANCE_CASES = [
    ("the hottest outsider replaces the coldest resident",
     [[5, 0, 9, 1]], [_on(4, 0, 1)], 8, 0.0, 1.0, [(0, 2, 1)]),
    ("two swaps, best pairs first; the third outsider is colder than the last resident",
     [[0, 1, 9, 8, 2, 3]], [_on(6, 0, 1, 5)], 8, 0.0, 1.0, [(0, 2, 0), (0, 3, 1)]),
    ("nothing hotter outside: no copy", [[9, 8, 1, 0]], [_on(4, 0, 1)], 8, 0.0, 1.0, []),
    ("equal scores never churn", [[3, 3, 3, 3]], [_on(4, 0, 1)], 8, 0.0, 1.0, []),
    ("the margin holds back a small gain", [[4, 0, 4.5, 0]], [_on(4, 0, 1)], 8, 1.0, 1.0, [(0, 2, 1)]),
    ("... and the ratio a proportionally small one", [[10, 9, 12, 0]], [_on(4, 0, 1)], 8, 1.0, 1.5, []),
    ("ties: the lower outsider in, the higher resident out",
     [[0, 0, 5, 5]], [_on(4, 0, 1)], 1, 0.0, 1.0, [(0, 2, 1)]),
    ("the copy bound goes to the largest gains over all layers, each layer's a prefix",
     [[0, 0, 9, 8], [0, 1, 20, 2]], [_on(4, 0, 1), _on(4, 0, 1)], 2, 0.0, 1.0, [(1, 2, 0), (0, 2, 1)]),
    ("a copy bound of 0 copies nothing", [[0, 9]], [_on(2, 0)], 0, 0.0, 1.0, []),
    ("a layer all on the GPU, or with no slot, has nothing to swap",
     [[0, 9], [0, 9]], [_on(2, 0, 1), _on(2)], 8, 0.0, 1.0, []),
]


@pytest.mark.parametrize("name,scores,resident,copies,margin,ratio,want", REBALANCE_CASES,
                         ids=[c[0] for c in REBALANCE_CASES])
def test_rebalance_promotes_the_hottest_and_evicts_the_coldest(name, scores, resident, copies, margin, ratio, want):
    before = [r.copy() for r in resident]
    got = XC.rebalance([np.array(s, float) for s in scores], resident, copies, margin, ratio)
    assert got == want
    assert all(np.array_equal(a, b) for a, b in zip(before, resident)), "rebalance changed its input"


def _traffic_ticks(cache, ticks):
    """Feed cumulative counters built from per-tick rows {expert: rows}; the moves of each tick."""
    total = [np.zeros(r.shape[0], np.int64) for r in cache.resident]
    out = []
    for tick in ticks:
        for e, n in tick.items():
            total[0][e] += n
        out.append(cache.tick([t.copy() for t in total]))
    return out


def test_learned_cache_lfu_moves_toward_hot_experts_keeps_its_capacity_and_bounds_copies():
    tiers = (("gpu", "gpu", "gpu", "host", "host", "host", "host", "host"),)
    cache = X.LearnedCache(tiers, X.LearnedPolicy("lfu", decay=0.5, copies_per_tick=2, margin=1.0, ratio=1.5))
    assert cache.capacity == [3]
    moves = _traffic_ticks(cache, [{}] + [{5: 4, 6: 4, 7: 4, 0: 1}] * 3)
    assert moves[0] == [] and moves[1] == [(0, 5, 2), (0, 6, 1)]   # 2 copies at most; the unused go first
    assert moves[2] == [(0, 7, 0)]                                 # expert 0 (1 row a tick) makes room
    assert moves[3] == []
    assert cache.resident[0].tolist() == [False] * 5 + [True] * 3 and int(cache.resident[0].sum()) == 3
    assert cache.copies == 3 and cache.stats()["ticks"] == 4
    # hits/misses count the residents at the time the rows ran
    assert (cache.hits, cache.misses) == (1 + 9 + 12, 12 + 4 + 1)
    # the burst fades: other experts hot now take the slots back, within the bound again
    moves = _traffic_ticks(cache, [{}] + [{0: 8, 1: 8}] * 4)
    assert [m for m in moves if m] and all(len(m) <= 2 for m in moves)
    assert cache.resident[0][[0, 1]].all() and int(cache.resident[0].sum()) == 3


def test_learned_cache_lru_takes_the_most_recently_used():
    tiers = (("gpu", "gpu", "host", "host"),)
    cache = X.LearnedCache(tiers, X.LearnedPolicy("lru", copies_per_tick=4))
    moves = _traffic_ticks(cache, [{}, {0: 1, 2: 1}, {2: 1, 3: 1}])
    assert moves == [[], [(0, 2, 1)], [(0, 3, 0)]]
    assert cache.resident[0].tolist() == [False, False, True, True]


def test_learned_policy_refuses_bad_values():
    with pytest.raises(ValueError, match="'mru'"):
        X.LearnedPolicy("mru")
    with pytest.raises(ValueError, match="decay"):
        X.LearnedPolicy("lfu", decay=1.5)


def test_a_reused_calibration_is_not_timed_again_in_the_second_pass(request, tmp_path, monkeypatch):
    """The MoE benchmark sets the experts up three times in one process (every expert on the
    CPU, 40% on the GPU, all on the GPU); with the stored costs reused, the second pass
    re-timed every layer each time (48 layers of the 30B-A3B shape: tens of seconds of a
    10-minute device call). Stored costs come from an earlier second pass: reused as they are."""
    from aotx.engine.model.loader import load_model

    lm = load_model(request.getfixturevalue("tiny_model_path")("qwen3moe"))
    calls = []
    real = X.calibrate

    def spy(*a, **kw):
        calls.append(kw.get("model") is not None)
        return real(*a, **kw)

    monkeypatch.setattr(X, "calibrate", spy)
    X.setup(lm.model, model_fp=lm.fingerprint, root=tmp_path)
    assert calls == [False, True]                # the layers, then the second pass with the step
    again = X.setup(lm.model, model_fp=lm.fingerprint, root=tmp_path)
    assert calls == [False, True] and again.note.endswith("stored calibration reused")
    X.setup(lm.model, model_fp=lm.fingerprint, root=tmp_path, reuse=False)
    assert calls == [False, True, False, True]


def _fixed_costs(n_layers=4):
    """gpu_costs with the GPU tier's call costing 5e-5 s fixed per layer."""
    c = gpu_costs(n_layers)
    return X.Costs(c.cpu, c.gpu, c.copy, c.dense_decode_s, c.device, gpu_fixed=(5e-5,) * n_layers)


def test_whole_layers_go_on_the_gpu_where_the_backend_runs_them_as_device_steps():
    """Measured (H100, 30B-A3B shape: 40% of the experts spread over every layer decoded at 13.5
    tok/s, slower than every expert on the CPU, 15.5; a layer with every expert on the GPU runs
    as the CUDA backend's device step, with no host round trip). 4 layers of 8 experts, 2 per
    token, CPU 2e-4 s and GPU 2.1e-5 s per expert at 1 row, fixed 5e-5, dense 1e-3; room for 16
    experts. Spread: 4 per layer, each layer 1/4 x 4e-4 + 1/2 x 2e-4 + 1/4 x (5e-5 + 4.2e-5) =
    2.23e-4 s, 528.5 tok/s; whole layers: 2 x 4.2e-5 (device steps, no fixed cost) + 2 x 4e-4,
    530.8 tok/s: two whole layers."""
    L = layers(4)
    p = X.plan(L, _fixed_costs(), gpu_bytes=16 * EB, device_layers=(True,) * 4)
    assert [t.count("gpu") for t in p.tiers] == [8, 8, 0, 0]
    assert p.decode_tok_s == pytest.approx(1 / (1e-3 + 2 * 4.2e-5 + 2 * 4e-4), rel=1e-3)
    assert "2 whole layers on the GPU" in p.reason and "530.8 tok/s against 528.5" in p.reason
    # a backend without the device step (the model as before): the budget spread evenly
    p = X.plan(L, _fixed_costs(), gpu_bytes=16 * EB)
    assert [t.count("gpu") for t in p.tiers] == [4, 4, 4, 4] and "whole" not in p.reason
    # only layers 1 and 3 can run as device steps: those two are the whole ones
    p = X.plan(L, _fixed_costs(), gpu_bytes=16 * EB, device_layers=(False, True, False, True))
    assert [t.count("gpu") for t in p.tiers] == [0, 8, 0, 8]
    # room for 20: two whole layers, the 4 left spread over the other two
    p = X.plan(L, _fixed_costs(), gpu_bytes=20 * EB, device_layers=(True,) * 4)
    assert [t.count("gpu") for t in p.tiers] == [8, 8, 2, 2] and p.count("host") == 12


def test_whole_layers_keep_the_hot_experts_of_the_other_layers_on_the_gpu():
    """Skewed traffic (two experts of each layer take 90% of its rows): two whole layers would
    leave layers 2 and 3's hot experts on the CPU (modeled 531 tok/s); the plan scores every
    count of whole layers and takes one, with every other layer's hot experts on the GPU too
    (726 tok/s against 701 for the budget spread)."""
    L = layers(4)
    share = [[0.45, 0.45] + [0.1 / 6] * 6 for _ in L]
    p = X.plan(L, _fixed_costs(), gpu_bytes=16 * EB, device_layers=(True,) * 4, traffic=share)
    assert [t.count("gpu") for t in p.tiers] == [8, 3, 3, 2]
    assert all(t[0] == "gpu" and t[1] == "gpu" for t in p.tiers)
    assert "1 whole layer on the GPU" in p.reason and "725.8 tok/s against 700.7" in p.reason


def test_a_layer_a_whole_gpu_copy_does_not_speed_up_stays_spread_and_sets_no_copy_threshold():
    """Regressions from a review: a device-capable layer whose GPU is slower than its CPU was
    taken whole while it fit (its modeled saving negative), and a whole layer's copy cost set
    copy_min_rows for every layer, though a whole layer copies nothing."""
    L = layers(3)
    slow = X.Costs((X.Line(1e-4, 1e-4),) * 3, (X.Line(2e-5, 1e-6), X.Line(2e-5, 1e-6), X.Line(5e-4, 1e-6)),
                   (1e-3, 1e-3, 1e-3), dense_decode_s=1e-3, device="test", gpu_fixed=(5e-5,) * 3)
    p = X.plan(L, slow, gpu_bytes=12 * EB, device_layers=(True,) * 3)
    assert p.tiers[2].count("gpu") < 8 and p.tiers[0].count("gpu") == 8, [t.count("gpu") for t in p.tiers]
    c = _fixed_costs()
    c = X.Costs(c.cpu, c.gpu, (1.0,) + c.copy[1:], c.dense_decode_s, c.device, gpu_fixed=c.gpu_fixed)
    p = X.plan(layers(4), c, gpu_bytes=16 * EB, device_layers=(True,) * 4)
    assert p.tiers[0].count("gpu") == 8 and p.copy_min_rows == 10          # layer 0's copy cost: not counted


def test_a_device_step_layer_with_every_expert_on_the_gpu_pays_no_fixed_cost():
    p = X.plan(layers(4), _fixed_costs(), gpu_bytes=32 * EB, device_layers=(True,) * 4)
    assert p.count("gpu") == 32 and p.decode_tok_s == pytest.approx(1 / (1e-3 + 4 * 4.2e-5), rel=1e-3)
    p = X.plan(layers(4), _fixed_costs(), gpu_bytes=32 * EB)              # the host step: fixed once per layer
    assert p.decode_tok_s == pytest.approx(1 / (1e-3 + 4 * (5e-5 + 4.2e-5)), rel=1e-3)
