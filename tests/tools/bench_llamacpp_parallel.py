#!/usr/bin/env python3
"""The peer for `aotx bench`'s aggregate decode: llama.cpp decoding N sequences at once.

Run with the peer's interpreter (llama-cpp-python, see shared/peer/llamacpp_bench.py):
    /tmp/peer/bin/python tests/tools/bench_llamacpp_parallel.py --model PATH.gguf [--seqs 1,2,4,8,16]
        [--threads 2] [--tokens 64] [--repeats 3] [--json]

For each N: one context with n_seq_max = N; N different chat prompts (engine/cli/bench.py's
PROMPTS) are prefilled one sequence at a time, then every decode step is ONE llama_decode
call whose llama_batch holds one token per sequence (seq_id = its sequence, logits on),
greedy (argmax of llama_get_logits_ith), for --tokens steps. Aggregate decode tok/s =
N * steps / wall time of the decode steps (after llama_synchronize), the median of
--repeats; also per CPU second of this process (time.process_time: all its threads), a
figure that other load on the machine disturbs much less than the wall clock. This is what llama.cpp's examples/batched and llama-batched-bench do; it
does not import aotx. Uses the low-level API of llama-cpp-python 0.3.x (llama_batch_init,
llama_decode, llama_memory_clear).
"""
import argparse
import json
import statistics
import time

import numpy as np

PROMPTS = ["Tell me a long story about a dragon.", "Explain how a steam engine works, in detail.",
           "Write a long poem about the sea.", "Describe the history of Rome.",
           "Give me a recipe for bread and explain each step.", "What are the planets of the solar system?",
           "Write a story about a robot learning to paint.", "Explain photosynthesis to a child."]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--seqs", default="1,2,4,8,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    import llama_cpp as L

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(a.model.encode(), mp)
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)

    def tokenize(text: str) -> list[int]:
        raw = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n".encode()
        buf = (L.llama_token * 512)()
        n = L.llama_tokenize(vocab, raw, len(raw), buf, 512, False, True)
        return list(buf[:n])

    out = {"engine": "llama.cpp via llama-cpp-python " + L.__version__, "threads": a.threads,
           "tokens": a.tokens, "aggregate_decode_tok_s": {}, "aggregate_decode_tok_per_cpu_s": {}}
    for N in (int(x) for x in a.seqs.split(",")):
        cp = L.llama_context_default_params()
        cp.n_ctx = N * 256
        cp.n_batch = 512
        cp.n_seq_max = N
        cp.n_threads = a.threads
        cp.n_threads_batch = a.threads
        ctx = L.llama_init_from_model(model, cp)
        batch = L.llama_batch_init(512, 0, N)
        prompts = [tokenize(PROMPTS[s % len(PROMPTS)]) for s in range(N)]

        def fill(items):
            """items: (token, pos, seq, logits) -> batch."""
            for i, (tok, pos, seq, lg) in enumerate(items):
                batch.token[i] = tok
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = lg
            batch.n_tokens = len(items)

        def argmax(i: int) -> int:
            ptr = L.llama_get_logits_ith(ctx, i)
            return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))

        rates, cpu_rates = [], []
        for rep in range(a.repeats + 1):                       # the first run warms up
            L.llama_memory_clear(L.llama_get_memory(ctx), True)
            last = []
            for s, p in enumerate(prompts):
                fill([(t, j, s, j == len(p) - 1) for j, t in enumerate(p)])
                assert L.llama_decode(ctx, batch) == 0
                last.append(argmax(len(p) - 1))
            pos = [len(p) for p in prompts]
            L.llama_synchronize(ctx)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(a.tokens):
                fill([(last[s], pos[s], s, True) for s in range(N)])
                assert L.llama_decode(ctx, batch) == 0
                last = [argmax(s) for s in range(N)]
                pos = [p + 1 for p in pos]
            L.llama_synchronize(ctx)
            if rep:
                rates.append(N * a.tokens / (time.perf_counter() - t0))
                cpu_rates.append(N * a.tokens / (time.process_time() - c0))
        out["aggregate_decode_tok_s"][N] = round(statistics.median(rates), 1)
        out["aggregate_decode_tok_per_cpu_s"][N] = round(statistics.median(cpu_rates), 1)
        L.llama_batch_free(batch)
        L.llama_free(ctx)
    L.llama_model_free(model)
    if a.json:
        print(json.dumps(out))
    else:
        for N, r in out["aggregate_decode_tok_s"].items():
            print(f"{N:>3} sequences: {r:8.1f} tok/s aggregate decode, "
                  f"{out['aggregate_decode_tok_per_cpu_s'][N]:8.1f} tok per CPU second")
        print(f"({out['engine']}, {a.threads} threads, {a.tokens} greedy steps)")


if __name__ == "__main__":
    main()
