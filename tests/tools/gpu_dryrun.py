"""Run the CUDA backend's host code on the CPU against fake CuPy: ``python -m tests.tools.gpu_dryrun``.

Every kernel launch and cuBLAS call of the scenarios below is checked by
``tests/tools/gpu_fake_cupy.py`` (argument lists against the kernels' signatures, pointers
inside their allocations, GEMM extents); the numbers are not computed. Scenarios, on
random-weight llama files (``tests/models/cuda_testmodel.py``): every prefill mode
(default choice, f16, tf32, f32, gemv), the KV types (f16, f32, and the quantized q8_0 and
q4_0 with their rotation: stores, loads and the cuBLAS path's dequantization checked like every
other launch), fused and generic kernels, every
GEMV variant forced (float and int8 activations), the MMQ (int8 tensor cores) from 2 rows
and turned off, graph buckets 1 to 128 and the eager path past them, the persistent decode step (tests/tools/persistent_step.py), a QK-norm-free
model with mixed tensor types and an untied odd vocabulary, and the kernel-choice tuner
(policy force, then reuse of the artifact it wrote). Prints one line per scenario and
``dry run OK`` last; exit code 1 on the first violation.

Run in a subprocess by tests/test_cuda_host.py (the fake must not replace a real CuPy in
the test process).
"""

from __future__ import annotations

import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np


def _build(path, **backend_kw):
    """The model on ``CudaBackend(**backend_kw)``; with ``persistent`` among them, on the
    persistent decode step's backend (tests/tools/persistent_step.py)."""
    from aotx.engine.backend.cuda.backend import CudaBackend
    from aotx.engine.model.architectures import build
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile

    from tests.tools import persistent_step

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    be = persistent_step.backend(**backend_kw) if "persistent" in backend_kw else CudaBackend(**backend_kw)
    return build(cfg, gf, be)


def _exercise(model, kv_type: str) -> None:
    from aotx.engine.model.batch import Segment

    V = model.cfg.vocab_size
    rng = np.random.default_rng(0)
    kv = model.new_kv_cache(4, 512, kv_type)
    toks = rng.integers(0, V, 300).astype(np.int32)
    model.forward(toks[:150], [Segment(0, 0, 150, all_logits=True)], kv)          # eager: more rows than a graph
    model.forward(toks[:40], [Segment(1, 0, 40)], kv)                         # graph bucket 64
    model.forward(toks[:1], [Segment(0, 150, 1)], kv)                        # graph bucket 1
    model.forward(toks[:3], [Segment(0, 151, 1), Segment(1, 40, 1), Segment(2, 0, 1)], kv)
    model.forward(toks[:129], [Segment(2, 1, 129)], kv)                       # past b_max 128: eager, 1 logits row
    model.forward(toks[:20], [Segment(3, 0, 10), Segment(3, 10, 10)], kv)     # one slot twice: eager, short rows
    model.forward(toks[:5], [Segment(0, 152, 5, all_logits=True)], kv)        # a verify window
    model.forward(toks[:200], [Segment(1, 41, 180, logits=False), Segment(2, 130, 20)], kv)   # long + short
    # the same long segments on the cuBLAS attention path (these tiny models' prompts are
    # within ATT_KERNEL_WORK, where long segments take the attention kernel)
    from aotx.engine.backend.cuda import attention as CA

    # (the flash-style kernel, then the cuBLAS path it falls back to)
    work, flash, CA.ATT_KERNEL_WORK = CA.ATT_KERNEL_WORK, CA.FLASH_ATTENTION, 0
    try:
        for CA.FLASH_ATTENTION in (True, False):
            model.forward(toks[:150], [Segment(0, 0, 150, all_logits=True)], kv)
            model.forward(toks[:200], [Segment(1, 41, 180, logits=False), Segment(2, 130, 20)], kv)
    finally:
        CA.ATT_KERNEL_WORK, CA.FLASH_ATTENTION = work, flash


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.tools import gpu_fake_cupy as fake_cupy

    fake_cupy.install()
    from aotx.engine.backend.cuda import choice as CC
    from gguf import GGMLQuantizationType as T

    from tests.models.cuda_testmodel import write_llama

    tmp = Path(tempfile.mkdtemp(prefix="aotx-dryrun-"))
    files = {
        "q4k": write_llama(tmp / "q4k.gguf", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, ffn=512, vocab=512,
                           qtype=T.Q4_K, layer_types={"attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K},
                           emb_qtype=T.Q4_K, out_qtype=T.Q6_K),
        "q8": write_llama(tmp / "q8.gguf", n_layers=2, d_model=128, n_heads=2, n_kv_heads=1, ffn=256, vocab=301,
                          qtype=T.Q8_0, out_qtype=T.Q4_0),
        "q41": write_llama(tmp / "q41.gguf", n_layers=2, d_model=192, n_heads=3, n_kv_heads=1, ffn=384, vocab=256,
                           qtype=T.Q4_1, emb_qtype=T.Q8_0),
    }
    scenarios = []
    for name in files:
        for kv_type in ("f16", "f32", "q8_0", "q4_0"):
            scenarios.append((f"{name} default kernels, kv {kv_type}", name, {}, kv_type))
        # a quantized cache through the generic kernels (the separate KV store) and the GEMV prefill
        scenarios.append((f"{name} generic kernels, kv q8_0", name, {"fuse": False}, "q8_0"))
        scenarios.append((f"{name} prefill gemv, kv q4_0", name, {"prefill": "gemv"}, "q4_0"))
        # every prefill mode and the persistent step on the first file (the others: their default mode,
        # and the GEMV prefill above; CI's time budget)
        for mode in ("f16", "tf32", "f32", "gemv") if name == "q4k" else ("f32",):
            scenarios.append((f"{name} prefill {mode}", name, {"prefill": mode}, "f16"))
        scenarios.append((f"{name} generic kernels", name, {"fuse": False}, "f16"))
        for kv_type in ("f16", "f32") if name == "q4k" else ():   # the persistent decode step (tests/tools), buckets 1-8
            scenarios.append((f"{name} persistent step, kv {kv_type}", name, {"persistent": "on"}, kv_type))
        scenarios.append((f"{name} prefill tiles (no dense copies)", name, {"dense_prefill": False}, "f16"))
        # gemm_min_rows: batches of 3+ rows (the 3-slot decode, the 40-row chunk) on the eager path's GEMMs
        scenarios.append((f"{name} gemm_min_rows 3", name, {"gemm_min_rows": 3}, "f16"))
    variants = sorted({c for b in CC.TUNE_BUCKETS for norm in (False, True) for c in CC.gemv_candidates(b, norm)})
    for v in variants:
        scenarios.append((f"q4k gemv {v}", "q4k", {"gemv": v, "prefill": "gemv"}, "f16"))
    for v in sorted({c for b in CC.TUNE_BUCKETS for norm in (False, True) for c in CC.gemv_candidates(b, norm, True)}):
        scenarios.append((f"q4k int8 activations, gemv {v}", "q4k", {"gemv": v, "prefill": "gemv",
                                                                     "int8_activations": True, "int8_min_bytes": 0}, "f16"))
    for name in files:
        scenarios.append((f"{name} int8 activations, default kernels", name,
                          {"int8_activations": True, "int8_min_bytes": 0}, "f16"))
    for name in files:                      # the MMQ from 2 rows: every graph bucket but 1, and the eager path's 150 rows
        scenarios.append((f"{name} int8 activations, MMQ from 2 rows, prefill gemv", name,
                          {"int8_activations": True, "int8_min_bytes": 0, "mmq_min_rows": 2, "prefill": "gemv"}, "f16"))
    scenarios.append(("q4k int8 activations, MMQ off", "q4k",
                      {"int8_activations": True, "int8_min_bytes": 0, "mmq_min_rows": None}, "f16"))
    scenarios.append(("q4k int8 asked below the size rule: float", "q4k", {"int8_activations": True}, "f16"))
    scenarios.append(("q4k over the dense budget: tiles", "q4k", {"_dense_max": 1 << 20}, "f16"))
    root = tmp / "home"
    # no time budget for the tuner on the fake: on a loaded machine a 30 s budget ran out before every
    # site was timed, and the reuse check below then found a partial artifact
    scenarios.append(("q4k tuner (force)", "q4k", {"tune": "force", "artifact_root": root, "tune_budget_s": 1e9},
                      "f16"))
    scenarios.append(("q4k artifact reused", "q4k", {"tune": "reuse", "artifact_root": root}, "f16"))
    scenarios.append(("q8 tuner (auto, new shapes)", "q8", {"tune": "auto", "artifact_root": root}, "f16"))
    scenarios.append(("q4k tuner, int8 activations (auto)", "q4k", {"tune": "auto", "artifact_root": root,
                                                                  "int8_activations": True, "int8_min_bytes": 0}, "f16"))
    for label, name, kw, kv_type in scenarios:
        before = fake_cupy.stats["launches"]
        from aotx.engine.backend.cuda import gemm as cuda_gemm

        cap = cuda_gemm.DENSE_MAX_BYTES
        try:
            kw = dict(kw)
            cuda_gemm.DENSE_MAX_BYTES = kw.pop("_dense_max", cap)
            over = cuda_gemm.DENSE_MAX_BYTES != cap
            model = _build(files[name], **kw)
            if over:
                kw["dense_prefill"] = False      # what the check below expects: the budget refused them
                assert model.compiled.gemm.dense_reason.startswith("tiles: dense copies would take"), \
                    model.compiled.gemm.dense_reason
            _exercise(model, kv_type)
            # int8 activations: every GEMV of integer types on them when forced (int8_min_bytes 0);
            # asked on a model below the size rule (these tiny ones): none, and the numerics say so
            q8 = [g.q8 for g in model.compiled.gemvs]
            if kw.get("int8_activations"):
                want = kw.get("int8_min_bytes") == 0
                assert any(q8) == want and model.compiled.backend.numerics == ("cuda-int8" if want else "cuda-f32"), \
                    (q8, model.compiled.backend.numerics)
            else:
                assert not any(q8), q8
            # the MMQ: every int8 GEMV has its form unless turned off (the fake is an sm_90 device)
            from aotx.engine.backend.cuda import mmq as MQ

            mmq = [g.mmq is not None for g in model.compiled.gemvs if g.q8]
            assert all(mmq) if kw.get("mmq_min_rows", MQ.DEFAULT_MIN_ROWS) is not None else not any(mmq), \
                [g.mmq_why for g in model.compiled.gemvs]
        except Exception:
            print(f"FAIL {label}")
            traceback.print_exc()
            return 1
        finally:
            cuda_gemm.DENSE_MAX_BYTES = cap
        kc = model.compiled.kernel_choice
        extra = f"; kernel choice: {kc.summary()}" if kw.get("tune") else ""
        g = model.compiled.gemm
        if kw.get("prefill") != "gemv":
            dense = kw.get("dense_prefill", True)
            if bool(g._dense_ok) != dense or (dense and len(g._dense) != len(g._dense_ok)) or \
                    (not dense and g._dense) or model.prefill_weight_bytes != g.weight_bytes:
                print(f"FAIL {label}: dense prefill copies {g.dense_reason!r}, {len(g._dense)} made of "
                      f"{len(g._dense_ok)}, prefill_weight_bytes {model.prefill_weight_bytes}")
                return 1
            extra += f"; {g.dense_reason}"
        print(f"ok   {label}: {fake_cupy.stats['launches'] - before} launches{extra}")
    print(f"dry run OK: {fake_cupy.stats['launches']} launches, {fake_cupy.stats['gemms']} GEMMs, "
          f"{fake_cupy.stats['captures']} graph captures, kernels: {', '.join(sorted(fake_cupy.stats['kernels']))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
