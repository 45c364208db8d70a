"""Mixtures of experts on the CUDA backend (issue 22): the dense layers on the GPU, the
``moe`` op on the CPU expert tier (``cuda_plan.MoeHost``, ``cpu_moe.moe_rows``).

Without a GPU (CI): the plan of each MoE architecture (a host step per layer; gpt-oss's
attention steps carry their sinks and windows), and the host code of the whole path against fake
CuPy (``tests/tools/gpu_dryrun_moe.py`` in a subprocess). With a GPU (``-m cuda``; the
lead runs ``tests/tools/cuda_check_moe.sh``): logits of tiny qwen3moe, olmoe and gpt-oss files
(gpt-oss: attention sinks and sliding-window layers in the CUDA attention kernels)
against the CPU float path through prefill, multi-slot decode, verify and mixed batches,
with both KV types, and greedy device sampling equal to the argmax of those logits.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aotx.engine.backend import cuda_plan
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


def _build(path, device: str):
    from aotx.engine.model.architectures import build
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    if device == "cpu":
        from aotx.engine.backend.cpu import CpuBackend

        be = CpuBackend(int8_activations=False)
    else:
        from aotx.engine.backend.cuda import CudaBackend

        be = CudaBackend(prefill="f32", expert_int8=False)
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
