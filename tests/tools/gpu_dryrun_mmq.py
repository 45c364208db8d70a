"""The MMQ's host code by value on fake CuPy: ``python -m tests.tools.gpu_dryrun_mmq``.

For random-weight llama files of several tensor-type mixes (Q4_K with Q6_K V, down and head;
Q8_0 with a Q4_0 head; Q4_1 with a Q8_0 embedding; Q5_0 with a Q5_K down projection and a
Q5_1 head; the helpers write sane scales for these types only), built with int8
activations and ``mmq_min_rows=2`` on ``tests/tools/gpu_fake_cupy.py`` with its ``emulate``
flag: every GEMV of the program (QKV with RoPE and the KV write in both KV types, the output
projection with its residual add, gate/up with SwiGLU, down, the output head) is launched by
the program's own code (``steps.Gemv.launch``) over 2 to 150 rows of random inputs, once as
the program picks (the MMQ) and once forced to the int8 GEMV (its default variant); the
outputs and KV rows must be the same bits. ``quant_rows``, the GEMV and the MMQ are computed
by ``tests/tools/mmq_model.py`` from the memory the launch arguments address, each in its own
reduction order, so this checks the launch arguments (pointers, strides, row pairs, modes,
the norm scale) and the two orders together. Prints one line per model and
``mmq dry run OK`` last; exit code 1 on the first difference. Run in a subprocess by
tests/test_cuda_mmq_model.py (the fake must not replace a real CuPy in the test process).
"""

from __future__ import annotations

import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np

ROWS = (2, 5, 16, 33, 64, 150)


def _build(path):
    from aotx.engine.backend.cuda.backend import CudaBackend
    from aotx.engine.model.architectures import build
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    return build(cfg, gf, CudaBackend(int8_activations=True, int8_min_bytes=0, mmq_min_rows=2))


def _check_model(model, rng) -> int:
    """Every GEMV site, every row count, both KV types: MMQ vs int8 GEMV. Returns the launches compared."""
    import cupy as cp

    from aotx.engine.backend.cuda import choice as CC
    from aotx.engine.backend.cuda.kv import CudaKVCache
    from aotx.engine.backend.cuda.matrix import q8_buffers
    from aotx.engine.backend.cuda.tune import _Ctx

    prog = model.compiled
    gemvs = [g for g in prog.gemvs if g.q8]
    missing = [g.site for g in gemvs if g.mmq is None]
    assert gemvs and not missing, f"int8 GEMVs without an MMQ form: {missing} ({[g.mmq_why for g in gemvs]})"
    bmax = max(ROWS)
    kmax = max(g.k for g in gemvs)
    ldx = (kmax + 7) // 8 * 8
    ldy = (max([g.m_rows for g in gemvs] + [prog.qkv_width]) + 8) // 8 * 8
    n = 0
    for kv_type in ("f32", "f16"):
        kv = CudaKVCache(prog.n_layers, prog.n_kv, prog.head_dim, 4, 64, kv_type)
        c = _Ctx()
        c.kv = kv
        c.rope = [tuple(cp.asarray(t) for t in spec.tables(kv.n_ctx)) for spec in prog.plan.rope_specs]
        slots = cp.asarray(rng.integers(0, 4, bmax).astype(np.int32))
        pos = cp.asarray(rng.integers(0, 64, bmax).astype(np.int32))
        c.slot_p, c.pos_p = slots.data.ptr, pos.data.ptr
        c.xs = cp.zeros(bmax, cp.float32)
        c.xq, c.xd = q8_buffers(bmax, kmax)
        for g in gemvs:
            if kv_type == "f16" and g.qkv is None:
                continue                         # the KV type only changes the QKV epilogue
            for B in ROWS:
                x = cp.asarray((rng.standard_normal((bmax, ldx)) * rng.uniform(0.2, 5.0, (bmax, 1))).astype(np.float32))
                outs = []
                for forced in (None, CC.GemvVariant.parse(CC.gemv_default(B, g.nw is not None, g.m_rows, g.k, True))):
                    y = cp.zeros((bmax, ldy), cp.float32)
                    y[:] = cp.asarray(np.full((bmax, ldy), 0.25, np.float32))     # the add mode's residual
                    kv.k.fill(0)
                    kv.v.fill(0)
                    g.launch(prog, c, x.data.ptr, ldx, B, y.data.ptr, ldy, variant=forced)
                    outs.append((y.get(), kv.k.get(), kv.v.get()))
                (ym, km, vm), (yg, kg, vg) = outs
                for what, m_, g_ in (("output rows", ym, yg), ("K cache", km, kg), ("V cache", vm, vg)):
                    bad = int((m_.view(np.uint32 if m_.dtype == np.float32 else np.uint16)
                               != g_.view(np.uint32 if g_.dtype == np.float32 else np.uint16)).sum())
                    if bad:
                        raise AssertionError(f"{g.site}, {B} rows, kv {kv_type}: {bad} values of the {what} differ "
                                             f"between the MMQ and the int8 GEMV")
                if not np.isfinite(ym[:B]).all() or (g.qkv is None and not (ym[:B] != 0.25).any()):
                    raise AssertionError(f"{g.site}, {B} rows: the MMQ wrote nothing finite")
                n += 1
    return n


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.tools import gpu_fake_cupy as fake_cupy

    fake_cupy.install()
    from gguf import GGMLQuantizationType as T

    from tests.models.cuda_testmodel import write_llama

    tmp = Path(tempfile.mkdtemp(prefix="aotx-dryrun-mmq-"))
    files = {
        "q4k": write_llama(tmp / "q4k.gguf", n_layers=1, d_model=256, n_heads=4, n_kv_heads=2, ffn=512, vocab=300,
                           qtype=T.Q4_K, layer_types={"attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K},
                           emb_qtype=T.Q4_K, out_qtype=T.Q6_K),
        "q8": write_llama(tmp / "q8.gguf", n_layers=1, d_model=128, n_heads=2, n_kv_heads=1, ffn=256, vocab=301,
                          qtype=T.Q8_0, out_qtype=T.Q4_0),
        "q41": write_llama(tmp / "q41.gguf", n_layers=1, d_model=192, n_heads=3, n_kv_heads=1, ffn=384, vocab=256,
                           qtype=T.Q4_1, emb_qtype=T.Q8_0),
        "q5": write_llama(tmp / "q5.gguf", n_layers=1, d_model=128, n_heads=2, n_kv_heads=1, ffn=256, vocab=200,
                          qtype=T.Q5_0, layer_types={"ffn_down.weight": T.Q5_K}, out_qtype=T.Q5_1),
    }
    rng = np.random.default_rng(0)
    fake_cupy.emulate = True
    try:
        for name, path in files.items():
            try:
                n = _check_model(_build(path), rng)
            except Exception:  # noqa: BLE001 - report the model and stop
                print(f"FAIL {name}")
                traceback.print_exc()
                return 1
            print(f"ok   {name}: {n} launches, the MMQ's bits = the int8 GEMV's")
    finally:
        fake_cupy.emulate = False
    print("mmq dry run OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
