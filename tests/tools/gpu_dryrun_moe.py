"""The CUDA backend's mixture-of-experts path on the CPU against fake CuPy (issue 22):
``python -m tests.tools.gpu_dryrun_moe``.

Like ``tests/tools/gpu_dryrun.py`` (every launch checked by ``gpu_fake_cupy``; kernels do
not run, so the device numbers are garbage), on tiny qwen3moe and olmoe files with
head dimension 32 (the CUDA attention kernel's smallest): the plan's host moe steps, every
forward on the eager path (no graph capture), the host step's rows back in the device
buffer with the shape of the op's output (compared against ``cpu_moe.moe_rows`` run on the
same host rows), device sampling, and the expert-tier setup (calibrate, plan, place) on the
CUDA program. Prints one line per scenario and ``moe dry run OK`` last; exit code 1 on the
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


def _build(path):
    from aotx.engine.backend.cuda import CudaBackend
    from aotx.engine.model.architectures import build
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    return build(cfg, gf, CudaBackend())


def _exercise(model, fake) -> None:
    from aotx.engine.backend import cpu_moe
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

    def spy(attrs, x, pool, traffic=None, small=None):
        y = real(attrs, x, pool, traffic, small)
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


def _setup(model, root) -> str:
    from aotx.engine.model import experts as X
    from aotx.engine.runtime import admission

    st = X.setup(model, model_fp="dryrun", gpu_bytes=1 << 30, host_bytes=None, root=root)
    assert st.plan.count("host") == st.plan.n_experts, st.plan.summary()
    assert set(st.stages) == {"experts calibrate", "experts plan", "experts place", "experts replan"}
    lines = admission.check_experts(st.plan, sum(x.n_expert * x.expert_bytes for x in X.moe_layers(model.program)),
                                    64 << 30, gpu=True)
    assert "CPU tier" in lines[-1], lines
    return st.plan.summary()


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.tools import gpu_fake_cupy as fake

    fake.install()
    from tests import models as tm

    tmp = Path(tempfile.mkdtemp(prefix="aotx-dryrun-moe-"))
    tok = _toy_tokenizer(tm)
    files = {"qwen3moe": tm.qwen3moe.write(tmp / "qwen3moe.gguf", tok),
             "olmoe": tm.olmoe.write(tmp / "olmoe.gguf", tok, d_model=128)}
    for name, path in files.items():
        try:
            model = _build(path)
            _exercise(model, fake)
            summary = _setup(model, tmp / "home")
        except Exception:  # noqa: BLE001 - report the scenario and stop
            print(f"FAIL {name}")
            traceback.print_exc()
            return 1
        print(f"ok   {name}: {len(model.compiled.moe_steps)} host moe steps; {summary}")
    print(f"moe dry run OK: {fake.stats['launches']} launches, {fake.stats['captures']} graph captures")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
