#!/usr/bin/env python3
"""llama.cpp's teacher-forced references for a real file (issue 14): the rows of
``tests/data/refs/<model>/chat_refs.json`` (prompt + llama.cpp's own greedy completion),
evaluated by llama.cpp the way ``tests/refcheck.py`` feeds AOTX: the whole sequence in ONE
``Llama.eval`` (logits_all), with the references' settings (n_ctx, n_batch/n_ubatch, threads,
seed, f16 KV, no flash attention). Written in refcheck's "prompts" form, with ``first_row``.

Why: ``chat_refs.json`` holds the logits llama.cpp computed while generating (the prompt in one
eval, then one token per eval). llama.cpp's CPU kernels differ between a 1-row decode and a
many-row batch, and on Gemma 3 270M that difference alone is mean |diff| 0.195 on the top-5 and
flips a row whose reference gap is 0.517 (tests/tools/gemma3_check.py). The teacher-forced
comparison needs llama.cpp's teacher-forced logits. Run once with llama-cpp-python's venv:

    /work/coord/llama-venv/bin/python tests/tools/make_refs_teacher_forced.py gemma3 MODEL.gguf
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    name, model = sys.argv[1], sys.argv[2]
    sys.path.insert(0, str(ROOT))
    from llama_cpp import Llama, __version__

    from tests import refcheck

    src = ROOT / "tests" / "data" / "refs" / name / "chat_refs.json"
    ref = json.loads(src.read_text(encoding="utf-8"))
    meth = ref["method"]
    m = Llama(model_path=model, n_ctx=meth["n_ctx"], n_batch=meth["n_batch"], n_ubatch=meth["n_ubatch"],
              n_threads=meth["n_threads"], n_threads_batch=meth["n_threads"], seed=meth["seed"],
              flash_attn=meth["flash_attn"], logits_all=True, verbose=False)
    prompts = []
    for c in refcheck.cases(ref, k=10):
        ids = [int(t) for t in c.ids]
        m.reset()
        m.eval(ids)
        rows = np.array(m.scores[:len(ids)], np.float32)[c.first_row:c.first_row + len(c.top)]
        top, gap = [], []
        for r in rows:
            best = np.argsort(-r, kind="stable")[:10]
            top.append([[int(i), round(float(r[i]), 4)] for i in best])
            gap.append(round(float(r[best[0]] - r[best[1]]), 4))
        prompts.append({"name": c.name, "token_ids": ids, "first_row": c.first_row, "top": top, "gap": gap})
        print(c.name, len(rows), "rows", flush=True)
    out = {"model": ref["model"], "engine": ref["engine"] | {"llama_cpp_python": __version__},
           "method": meth | {"logits_all": True, "teacher_forced":
                             "prompt + chat_refs.json's greedy completion in one Llama.eval; rows from first_row "
                             "(the row that predicts the first completion token); top = 10 best (id, logit)"},
           "prompts": prompts}
    dst = src.with_name("teacher_forced_refs.json")
    dst.write_text(json.dumps(out, separators=(",", ":")) + "\n", encoding="utf-8")
    print("wrote", dst)


if __name__ == "__main__":
    main()
