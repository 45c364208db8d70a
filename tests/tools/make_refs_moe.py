#!/usr/bin/env python3
"""Make llama.cpp's reference logits for the tiny mixture-of-experts files (issue 22; never
run in CI or by the tests).

Runs llama.cpp through llama-cpp-python in its own venv, exactly as ``make_refs.py tiny``
does for issue 14's files (same prompts, settings and JSON format; its helpers are reused):

    /work/coord/llama-venv/bin/python tests/tools/make_refs_moe.py --smollm2 PATH/SmolLM2-135M-Instruct.Q4_1.gguf

Writes ``tests/data/refs/moe/<name>.json`` for every file of ``tests.models.MOE``
(qwen3moe, olmoe, gptoss): sha256 of the file, the four prompts' token ids and llama.cpp's
top-10 logits and top-two gap at every position; llama.cpp against itself (prompt in
chunks of 7, flash attention on); and ``sensitivity``: llama.cpp on copies of the file
with one MoE or gpt-oss feature changed (one expert per token instead of k, no attention
sinks, no YaRN, no sliding window), compared with the references the same way, to show
that a forward which got that feature wrong could not pass.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS.parents[1]))

from tests.tools import make_refs as R  # noqa: E402  (the issue 14 reference maker: same method)

OUT = R.REFS / "moe"

SENSITIVITY = {
    "qwen3moe": {"top1": ({"n_expert_used": 1}, "expert_used_count 1 instead of 2")},
    "olmoe": {"top1": ({"n_expert_used": 1}, "expert_used_count 1 instead of 3")},
    "gptoss": {"no_sinks": ({"sink_mean": -10000.0, "sink_std": 0.0}, "attention sinks at -1e4 (no effect)"),
               "no_yarn": ({"yarn": False}, "rope.scaling keys left out (plain RoPE)"),
               "no_window": ({"sliding_window": 4096}, "sliding_window 4096: no layer slides over these prompts")},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2", required=True, help="the default model's GGUF (its tokenizer goes in every file)")
    ap.add_argument("names", nargs="*", help="files of tests.models.MOE (default: all)")
    args = ap.parse_args()
    models = R._models()
    refcheck = R._refcheck()
    tok = models.tokenizer_from_gguf(args.smollm2)
    OUT.mkdir(parents=True, exist_ok=True)
    for name in args.names or list(models.MOE):
        module, kwargs = models.MOE[name]
        with tempfile.TemporaryDirectory() as td:
            td = Path(td)
            path = models.write(name, td / f"{name}.gguf", tok)
            again = models.write(name, td / f"{name}-again.gguf", tok)
            if R.sha256(path) != R.sha256(again):
                raise SystemExit(f"{name}: the writer is not deterministic")
            runs = R._tiny_logits(path, R.TINY_PROMPTS)
            ref = {
                "model": name,
                "writer": f"tests/models/{module.__name__.rsplit('.', 1)[-1]}.py write(path, tokenizer, **{kwargs!r})",
                "tokenizer_from": f"{Path(args.smollm2).name} sha256 {R.sha256(Path(args.smollm2))}",
                "sha256": R.sha256(path), "size": path.stat().st_size,
                "engine": R.engine_facts(), "method": R._method(512, 512, True) | {
                    "tokenize": "Llama.tokenize(text_utf8, add_bos=<file's add_bos_token>, special=True)",
                    "logits": "one Llama.eval of the whole prompt; top = the 10 best (id, logit) at every position, "
                              "gap = top-1 minus top-2 logit"},
                "prompts": [{"name": n, "text": t, "token_ids": ids,
                             "top": [R._top(row, 10) for row in L], "gap": [R._gap(row) for row in L]}
                            for n, t, ids, L in runs],
            }
            ref["llama_cpp_self_consistency"] = {
                "n_batch_7": R._report_facts(refcheck.compare(
                    R._forward_from(R._tiny_logits(path, R.TINY_PROMPTS, n_batch=7)), ref)),
                "flash_attn_on": R._report_facts(refcheck.compare(
                    R._forward_from(R._tiny_logits(path, R.TINY_PROMPTS, flash_attn=True)), ref))}
            sens = {}
            for vname, (over, what) in SENSITIVITY.get(name, {}).items():
                vpath = models.write(name, td / f"{name}-{vname}.gguf", tok, **over)
                rep = refcheck.compare(R._forward_from(R._tiny_logits(vpath, R.TINY_PROMPTS)), ref)
                sens[vname] = {"what": what, "overrides": over, **R._report_facts(rep)}
            if sens:
                ref["sensitivity"] = {"what": "llama.cpp on a copy of the file with one feature changed, compared "
                                              "with these references by tests/refcheck.py", **sens}
        (OUT / f"{name}.json").write_text(json.dumps(ref, ensure_ascii=False, separators=(",", ":")) + "\n",
                                          encoding="utf-8")
        print(name, ref["sha256"][:12], "self", ref["llama_cpp_self_consistency"],
              {k: (v["mad"], v["strict_mismatches"]) for k, v in sens.items()}, flush=True)


if __name__ == "__main__":
    main()
