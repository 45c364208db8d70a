"""Quantized KV caches (q8_0, q4_0) on CUDA against the CPU path, per KV type.

The two backends keep a slot's K and V in the same bytes (engine/backend/kvformat.py: ggml's
blocks, rotated by the Walsh-Hadamard matrix where the head size is a multiple of 64) and
quantize and rotate with the same operations in the same order (kernels/kv_quant.cu and
cpu/kvquant.py). On a random llama file with 64-wide heads (rotation on) and one with 32-wide
heads (no rotation), each KV type runs the same scenario on both backends: a prefill of 150
rows with every row's logits (eager: the flash-style kernel), then decode steps of three slots
(the captured graph, a padded row) and a decode at position 150 (the split attention).

* layer 0's K and V bytes, whose inputs differ between the backends only by float32
  summation order, are the same blocks but for rare one-step flips;
* the logits: CUDA's distance from the CPU's with the same cache is well inside what the
  quantization itself moves the CPU's logits (its distance from its own float32 cache);
* a capsule of a quantized CUDA slot restores byte-exact and decodes identically.

Skips where CuPy or a CUDA device is absent. The lead's command (a GPU machine):
    PYTHONPATH=<checkout>.path python -m pytest -q tests/test_cuda_kv_quant.py
"""

from __future__ import annotations

import numpy as np
import pytest

try:
    import cupy

    _n_dev = cupy.cuda.runtime.getDeviceCount()
except Exception as e:
    pytest.skip(f"no CUDA device: {type(e).__name__}: {e}", allow_module_level=True)
if _n_dev < 1:
    pytest.skip("no CUDA device: CuPy sees 0 devices", allow_module_level=True)

from aotx.engine.backend.cpu import kvquant as Q
from aotx.engine.model.batch import Segment
from aotx.engine.state import capsule as C
from gguf import GGMLQuantizationType as T

from tests.models.cuda_testmodel import write_llama

pytestmark = pytest.mark.cuda

REL_TOL = 1e-3          # float32 on both sides, only the order of sums differs (test_cuda_parity's)


def _build(path, device: str):
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

        be = CudaBackend(prefill="f32")
    return build(cfg, gf, be)


@pytest.fixture(scope="module", params=[64, 32], ids=["hd64-rotated", "hd32"])
def pair(request, tmp_path_factory):
    hd = request.param
    path = write_llama(tmp_path_factory.mktemp("kvq") / f"kvq{hd}.gguf", n_layers=2, d_model=2 * hd, n_heads=2,
                       n_kv_heads=1, ffn=256, vocab=301, qtype=T.Q8_0, seed=11)
    return _build(path, "cpu"), _build(path, "cuda")


def _scenario(model, kv_type: str) -> tuple[list[np.ndarray], object]:
    V = model.cfg.vocab_size
    toks = np.random.default_rng(5).integers(0, V, 160).astype(np.int32)
    kv = model.new_kv_cache(4, 256, kv_type)
    out = [model.forward(toks[:150], [Segment(0, 0, 150, all_logits=True)], kv)]
    model.forward(toks[:20], [Segment(1, 0, 20)], kv)
    model.forward(toks[:9], [Segment(2, 0, 9)], kv)
    for i in range(3):       # three slots decoding: the captured graph (bucket 4, one padded row)
        out.append(model.forward(toks[150 + i:153 + i], [Segment(0, 150 + i, 1), Segment(1, 20 + i, 1),
                                                         Segment(2, 9 + i, 1)], kv))
    return out, kv


def _rel(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    x, y = np.concatenate([r.ravel() for r in a]), np.concatenate([r.ravel() for r in b])
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_cuda_and_cpu_keep_the_same_blocks_and_close_logits(pair, kv_type):
    cpu, cuda = pair
    got, kv_g = _scenario(cuda, kv_type)
    want, kv_c = _scenario(cpu, kv_type)
    exact, _ = _scenario(cpu, "f32")
    k_c, v_c = kv_c.snapshot_slot(0, 150)
    k_g, v_g = kv_g.snapshot_slot(0, 150)
    assert k_g.dtype == np.uint8 and k_g.shape == k_c.shape
    for name, a, b in (("K", k_g[0], k_c[0]), ("V", v_g[0], v_c[0])):   # layer 0: inputs equal but for sum order
        same = float((a == b).mean())
        assert same >= 0.99, f"{kv_type} layer 0 {name}: {same:.4f} of the bytes equal"
        hd = cpu.cfg.head_dim
        da, db = Q.dequantize(a, kv_type, hd), Q.dequantize(b, kv_type, hd)
        step = np.abs(db).max() / (127 if kv_type == "q8_0" else 7)
        assert np.abs(da - db).max() <= step * 1.01, (kv_type, name)
    apart, quant = _rel(got, want), _rel(want, exact)
    print(f"\n{kv_type} hd {cpu.cfg.head_dim}: CUDA vs CPU {apart:.2e}, the quantization's own effect {quant:.2e}")
    assert apart <= 0.25 * quant + REL_TOL, (apart, quant)


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_a_quantized_cuda_capsule_restores_byte_exact(pair, kv_type):
    _, cuda = pair
    toks = np.random.default_rng(6).integers(0, cuda.cfg.vocab_size, 60).astype(np.int32)
    kv = cuda.new_kv_cache(2, 128, kv_type)
    cuda.forward(toks[:50], [Segment(0, 0, 50)], kv)
    cap = C.snapshot(kv, 0, toks[:50].tolist(), fingerprint="t")
    assert cap.header.kv_type == kv_type and cap.k.dtype == np.uint8
    straight = [cuda.forward(toks[50 + i:51 + i], [Segment(0, 50 + i, 1)], kv) for i in range(4)]
    cuda.forward(toks[:30], [Segment(1, 0, 30)], kv)        # the slot held something else
    C.restore(cap, kv, 1, fingerprint="t")
    k, v = kv.snapshot_slot(1, 50)
    assert k.tobytes() == cap.k.tobytes() and v.tobytes() == cap.v.tobytes()
    again = [cuda.forward(toks[50 + i:51 + i], [Segment(1, 50 + i, 1)], kv) for i in range(4)]
    for a, b in zip(straight, again):
        np.testing.assert_array_equal(a, b)
