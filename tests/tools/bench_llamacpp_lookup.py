#!/usr/bin/env python3
"""llama.cpp's prompt-lookup decoding on AOTX's speculative tasks: the peer of
``aotx bench --speculative`` (issue 10).

Standalone: run it with the peer's Python (llama-cpp-python and numpy; it imports
nothing from AOTX). It reads the prompts as token ids that AOTX's chat template
produced (so both engines see the same tokens), and for each task generates
``--max-tokens`` greedy tokens twice: plainly, and with
``llama_cpp.llama_speculative.LlamaPromptLookupDecoding(num_pred_tokens=N)``
(llama-cpp-python's port of prompt-lookup decoding: the earliest earlier match
of the last 1..max_ngram_size tokens, ``num_pred_tokens`` drafts, verified in
one batch; greedy output is unchanged). Reports decode tokens/s (tokens after
the first over the wall time from the first to the last), verify passes
(``Llama.eval`` calls after the prompt), tokens per pass, drafts proposed and
accepted, and whether the lookup output equals the plain output.

Make the prompts file with AOTX's Python:
    python -c "from aotx.engine.cli.bench import dump_spec_prompts; dump_spec_prompts('prompts.json')"
Run:
    /tmp/peer/bin/python tests/tools/bench_llamacpp_lookup.py --model PATH.gguf --prompts prompts.json [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def run_once(model: str, ids: list[int], eog: set[int], max_tokens: int, threads: int, num_pred: int | None) -> dict:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    proposed = [0]

    class Counted(LlamaPromptLookupDecoding):
        def __call__(self, input_ids, /, **kw):
            got = super().__call__(input_ids, **kw)
            proposed[0] += int(len(got))
            return got

    draft = Counted(num_pred_tokens=num_pred) if num_pred is not None else None
    llm = Llama(model_path=model, n_ctx=2048, n_threads=threads, n_threads_batch=threads, n_gpu_layers=0,
                seed=1234, verbose=False, draft_model=draft)
    evals = [0]
    real_eval = llm.eval

    def eval_counted(tokens):
        evals[0] += 1
        return real_eval(tokens)

    llm.eval = eval_counted
    out: list[int] = []
    stamps: list[float] = []
    for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        stamps.append(time.perf_counter())
        out.append(int(tok))
        if len(out) >= max_tokens or tok in eog:
            break
    passes = max(1, evals[0] - 1)  # the first eval is the prompt
    dt = max(1e-9, stamps[-1] - stamps[0])
    return {"tokens": len(out), "decode_tok_s": round((len(out) - 1) / dt, 2), "verify_passes": passes,
            "tokens_per_pass": round((len(out) - 1) / passes, 2), "drafts_proposed": proposed[0],
            "ids": out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON: {tasks: {name: [ids]}, eog: [ids]}")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--num-pred-tokens", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    import llama_cpp

    spec = json.load(open(a.prompts))
    eog = set(spec["eog"])
    res = {"engine": "llama.cpp via llama-cpp-python " + llama_cpp.__version__, "threads": a.threads,
           "num_pred_tokens": a.num_pred_tokens, "tasks": {}}
    for task, ids in spec["tasks"].items():
        runs: dict[str, list[dict]] = {"off": [], "lookup": []}
        for _ in range(a.repeats):
            runs["off"].append(run_once(a.model, ids, eog, a.max_tokens, a.threads, None))
            runs["lookup"].append(run_once(a.model, ids, eog, a.max_tokens, a.threads, a.num_pred_tokens))
        r = {}
        for mode, rs in runs.items():
            last = dict(rs[-1])
            last["decode_tok_s"] = round(statistics.median(x["decode_tok_s"] for x in rs), 2)
            r[mode] = last
        on, off = r["lookup"], r["off"]
        accepted = on["tokens"] - 1 - on["verify_passes"]  # each pass yields one token of its own
        res["tasks"][task] = {
            "decode_tok_s_off": off["decode_tok_s"], "decode_tok_s_lookup": on["decode_tok_s"],
            "speedup": round(on["decode_tok_s"] / max(1e-9, off["decode_tok_s"]), 2),
            "tokens_per_pass": on["tokens_per_pass"], "drafts_proposed": on["drafts_proposed"],
            "accepted_estimate": accepted,
            "acceptance_rate": round(accepted / max(1, on["drafts_proposed"]), 3),
            "identical": on["ids"] == off["ids"], "tokens": on["tokens"], "ids_off": off["ids"],
            "first_difference": next((i for i, (x, y) in enumerate(zip(on["ids"], off["ids"])) if x != y), None),
        }
    if a.json:
        print(json.dumps(res))
        return
    print(res["engine"], f"{a.threads} threads, num_pred_tokens {a.num_pred_tokens}")
    for task, r in res["tasks"].items():
        print(f"{task:<8} off {r['decode_tok_s_off']:7.1f} tok/s  lookup {r['decode_tok_s_lookup']:7.1f} tok/s  "
              f"{r['speedup']:.2f}x  acceptance {r['acceptance_rate']:.3f}  tokens/pass {r['tokens_per_pass']:.2f}"
              f"  identical {r['identical']} (first difference at token {r['first_difference']})")


if __name__ == "__main__":
    main()
