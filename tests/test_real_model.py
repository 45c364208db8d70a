"""The default model against llama.cpp's references in tests/data/refs/smollm2/.

Teacher-forced (tests/data/refs/smollm2/README.md): feed prompt + reference completion, and
at every step compare our logits with llama.cpp's reference top-5. Where the
reference top-two gap is >= 0.5 our argmax must equal llama.cpp's; over all
steps the mean absolute logit difference on the reference top-5 ids must stay
<= 0.5. Greedy generation must reproduce the reference completion up to the
first near-tie (reference gap < 0.25), where a numerically different engine may
legitimately diverge. 0.25, not less: llama.cpp's own logits differ from the exact
(float64) model by 0.2-0.4 on these prompts (ours by 0.07-0.25); long_prompt's step 2
reads a gap of 0.11 in llama.cpp where the exact model has 0.07, the other way round,
so it has no 4 safe steps and is left out of the greedy test.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from aotx.engine.model.batch import Segment
from aotx.engine.runtime.sampling import SamplerConfig, SamplerState, sample

GAP_STRICT = 0.5
NEAR_TIE = 0.25


@pytest.fixture(scope="module")
def lm(default_model_path):
    from aotx.engine.model.loader import load_model

    return load_model(default_model_path, device="cpu")


@pytest.fixture(scope="module")
def chat_refs(refs_dir):
    return json.loads((refs_dir / "chat_refs.json").read_text())["results"]


def _teacher_forced(lm, prompt, completion):
    ids = np.asarray(prompt + completion, np.int32)
    kv = lm.model.new_kv_cache(1, len(ids) + 1)
    logits = lm.model.forward(ids, [Segment(0, 0, len(ids), all_logits=True)], kv)
    return logits[len(prompt) - 1: len(prompt) - 1 + len(completion)]


@pytest.mark.parametrize("name", ["short_question", "code_request", "list_request", "emoji_accents", "long_prompt"])
def test_teacher_forced_logits_match_llamacpp(lm, chat_refs, name):
    ref = next(r for r in chat_refs if r["name"] == name)
    rows = _teacher_forced(lm, ref["prompt_token_ids"], ref["completion_token_ids"])
    diffs = []
    for step, (row, top5, gap) in enumerate(zip(rows, ref["greedy_step_top5"],
                                               ref["greedy_step_top1_minus_top2_logit"])):
        diffs.extend(abs(float(row[i]) - v) for i, v in top5)
        if gap >= GAP_STRICT:
            assert int(np.argmax(row)) == top5[0][0], (
                f"{name} step {step}: argmax {int(np.argmax(row))} but llama.cpp's top-1 is {top5[0][0]} "
                f"with a gap of {gap}")
    mad = float(np.mean(diffs))
    assert mad <= 0.5, f"{name}: mean |logit - llama.cpp| on the reference top-5 is {mad:.3f} (> 0.5)"


def test_prompt_tokenization_matches_reference(lm, chat_refs):
    from aotx.engine.model.chat_template import encode_chat

    for ref in chat_refs:
        messages = [{"role": "user", "content": ref["rendered_prompt"].split("<|im_start|>user\n")[1]
                     .split("<|im_end|>")[0]}]
        assert encode_chat(lm.tokenizer, lm.template, messages) == ref["prompt_token_ids"], ref["name"]


@pytest.mark.parametrize("name", ["code_request", "emoji_accents"])
def test_greedy_reproduces_reference_until_a_near_tie(lm, chat_refs, name):
    ref = next(r for r in chat_refs if r["name"] == name)
    gaps = ref["greedy_step_top1_minus_top2_logit"]
    n = next((i for i, g in enumerate(gaps) if g < NEAR_TIE), len(gaps))
    assert n >= 4, "the reference has a near-tie too early to test anything"
    prompt = ref["prompt_token_ids"]
    kv = lm.model.new_kv_cache(1, len(prompt) + n + 1)
    logits = lm.model.forward(np.asarray(prompt, np.int32), [Segment(0, 0, len(prompt))], kv)
    cfg, st = SamplerConfig(repeat_penalty=1.0, temperature=0.0), SamplerState(seed=0)
    out = []
    for i in range(n):
        tok = sample(logits[0].copy(), cfg, st)
        out.append(tok)
        logits = lm.model.forward(np.asarray([tok], np.int32), [Segment(0, len(prompt) + i, 1)], kv)
    assert out == ref["completion_token_ids"][:n]
