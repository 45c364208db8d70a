"""The CUDA backend's mixture-of-experts path on the CPU against fake CuPy (issue 22):
``python -m tests.tools.gpu_dryrun_moe``.

Like ``tests/tools/gpu_dryrun.py`` (every launch checked by ``gpu_fake_cupy``; kernels do
not run, so the device numbers are garbage), on tiny qwen3moe, olmoe and gpt-oss files with
head dimension 32 (the CUDA attention kernel's smallest): the plan's host moe steps, every
forward on the eager path (no graph capture), the host step's rows through the pinned
staging rows (moe_rows gets the device input; the device output is what it returned), back in the device
buffer with the shape of the op's output (compared against ``cpu_moe.moe_rows`` run on the
same host rows), device sampling, the GPU expert tier's launches under each placement
(all on the GPU, mixed, all on the CPU), the tier's grouped launches against its per-expert
ones with the tier's kernels emulated in numpy (the same values; the float64 reference's
within rounding), and the expert-tier setup (calibrate with GPU
timings, plan, place: everything on the GPU under a large budget, a mix under 40%) on
the CUDA program, and the learned GPU expert cache (lfu) under skewed routing. Prints one line per scenario and ``moe dry run OK`` last; exit code 1 on the
first failure. Run in a subprocess by tests/test_cuda_moe.py.
"""

from __future__ import annotations

import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np

VOCAB = 512


def _toy_tokenizer(tm):
    from gguf import GGUFValueType as V

    toks = tuple(f"t{i}" for i in range(VOCAB))
    kv = (("tokenizer.ggml.model", "gpt2", V.STRING), ("tokenizer.ggml.tokens", toks, V.ARRAY),
          ("tokenizer.ggml.token_type", tuple([1] * VOCAB), V.ARRAY))
    return tm.common.Tokenizer(kv, VOCAB)


def _build(path, **kw):
    from aotx.engine.backend.cuda.backend import CudaBackend
    from aotx.engine.model.architectures import build
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    return build(cfg, gf, CudaBackend(**kw))


def _exercise_segmented(model, fake) -> str:
    """``CudaBackend(moe_graphs=True)``: the same batches as ``_exercise``, the ones that fit a
    graph bucket as graphs cut at the host moe steps (``moe.Segments``): captured once per
    bucket, replayed with the host steps between the graphs on the real rows only (a
    3-row decode in the 4-row bucket: 3 rows to the host; the last layer's FFN on the
    logits rows; the plain run before a capture skips them), each host step's rows and
    "small" flags as on the eager path, traffic
    counted per real row; every expert on the GPU: one graph, no host step."""
    from aotx.engine.backend.cuda import moe as CM
    from aotx.engine.model import experts as X
    from aotx.engine.model.batch import Segment

    c = model.compiled
    L = model.cfg.n_layers
    k = model.cfg.n_expert_used
    rng = np.random.default_rng(0)
    toks = rng.integers(0, VOCAB, 200).astype(np.int32)
    kv = model.new_kv_cache(3, 256)
    seen = []
    real = c.moe_steps[0]._moe_rows

    def spy(attrs, x, pool, traffic=None, small=None, gpu=None, worker=None):
        y = real(attrs, x, pool, traffic, small, gpu, worker)
        seen.append((x.shape[0], None if small is None else small.tolist()))
        return y

    for s in c.moe_steps:
        s._moe_rows = spy
    try:
        t0 = sum(c.expert_stats()["traffic"][0])
        model.forward(toks[:150], [Segment(0, 0, 150)], kv)                      # past the largest bucket: eager
        cap = fake.stats["captures"]
        model.forward(toks[:2], [Segment(0, 150, 1), Segment(1, 0, 1)], kv)
        assert fake.stats["captures"] == cap + L + 1, (fake.stats["captures"] - cap, "graphs for", L, "host steps")
        g = next(iter(c._state(kv).graphs.values()))
        assert isinstance(g, CM.Segments) and len(g.graphs) == L + 1 and len(g.hosts) == L
        model.forward(toks[:2], [Segment(0, 151, 1), Segment(1, 1, 1)], kv)      # replayed, not captured again
        assert fake.stats["captures"] == cap + L + 1
        ids = model.sample(toks[:3], [Segment(0, 152, 1), Segment(1, 2, 1), Segment(2, 0, 1)], kv, None)
        assert ids.shape == (3,)
        model.forward(toks[:20], [Segment(1, 3, 1), Segment(2, 1, 19)], kv)      # a decode row + a 19-row chunk
        rows = [n for n, _ in seen]          # the last layer's FFN: on the logits rows only
        want = [150] * (L - 1) + [1] + [2] * (2 * L) + [3] * L + [20] * (L - 1) + [2]
        assert rows == want, rows            # the plain run before each capture skips the host steps
        assert seen[4 * L][1] == [True] + [False] * 19 and seen[5 * L - 1][1] is None, seen[4 * L]
        got = sum(c.expert_stats()["traffic"][0]) - t0
        assert got == (150 + 2 + 2 + 3 + 20) * k, (got, "pairs: padding rows counted?")
    finally:
        for s in c.moe_steps:
            s._moe_rows = real
    # every expert on the GPU: no host step, one graph per bucket
    c.place_experts(X.Plan(_tiers(model, "gpu")))
    cap = fake.stats["captures"]
    model.forward(toks[:2], [Segment(0, 172, 1), Segment(1, 23, 1)], kv)
    g = next(iter(c._state(kv).graphs.values()))
    assert fake.stats["captures"] == cap + 1 and not isinstance(g, CM.Segments)
    c.place_experts(X.Plan(_tiers(model, "cpu")))
    return f"segmented graphs: {L + 1} per bucket around {L} host steps, host rows {sorted(set(rows))}"


def _exercise(model, fake) -> None:
    from aotx.engine.backend.cpu import experts as cpu_moe
    from aotx.engine.model.batch import Segment

    c = model.compiled
    L = model.cfg.n_layers
    assert len(c.moe_steps) == L, f"{len(c.moe_steps)} host moe steps for {L} layers"
    rng = np.random.default_rng(0)
    toks = rng.integers(0, VOCAB, 200).astype(np.int32)
    kv = model.new_kv_cache(3, 256)
    captures = fake.stats["captures"]
    seen = []
    real = c.moe_steps[0]._moe_rows

    def spy(attrs, x, pool, traffic=None, small=None, gpu=None, worker=None):
        y = real(attrs, x, pool, traffic, small, gpu, worker)
        seen.append((x.copy(), y, small))
        return y

    for s in c.moe_steps:
        s._moe_rows = spy
    out = model.forward(toks[:150], [Segment(0, 0, 150, all_logits=True)], kv)
    assert out.shape == (150, VOCAB), out.shape
    out = model.forward(toks[:2], [Segment(0, 150, 1), Segment(1, 0, 1)], kv)       # decode: still eager
    assert out.shape == (2, VOCAB), out.shape
    ids = model.sample(toks[:3], [Segment(0, 151, 1), Segment(1, 1, 1), Segment(2, 0, 1)], kv, None)
    assert ids.shape == (3,), ids.shape
    assert fake.stats["captures"] == captures, "a program with host moe steps captured a CUDA graph"
    assert len(seen) == 3 * L, f"{len(seen)} host moe calls, expected {3 * L}"
    assert seen[0][2] is not None and not seen[0][2].any()        # one long segment: the prefill path
    assert all(s is None for _, _, s in seen[L:])                  # decode rows: the per-row kernels
    mixed = model.forward(toks[:20], [Segment(1, 1, 1), Segment(2, 0, 19)], kv)    # a decode row + a long prefill
    assert mixed.shape == (2, VOCAB)
    # layers before the last see all 20 rows; the last layer's FFN runs on the 2 logits rows only
    small = seen[-2][2]
    assert small is not None and small.tolist() == [True] + [False] * 19, small
    assert seen[-1][2] is None and seen[-1][0].shape[0] == 2
    x, y, _ = seen[-(L + 1)]
    assert x.shape == (3, model.cfg.d_model) and y.shape == (3, model.cfg.d_model)
    st = c.moe_steps[-1]
    want = cpu_moe.moe_rows(st.attrs, x, st.pool)
    assert np.array_equal(np.nan_to_num(want), np.nan_to_num(y)), "the host step's rows differ from moe_rows"
    stats = c.expert_stats()
    assert sum(stats["traffic"][0]) == (150 + 2 + 3 + 20) * model.cfg.n_expert_used, stats["traffic"][0]
    for s in c.moe_steps:
        s._moe_rows = real


def _tiers(model, placement: str):
    """A placement's tiers per moe layer: "gpu" (all), "cpu" (all host) or "mixed" (layer 0
    all on the GPU, the others every other expert, starting with the GPU)."""
    from aotx.engine.model import experts as X

    out = []
    for L in X.moe_layers(model.program):
        if placement == "gpu":
            t = ["gpu"] * L.n_expert
        elif placement == "cpu":
            t = ["host"] * L.n_expert
        else:
            t = ["gpu"] * L.n_expert if L.index == 0 else ["gpu" if e % 2 == 0 else "host" for e in range(L.n_expert)]
        out.append(tuple(t))
    return tuple(out)


def _placements(model) -> str:
    """The GPU expert tier's host code: each placement applied, then a prefill, a decode
    step and a mixed batch (launches checked; the numbers are garbage): on the eager path
    with host moe steps, and with every expert on the GPU as device steps, the decode
    step captured in a graph."""
    from aotx.engine.model import experts as X
    from aotx.engine.model.batch import Segment

    c = model.compiled
    rng = np.random.default_rng(1)
    toks = rng.integers(0, VOCAB, 40).astype(np.int32)
    done = []
    for placement in ("gpu", "mixed", "cpu"):
        tiers = _tiers(model, placement)
        placed = c.place_experts(X.Plan(tiers))
        n_gpu = sum(t.count("gpu") for t in tiers)
        want = sum(sum(int(a[k].raw(e).nbytes) for k in ("gate", "up", "down"))
                   + sum(a[k].shape[1] * 4 for k in ("gate_bias", "up_bias", "down_bias") if a.get(k) is not None)
                   for a, t in zip((s.attrs for s in c.moe_steps), tiers) for e, tt in enumerate(t) if tt == "gpu")
        assert placed["gpu_bytes"] == want, (placement, placed, want)
        before = list(c.expert_stats()["gpu_rows"])
        kv = model.new_kv_cache(2, 64)
        assert model.forward(toks[:30], [Segment(0, 0, 30)], kv).shape == (1, VOCAB)
        assert model.forward(toks[:2], [Segment(0, 30, 1), Segment(1, 0, 1)], kv).shape == (2, VOCAB)
        assert model.forward(toks[:20], [Segment(0, 31, 1), Segment(1, 1, 19)], kv).shape == (2, VOCAB)
        got = [a - b for a, b in zip(c.expert_stats()["gpu_rows"], before)]
        ready = [st.device_ready() for st in c.moe_steps]
        want_ready = [placement == "gpu" or (placement == "mixed" and i == 0) for i in range(len(ready))]
        assert ready == want_ready, (placement, ready)   # "mixed": layer 0 has every expert on the GPU
        if n_gpu == 0:
            assert sum(got) == 0, got
        else:
            assert all(g > 0 for g in got), (placement, got)
        done.append(f"{placement} {n_gpu} on gpu, {sum(got)} gpu pairs")
    return "; ".join(done)


def _staging(model) -> str:
    """The host step's copies through the program's pinned rows: the rows ``moe_rows`` gets
    are the step's device input (a view of a wider buffer), and the device output holds
    exactly what it returned, through a prefill, a decode batch and a mixed batch."""
    from aotx.engine.model.batch import Segment

    c = model.compiled
    n_checked = 0

    def wrap(st):
        orig_eager, real = st.eager, st._moe_rows

        def eager(prog, ctx):
            nonlocal n_checked
            xd = np.array(ctx.arr(st.s.x).get())
            got = {}

            def spy(attrs, x, *a):
                got["x"] = np.array(x)
                got["y"] = real(attrs, x, *a)
                return got["y"]

            st._moe_rows = spy
            try:
                orig_eager(prog, ctx)
            finally:
                st._moe_rows = real
            if xd.shape[0]:
                assert np.array_equal(xd, got["x"]), "the host step's rows are not its device input"
                assert np.array_equal(np.array(ctx.arr(st.s.out).get()), got["y"]), "the device output is not moe_rows'"
                n_checked += 1
        return orig_eager, eager

    saved = []
    for st in c.moe_steps:
        orig, st.eager = wrap(st)
        saved.append((st, orig))
    try:
        rng = np.random.default_rng(2)
        kv = model.new_kv_cache(2, 64)
        model.forward(rng.integers(0, VOCAB, 30).astype(np.int32), [Segment(0, 0, 30)], kv)
        model.forward(rng.integers(0, VOCAB, 2).astype(np.int32), [Segment(0, 30, 1), Segment(1, 0, 1)], kv)
        model.forward(rng.integers(0, VOCAB, 40).astype(np.int32), [Segment(0, 31, 1), Segment(1, 1, 39)], kv)
    finally:
        for st, orig in saved:
            st.eager = orig
    assert n_checked == 3 * len(c.moe_steps), n_checked
    return f"staged rows ok ({n_checked} calls)"


def _reference_ffn(a: dict, e: int, x: np.ndarray) -> np.ndarray:
    """Expert e's FFN on rows x in float64 from gguf's dequantized weights (+ biases)."""
    from aotx.engine.backend.cpu import experts as cpu_moe

    W = [a[k].dequantize(e).astype(np.float64) for k in ("gate", "up", "down")]
    bias = [a.get(k) for k in ("gate_bias", "up_bias", "down_bias")]
    g, u = x.astype(np.float64) @ W[0].T, x.astype(np.float64) @ W[1].T
    if bias[0] is not None:
        g, u = g + bias[0][e], u + bias[1][e]
    g, u = g.astype(np.float32), u.astype(np.float32)
    h = np.empty_like(g)
    if a["act"] == "silu":
        cpu_moe.silu_mul(g, u, h)
    else:
        cpu_moe.swiglu_oai(g, u, np.float32(a["alpha"]), np.float32(a["limit"]), h)
    y = h.astype(np.float64) @ W[2].T
    if bias[2] is not None:
        y = y + bias[2][e]
    return y.astype(np.float32)


class _Routed:
    """The GPU tier with the step's device rows bound (as ``moe.MoeStep`` binds them)."""

    def __init__(self, gpu, x):
        self.gpu, self.x, self.on = gpu, x, gpu.on

    def launch_routed(self, experts, rows):
        return self.gpu.launch_routed(experts, rows, self.x)

    def wait(self, h):
        return self.gpu.wait(h)


class _ReferenceTier:
    """A stand-in GPU tier holding the same experts: each pair by ``_reference_ffn``."""

    def __init__(self, gpu, attrs, xh):
        self.on, self.a, self.xh, self.pairs = gpu.on, attrs, xh, 0

    def launch_routed(self, experts, rows):
        self.pairs += int(rows.shape[0])
        return np.concatenate([_reference_ffn(self.a, int(e), self.xh[r:r + 1]) for e, r in zip(experts, rows)])

    def wait(self, h):
        return h


def _grouped_matches_each(model, fake) -> str:
    """The GPU tier's grouped launches (one moe_gemv per GEMV for every expert, rows
    gathered on the device from the one table) against its per-expert gemv launches, with
    the kernels emulated in numpy (``fake.emulate``): the same values exactly, and the
    float64 reference's within rounding, on batches of 1 to 100 rows (one tile per expert
    at NB 1..16, several tiles per expert at 100 rows), on rows that are a strided view of a
    wider buffer (as the step's input is), with the tiles split over several launches, and
    with only some experts on the GPU (the slots are not the expert ids); and the whole op
    through ``moe_rows`` (the pairs split between the tiers, scattered back and joined)
    against a stand-in GPU tier computing the same pairs with the reference."""
    import cupy as cp

    from aotx.engine.backend.cpu import experts as cpu_moe
    from aotx.engine.model import experts as X

    c = model.compiled
    st = c.moe_steps[1]
    gpu, a = st.gpu, st.attrs
    E, d = a["n_expert"], model.cfg.d_model
    rng = np.random.default_rng(5)
    out = []
    worst_cpu = 0.0              # vs the CPU tier alone (its int8 activations: ~1e-2)
    fake.emulate = True
    try:
        for held in (list(range(E)), [e for e in range(E) if e % 3 != 0]):
            tiers = [tuple("gpu" for _ in range(E)) for _ in c.moe_steps]
            tiers[1] = tuple("gpu" if e in held else "host" for e in range(E))
            c.place_experts(X.Plan(tuple(tiers)))
            for n, max_tiles in ((1, None), (3, None), (16, None), (100, None), (100, 2)):
                wide = cp.asarray(rng.standard_normal((n, d + 24)).astype(np.float32))
                x = wide[:, 8:8 + d]                        # a strided view, as c.arr gives
                xh = np.ascontiguousarray(x.get())
                logits = st.attrs["router"].matmul(xh, per_row=True)
                if a.get("router_bias") is not None:
                    logits += a["router_bias"]
                sel, _, _ = cpu_moe.route(logits, a["n_used"], a["gating"], a["norm_w"], a["w_scale"])
                pairs = [p for p in cpu_moe.groups(sel) if gpu.on[p[0]]]
                if not pairs:
                    continue                                # every routed expert is on the CPU
                gpu.MAX_TILES = max_tiles or type(gpu).MAX_TILES
                gpu.grouped = True
                launches = fake.stats["launches"]
                yg = gpu.wait(gpu.launch(pairs, x)).copy()
                n_launch = fake.stats["launches"] - launches
                gpu.grouped = False
                ye = gpu.wait(gpu.launch(pairs, x))
                gpu.grouped = True
                assert np.array_equal(yg, ye), f"{n} rows: grouped != per-expert, worst {np.abs(yg - ye).max():.3e}"
                want = np.concatenate([_reference_ffn(a, e, xh[r]) for e, r, _ in pairs])
                rel = float(np.linalg.norm(yg - want) / np.linalg.norm(want))
                assert rel < 1e-5, f"{n} rows: {rel:.2e} from the float64 reference"
                per_layer = 3 if a["act"] == "silu" else 5
                if max_tiles is None:
                    assert n_launch == per_layer, f"{n} rows: {n_launch} launches, want {per_layer}"
                out.append(f"{n}/{len(pairs)}/{n_launch}")
                # the whole op through moe_rows: the GPU's pairs split off, computed, scattered back
                # into their (row, slot) places, joined with the CPU tier's: against a stand-in tier
                # that computes the same pairs with the float64 reference
                ref_tier = _ReferenceTier(gpu, a, xh)
                got = cpu_moe.moe_rows(a, xh, st.pool, gpu=_Routed(gpu, x), worker=c.moe_worker)
                want = cpu_moe.moe_rows(a, xh, st.pool, gpu=ref_tier, worker=c.moe_worker)
                assert ref_tier.pairs == sum(int(r.shape[0]) for _, r, _ in pairs), "the GPU tier got other pairs"
                rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                assert rel < 1e-5, f"{n} rows: moe_rows with the GPU tier {rel:.2e} from the reference tier"
                cpu_only = cpu_moe.moe_rows(a, xh, st.pool)      # the split itself: against the CPU tier alone
                rel = float(np.linalg.norm(got - cpu_only) / np.linalg.norm(cpu_only))
                worst_cpu = max(worst_cpu, rel)
                assert rel < 5e-2, f"{n} rows: moe_rows with the GPU tier {rel:.2e} from the CPU tier alone"
    finally:
        fake.emulate = False
        gpu.MAX_TILES = type(gpu).MAX_TILES
        gpu.grouped = True
    return ("grouped == per-expert (rows/experts/launches " + " ".join(out)
            + f"); moe_rows vs the CPU tier alone {worst_cpu:.1e}")


class _StubCtx:
    """What ``moe.MoeStep._device`` reads of a step context: the input and output views, the
    eager flag (its buffers are new and kept in ``prog._keep``)."""

    def __init__(self, step, x, out):
        self.vals, self.eager = {step.s.x: x, step.s.out: out}, True

    def arr(self, vid):
        return self.vals[vid]


def _device_step(model, fake) -> str:
    """The device-resident moe step (every expert of the layer on the GPU) with its kernels
    emulated (the router's GEMV, moe_route, moe_tiles, moe_gather, moe_gemv, moe_join):
    against the float64 reference of each routed expert joined with the routing's weights,
    on 1 to 100 rows of a strided input into a strided output; a row's bits alone equal its
    bits in the batch; the device traffic counters count every pair; and a host step (one
    expert off the GPU) is not device_ready."""
    import cupy as cp

    from aotx.engine.backend.cpu import experts as cpu_moe
    from aotx.engine.model import experts as X

    c = model.compiled
    c.place_experts(X.Plan(_tiers(model, "gpu")))
    st = c.moe_steps[-1]
    assert st.device_ready(), st.dev_why
    a = st.attrs
    E, k, d = a["n_expert"], a["n_used"], model.cfg.d_model
    rng = np.random.default_rng(7)
    worst = 0.0
    fake.emulate = True
    try:
        t0 = int(st.traffic.sum())
        pairs = 0
        for n in (1, 3, 16, 100):
            wide = cp.asarray(rng.standard_normal((n, d + 24)).astype(np.float32))
            x = wide[:, 8:8 + d]
            ow = cp.zeros((n, d + 12), cp.float32)
            out = ow[:, 4:4 + d]
            c._keep = []
            st._device(c, _StubCtx(st, x, out))
            got = out.get()
            xh = np.ascontiguousarray(x.get())
            rw = _deq_rows(st.router_dev)
            logits = (xh.astype(np.float64) @ rw.T).astype(np.float32)
            if st.router_bias_dev is not None:
                logits = logits + st.router_bias_dev.get()
            sel, w, _ = cpu_moe.route(logits, k, a["gating"], a["norm_w"], a["w_scale"])
            Y = np.stack([np.stack([_reference_ffn(a, int(sel[i, j]), xh[i:i + 1])[0] for j in range(k)])
                          for i in range(n)])
            want = cpu_moe.join(Y, w, np.empty((n, d), np.float32))
            rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            worst = max(worst, rel)
            assert rel < 1e-5, f"{n} rows: the device step {rel:.2e} from the reference"
            pairs += n * k
            if n > 1:                                   # row 1 alone: the same bits
                o1 = cp.zeros((1, d), cp.float32)
                st._device(c, _StubCtx(st, x[1:2], o1))
                assert np.array_equal(o1.get()[0], got[1]), f"{n} rows: row 1 alone differs from row 1 in the batch"
                pairs += k
        assert int(st.traffic.sum()) - t0 == pairs, (int(st.traffic.sum()) - t0, pairs)
    finally:
        fake.emulate = False
        c._keep = []
    tiers = list(_tiers(model, "gpu"))
    tiers[-1] = tuple("host" if e == 0 else "gpu" for e in range(E))
    c.place_experts(X.Plan(tuple(tiers)))
    assert not st.device_ready() and all(s.device_ready() for s in c.moe_steps[:-1])
    return f"device step {worst:.1e} from the reference (1-100 rows), {pairs} pairs counted"


def _deq_rows(dm) -> np.ndarray:
    """A DevMatrix's m rows dequantized (float64)."""
    from gguf.quants import dequantize

    return dequantize(np.asarray(dm.data[:dm.m].get()), dm.qtype).astype(np.float64)


def _setup(model, root, fake) -> str:
    from aotx.engine.model import experts as X
    from aotx.engine.runtime import admission

    layers = X.moe_layers(model.program)
    total = sum(x.n_expert * x.expert_bytes for x in layers)
    # the GPU tier's calibration: one expert's call and a layer-shaped call of n_used experts (issue 22:
    # one expert's call times n_used counted the call's fixed cost n_used times), split into fixed + marginal
    gpu = model.compiled.moe_steps[0].gpu
    before = (gpu.rows, gpu.calls, list(gpu.ids))
    launches = fake.stats["launches"]
    shapes = []
    real = gpu.launch_routed

    def spy(experts, rows, x=None):
        shapes.append((tuple(np.unique(experts).tolist()), int(rows.shape[0]), int(x.shape[0])))
        return real(experts, rows, x)

    gpu.launch_routed = spy
    try:
        m = model.compiled.measure_experts(0, (1, 16))
    finally:
        del gpu.launch_routed
    k = max(2, model.cfg.n_expert_used)
    ks = tuple(range(k))
    assert sorted(set(shapes)) == [((0,), 1, 1), (ks, k, 1), (ks, 16 * k, 16)], sorted(set(shapes))
    assert set(m) == {"cpu", "gpu_one", "gpu_layer", "gpu_k", "copy"} and set(m["gpu_layer"]) == {1, 16}, m
    assert m["gpu_k"] == k and m["gpu_one"] > 0 and all(v > 0 for v in m["gpu_layer"].values()) and m["copy"] > 0, m
    per_call = 3 if gpu.act == "silu" else 5          # gather, the GEMVs (gpt-oss: and its SwiGLU)
    # three grouped calls timed (one expert on 1 row; k experts on 1 and 16 rows), each warm-up + 5 runs
    assert fake.stats["launches"] - launches == 3 * 6 * per_call, fake.stats["launches"] - launches
    assert (gpu.rows, gpu.calls, list(gpu.ids)) == before, "the calibration left the tier's counters or experts changed"
    costs = X.calibrate(model.compiled, layers)
    assert costs.has_gpu and len(costs.gpu_fixed) == len(layers) and all(f >= 0 for f in costs.gpu_fixed), costs
    st = X.setup(model, model_fp="dryrun", gpu_bytes=1 << 30, host_bytes=None, root=root, reuse=False)
    assert st.plan.count("gpu") == st.plan.n_experts, st.plan.summary()
    assert set(st.stages) == {"experts calibrate", "experts plan", "experts place", "experts replan"}
    assert model.compiled.expert_stats()["gpu_experts"] == [x.n_expert for x in layers]
    st2 = X.setup(model, model_fp="dryrun", gpu_bytes=int(total * 0.4), host_bytes=None, root=root, reuse=False)
    n_gpu = st2.plan.count("gpu")
    assert 0 < n_gpu < st2.plan.n_experts, st2.plan.summary()
    assert sum(model.compiled.expert_stats()["gpu_experts"]) == n_gpu
    lines = admission.check_experts(st2.plan, total, 64 << 30, gpu=True)
    assert f"{st2.plan.n_experts - n_gpu} of its {st2.plan.n_experts} experts on the CPU" in lines[-1], lines
    return st.plan.summary() + " | " + st2.plan.summary()


def _learned(model, fake, root) -> str:
    """The learned GPU expert cache (``--expert-cache lfu``) on the CUDA program: set up from
    the 40% plan, then skewed traffic (a large bias on the router logits of as many experts
    as each layer has GPU slots, experts the plan left on the CPU: the static
    plan's worst case; at most n_used of them, so every row routes to each) over a few ticks: the GPU set must move to exactly the hot experts
    with at most the policy's copies per tick and the capacity per layer unchanged, the
    slots must hold the promoted experts' bytes (biases too), and the moe op with the tier's
    kernels emulated must match the float64 reference within rounding and the CPU tier alone
    within its int8 tolerance."""
    from aotx.engine.backend.cpu import experts as cpu_moe
    from aotx.engine.model import experts as X
    from aotx.engine.model.batch import Segment

    c = model.compiled
    layers = X.moe_layers(model.program)
    total = sum(x.n_expert * x.expert_bytes for x in layers)
    pol = X.LearnedPolicy("lfu", decay=0.5, copies_per_tick=3)
    st = X.setup(model, model_fp="dryrun", gpu_bytes=int(total * 0.4), host_bytes=None, root=root, policy="lfu",
                 learned=pol)
    assert c.expert_cache is st.cache and isinstance(st.cache, X.LearnedCache), st.cache
    cap = [len(s.gpu.ids) for s in c.moe_steps]
    assert sum(cap) == st.plan.count("gpu") > 0, (cap, st.plan.summary())
    hot, saved = [], []
    for s, n in zip(c.moe_steps, cap):
        off = [e for e in range(s.attrs["n_expert"]) if not s.gpu.on[e]]
        h = off[:min(n, len(off), int(s.attrs["n_used"]))]   # every row routes to all of them (the fake's
        # dense kernels do not run, so x, and the router logits but for the bias, are not random)
        hot.append(sorted(h))
        E = s.attrs["n_expert"]
        b0 = s.attrs.get("router_bias")
        saved.append(b0)
        bias = np.zeros(E, np.float32) if b0 is None else np.array(b0, np.float32)
        bias[h] += 1000.0
        # fewer slots than experts per token (the whole-layer plan leaves a layer 1 slot): the other
        # picks go to experts off the GPU too, so the residents get no rows and the hot ones win
        bias[off[len(h):len(h) + max(0, int(s.attrs["n_used"]) - len(h))]] += 990.0   # softmax: not 0 in float32
        s.attrs["router_bias"] = bias
    rng = np.random.default_rng(3)
    kv = model.new_kv_cache(2, 64)
    copies = []
    try:
        before = st.cache.copies
        model.forward(rng.integers(0, VOCAB, 16).astype(np.int32), [Segment(0, 0, 16)], kv)
        for i in range(12):
            model.forward(rng.integers(0, VOCAB, 2).astype(np.int32), [Segment(0, 16 + i, 1), Segment(1, i, 1)], kv)
            copies.append(st.cache.copies - before)
            before = st.cache.copies
    finally:
        for s, b0 in zip(c.moe_steps, saved):
            s.attrs["router_bias"] = b0
    assert max(copies) <= pol.copies_per_tick and sum(copies) > 0, copies
    for s, n, h, on in zip(c.moe_steps, cap, hot, st.cache.resident):
        assert len(s.gpu.ids) == n and int(on.sum()) == n, (n, s.gpu.ids)
        assert np.array_equal(on, s.gpu.on), (on, s.gpu.on)
        assert set(h) <= set(s.gpu.ids), (h, s.gpu.ids)
        for e in s.gpu.ids:                                  # the slot holds the expert's bytes
            sl = int(s.gpu.slot[e])
            for i, key in enumerate(("gate", "up", "down")):
                raw = s.attrs[key].raw(e)
                nb = int(raw.nbytes)
                got = np.asarray(s.gpu.w[i]).reshape(-1)[sl * nb:(sl + 1) * nb]
                assert np.array_equal(got, raw.reshape(-1)), (s.attrs["moe_layer"], e, key)
            for i, key in enumerate(("gate_bias", "up_bias", "down_bias")):
                if s.attrs.get(key) is not None:
                    assert np.array_equal(np.asarray(s.gpu.b[i])[sl], s.attrs[key][e]), (e, key)
    stats = c.expert_stats()["cache"]
    assert stats["copies"] == st.cache.copies and stats["copied_bytes"] > 0, stats
    # the moe op after the moves, the tier's kernels emulated: rows routed to the promoted experts
    import cupy as cp

    # a layer with experts on both tiers (the whole-layer plan leaves some layers with none on the
    # GPU), the most GPU experts first; 64 rows, so that some pairs reach its GPU experts
    s = max(c.moe_steps, key=lambda m: (0 < len(m.gpu.ids) < m.gpu.E, len(m.gpu.ids)))
    a = s.attrs
    xh = rng.standard_normal((64, model.cfg.d_model)).astype(np.float32)
    fake.emulate = True
    try:
        x = cp.asarray(xh)
        got = cpu_moe.moe_rows(a, xh, s.pool, gpu=_Routed(s.gpu, x), worker=c.moe_worker)
        ref = _ReferenceTier(s.gpu, a, xh)
        want = cpu_moe.moe_rows(a, xh, s.pool, gpu=ref, worker=c.moe_worker)
    finally:
        fake.emulate = False
    assert ref.pairs > 0, "no pair reached the GPU tier"
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert rel < 1e-5, f"after the moves, moe_rows with the GPU tier {rel:.2e} from the reference tier"
    cpu_only = cpu_moe.moe_rows(a, xh, s.pool)
    rel_cpu = float(np.linalg.norm(got - cpu_only) / np.linalg.norm(cpu_only))
    assert rel_cpu < 5e-2, f"after the moves, {rel_cpu:.2e} from the CPU tier alone"
    c.attach_expert_cache(None)
    return (f"learned lfu: hot experts on the GPU within {len(copies) + 1} ticks, copies per tick {copies}, "
            f"hit rate {stats['hit_rate']}; moe op {rel:.1e} from the reference, {rel_cpu:.1e} from the CPU tier")


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.tools import gpu_fake_cupy as fake

    fake.install()
    from tests import models as tm

    tmp = Path(tempfile.mkdtemp(prefix="aotx-dryrun-moe-"))
    tok = _toy_tokenizer(tm)
    files = {"qwen3moe": tm.qwen3moe.write(tmp / "qwen3moe.gguf", tok),
             "olmoe": tm.olmoe.write(tmp / "olmoe.gguf", tok, d_model=128),
             "gptoss": tm.gptoss.write(tmp / "gptoss.gguf", tok)}
    for name, path in files.items():
        try:
            model = _build(path)
            _exercise(model, fake)
            summary = _staging(model) + "; " + _grouped_matches_each(model, fake) + " | " + _placements(model) + " | " \
                + _device_step(model, fake) + " | " + _setup(model, tmp / "home", fake) + " | " \
                + _learned(model, fake, tmp / "home")
        except Exception:  # noqa: BLE001 - report the scenario and stop
            print(f"FAIL {name}")
            traceback.print_exc()
            return 1
        print(f"ok   {name}: {len(model.compiled.moe_steps)} host moe steps; {summary}")
        # the engine's numerics on a large model: int8 activations in the dense GEMVs, the expert
        # tier's GEMVs float (moe_gemv); forced here on the tiny file
        try:
            model = _build(path, int8_activations=True, int8_min_bytes=0)
            q8 = {g.q8 for g in model.compiled.gemvs}
            assert True in q8 and model.compiled.backend.numerics == "cuda-int8", q8
            assert not any(g.q8 for s in model.compiled.moe_steps for t in [getattr(s, "gpu", None)] if t is not None
                           for g in getattr(t, "gemvs", {}).values()), "an expert-tier GEMV on int8"
            _exercise(model, fake)
        except Exception:  # noqa: BLE001 - report the scenario and stop
            print(f"FAIL {name} (int8 activations)")
            traceback.print_exc()
            return 1
        print(f"ok   {name}: int8 activations in {sum(g.q8 for g in model.compiled.gemvs)} dense GEMVs")
        try:
            model = _build(path, moe_graphs=True)
            line = _exercise_segmented(model, fake)
        except Exception:  # noqa: BLE001 - report the scenario and stop
            print(f"FAIL {name} (moe_graphs)")
            traceback.print_exc()
            return 1
        print(f"ok   {name}: {line}")
    print(f"moe dry run OK: {fake.stats['launches']} launches, {fake.stats['captures']} graph captures")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
