#!/usr/bin/env python3
"""How close AOTX's gemma4 mixture of experts gets to llama.cpp without activation rounding
(a one-off check, never run in CI; the numbers are in tests/data/refs/hybrid/README.md).

Writes ``gemma4moe`` (tests/models.HYBRID) with every weight F32 (12 MB), runs
40 random tokens through llama.cpp (llama-cpp-python 0.3.36 in its own venv, f32 KV cache,
one eval), AOTX's CPU executor (float32, f32 KV) and the float64 interpreter of the same
Program (tests/program_reference.py), the latter also with ggml's CPU GELU (the input and
the result rounded to float16, as its table does). Prints max and mean |logit diff|:

    PYTHONPATH=<worktree>.path:<worktree> python tests/tools/check_gemma4moe_f32.py \\
        --smollm2 PATH/SmolLM2-135M-Instruct.Q4_1.gguf [--llama-python /work/llama-venv/bin/python]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LLAMA = """
import sys, numpy as np
from llama_cpp import Llama
m = Llama(model_path=sys.argv[1], n_ctx=64, n_batch=64, logits_all=True, verbose=False, type_k=0, type_v=0)
ids = [int(i) for i in np.load(sys.argv[2])]
m.eval(ids)
np.save(sys.argv[3], np.array(m.scores[:len(ids)], np.float32))
"""
GELU = "0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))"
GELU16 = '''
def _gelu16(g):
    x = g.astype(np.float16).astype(np.float64)
    y = (0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))).astype(np.float16)
    return np.where(g <= -10, 0.0, np.where(g >= 10, g, y.astype(np.float64)))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2", required=True)
    ap.add_argument("--llama-python", default="/work/llama-venv/bin/python")
    args = ap.parse_args()
    from aotx.engine.backend.cpu.backend import CpuBackend
    from aotx.engine.model.architectures import gemma4
    from aotx.engine.model.batch import Segment
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.transformer import build
    from tests import models, program_reference

    roles = ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_inp",
             "ffn_gate_up_exps", "ffn_down_exps")
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        path = models.write("gemma4moe", td / "f32.gguf", models.tokenizer_from_gguf(args.smollm2),
                            types={r: T.F32 for r in roles})
        ids = np.random.default_rng(3).integers(0, 49152, 40).astype(np.int32)
        np.save(td / "ids.npy", ids)
        subprocess.run([args.llama_python, "-c", LLAMA, str(path), str(td / "ids.npy"), str(td / "lc.npy")], check=True)
        lc = np.load(td / "lc.npy")
        gf = GGUFFile.open(path)
        model = build(ModelConfig.from_metadata(gf.metadata, str(path)), gf, CpuBackend(), gemma4)
        got = model.forward(ids, [Segment(0, 0, len(ids), all_logits=True)], model.new_kv_cache(1, 48, "f32"))
        f64 = program_reference.reference_logits(model.program, ids, n_ctx=48)
        src = Path(program_reference.__file__).read_text(encoding="utf-8")
        g16 = types.ModuleType("program_reference_gelu16")
        exec(compile(src.replace(GELU, "_gelu16(g)") + GELU16, "program_reference_gelu16", "exec"), g16.__dict__)
        f64_16 = g16.reference_logits(model.program, ids, n_ctx=48)
    for what, a, b in (("AOTX f32 vs llama.cpp", got, lc), ("float64 vs llama.cpp", f64, lc),
                       ("float64 with ggml's f16 GELU vs llama.cpp", f64_16, lc), ("AOTX f32 vs float64", got, f64)):
        d = np.abs(np.asarray(a, np.float64) - b)
        print(f"{what}: max {d.max():.4g}, mean {d.mean():.4g}")


if __name__ == "__main__":
    main()
