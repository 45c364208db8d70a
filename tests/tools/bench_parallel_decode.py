"""AOTX's side of tests/tools/bench_llamacpp_parallel.py: the model alone decoding B sequences.

Run: NUMBA_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python -m tests.tools.bench_parallel_decode 1,2,4,8,16

For each B: engine/cli/bench.py's PROMPTS (chat-wrapped) prefilled one sequence at a time,
then 64 greedy steps, each ONE forward pass with B one-token segments (the engine's decode
tick without the engine). Prints JSON: tokens per second of wall time and per CPU second of
this process (time.process_time, all threads; with one thread it is the work per token,
which other load on the machine disturbs much less than the wall clock). Median of 3.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np


def main(argv: list[str]) -> None:
    from aotx.engine.cli.bench import PROMPTS
    from aotx.engine.model.batch import Segment
    from aotx.engine.model.loader import load_model

    lm = load_model(None, device="cpu")
    m = lm.model
    steps = 64
    out: dict = {"tok_per_cpu_s": {}, "tok_per_wall_s": {}}
    for B in (int(x) for x in (argv[0] if argv else "1,2,4,8,16").split(",")):
        prompts = [np.asarray(lm.tokenizer.encode(f"<|im_start|>user\n{PROMPTS[s % len(PROMPTS)]}<|im_end|>\n"
                                                  "<|im_start|>assistant\n", parse_special=True), np.int32)
                   for s in range(B)]
        cpu, wall = [], []
        for _ in range(3):
            kv = m.new_kv_cache(B, 256)
            last = []
            for s, p in enumerate(prompts):
                last.append(int(np.argmax(m.forward(p, [Segment(s, 0, len(p))], kv)[-1])))
            pos = [len(p) for p in prompts]
            c0, w0 = time.process_time(), time.perf_counter()
            for i in range(steps):
                lg = m.forward(np.asarray(last, np.int32), [Segment(s, pos[s] + i, 1) for s in range(B)], kv)
                last = [int(np.argmax(lg[s])) for s in range(B)]
            cpu.append(B * steps / (time.process_time() - c0))
            wall.append(B * steps / (time.perf_counter() - w0))
        out["tok_per_cpu_s"][B] = round(statistics.median(cpu), 1)
        out["tok_per_wall_s"][B] = round(statistics.median(wall), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
