#!/usr/bin/env python3
"""Qwen3.5 (``qwen35``: gated DeltaNet + gated attention) on the CPU: AOTX next to llama.cpp on
random-weight files of the exact Qwen3.5-0.8B and -2B shapes (issue 35). On a quiet machine:

    PYTHONPATH=<checkout>.path:<checkout> .venv/bin/python -m tests.tools.bench_hybrid_cpu \\
        --peer /work/llama-venv/bin/python [--shape qwen3.5-0.8b,qwen3.5-2b] [--rounds 3] [--threads 2]

Writes each shape's file once into ``--dir`` (``tests/models/hybrid_shapes.py``: Q4_K_M's
tensor types, Qwen3.5's own vocabulary padded to 248,320 rows; ~0.5 and ~1.2 GB), then, per
round, runs two subprocesses one after the other: AOTX (``engine.cli.bench.bench_model``, the
model part of ``aotx bench``: prefill of 512 tokens from position 0, the median of
``--repeats``; batch-1 greedy decode of DECODE_STEPS tokens after a short chat prompt) and
llama.cpp through llama-cpp-python (the same counts, timed by its own perf counters), both
with ``--threads`` threads (AOTX: numba's) and OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE unset.
Prints per shape the medians over the rounds and the AOTX / llama.cpp ratios.

The llama.cpp side imports nothing from AOTX: it runs under the peer's Python.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

PREFILL = 512
DECODE_STEPS = 64
PROMPT = "<|im_start|>user\nTell me a long story.<|im_end|>\n<|im_start|>assistant\n"
TEXT = ("The river ran slow and brown past the mill, and the miller's children "
        "counted the barges as they went by, naming each one after a bird. ") * 60
ROOT = Path(__file__).resolve().parents[2]


def write_file(shape: str, folder: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.models import hybrid_shapes

    path = folder / f"aotx-bench-{shape}-q4_k_m-shape.gguf"
    if not path.is_file():
        tmp = path.with_suffix(".tmp")
        t = time.perf_counter()
        hybrid_shapes.write(tmp, shape)
        os.replace(tmp, path)
        print(f"wrote {path} ({path.stat().st_size:,} bytes) in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return path


def side_aotx(model: str, threads: int, repeats: int) -> dict:
    import numba

    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    from aotx.engine.cli.bench import bench_model
    from aotx.engine.model.loader import load_model

    t = time.perf_counter()
    lm = load_model(model, device="cpu")
    load_s = time.perf_counter() - t
    r = bench_model(lm, sizes=(PREFILL,), decode_steps=DECODE_STEPS, repeats=repeats)
    return {"engine": "aotx", "load_s": round(load_s, 2), "prefill_tok_s": r["prefill_tok_s"][PREFILL],
            "decode_tok_s": r["decode_tok_s"]}


def profile_aotx(model: str, threads: int, steps: int = 16) -> dict:
    """Where a forward's time goes: seconds per op kind (and per recurrent op), summed over the
    layers, for one prefill of PREFILL tokens and for ``steps`` decode steps (each step of the
    compiled program timed around its closure; the first forward of each kind warms up)."""
    import numba
    import numpy as np

    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    from aotx.engine.model.batch import Segment
    from aotx.engine.model.loader import load_model

    lm = load_model(model, device="cpu")
    cp = lm.model.compiled
    nodes = cp.program.nodes
    acc: dict[str, float] = {}

    def key(n) -> str:
        return f"linear:{re.sub(r'blk[.][0-9]+[.]', '', n.outs[0].name)}" if n.op == "linear" else n.op

    def timed(step, k):
        def run(env, bt, kv):
            t = time.perf_counter()
            step(env, bt, kv)
            acc[k] = acc.get(k, 0.0) + time.perf_counter() - t
        return run

    cp._steps = [timed(s, key(n)) for s, n in zip(cp._steps, nodes)]
    ids = np.asarray((lm.tokenizer.encode(TEXT) * 4)[:PREFILL], np.int32)
    kv = lm.model.new_kv_cache(1, PREFILL + steps + 8)
    out = {}
    for phase in ("warm", "prefill", "decode"):
        acc.clear()
        t0 = time.perf_counter()
        if phase == "decode":
            for i in range(steps):
                lm.model.forward(ids[i:i + 1], [Segment(0, PREFILL + i, 1)], kv)
        else:
            lm.model.forward(ids, [Segment(0, 0, PREFILL)], kv)
        total = time.perf_counter() - t0
        if phase != "warm":
            out[phase] = {"total_s": round(total, 3),
                          "ops": {k: round(v, 4) for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}}
    return out


def side_llamacpp(model: str, threads: int, repeats: int) -> dict:
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    t = time.perf_counter()
    llm = Llama(model_path=model, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads,
                n_threads_batch=threads, n_gpu_layers=0, seed=1234, verbose=False)
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
    while len(pool) < PREFILL:
        pool += pool
    llm.reset()
    llm.eval(pool[:64])                       # warm-up
    rates = []
    for _ in range(repeats):
        llm.reset()
        reset()
        llm.eval(pool[:PREFILL])
        c = counters()
        rates.append(1e3 * c["n_p_eval"] / c["t_p_eval_ms"])
    out = {"engine": "llama.cpp " + llama_cpp.__version__, "load_s": round(load_s, 2),
           "prefill_tok_s": round(statistics.median(rates), 1)}
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
    ap.add_argument("--peer", help="the Python of a venv with llama-cpp-python (e.g. /work/llama-venv/bin/python)")
    ap.add_argument("--shape", default="qwen3.5-0.8b,qwen3.5-2b")
    ap.add_argument("--dir", default="/tmp", help="where the files are written (once)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--only", choices=["aotx", "llamacpp"], help="run one engine")
    ap.add_argument("--before", help="another checkout (or `git archive` tree, with its .path dir beside it) whose "
                                     "AOTX runs as a third side, aotx-before")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", action="store_true", help="AOTX only: seconds per op of one prefill and decode")
    ap.add_argument("--side", choices=["aotx", "llamacpp"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.profile:
        for shape in a.shape.split(","):
            print(json.dumps({"shape": shape, **profile_aotx(str(write_file(shape, Path(a.dir))), a.threads)},
                             indent=1))
        return 0
    if a.side:
        fn = side_aotx if a.side == "aotx" else side_llamacpp
        print(json.dumps(fn(a.model, a.threads, a.repeats)))
        return 0
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    env["NUMBA_NUM_THREADS"] = str(a.threads)
    me = str(Path(__file__).resolve())
    sides = [("aotx", sys.executable)] + ([("llamacpp", a.peer)] if a.peer else [])
    if a.only:
        sides = [s for s in sides if s[0] == a.only]
    if a.before:
        sides.append(("aotx-before", sys.executable))
    envs = {s: env for s, _ in sides}
    if a.before:
        b = Path(a.before).resolve()
        envs["aotx-before"] = dict(env, PYTHONPATH=f"{b.parent / (b.name + '.path')}:{b}")
    report = []
    for shape in a.shape.split(","):
        path = write_file(shape, Path(a.dir))
        runs: dict[str, list[dict]] = {s: [] for s, _ in sides}
        for _ in range(a.rounds):
            for side, py in sides:
                p = subprocess.run([py, me, "--side", side.split("-")[0], "--model", str(path), "--threads",
                                    str(a.threads), "--repeats", str(a.repeats)], capture_output=True, text=True,
                                   env=envs[side],
                                   cwd=str(ROOT), timeout=3600)
                if p.returncode != 0:
                    print(f"{side} failed:\n{p.stderr[-3000:]}", file=sys.stderr)
                    return 1
                r = json.loads(p.stdout.strip().splitlines()[-1])
                runs[side].append(r)
                print(f"  {shape} {side}: {r}", file=sys.stderr)
        s = {"shape": shape, "file": str(path), "bytes": path.stat().st_size, "threads": a.threads,
             "rounds": a.rounds}
        for side, rs in runs.items():
            s[side] = {k: statistics.median(r[k] for r in rs) for k in ("prefill_tok_s", "decode_tok_s", "load_s")}
            s[side]["all"] = {k: [r[k] for r in rs] for k in ("prefill_tok_s", "decode_tok_s")}
        report.append(s)
    if a.json:
        print(json.dumps(report))
        return 0
    names = [n for n, _ in sides]
    both = "aotx" in names and "llamacpp" in names
    print(f"{a.threads} threads, median of {a.rounds} rounds (each the median of {a.repeats} repeats)")
    print(f"{'shape':14}{'':18}" + "".join(f"{n:>13}" for n in names) + ("   aotx/llama.cpp" if both else ""))
    for s in report:
        for label, key in ((f"prefill {PREFILL} tok/s", "prefill_tok_s"), ("decode b1 tok/s", "decode_tok_s"),
                           ("load s", "load_s")):
            ratio = f"   {s['aotx'][key] / s['llamacpp'][key]:14.2f}" if both and s["llamacpp"][key] else ""
            print(f"{s['shape']:14}{label:18}" + "".join(f"{s[n][key]:13.1f}" for n in names) + ratio)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
