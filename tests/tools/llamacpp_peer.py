#!/usr/bin/env python3
"""llama.cpp (through llama-cpp-python) on a GGUF file, CPU only: the peer of
``aotx bench --engine-path``, which runs this script in the Python given by ``--peer``.

Prints ONE JSON line: prefill tokens/s per prompt size (llama.cpp's own prompt-eval
counter, one ``eval`` of n tokens), decode tokens/s of greedy steps after a short chat
prompt (its eval counter), each the median of --repeats, and the same as CPU seconds of
this process per token (RUSAGE_SELF: robust to other load on the machine). The prompts
are the ones aotx bench uses (the same text, the same chat prompt). Run with the Python
of a virtualenv that has llama-cpp-python (pip compiles llama.cpp: minutes)::

    python tests/tools/llamacpp_peer.py --model PATH.gguf [--threads 2] [--sizes 128,512]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics

import numpy as np

TEXT = ("The river ran slow and brown past the mill, and the miller's children "
        "counted the barges as they went by, naming each one after a bird. ") * 60
CHAT = b"<|im_start|>user\nTell me a long story about a dragon.<|im_end|>\n<|im_start|>assistant\n"


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default="128,512,1024")
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",") if x]

    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=a.model, n_ctx=max(2048, max(sizes) + a.decode + 64), n_batch=512,
                n_threads=a.threads, n_threads_batch=a.threads, n_gpu_layers=0, seed=1, verbose=False)
    ctx = llm._ctx.ctx

    def counters() -> dict:
        llama_cpp.llama_synchronize(ctx)
        d = llama_cpp.llama_perf_context(ctx)
        return {k: getattr(d, k) for k, _ in d._fields_}

    def reset() -> None:
        llama_cpp.llama_synchronize(ctx)
        llama_cpp.llama_perf_context_reset(ctx)

    def argmax_last() -> int:
        ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))))

    pool = llm.tokenize(TEXT.encode(), add_bos=False, special=False)
    while len(pool) < max(sizes) * (a.repeats + 1):
        pool += pool
    llm.reset()
    llm.eval(pool[:min(512, max(sizes))])            # warm-up: page the weights in, size the buffers
    out = {"engine": "llama.cpp via llama-cpp-python " + llama_cpp.__version__, "threads": a.threads,
           "prefill_tok_s": {}, "prefill_cpu_ms_per_token": {}}
    for n in sizes:
        rates, cpus = [], []
        for r in range(a.repeats):
            llm.reset()
            reset()
            c0 = _cpu()
            llm.eval(pool[(r + 1) * n:(r + 2) * n])
            c = counters()
            cpus.append((_cpu() - c0) / n)
            rates.append(1e3 * c["n_p_eval"] / c["t_p_eval_ms"])
        out["prefill_tok_s"][n] = round(statistics.median(rates), 1)
        out["prefill_cpu_ms_per_token"][n] = round(1e3 * statistics.median(cpus), 3)
    prompt = llm.tokenize(CHAT, add_bos=False, special=True)
    rates, cpus = [], []
    for _ in range(a.repeats):
        llm.reset()
        llm.eval(prompt)
        reset()
        c0 = _cpu()
        for _ in range(a.decode):
            llm.eval([argmax_last()])
        c = counters()
        cpus.append((_cpu() - c0) / a.decode)
        rates.append(1e3 * c["n_eval"] / c["t_eval_ms"])
    out["decode_tok_s"] = round(statistics.median(rates), 1)
    out["decode_cpu_ms_per_token"] = round(1e3 * statistics.median(cpus), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
