"""The architectures of issue 35 (qwen35, qwen35moe, gemma4 and its mixture of experts
gemma4moe) and lfm2 against llama.cpp on their tiny random-weight files (tests/models/HYBRID,
references in tests/data/refs/hybrid/ made by
tests/tools/make_refs_hybrid.py with llama-cpp-python 0.3.36): teacher-forced logits on four
prompts (argmax where llama.cpp's top-two gap is >= 0.5, mean |logit diff| on its top-5),
and llama.cpp's greedy continuations decoded step by step (recurrent state, shared KV and
sliding windows carried across forwards). The model is built on the CPU as the engine loads
it (int8 activations) without the tokenizer: the references carry llama.cpp's token ids.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from aotx.engine.model.batch import Segment

REFS = Path(__file__).resolve().parent / "data" / "refs" / "hybrid"
NAMES = sorted(p.stem for p in REFS.glob("*.json") if not p.stem.endswith("_tokenizer")) if REFS.is_dir() else []


def _build(path):
    from aotx.engine.backend.cpu.backend import CpuBackend
    from aotx.engine.model.architectures import get_architecture
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.transformer import build

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    return build(cfg, gf, CpuBackend(int8_activations=True), get_architecture(cfg.arch, str(path)))


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    """name -> (model, ref), after checking the regenerated file (written once per session,
    shared with the batch-invariance test) is byte-identical to the one llama.cpp ran."""
    made: dict = {}

    def get(name):
        if name not in made:
            ref = json.loads((REFS / f"{name}.json").read_text(encoding="utf-8"))
            path = tiny_model_path(name)
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            assert digest == ref["sha256"], f"{name} regenerated differently: rerun tests/tools/make_refs_hybrid.py"
            made[name] = (_build(path), ref)
        return made[name]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_teacher_forced_logits_match_llama_cpp(name, reference):
    """Every position of the four prompts: argmax = llama.cpp's where its top-two gap is
    >= 0.5, mean |logit diff| on its top-5 far inside 0.5."""
    from tests import refcheck

    model, ref = reference(name)

    def forward(ids):
        kv = model.new_kv_cache(1, len(ids) + 1)
        return model.forward(np.asarray(ids, np.int32), [Segment(0, 0, len(ids), all_logits=True)], kv)

    report = refcheck.compare(forward, ref)
    report.check()
    assert report.mad < 0.25, report.summary()


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_match_llama_cpp(name, reference):
    """llama.cpp's greedy continuation of each prompt, decoded step by step along its path:
    the same token at every step whose reference top-two gap is at least 0.5 (a nearer tie
    two correct engines may break either way)."""
    model, ref = reference(name)
    compared = 0
    for g in ref["greedy"]:
        ids = g["prompt_ids"]
        kv = model.new_kv_cache(1, len(ids) + len(g["tokens"]) + 1)
        row = model.forward(np.asarray(ids, np.int32), [Segment(0, 0, len(ids))], kv)[0]
        for i, (want, gap) in enumerate(zip(g["tokens"], g["gap"])):
            if gap >= 0.5:
                assert int(np.argmax(row)) == want, f"{g['name']} step {i}"
                compared += 1
            row = model.forward(np.asarray([want], np.int32), [Segment(0, len(ids) + i, 1)], kv)[0]
    assert compared >= 40


@pytest.mark.parametrize("name", NAMES)
def test_the_references_notice_each_feature(name):
    """Guards the two tests above: llama.cpp on a copy of the file with one feature changed
    fails the same comparison by a wide margin (recorded when the references were made)."""
    ref = json.loads((REFS / f"{name}.json").read_text(encoding="utf-8"))
    for vname, v in ref.get("sensitivity", {}).items():
        if isinstance(v, dict):
            assert v["mad"] > 1.0 or v["strict_mismatches"] > 10, (vname, v)
