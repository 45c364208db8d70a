"""Which repeat penalty should a small model get by default? (issue 17, point 15)

For each of llama.cpp's reference chat prompts on the default model
(``tests/data/refs/smollm2/chat_refs.json``: the prompt ids as llama.cpp rendered them,
and its first 48 greedy completion ids), decode greedily (temperature 0) with AOTX's
own model and sampler (``runtime.sampling.sample``; the penalty history starts with
the prompt's last ``repeat_last_n`` ids, as the engine's does) at several repeat
penalties, and report per prompt and penalty:

* ``loop``: the share of generated 8-token windows that already occurred earlier in
  the reply (0 for text that never repeats itself; a reply stuck in "la Femme, la
  Femme, ..." scores near 1);
* ``agree``: how many of the first 48 tokens equal AOTX's own greedy reply without a
  penalty (the model's intent: a penalty should not change a good answer's start);
* ``ref``: the same against llama.cpp's greedy reference ids;
* ``eos``: whether the reply ended by itself within the budget.

    python -m tests.tools.measure_repeat_penalty [--tokens 160] [--penalties 1,1.05,1.1,1.15,1.2,1.3]

Prints one JSON object per (prompt, penalty) and a summary table. A one-off measurement
to choose a default, not a benchmark (its figures are token ids, not times, so a busy
machine gives the same table). Each cell: loop share, agreeing tokens of 48, ``e`` when
it ended by itself, tokens.

The run behind ``protocol.REPEAT_PENALTY`` (11:40, 160 tokens, before the one-forward-per-
architecture executor landed)::

    prompt              1.0           1.05          1.1           1.15          1.2
    short_question   0.90 48  160  0.82 15  160  0.00  5e  56  0.00  5e  45  0.00  5e  57
    code_request     0.00 48e  64  0.00 36e  66  0.00 31e  79  0.00  4e  71  0.00  4e 101
    list_request     0.20 48e 135  0.25  7e 121  0.22  7e 122  0.23  7  160  0.00  7e  63
    emoji_accents    0.00 48e  61  0.00 48e  61  0.00 48e  61  0.00 48e  61  0.00 14e  60
    long_prompt      0.00 48  160  0.00 22  160  0.00  1  160  0.00  1e  79  0.00  1e  85

Then, without a penalty the capital-of-France prompt looped ("la femme, la femme, ...") to
the limit, as llama.cpp's own greedy reference for it does, and 1.05 still looped; 1.1 was
the least that ended it, with an answer. At 1.1 the code answer kept its function and
explanation, the French echo was unchanged, and the summary said the same in other words;
from 1.15 the code answer itself changes (another function name).

Again on main at 12:58 (the new executor; same prompts, 1.2 left out)::

    prompt              1.0           1.05          1.1           1.15
    short_question   0.00  8e   8  0.00  8e   8  0.00  8e   8  0.00  8e   8
    code_request     0.00 48e  73  0.00 27e  76  0.00 27e  74  0.00  4e  70
    list_request     0.31 48e 138  0.20 13e 130  0.15 13e 141  0.01 11  160
    emoji_accents    0.00 48e  61  0.00 48e  61  0.00 48e  61  0.00 48e  61
    long_prompt      0.01 48  160  0.00  1  160  0.00  1  160  0.00  1e  87

The first token of the France reply is a near-tie (AOTX's logits now: "The" 25.313, "L"
25.290; llama.cpp takes "L"), and the new executor's rounding now gives "The capital of
France is Paris." at every penalty, so the loop no longer shows on AOTX itself: it is
still llama.cpp's greedy reply, and it was AOTX's an hour before. The rest holds: 1.1
keeps the code answer's start (27 tokens, as 1.05) where 1.15 changes it, and halves the
list's repeated phrasing ("is a great source of vitamin C": 0.31 to 0.15, not a loop).
So the default stays 1.1.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

REFS = Path(__file__).resolve().parents[1] / "data" / "refs" / "smollm2" / "chat_refs.json"


def loop_share(ids: list[int], n: int = 8) -> float:
    """Share of the n-token windows of ``ids`` that occurred earlier in ``ids``."""
    if len(ids) <= n:
        return 0.0
    seen, repeats, total = set(), 0, 0
    for i in range(len(ids) - n + 1):
        w = tuple(ids[i:i + n])
        total += 1
        repeats += w in seen
        seen.add(w)
    return repeats / total


def agree(a: list[int], b: list[int], n: int = 48) -> int:
    """Length of the common prefix of a[:n] and b[:n]."""
    k = 0
    for x, y in zip(a[:n], b[:n]):
        if x != y:
            break
        k += 1
    return k


def generate(lm, prompt: list[int], penalty: float, n_tokens: int, last_n: int = 64) -> tuple[list[int], bool]:
    """Greedy ids after ``prompt`` with AOTX's sampler at ``penalty``; (ids, ended on EOS)."""
    from aotx.engine.model.batch import Segment
    from aotx.engine.runtime.sampling import SamplerConfig, SamplerState, sample

    kv = lm.model.new_kv_cache(1, len(prompt) + n_tokens + 1)
    cfg = SamplerConfig(temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=penalty,
                        repeat_last_n=last_n)
    state = SamplerState(seed=0, history=list(prompt[-last_n:]))
    logits = lm.model.forward(np.asarray(prompt, np.int32), [Segment(0, 0, len(prompt))], kv)
    out: list[int] = []
    pos = len(prompt)
    for _ in range(n_tokens):
        tok = sample(np.array(logits[-1], np.float32), cfg, state)
        out.append(tok)
        if tok in lm.eog_ids:
            return out, True
        logits = lm.model.forward(np.asarray([tok], np.int32), [Segment(0, pos, 1)], kv)
        pos += 1
    return out, False


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF (default: the default model)")
    p.add_argument("--tokens", type=int, default=160)
    p.add_argument("--penalties", default="1,1.05,1.1,1.15,1.2,1.3")
    p.add_argument("--prompts", default="", help="comma-separated names (default: all)")
    a = p.parse_args(argv)
    from aotx.engine.model.loader import load_model

    lm = load_model(a.model, device="cpu")
    refs = json.loads(REFS.read_text())["results"]
    if a.prompts:
        refs = [r for r in refs if r["name"] in a.prompts.split(",")]
    penalties = [float(x) for x in a.penalties.split(",")]
    table: dict[str, dict[float, dict]] = {}
    for r in refs:
        base = None
        for pen in penalties:
            t0 = time.perf_counter()
            ids, eos = generate(lm, r["prompt_token_ids"], pen, a.tokens)
            base = ids if base is None and pen == 1.0 else base
            row = {"prompt": r["name"], "penalty": pen, "n": len(ids), "eos": eos,
                   "loop": round(loop_share(ids), 3), "agree": agree(ids, base or ids),
                   "ref": agree(ids, r["completion_token_ids"]), "s": round(time.perf_counter() - t0, 1),
                   "text": lm.tokenizer.decode(ids, skip_special=True)[:160]}
            print(json.dumps(row, ensure_ascii=False), flush=True)
            table.setdefault(r["name"], {})[pen] = row
    print("\nprompt            " + "".join(f"{pen:>16}" for pen in penalties))
    for name, rows in table.items():
        cells = "".join(f"{rows[pen]['loop']:>6.2f} {rows[pen]['agree']:>3}/{rows[pen]['ref']:<3}  "
                        for pen in penalties)
        print(f"{name:<18}{cells}")
    print("(each cell: loop share, tokens agreeing with AOTX's unpenalized greedy / with llama.cpp's)")


if __name__ == "__main__":
    main()
