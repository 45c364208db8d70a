#!/usr/bin/env python3
"""Make llama.cpp's reference outputs for the tiny files of ``tests.models.HYBRID``
(qwen35, qwen35moe, lfm2, ...; never run in CI or by the tests).

Runs llama.cpp through llama-cpp-python 0.3.36 (llama.cpp 0c1e5709) in its own venv, with
the method and JSON format of ``make_refs.py tiny`` (its helpers are reused: the same four
prompts, n_ctx 512, whole prompt in one eval, f16 KV cache, flash attention off):

    /work/llama-venv/bin/python tests/tools/make_refs_hybrid.py --smollm2 PATH/SmolLM2-135M-Instruct.Q4_1.gguf

Writes ``tests/data/refs/hybrid/<name>.json``: sha256 of the file, every prompt's token
ids (llama.cpp's tokenization with the file's pre-tokenizer) with llama.cpp's top-10 logits
and top-two gap at every position; ``greedy``: 24 tokens llama.cpp's argmax picks after
each prompt, fed back one at a time (decode steps: the recurrent state carried from one
eval to the next), with each step's gap; llama.cpp against itself (prompt in chunks of 7,
flash attention on); and ``sensitivity``: copies of the file with one feature changed,
compared with the references the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS.parents[1]))

from tests.tools import make_refs as R  # noqa: E402  (the issue 14 reference maker: same method)

OUT = R.REFS / "hybrid"
GREEDY_STEPS = 24

SENSITIVITY = {
    "qwen35": {"no_state_memory": ({"a_mean": -60.0}, "ssm_a near -60: the recurrent state forgets every token")},
    "gemma4": {"no_window": ({"window": 4096}, "sliding_window 4096: no layer slides over these prompts"),
               "swa_base_1e6": ({"rope_base_swa": 1000000.0}, "rope.freq_base_swa = 1e6: one RoPE base"),
               "softcap_10": ({"softcap": 10.0}, "final_logit_softcapping 10 instead of 30")},
    "gemma4moe": {"top1": ({"n_expert_used": 1}, "expert_used_count 1 instead of 2"),
                  "no_down_scale": ({"skip": [f"blk.{i}.ffn_down_exps.scale" for i in range(4)]},
                                    "no ffn_down_exps.scale (every expert's output unscaled)")},
    "qwen3next": {"no_state_memory": ({"a_mean": -60.0}, "ssm_a near -60: the recurrent state forgets every token")},
    "lfm2": {"no_conv_memory": ({"memory": False}, "the convolution's earlier taps zeroed: it forgets every token"),
             "no_window": ({"window": 0}, "no attention.sliding_window: the attention layer sees every position")},
    "qwen35moe": {"top1": ({"n_expert_used": 1}, "expert_used_count 1 instead of 2"),
                  "no_state_memory": ({"a_mean": -60.0}, "ssm_a near -60: the recurrent state forgets every token")},
}


def _greedy(path: Path, prompts) -> list[dict]:
    """Per prompt: GREEDY_STEPS tokens by argmax, each fed back as a one-token eval."""
    m = R._open(path, n_ctx=512, logits_all=True)
    add_bos = bool(m.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true")
    out = []
    for name, text in prompts:
        ids = m.tokenize(text.encode(), add_bos=add_bos, special=True)
        m.reset()
        m.eval(ids)
        row = np.array(m.scores[len(ids) - 1], np.float32)
        toks, gaps = [], []
        for _ in range(GREEDY_STEPS):
            t = int(np.argmax(row))
            toks.append(t)
            gaps.append(R._gap(row))
            m.eval([t])
            row = np.array(m.scores[m.n_tokens - 1], np.float32)
        out.append({"name": name, "prompt_ids": ids, "tokens": toks, "gap": gaps})
    del m
    return out


GEMMA4_STRINGS = [
    ("trained", "The quick brown fox jumps over the lazy dog."),
    ("spaces", "  two leading,  double  inner and trailing  "),
    ("clean_spaces", "hello , world . it 's ok ' quoted ' ?"),
    ("newlines", "a\nb\n\nc\n\n\nd\n\n\n\ne\n"),
    ("only_newlines", "\n\n\n"),
    ("bytes", "caf\u00e9 \U0001f600 \u4e2d\u6587"),
    ("code", "def f(n):\n    return n\n\nprint(f(10))"),
    ("turns", "<|turn>user\nhi there<turn|>\n<|turn>model\n"),
    ("bos_eos_text", "<bos>text<eos>"),
]


def make_gemma4_vocab() -> None:
    """tests/data/refs/hybrid/gemma4_tokenizer.json: llama.cpp's tokenization of
    GEMMA4_STRINGS with tests/models/gemma4.synthetic_vocab() (a "gemma4" BPE vocabulary)
    in the tiny gemma4 file, special-token parsing on and off, both detokenizations."""
    import llama_cpp
    from llama_cpp import Llama

    models = R._models()
    with tempfile.TemporaryDirectory() as td:
        path = models.gemma4.write(Path(td) / "gemma4-vocab.gguf", models.gemma4.synthetic_vocab())
        m = Llama(model_path=str(path), vocab_only=True, verbose=False)
        vocab = llama_cpp.llama_model_get_vocab(m.model)
        out = []
        for name, text in GEMMA4_STRINGS:
            entry = {"name": name, "text": text}
            for special in (True, False):
                ids = m.tokenize(text.encode(), add_bos=True, special=special)
                entry[f"special_{str(special).lower()}"] = {
                    "ids": ids,
                    "llama_detokenize_special_true": R._llama_detokenize(vocab, ids, True),
                    "llama_detokenize_special_false": R._llama_detokenize(vocab, ids, False),
                    "detok_special_true": m.detokenize(ids, special=True).decode("utf-8", errors="replace")}
            out.append(entry)
        ref = {"vocabulary": "tests/models/gemma4.py synthetic_vocab()", "engine": R.engine_facts(),
               "method": "written into the tiny gemma4 file, loaded vocab_only; Llama.tokenize(text, add_bos=True, "
                         "special=True|False); llama_detokenize(remove_special=False, unparse_special); "
                         "detok = Llama.detokenize(special=True)",
               "strings": out}
    (OUT / "gemma4_tokenizer.json").write_text(json.dumps(ref, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print("gemma4 vocabulary", len(out), "strings")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2", required=True, help="the default model's GGUF (its tokenizer goes in every file)")
    ap.add_argument("names", nargs="*", help="files of tests.models.HYBRID, or gemma4-vocab (default: all)")
    args = ap.parse_args()
    if args.names == ["gemma4-vocab"]:
        make_gemma4_vocab()
        return
    models = R._models()
    refcheck = R._refcheck()
    tok = models.tokenizer_from_gguf(args.smollm2)
    OUT.mkdir(parents=True, exist_ok=True)
    for name in args.names or list(models.HYBRID):
        module, kwargs = models.HYBRID[name]
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
                              "gap = top-1 minus top-2 logit",
                    "greedy": f"after each prompt, {GREEDY_STEPS} argmax tokens, each fed back as one Llama.eval"},
                "prompts": [{"name": n, "text": t, "token_ids": ids,
                             "top": [R._top(row, 10) for row in L], "gap": [R._gap(row) for row in L]}
                            for n, t, ids, L in runs],
                "greedy": _greedy(path, R.TINY_PROMPTS),
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
