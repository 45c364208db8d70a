"""Where CUDA's quantized KV blocks differ from the CPU's (issue 33's one-byte-per-block gap).

    PYTHONPATH=<checkout>.path python -m tests.tools.kvq_diag

For each head size (64: rotated, 32: not) and KV type: the scenario of tests/test_cuda_kv_quant.py
(a 150-token prefill into slot 0), layer 0's K and V bytes from both backends, and:
* the mismatches by byte offset inside a block (0-1: the float16 scale) and by position;
* CUDA's float32 cache (the same scenario with ``f32``) quantized by the CPU's own quantizer
  (hd 32: no rotation) against CUDA's quantized bytes: the quantizer alone, same inputs;
* the scale's bits where they differ (a few examples).
"""

from __future__ import annotations

import numpy as np
from aotx.engine.backend.cpu import kvquant as Q
from aotx.engine.model.batch import Segment
from gguf import GGMLQuantizationType as T

from tests.models.cuda_testmodel import write_llama


def _build(path, device: str):
    """The model on one backend (tests/test_cuda_kv_quant.py's: CPU float32 activations, CUDA f32 prefill)."""
    from aotx.engine.model.architectures import build
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    if device == "cpu":
        from aotx.engine.backend.cpu.backend import CpuBackend

        return build(cfg, gf, CpuBackend(int8_activations=False))
    from aotx.engine.backend.cuda.backend import CudaBackend

    return build(cfg, gf, CudaBackend(prefill="f32"))


def _fill(model, kv_type):
    V = model.cfg.vocab_size
    toks = np.random.default_rng(5).integers(0, V, 160).astype(np.int32)
    kv = model.new_kv_cache(4, 256, kv_type)
    model.forward(toks[:150], [Segment(0, 0, 150, all_logits=True)], kv)
    return kv.snapshot_slot(0, 150)


def main() -> None:
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp())
    for hd in (32, 64):
        path = write_llama(d / f"kvq{hd}.gguf", n_layers=2, d_model=2 * hd, n_heads=2, n_kv_heads=1, ffn=256,
                           vocab=301, qtype=T.Q8_0, seed=11)
        cpu, cuda = _build(path, "cpu"), _build(path, "cuda")
        fk_g, fv_g = _fill(cuda, "f32")
        fk_c, fv_c = _fill(cpu, "f32")
        print(f"== hd {hd}: f32 cache layer 0 K CUDA vs CPU: max |d| {np.abs(fk_g[0] - fk_c[0]).max():.3e}, "
              f"equal {float((fk_g[0] == fk_c[0]).mean()):.4f}; shapes {fk_g.shape}")
        for kv_type in ("q8_0", "q4_0"):
            bb = 34 if kv_type == "q8_0" else 18
            k_g, v_g = _fill(cuda, kv_type)
            k_c, v_c = _fill(cpu, kv_type)
            for name, a, b, f in (("K", k_g[0], k_c[0], fk_g[0]), ("V", v_g[0], v_c[0], fv_g[0])):
                a = np.ascontiguousarray(a)
                b = np.ascontiguousarray(b)
                ne = a != b
                blocks = ne.reshape(-1, bb)
                by_off = blocks.sum(axis=0)
                print(f"{kv_type} {name}: shape {a.shape}, equal {1 - ne.mean():.4f}; mismatches by offset in "
                      f"block {by_off.tolist()}")
                pos_bad = ne.reshape(a.shape[0], a.shape[1], -1).any(axis=2) if a.ndim >= 3 else ne
                print(f"   positions with a mismatch (head 0): {np.flatnonzero(pos_bad[0])[:20].tolist()} "
                      f"of {pos_bad.shape[1]}")
                if hd == 32:
                    mine = Q.quantize(f, kv_type)
                    m2 = mine != a
                    print(f"   CPU quantizer on CUDA's f32 {name}: equal to CUDA's blocks {1 - m2.mean():.4f}; "
                          f"by offset {m2.reshape(-1, bb).sum(axis=0).tolist()}")
                idx = np.flatnonzero(blocks[:, 0] | blocks[:, 1])[:4]
                for i in idx:
                    ga = blocks.shape
                    ra, rb_ = a.reshape(-1, bb)[i], b.reshape(-1, bb)[i]
                    print(f"   block {i}: CUDA scale {ra[:2].view(np.float16)[0]!r} bytes {ra[:6].tolist()} | "
                          f"CPU {rb_[:2].view(np.float16)[0]!r} bytes {rb_[:6].tolist()}")


if __name__ == "__main__":
    main()
