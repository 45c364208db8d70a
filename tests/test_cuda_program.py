"""The CUDA backend runs every architecture's Program: logits against the CPU float path.

For each architecture's tiny random-weight file (``tests/models``: llama, Llama 3 with
``rope_freqs``, qwen2 with QKV bias, qwen3 with QK-norm, gemma3 with sliding windows,
post-norms, GEGLU and an embedding scale, phi3 with fused QKV and gate/up) the same
scenario runs on both backends: a prefill with every row's logits, a prefill with the
last row's, decode steps of two and three slots and a mixed decode + short prefill
batch (the captured graph), a 150-token prefill (more rows than a graph takes: the eager
path: float32 SGEMM here, the tensor-core modes are tests/test_cuda_invariance.py's), decode and
verify rows past position 150 (attention split over the
context, past gemma3's 16-position window). Every logits array must satisfy
||cuda - cpu|| / ||cpu|| <= REL_TOL, in float32 and float16 KV, and with the plan's
fusions off (every op a generic kernel). The CPU side is its float path
(``int8_activations=False``): both backends round K and V to float16 the same way.

Also: the KV cache's dtype and its capsule round trip on the device (byte-exact,
float16), and a CPU float16 capsule restored into the CUDA cache.

Skips with a visible reason where CuPy or a CUDA device is absent (CI).
"""

from __future__ import annotations

import numpy as np
import pytest

try:
    import cupy

    _n_dev = cupy.cuda.runtime.getDeviceCount()
except Exception as e:  # noqa: BLE001 - ImportError, or the driver's CUDARuntimeError
    pytest.skip(f"no CUDA device: {type(e).__name__}: {e}", allow_module_level=True)
if _n_dev < 1:
    pytest.skip("no CUDA device: CuPy sees 0 devices", allow_module_level=True)

from aotx.engine.model.batch import Segment  # noqa: E402

pytestmark = pytest.mark.cuda

REL_TOL = {"f32": 1e-3, "f16": 2e-3}
VOCAB = 512

# tiny files with head dimensions the CUDA attention kernel takes (multiples of 32)
ARCHS = {
    "llama3": {},
    "qwen2": {"d_model": 128},           # 4 heads of 32
    "qwen3": {},
    "gemma3": {},
    "phi3": {},
}


def _toy_tokenizer(tm):
    from gguf import GGUFValueType as V

    toks = tuple(f"t{i}" for i in range(VOCAB))
    kv = (("tokenizer.ggml.model", "gpt2", V.STRING), ("tokenizer.ggml.tokens", toks, V.ARRAY),
          ("tokenizer.ggml.token_type", tuple([1] * VOCAB), V.ARRAY))
    return tm.common.Tokenizer(kv, VOCAB)


@pytest.fixture(scope="module")
def arch_files(tiny_models, tiny_gguf, tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda-archs")
    tok = _toy_tokenizer(tiny_models)
    files = {name: getattr(tiny_models, name).write(root / f"{name}.gguf", tok, **kw) for name, kw in ARCHS.items()}
    files["llama"] = tiny_gguf.write_tiny_llama(root / "llama.gguf", seed=4, d_model=256, n_heads=4, n_kv_heads=2,
                                                ffn=512)
    return files


def _build(path, device: str, fuse: bool = True):
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.architectures import build

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    if device == "cpu":
        from aotx.engine.backend.cpu.backend import CpuBackend

        be = CpuBackend(int8_activations=False)
    else:
        from aotx.engine.backend.cuda.backend import CudaBackend

        be = CudaBackend(fuse=fuse, prefill="f32")   # the float32 eager path (tensor-core modes: test_cuda_invariance)
    return build(cfg, gf, be)


def _scenario(model, kv_type: str) -> list[np.ndarray]:
    vocab = model.cfg.vocab_size
    rng = np.random.default_rng(7)
    tok = lambda n: rng.integers(0, vocab, n).astype(np.int32)  # noqa: E731
    kv = model.new_kv_cache(4, 256, kv_type)
    out = [model.forward(tok(9), [Segment(1, 0, 9, all_logits=True)], kv),
           model.forward(tok(5), [Segment(0, 0, 5)], kv)]
    for i in range(3):
        out.append(model.forward(tok(2), [Segment(0, 5 + i, 1), Segment(1, 9 + i, 1)], kv))
    out.append(model.forward(tok(7), [Segment(0, 8, 1), Segment(2, 0, 6)], kv))
    out.append(model.forward(tok(3), [Segment(2, 6, 1), Segment(1, 12, 1), Segment(0, 9, 1)], kv))
    out.append(model.forward(tok(150), [Segment(3, 0, 150, logits=False)], kv))
    out.append(model.forward(tok(1), [Segment(3, 150, 1)], kv))
    out.append(model.forward(tok(6), [Segment(3, 151, 4, all_logits=True), Segment(2, 7, 2)], kv))
    out.append(model.forward(tok(140), [Segment(0, 10, 130, all_logits=True), Segment(1, 13, 10)], kv))
    return out


def _compare(path, kv_type: str, fuse: bool = True) -> float:
    cpu = _scenario(_build(path, "cpu"), kv_type)
    gpu = _scenario(_build(path, "cuda", fuse), kv_type)
    worst = 0.0
    for i, (a, b) in enumerate(zip(gpu, cpu)):
        assert a.shape == b.shape, f"step {i}: CUDA logits {a.shape}, CPU {b.shape}"
        if b.size == 0:
            continue
        assert np.isfinite(a).all(), f"step {i}: CUDA logits are not finite"
        rel = float(np.linalg.norm(a - b) / np.linalg.norm(b))
        worst = max(worst, rel)
        assert rel <= REL_TOL[kv_type], f"step {i}: ||cuda - cpu|| / ||cpu|| = {rel:.2e} > {REL_TOL[kv_type]}"
    return worst


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3", "gemma3", "phi3"])
def test_logits_match_cpu_every_architecture(arch_files, arch, kv_type):
    worst = _compare(arch_files[arch], kv_type)
    print(f"{arch} kv {kv_type}: worst relative logits error {worst:.2e}")


@pytest.mark.parametrize("flash", [False, True], ids=["cublas", "flash"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_long_segments_on_the_cublas_attention_path_match_cpu(arch_files, arch, flash, monkeypatch):
    """The scenario's 130- and 150-token segments take the attention kernel (within
    attention.ATT_KERNEL_WORK); with the threshold at 0 they take the long-segment path:
    the cuBLAS one, or the flash-style kernel (attn_prefill) where it runs (gemma3: its
    sliding-window layers too). Both must match the CPU."""
    from aotx.engine.backend.cuda import attention as CA

    monkeypatch.setattr(CA, "ATT_KERNEL_WORK", 0)
    monkeypatch.setattr(CA, "FLASH_ATTENTION", flash)
    worst = _compare(arch_files[arch], "f16")
    print(f"{arch} {'flash' if flash else 'cuBLAS'} attention: worst relative logits error {worst:.2e}")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "phi3"])
def test_generic_kernels_match_cpu(arch_files, arch):
    """The fallback path: no fusion, one generic kernel per op (what a program that does
    not match the patterns runs)."""
    worst = _compare(arch_files[arch], "f16", fuse=False)
    print(f"{arch} unfused: worst relative logits error {worst:.2e}")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "phi3"])
def test_plan_fuses_the_known_patterns(arch_files, arch):
    """Every architecture's attention input is one fused QKV step, its FFN one GLU GEMV,
    and no rms_norm feeding linears runs as its own kernel."""
    m = _build(arch_files[arch], "cuda")
    f = m.compiled.plan.fused
    L = m.cfg.n_layers
    assert f["qkv"] == L and f["glu"] == L, f
    assert f["add"] + f["post_norm"] == 2 * L, f
    assert not any(type(s).__name__ in ("HeadOpStep", "KVStoreStep") for s in m.compiled.steps)


def test_kv_cache_types_and_device_capsule_round_trip(arch_files):
    """f16 by default; the snapshot keeps the dtype, restores byte-exact, and greedy decode
    continues identically from the original and the restored slot."""
    m = _build(arch_files["gemma3"], "cuda")
    kv = m.new_kv_cache(3, 128)
    assert kv.kv_type == "f16" and kv.k.dtype == cupy.float16
    assert m.kv_cache_bytes(3, 128, "f32") == 2 * m.kv_cache_bytes(3, 128, "f16")
    prompt = np.random.default_rng(1).integers(0, VOCAB, 40).astype(np.int32)
    m.forward(prompt, [Segment(0, 0, 40)], kv)
    for device in (False, True):
        k, v = kv.snapshot_slot(0, 40, device=device)
        assert k.dtype == np.float16
        kv.restore_slot(2, k, v, 40)
        a, b = kv.snapshot_slot(0, 40), kv.snapshot_slot(2, 40)
        assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()
    with pytest.raises(ValueError, match="float32"):
        kv.restore_slot(1, k.astype(np.float32), v.astype(np.float32), 40)
    ta = tb = int(prompt[-1])
    outs_a, outs_b = [], []
    for i in range(24):
        ids = m.greedy(np.array([ta, tb], np.int32), [Segment(0, 40 + i, 1), Segment(2, 40 + i, 1)], kv)
        ta, tb = int(ids[0]), int(ids[1])
        outs_a.append(ta)
        outs_b.append(tb)
    assert outs_a == outs_b


def test_cpu_f16_capsule_restores_into_cuda(arch_files):
    cpu, gpu = _build(arch_files["qwen3"], "cpu"), _build(arch_files["qwen3"], "cuda")
    prompt = np.random.default_rng(2).integers(0, VOCAB, 30).astype(np.int32)
    kc = cpu.new_kv_cache(1, 64, "f16")
    cpu.forward(prompt, [Segment(0, 0, 30)], kc)
    k, v = kc.snapshot_slot(0, 30)
    kg = gpu.new_kv_cache(2, 64, "f16")
    kg.restore_slot(1, k, v, 30)
    k2, v2 = kg.snapshot_slot(1, 30)
    assert k2.tobytes() == k.tobytes() and v2.tobytes() == v.tobytes()
    nxt = np.array([7], np.int32)
    ref = cpu.forward(nxt, [Segment(0, 30, 1)], kc)
    got = gpu.forward(nxt, [Segment(1, 30, 1)], kg)
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert rel < 2e-3, rel


def test_device_greedy_and_sampling_on_a_new_architecture(arch_files):
    """The graph's sampler on qwen2: device greedy ids equal the argmax of the logits it
    returns, through the graph and through the eager path."""
    m = _build(arch_files["qwen2"], "cuda")
    kv = m.new_kv_cache(2, 300)
    rng = np.random.default_rng(5)
    ids = m.greedy(rng.integers(0, VOCAB, 200).astype(np.int32), [Segment(0, 0, 200)], kv)   # eager
    assert int(ids[0]) == int(np.argmax(m.last_logits().get()[0]))
    for i in range(4):
        ids = m.greedy(np.array([int(ids[0]), 3], np.int32), [Segment(0, 200 + i, 1), Segment(1, i, 1)], kv)
        lg = m.last_logits().get()
        assert ids.tolist() == np.argmax(lg, axis=1).tolist()
