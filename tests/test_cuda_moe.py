"""Mixtures of experts on the CUDA backend: the dense layers on the GPU, the
``moe`` op's routing and CPU expert tier on the host (``cuda_plan.MoeHost``,
``cpu_moe.moe_rows``), its GPU expert tier on the device (``experts.GpuExperts``).

Without a GPU (CI): the plan of each MoE architecture (a host step per layer; gpt-oss's
attention steps carry their sinks and windows), and the host code of the whole path against fake
CuPy (``tests/tools/gpu_dryrun_moe.py`` in a subprocess). With a GPU (``-m cuda``; the
lead runs ``tests/tools/cuda_check_moe.sh``): logits of tiny qwen3moe, olmoe and gpt-oss files
(gpt-oss: attention sinks and sliding-window layers in the CUDA attention kernels)
against the CPU float path through prefill, multi-slot decode, verify and mixed batches,
with both KV types, and greedy device sampling equal to the argmax of those logits; the
GPU expert tier: the same logits (against the CPU) with every expert on the GPU, a mix,
and every expert on the CPU, each tier computing exactly the pairs placed on it; the
tier's grouped launches giving the bits of its per-expert launches (layer calls and
logits); the calibration timing the GPU tier and placing by it; with every expert on the
GPU, the device moe step (routing and join on the device, decode in a graph): batch-invariant
and within rounding of the host step.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aotx.engine.backend.cuda import plan as cuda_plan
from aotx.engine.model.batch import Segment

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512
REL_TOL = {"f32": 1e-3, "f16": 2e-3}


def _gpu() -> str | None:
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - ImportError, or the driver's CUDARuntimeError
        return f"no CUDA device: {type(e).__name__}: {e}"
    return None if n > 0 else "no CUDA device: CuPy sees 0 devices"


NO_GPU = _gpu()
needs_gpu = pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or "")


def _toy_tokenizer(tm):
    from gguf import GGUFValueType as V

    toks = tuple(f"t{i}" for i in range(VOCAB))
    kv = (("tokenizer.ggml.model", "gpt2", V.STRING), ("tokenizer.ggml.tokens", toks, V.ARRAY),
          ("tokenizer.ggml.token_type", tuple([1] * VOCAB), V.ARRAY))
    return tm.common.Tokenizer(kv, VOCAB)


@pytest.fixture(scope="module")
def moe_files(tiny_models, tmp_path_factory):
    """Tiny MoE files with a 512-token toy vocabulary and head dimension 32 (the CUDA
    attention kernel's smallest)."""
    root = tmp_path_factory.mktemp("cuda-moe")
    tok = _toy_tokenizer(tiny_models)
    return {"qwen3moe": tiny_models.qwen3moe.write(root / "qwen3moe.gguf", tok),
            "olmoe": tiny_models.olmoe.write(root / "olmoe.gguf", tok, d_model=128),
            "gptoss": tiny_models.gptoss.write(root / "gptoss.gguf", tok)}


def _build(path, device: str, **cuda_kw):
    from aotx.engine.model.architectures import build
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    if device == "cpu":
        from aotx.engine.backend.cpu.backend import CpuBackend

        be = CpuBackend(int8_activations=False)
    else:
        from aotx.engine.backend.cuda.backend import CudaBackend

        be = CudaBackend(prefill="f32", expert_int8=False, **cuda_kw)
    return build(cfg, gf, be)


# ------------------------------------------------------------------ no GPU needed

def test_plan_puts_each_moe_layer_on_the_host_and_carries_the_sinks(moe_files):
    for name in ("qwen3moe", "olmoe", "gptoss"):
        m = _build(moe_files[name], "cpu")
        p = cuda_plan.plan(m.program)
        hosts = [s for s in p.steps if isinstance(s, cuda_plan.MoeHost)]
        assert len(hosts) == m.cfg.n_layers, name
        assert [s.attrs["moe_layer"] for s in hosts] == list(range(m.cfg.n_layers))
        for s in hosts:        # the host step reads the normed rows and writes a d_model-wide value
            assert p.loc[s.out].width == m.cfg.d_model and s.x in p.loc
    # gpt-oss: every layer's attention step carries that layer's sink logits and window
    m = _build(moe_files["gptoss"], "cpu")
    att = [s for s in cuda_plan.plan(m.program).steps if isinstance(s, cuda_plan.Attend)]
    assert len(att) == m.cfg.n_layers
    nodes = [n for n in m.program.nodes if n.op == "attention"]
    for s, n in zip(att, nodes):
        assert s.sinks is n.attrs["sinks"] and s.sinks.shape == (m.cfg.n_heads,)
        assert s.window == n.attrs["window"]
    assert [s.window for s in att] == [16, 0, 16, 0]       # even layers slide (the tiny file's window 16)
    m = _build(moe_files["qwen3moe"], "cpu")
    assert all(s.sinks is None for s in cuda_plan.plan(m.program).steps if isinstance(s, cuda_plan.Attend))


def test_host_code_of_the_cuda_moe_path_passes_the_fake_cupy_checks():
    p = subprocess.run([sys.executable, "-m", "tests.tools.gpu_dryrun_moe"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0 and "moe dry run OK" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    # the learned expert cache moved each architecture's GPU set to its skewed traffic's hot experts
    assert p.stdout.count("learned lfu: hot experts on the GPU") == 3, p.stdout[-3000:]


# ------------------------------------------------------------------ on a GPU

def _scenario(model, kv_type: str) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    tok = lambda n: rng.integers(0, VOCAB, n).astype(np.int32)  # noqa: E731
    kv = model.new_kv_cache(4, 256, kv_type)
    out = [model.forward(tok(9), [Segment(1, 0, 9, all_logits=True)], kv),
           model.forward(tok(5), [Segment(0, 0, 5)], kv)]
    for i in range(3):
        out.append(model.forward(tok(2), [Segment(0, 5 + i, 1), Segment(1, 9 + i, 1)], kv))
    out.append(model.forward(tok(7), [Segment(0, 8, 1), Segment(2, 0, 6)], kv))
    out.append(model.forward(tok(150), [Segment(3, 0, 150, logits=False)], kv))
    out.append(model.forward(tok(1), [Segment(3, 150, 1)], kv))
    out.append(model.forward(tok(6), [Segment(3, 151, 4, all_logits=True), Segment(2, 7, 2)], kv))
    return out


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("name", ["qwen3moe", "olmoe", "gptoss"])
def test_cuda_moe_logits_match_the_cpu(moe_files, name, kv_type):
    cpu = _scenario(_build(moe_files[name], "cpu"), kv_type)
    gpu_model = _build(moe_files[name], "cuda")
    assert len(gpu_model.compiled.moe_steps) == gpu_model.cfg.n_layers
    gpu = _scenario(gpu_model, kv_type)
    worst = 0.0
    for i, (a, b) in enumerate(zip(gpu, cpu)):
        assert a.shape == b.shape, f"step {i}: CUDA logits {a.shape}, CPU {b.shape}"
        if b.size == 0:
            continue
        assert np.isfinite(a).all(), f"step {i}: CUDA logits are not finite"
        rel = float(np.linalg.norm(a - b) / np.linalg.norm(b))
        worst = max(worst, rel)
        assert rel <= REL_TOL[kv_type], f"step {i}: ||cuda - cpu|| / ||cpu|| = {rel:.2e} > {REL_TOL[kv_type]}"
    print(f"{name} kv {kv_type}: worst relative logits error {worst:.2e}")


@needs_gpu
@pytest.mark.cuda
def test_cuda_moe_device_greedy_is_the_argmax_of_its_logits(moe_files):
    m = _build(moe_files["qwen3moe"], "cuda")
    kv = m.new_kv_cache(2, 64)
    rng = np.random.default_rng(3)
    ids = m.greedy(rng.integers(0, VOCAB, 20).astype(np.int32), [Segment(0, 0, 20)], kv)
    lg = m.last_logits().get()
    assert ids.tolist() == lg.argmax(axis=1).tolist()
    for p in range(20, 24):
        ids = m.greedy(np.array([int(ids[0]), 5], np.int32), [Segment(0, p, 1), Segment(1, p - 20, 1)], kv)
        assert ids.tolist() == m.last_logits().get().argmax(axis=1).tolist()


# ------------------------------------------------------------------ the GPU expert tier (on a GPU)

def _tiers(model, placement: str) -> tuple:
    """"gpu": every expert on the GPU tier; "cpu": every expert "host"; "mixed": layer 0 all
    on the GPU, layer 1 all on the CPU, the others every other expert (even ids on the GPU)."""
    from aotx.engine.model import experts as X

    out = []
    for L in X.moe_layers(model.program):
        if placement == "gpu" or (placement == "mixed" and L.index == 0):
            t = ["gpu"] * L.n_expert
        elif placement == "cpu" or L.index == 1:
            t = ["host"] * L.n_expert
        else:
            t = ["gpu" if e % 2 == 0 else "host" for e in range(L.n_expert)]
        out.append(tuple(t))
    return tuple(out)


def _rel_errors(got, want) -> list[float]:
    out = []
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, f"step {i}: {a.shape} vs {b.shape}"
        if b.size:
            assert np.isfinite(a).all(), f"step {i}: logits are not finite"
            out.append(float(np.linalg.norm(a - b) / np.linalg.norm(b)))
    return out


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "moe_graphs"])
@pytest.mark.parametrize("name", ["qwen3moe", "gptoss"])
def test_cuda_gpu_expert_tier_gives_the_cpu_logits_whatever_the_placement(moe_files, name, graphs):
    """moe_graphs: the ticks with host moe steps as captured graphs between them
    (``moe.Segments``) instead of the eager path: the same logits."""
    from aotx.engine.model import experts as X

    cpu = _scenario(_build(moe_files[name], "cpu"), "f32")
    m = _build(moe_files[name], "cuda", moe_graphs=graphs)
    c = m.compiled
    worst = {}
    for placement in ("gpu", "mixed", "cpu"):
        tiers = _tiers(m, placement)
        placed = c.place_experts(X.Plan(tiers))
        want_bytes = 0
        for st, t in zip(c.moe_steps, tiers):
            a = st.attrs
            for e in (e for e, tt in enumerate(t) if tt == "gpu"):
                want_bytes += sum(int(a[k].raw(e).nbytes) for k in ("gate", "up", "down"))
                want_bytes += sum(4 * a[k].shape[1] for k in ("gate_bias", "up_bias", "down_bias")
                                  if a.get(k) is not None)
        assert placed["gpu_bytes"] == want_bytes, (placement, placed)
        s0 = c.expert_stats()
        out = _scenario(m, "f32")
        s1 = c.expert_stats()
        gpu_pairs = [b - a for a, b in zip(s0["gpu_rows"], s1["gpu_rows"])]
        cpu_rows = s1["pool"]["rows"] - s0["pool"]["rows"]
        routed = sum(sum(b) - sum(a) for a, b in zip(s0["traffic"], s1["traffic"]))
        if placement == "gpu":
            assert cpu_rows == 0 and sum(gpu_pairs) == routed, (cpu_rows, gpu_pairs, routed)
        elif placement == "cpu":
            assert sum(gpu_pairs) == 0 and cpu_rows == routed, (cpu_rows, gpu_pairs, routed)
        else:
            assert gpu_pairs[0] > 0 and gpu_pairs[1] == 0 and all(g > 0 for g in gpu_pairs[2:]), gpu_pairs
            assert 0 < cpu_rows < routed and cpu_rows + sum(gpu_pairs) == routed
        errs = _rel_errors(out, cpu)
        worst[placement] = max(errs)
        assert worst[placement] <= REL_TOL["f32"], f"{placement}: worst ||cuda - cpu|| / ||cpu|| {worst[placement]:.2e}"
    print(f"{name} GPU expert tier, worst relative logits error vs the CPU: "
          + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("name", ["qwen3moe", "olmoe", "gptoss"])
def test_cuda_device_moe_step_is_batch_invariant_and_matches_the_host_step(moe_files, name):
    """Every expert on the GPU: each moe layer runs as the device step (router, routing,
    experts and join on the device; decode captured in a graph). Three slots with the same
    prompt decoding the same token give the same logits bits in one batch (graph bucket 4),
    alone (bucket 1); and these and a 9-token chunk's logits are within rounding of the
    host step's (CudaBackend(moe_device=False), the same placement)."""
    from aotx.engine.model import experts as X

    rng = np.random.default_rng(11)
    prompt, nxt = rng.integers(0, VOCAB, 8).astype(np.int32), rng.integers(0, VOCAB, 1).astype(np.int32)
    runs = {}
    for dev in (True, False):
        m = _build(moe_files[name], "cuda", moe_device=dev)
        c = m.compiled
        c.place_experts(X.Plan(_tiers(m, "gpu")))
        assert all(st.device_ready() for st in c.moe_steps) == dev, [st.dev_why for st in c.moe_steps]
        kv = m.new_kv_cache(4, 64)
        for slot in range(3):
            m.forward(prompt, [Segment(slot, 0, 8)], kv)
        batch = m.forward(np.repeat(nxt, 3), [Segment(s, 8, 1) for s in range(3)], kv)
        kv1 = m.new_kv_cache(4, 64)
        m.forward(prompt, [Segment(1, 0, 8)], kv1)
        alone = m.forward(nxt, [Segment(1, 8, 1)], kv1)
        kv2 = m.new_kv_cache(4, 64)
        chunk = m.forward(np.concatenate([prompt, nxt]), [Segment(2, 0, 9)], kv2)
        runs[dev] = (batch, alone, chunk)
        if dev:
            assert np.array_equal(batch[0], batch[1]) and np.array_equal(batch[1], batch[2]), \
                "the same row gives other bits at another place in the batch"
            assert np.array_equal(batch[1], alone[0]), "a decode row alone differs from the same row in a batch"
    for a, b in zip(runs[True], runs[False]):
        rel = float(np.linalg.norm(a - b) / np.linalg.norm(b))
        assert rel <= REL_TOL["f32"], f"device step vs host step: {rel:.2e}"


def _layer_pairs(st, x_host: np.ndarray) -> list:
    """The (expert, rows, slots) pairs the router sends to the GPU tier of host step ``st``."""
    from aotx.engine.backend.cpu import experts as cpu_moe

    a = st.attrs
    logits = a["router"].matmul(np.ascontiguousarray(x_host), per_row=True)
    if a.get("router_bias") is not None:
        logits += a["router_bias"]
    sel, _, _ = cpu_moe.route(logits, a["n_used"], a["gating"], a["norm_w"], a["w_scale"])
    return [p for p in cpu_moe.groups(sel) if st.gpu.on[p[0]]]


def _set_grouped(c, on: bool) -> None:
    for st in c.moe_steps:
        st.gpu.grouped = on


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("name", ["qwen3moe", "olmoe", "gptoss"])
def test_cuda_gpu_tier_grouped_launches_give_the_bits_of_the_per_expert_launches(moe_files, name):
    """The GPU tier's host overhead: the tier runs one ``moe_gemv`` launch per GEMV for
    every expert it holds (rows gathered on the device, one table copy, one D2H); it must
    give exactly the bits of the per-expert ``gemv`` launches it replaced (``grouped =
    False``): per layer call on 1 to 100 rows (NB 1 .. 16, several tiles per expert, the
    tiles over several launches) with all experts and with a subset on the GPU, and in the
    logits of the whole scenario, all-GPU and mixed."""
    import cupy as cp

    from aotx.engine.model import experts as X

    m = _build(moe_files[name], "cuda")
    c = m.compiled
    d = m.cfg.d_model
    rng = np.random.default_rng(11)
    st = c.moe_steps[1]
    E = st.attrs["n_expert"]
    checked = 0
    for held in (range(E), [e for e in range(E) if e % 3]):
        tiers = [tuple(["gpu"] * E)] * len(c.moe_steps)
        tiers[1] = tuple("gpu" if e in held else "host" for e in range(E))
        c.place_experts(X.Plan(tuple(tiers)))
        for n, max_tiles in ((1, None), (3, None), (16, None), (100, None), (100, 3)):
            x = cp.asarray(rng.standard_normal((n, d + 24)).astype(np.float32))[:, 8:8 + d]   # a strided view
            pairs = _layer_pairs(st, x.get())
            if not pairs:
                continue
            st.gpu.MAX_TILES = max_tiles or type(st.gpu).MAX_TILES
            try:
                got = st.gpu.wait(st.gpu.launch(pairs, x)).copy()
                st.gpu.grouped = False
                want = st.gpu.wait(st.gpu.launch(pairs, x))
            finally:
                st.gpu.grouped = True
                st.gpu.MAX_TILES = type(st.gpu).MAX_TILES
            assert got.shape == want.shape and np.isfinite(want).all()
            bad = int((got.view(np.int32) != want.view(np.int32)).sum())
            assert bad == 0, (f"{n} rows, {len(pairs)} experts: {bad} of {want.size} outputs differ from the "
                              f"per-expert launches (worst {np.abs(got - want).max():.3e})")
            checked += 1
    assert checked >= 8, checked
    for placement in ("gpu", "mixed"):
        c.place_experts(X.Plan(_tiers(m, placement)))
        got = _scenario(m, "f32")
        _set_grouped(c, False)
        try:
            want = _scenario(m, "f32")
            diff = [i for i, (a, b) in enumerate(zip(got, want))
                    if not np.array_equal(a.view(np.int32), b.view(np.int32))]
            again = _scenario(m, "f32") if diff else want
        finally:
            _set_grouped(c, True)
        if diff:
            same = all(np.array_equal(a, b) for a, b in zip(again, want))
            i = diff[0]
            pytest.fail(f"{placement}: logits of steps {diff} differ between the grouped and the per-expert GPU tier "
                        f"(step {i}: worst {np.abs(got[i] - want[i]).max():.3e}); the per-expert path "
                        f"{'reproduces' if same else 'does NOT reproduce'} its own logits run to run")
    print(f"{name}: grouped GPU tier == per-expert launches, bit for bit ({checked} layer calls, the logits of "
          f"all-GPU and mixed)")


@needs_gpu
@pytest.mark.cuda
def test_cuda_expert_calibration_times_the_gpu_tier_and_places_by_it(moe_files, tmp_path):
    from aotx.engine.model import experts as X

    m = _build(moe_files["qwen3moe"], "cuda")
    c = m.compiled
    got = c.measure_experts(0, (1, 16))
    assert set(got) == {"cpu", "gpu_one", "gpu_layer", "gpu_k", "copy"}
    assert all(got[t][n] > 0 for t in ("cpu", "gpu_layer") for n in (1, 16)) and got["copy"] > 0, got
    assert got["gpu_k"] == max(2, m.cfg.n_expert_used) and got["gpu_one"] > 0, got
    layers = X.moe_layers(m.program)
    fixed, line = X.gpu_split(got["gpu_one"], got["gpu_layer"], got["gpu_k"], (1, 16))
    # the fixed part plus k experts' share is the layer call measured (within the clamps at 0)
    assert fixed >= 0 and fixed + got["gpu_k"] * line(1) >= 0.9 * got["gpu_layer"][1], (fixed, line, got)
    total = sum(L.n_expert * L.expert_bytes for L in layers)
    st = X.setup(m, model_fp="t", gpu_bytes=4 * total, root=tmp_path, reuse=False)
    assert st.costs.has_gpu and st.plan.count("gpu") == st.plan.n_experts, st.plan.summary()
    assert c.expert_stats()["gpu_experts"] == [L.n_expert for L in layers]
    st = X.setup(m, model_fp="t", gpu_bytes=int(0.4 * total), root=tmp_path, reuse=False)
    n_gpu = st.plan.count("gpu")
    assert 0 < n_gpu < st.plan.n_experts and n_gpu * layers[0].expert_bytes <= 0.4 * total, st.plan.summary()
    assert sum(c.expert_stats()["gpu_experts"]) == n_gpu
    print(st.plan.summary(), got, "fixed", st.costs.gpu_fixed, "marginal", st.costs.gpu)
