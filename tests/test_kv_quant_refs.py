"""The quantized KV caches against llama.cpp run with the same ``-ctk/-ctv`` on the same file.

tests/data/refs/smollm2/kv_quant_refs.json (made by tests/tools/make_kv_quant_refs.py:
llama-cpp-python 0.3.36, CPU, flash attention on, KV f16 | q8_0 | q4_0) holds llama.cpp's
teacher-forced logits on the default model at the f16 run's 16 most likely ids of every
kept step: the five chat references (48 completion steps each) and 128 steps at the end of
a 1,900-token text. AOTX runs the same token ids teacher-forced with each KV type.

The goal: quantizing the KV cache moves AOTX's logits no further from its own f16 logits
than llama.cpp's own drift from its f16 logits (within 1.25 times: the bound's comment says
why): the larger of what its quantized cache
moves them and what feeding the same tokens one at a time moves them (``f16_tokenwise``: a
change that should change nothing; its flash attention takes another path for one row).
This model is chaotic at that scale: any perturbation, even float16's rounding of the
cache, moves its logits by about 0.2. And AOTX with a q8_0 / q4_0 cache stays as close to
llama.cpp with the same cache as AOTX's f16 stays to llama.cpp's f16, give or take the two
drifts. Both engines rotate a quantized cache (llama.cpp's PR 21038; kvformat.rotations).
``test_drift_table`` prints the numbers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from aotx.engine.model.batch import Segment

TYPES = ("f16", "q8_0", "q4_0")
GAP_STRICT = 0.5


@pytest.fixture(scope="module")
def refs(refs_dir):
    return json.loads((refs_dir / "kv_quant_refs.json").read_text())


@pytest.fixture(scope="module")
def logits(loaded_model, refs):
    """name -> kv type -> (steps, 16) AOTX logits at each step's reference ids."""
    m = loaded_model.model
    out: dict[str, dict[str, np.ndarray]] = {}
    for r in refs["results"]:
        ids = np.asarray(r["token_ids"], np.int32)
        pick = np.asarray([s["ids"] for s in r["steps"]])
        out[r["name"]] = {}
        first = int(r["first"])
        for t in TYPES + ("f32",):
            kv = m.new_kv_cache(1, len(ids) + 1, t)
            if first:            # the prefix without its logits (a row's bits do not depend on the chunking)
                m.forward(ids[:first], [Segment(0, 0, first)], kv)
            lg = m.forward(ids[first:], [Segment(0, first, len(ids) - first, all_logits=True)], kv)
            out[r["name"]][t] = np.take_along_axis(lg[:len(r["steps"])], pick, axis=1)
    return out


def _theirs(r, t) -> np.ndarray:
    return np.asarray([s[t]["logits"] for s in r["steps"]], np.float32)


def _own(refs, name=None) -> float:
    """llama.cpp's drift from its f16 logits under a change that should change nothing:
    the same tokens one at a time (mean |logit difference| at the kept ids)."""
    res = [r for r in refs["results"] if name is None or r["name"] == name]
    return float(np.concatenate([np.abs(_theirs(r, "f16_tokenwise") - _theirs(r, "f16")).ravel() for r in res]).mean())


def _noise(refs, logits, name=None) -> float:
    """AOTX's drift from its f16 logits with a float32 cache (a change far below any
    quantization's): this model's own sensitivity on these sequences."""
    res = [r for r in refs["results"] if name is None or r["name"] == name]
    return float(np.concatenate([np.abs(logits[r["name"]]["f32"] - logits[r["name"]]["f16"]).ravel()
                                 for r in res]).mean())


def _drifts(refs, logits, name=None):
    """kv type -> (AOTX's mean |logit - its f16|, llama.cpp's mean |logit - its f16|, mean |AOTX - llama.cpp|)."""
    res = [r for r in refs["results"] if name is None or r["name"] == name]
    out = {}
    for t in TYPES:
        ours = np.concatenate([np.abs(logits[r["name"]][t] - logits[r["name"]]["f16"]).ravel() for r in res])
        theirs = np.concatenate([np.abs(_theirs(r, t) - _theirs(r, "f16")).ravel() for r in res])
        apart = np.concatenate([np.abs(logits[r["name"]][t] - _theirs(r, t)).ravel() for r in res])
        out[t] = (float(ours.mean()), float(theirs.mean()), float(apart.mean()))
    return out


def test_drift_table(refs, logits, capsys):
    rows = [(r["name"], _drifts(refs, logits, r["name"])) for r in refs["results"]] + [("all", _drifts(refs, logits))]
    with capsys.disabled():
        print("\nmean |logit difference| at llama.cpp's f16 top-16 ids (AOTX drift from its f16 / llama.cpp drift "
              "from its f16 / AOTX vs llama.cpp, same KV type)")
        for name, d in rows:
            print(f"  {name:<15} " + "  ".join(f"{t}: {a:.4f} / {b:.4f} / {c:.4f}" for t, (a, b, c) in d.items())
                  + f"  llama.cpp f16 one token at a time: {_own(refs, None if name == 'all' else name):.4f}"
                  + f"  AOTX f32 cache: {_noise(refs, logits, None if name == 'all' else name):.4f}")


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_quantized_kv_drifts_no_more_than_llamacpps_own(refs, logits, kv_type):
    ours, theirs, apart = _drifts(refs, logits)[kv_type]
    own = max(theirs, _own(refs))
    # 1.25: on these six sequences one (short_question) gives AOTX 1.6 times llama.cpp's q8_0
    # drift and the others 0.9-1.3 times (test_drift_table); without the rotation AOTX's
    # q4_0 drift was 1.6 times llama.cpp's over all of them, which this bound refuses
    assert ours <= own * 1.25, (f"{kv_type}: AOTX drifts {ours:.4f} from its f16 logits; llama.cpp's own drift is "
                                f"{own:.4f} (its {kv_type} cache {theirs:.4f}, one token at a time {_own(refs):.4f})")
    f16_apart = _drifts(refs, logits)["f16"][2]
    # as close to llama.cpp with the same cache as the f16 caches are to each other, give or
    # take the two engines' own drifts
    assert apart <= f16_apart + ours + theirs, (kv_type, apart, f16_apart, ours, theirs)


@pytest.mark.parametrize("kv_type", TYPES)
def test_clear_greedy_steps_agree_with_llamacpp_on_the_same_cache(refs, logits, kv_type):
    """Where llama.cpp's top two are further apart than the two engines' drifts could close
    (GAP_STRICT, or three times llama.cpp's own drift with this cache), the argmax agrees."""
    gap = max(GAP_STRICT, 3 * _drifts(refs, logits)[kv_type][1])
    for r in refs["results"]:
        theirs = _theirs(r, kv_type)
        for i, s in enumerate(r["steps"]):
            top2 = np.sort(theirs[i])[-2:]
            if top2[1] - top2[0] >= gap and s[kv_type]["argmax"] in s["ids"]:
                got = s["ids"][int(np.argmax(logits[r["name"]][kv_type][i]))]
                assert got == s[kv_type]["argmax"], (r["name"], kv_type, i)
