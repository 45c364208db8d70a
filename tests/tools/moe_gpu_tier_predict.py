"""The expert-tier calibration's predicted decode speed against the measured one, on a GPU
(issue 22, the GPU tier's fixed + marginal cost): ``python -m tests.tools.moe_gpu_tier_predict``.

On the tiny qwen3moe, olmoe and gpt-oss files of tests/test_cuda_moe.py (toy vocabulary,
head dimension 32), through the CUDA backend: the setup (calibration, plan, placement) under
three GPU expert budgets: every expert ("all"), 40% of the experts' bytes ("40%") and none
("cpu"); for each, the plan's ``decode_tok_s`` next to batch-1 decode tokens/s measured over
``--steps`` forward steps (the best of two rounds, after a warm-up), and their ratio. Per
model, layer 0's GPU-tier timings: one expert's call, the layer-shaped call of k experts on
1 and 16 rows, and the split (fixed, marginal per expert) with what it models for the layer
call. Prints one table; exit 1 when a model fails to run (a prediction off is not a failure:
the numbers are for reading).

Tiny models' expert work is a few microseconds: the fixed part (launches, the table upload,
the copy down, the sync) is most of a GPU-tier call, which is what this shows.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
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


def _decode_tok_s(model, steps: int) -> float:
    """Batch-1 decode tokens/s: the best of two rounds of ``steps`` one-token forwards after
    a warm-up round, on one slot after a 16-token prompt."""
    from aotx.engine.model.batch import Segment

    rng = np.random.default_rng(0)
    kv = model.new_kv_cache(1, 16 + 3 * steps + 8)
    model.forward(rng.integers(0, VOCAB, 16).astype(np.int32), [Segment(0, 0, 16)], kv)
    pos, best = 16, 0.0
    for r in range(3):                      # round 0 warms up
        toks = rng.integers(0, VOCAB, steps).astype(np.int32)
        t0 = time.perf_counter()
        for i in range(steps):
            model.forward(toks[i:i + 1], [Segment(0, pos + i, 1)], kv)
        dt = time.perf_counter() - t0
        pos += steps
        if r:
            best = max(best, steps / dt)
    return best


def run(name: str, path: Path, home: Path, steps: int) -> list[str]:
    from aotx.engine.backend.cuda.backend import CudaBackend
    from aotx.engine.model import experts as X
    from aotx.engine.model.architectures import build
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    model = build(cfg, gf, CudaBackend())
    layers = X.moe_layers(model.program)
    total = sum(L.n_expert * L.expert_bytes for L in layers)
    out = []
    m = model.compiled.measure_experts(0, X.CALIBRATION_ROWS)
    fixed, line = X.gpu_split(m["gpu_one"], m["gpu_layer"], m["gpu_k"], X.CALIBRATION_ROWS)
    k = m["gpu_k"]
    out.append(f"{name}: layer 0 GPU tier: one expert {m['gpu_one'] * 1e6:.1f} us; {k} experts x 1 row "
               f"{m['gpu_layer'][1] * 1e6:.1f} us (model {(fixed + k * line(1)) * 1e6:.1f}), x 16 rows "
               f"{m['gpu_layer'][16] * 1e6:.1f} us (model {(fixed + k * line(16)) * 1e6:.1f}); fixed "
               f"{fixed * 1e6:.1f} us, per expert {line.a * 1e6:.2f} + {line.b * 1e6:.3f} n us; "
               f"CPU per expert {m['cpu'][1] * 1e6:.1f} us (1 row)")
    first = True
    for label, budget in (("all", 4 * total), ("40%", int(0.4 * total)), ("cpu", 0)):
        st = X.setup(model, model_fp=f"predict-{name}", gpu_bytes=budget, root=home, reuse=not first)
        first = False
        got = _decode_tok_s(model, steps)
        pred = st.plan.decode_tok_s
        out.append(f"  {name:9} {label:4} {st.plan.count('gpu'):3}/{st.plan.n_experts:<3} gpu  predicted "
                   f"{pred:8.1f}  measured {got:8.1f} tok/s  ratio {pred / got if got else float('nan'):5.2f}  "
                   f"(dense {st.costs.dense_decode_s * 1e3:.2f} ms)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="decode steps per timed round")
    ap.add_argument("--models", default="qwen3moe,olmoe,gptoss")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests import models as tm

    tmp = Path(tempfile.mkdtemp(prefix="aotx-moe-predict-"))
    tok = _toy_tokenizer(tm)
    writers = {"qwen3moe": lambda: tm.qwen3moe.write(tmp / "qwen3moe.gguf", tok),
               "olmoe": lambda: tm.olmoe.write(tmp / "olmoe.gguf", tok, d_model=128),
               "gptoss": lambda: tm.gptoss.write(tmp / "gptoss.gguf", tok)}
    fail = 0
    lines = []
    for name in a.models.split(","):
        t0 = time.perf_counter()
        try:
            got = run(name, writers[name](), tmp / "home", a.steps)
        except Exception:  # noqa: BLE001 - report the model and go on
            print(f"FAIL {name}")
            traceback.print_exc()
            fail = 1
            continue
        for ln in got:
            print(ln, flush=True)
        print(f"  ({name}: {time.perf_counter() - t0:.1f} s)", flush=True)
        lines += got
    print("== predicted vs measured decode (batch 1)")
    for ln in lines:
        if ln.startswith("  "):
            print(ln)
    return fail


if __name__ == "__main__":
    raise SystemExit(main())
