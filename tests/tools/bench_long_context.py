"""Decode tokens/s and TTFT after long histories, AOTX's CPU path next to llama.cpp, per KV type.

    PYTHONPATH=<checkout>.path python tests/tools/bench_long_context.py --engine aotx \\
        --model PATH.gguf --kv-type q8_0 --history 4096,16384,32768 [--json]
    /work/llama-venv/bin/python tests/tools/bench_long_context.py --engine llamacpp \\
        --model PATH.gguf --kv-type q8_0 --history 4096,16384,32768 [--json]

For each history length H: a fresh cache of H + DECODE + 1 tokens; TTFT = the time to prefill
H tokens of text (the repository's DESIGN.md, repeated, tokenized by the engine itself) and
pick the first token; decode = DECODE greedy steps after it, one token per forward, as
tokens/s. Both engines: one slot, the same text, the same KV type (llama.cpp: ``type_k =
type_v``, flash attention on, which a quantized V needs; AOTX: ``new_kv_cache(kv_type)``),
``--threads`` threads (AOTX: numba's, set with NUMBA_NUM_THREADS before the run). ``--device cuda``:
AOTX on the GPU (decode steps replay the captured tick graph); llama.cpp on the GPU is
``llama-bench -d`` in tests/tools/gpu_long_context.sh. Run the two
engines alternately, several times each, on a quiet machine; compare ratios.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

DECODE = 32
ROOT = Path(__file__).resolve().parents[2]
GGML = {"f16": 1, "f32": 0, "q8_0": 8, "q4_0": 2}


def _text(n_words: int) -> str:
    """``n_words`` words of DESIGN.md, repeated as often as needed (at least as many tokens)."""
    words = (ROOT / "DESIGN.md").read_text().split()
    return " ".join((words * (n_words // len(words) + 1))[:n_words])


def load(model: str, device: str = "cpu"):
    """The model, loaded once, its kernels compiled before any clock starts."""
    from aotx.engine.model.batch import Segment
    from aotx.engine.model.loader import load_model

    lm = load_model(model, device=device)
    lm.bench_device = device
    for kv_type in ("f16", "q8_0", "q4_0"):
        try:
            warm = lm.model.new_kv_cache(1, 64, kv_type)
        except Exception:  # noqa: BLE001 - a KV type this backend refuses: the run says so
            continue
        lm.model.forward(np.zeros(16, np.int32), [Segment(0, 0, 16)], warm)
        lm.model.forward(np.zeros(1, np.int32), [Segment(0, 16, 1)], warm)
    return lm


def aotx(lm, kv_type: str, history: int) -> dict:
    from aotx.engine.model.batch import Segment

    device = lm.bench_device
    ids = lm.tokenizer.encode(_text(history), add_special=False)[:history]
    kv = lm.model.new_kv_cache(1, history + DECODE + 1, kv_type)
    t0 = time.perf_counter()
    pos, chunk = 0, 512
    while pos < len(ids):                      # the engine's prefill: chunks of its prefill_chunk
        n = min(chunk, len(ids) - pos)
        lg = lm.model.forward(np.asarray(ids[pos:pos + n], np.int32), [Segment(0, pos, n)], kv)
        pos += n
    tok = int(np.argmax(lg[-1]))
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    for i in range(DECODE):
        lg = lm.model.forward(np.asarray([tok], np.int32), [Segment(0, len(ids) + i, 1)], kv)
        tok = int(np.argmax(lg[0]))
    dec = time.perf_counter() - t1
    return {"engine": f"aotx {device}", "kv_type": kv_type, "history": len(ids), "ttft_s": round(ttft, 3),
            "decode_tok_s": round(DECODE / dec, 2)}


def llamacpp(model: str, kv_type: str, history: int, threads: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model, n_ctx=history + DECODE + 1, n_batch=512, n_ubatch=512, n_threads=threads,
                          flash_attn=True, type_k=GGML[kv_type], type_v=GGML[kv_type], verbose=False)
    ids = llm.tokenize(_text(history).encode(), add_bos=False)[:history]
    n_vocab = llm.n_vocab()

    def last() -> int:                          # the last row's logits (logits_all would hold them all)
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))))

    t0 = time.perf_counter()
    llm.eval(ids)
    tok = last()
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(DECODE):
        llm.eval([tok])
        tok = last()
    dec = time.perf_counter() - t1
    return {"engine": f"llama.cpp {llama_cpp.__version__}", "kv_type": kv_type, "history": len(ids),
            "ttft_s": round(ttft, 3), "decode_tok_s": round(DECODE / dec, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["aotx", "llamacpp"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--kv-type", default="f16", help="one or several of f16,f32,q8_0,q4_0 (comma-separated)")
    ap.add_argument("--history", default="4096,16384,32768")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="AOTX's backend (llama.cpp: this build's)")
    a = ap.parse_args()
    lm = load(a.model, a.device) if a.engine == "aotx" else None
    for kv in a.kv_type.split(","):
        if kv not in GGML:
            ap.error(f"--kv-type {kv!r}: one of {', '.join(GGML)}")
        for h in (int(x) for x in a.history.split(",")):
            try:
                r = aotx(lm, kv, h) if lm is not None else llamacpp(a.model, kv, h, a.threads)
            except Exception as e:  # noqa: BLE001 - one failed point is reported, the others still run
                print(json.dumps({"engine": a.engine, "kv_type": kv, "history": h, "error": f"{type(e).__name__}: {e}"}))
                continue
            print(json.dumps(r) if a.json else f"{r['engine']:<24} kv {r['kv_type']:<5} history {r['history']:>6}: "
                  f"TTFT {r['ttft_s']:8.2f} s, decode {r['decode_tok_s']:7.2f} tokens/s", flush=True)

if __name__ == "__main__":
    main()
