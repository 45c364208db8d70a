"""The llama.cpp reference data and the checker the forward tests use with it.

* Every tiny file of ``tests/models`` regenerates byte-identical to the file llama.cpp's
  references in ``tests/data/refs/tiny/`` were made from (their sha256), so a comparison
  with those logits compares the same weights.
* ``tests/refcheck.py`` passes a forward that reproduces llama.cpp's logits and fails one
  that is off by a constant, that swaps a clear winner, or that drops a feature (the
  references' own ``sensitivity`` runs: llama.cpp without the feature, which the checker must
  reject).
* The real-file references parse in the same checker.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
TINY_REFS = HERE / "data" / "refs" / "tiny"


def _refcheck():
    from tests import refcheck

    return refcheck


TINY_NAMES = sorted(p.stem for p in TINY_REFS.glob("*.json"))


def test_every_tiny_writer_has_a_reference(tiny_models):
    assert sorted(tiny_models.TINY) == TINY_NAMES


@pytest.mark.parametrize("name", TINY_NAMES)
def test_tiny_file_is_byte_identical_to_the_referenced_one(tiny_reference, name):
    path, ref = tiny_reference(name)  # fails inside on a sha256 mismatch
    assert path.stat().st_size == ref["size"]


def _replay(ref: dict, shift: float = 0.0, vocab: int = 49152):
    """A forward that gives back llama.cpp's top-10 logits (+ ``shift``) and -30 elsewhere."""
    table = {}
    for p in ref["prompts"]:
        rows = np.full((len(p["token_ids"]), vocab), -30.0, np.float32)
        for r, top in enumerate(p["top"]):
            for i, v in top:
                rows[r, i] = v + shift
        table[tuple(p["token_ids"])] = rows
    return lambda ids: table[tuple(int(i) for i in ids)]


@pytest.mark.parametrize("name", TINY_NAMES)
def test_refcheck_accepts_llama_cpp_and_rejects_a_constant_offset(name):
    rc = _refcheck()
    ref = rc.load(TINY_REFS / f"{name}.json")
    good = rc.compare(_replay(ref), ref)
    assert good.ok and good.mad < 1e-5
    assert sum(c.n_strict for c in good.cases) > 0.2 * sum(c.n_rows for c in good.cases), \
        "too few positions with a top-two gap >= 0.5: the argmax check would be vacuous"
    bad = rc.compare(_replay(ref, shift=0.6), ref)
    assert not bad.ok and bad.mad == pytest.approx(0.6, abs=1e-4)
    with pytest.raises(AssertionError, match="mean"):
        bad.check()


def test_refcheck_names_a_row_whose_clear_winner_is_swapped():
    rc = _refcheck()
    ref = rc.load(TINY_REFS / "qwen3.json")
    p = ref["prompts"][0]
    r = next(i for i, g in enumerate(p["gap"]) if g >= 1.0)
    base = _replay(ref)

    def swapped(ids):
        rows = base(ids).copy()
        if tuple(int(i) for i in ids) == tuple(p["token_ids"]):
            (a, va), (b, vb) = p["top"][r][:2]
            rows[r, a], rows[r, b] = vb, va
        return rows

    rep = rc.compare(swapped, ref)
    assert not rep.ok
    assert [m["row"] for c in rep.cases for m in c.mismatches] == [r]
    with pytest.raises(AssertionError, match=f"{p['name']} row {r}: argmax"):
        rep.check()


@pytest.mark.parametrize("name", [n for n in TINY_NAMES
                                  if "sensitivity" in json.loads((TINY_REFS / f"{n}.json").read_text())])
def test_the_references_notice_a_missing_feature(name):
    """llama.cpp run on the file without a feature (the reference's ``sensitivity``) would
    fail the checker: the references can tell a forward that ignores it."""
    ref = json.loads((TINY_REFS / f"{name}.json").read_text())
    for variant, facts in ref["sensitivity"].items():
        if variant == "what":
            continue
        assert facts["mad"] > 0.5 or facts["strict_mismatches"] > 0, (name, variant, facts)
    for variant, facts in ref["llama_cpp_self_consistency"].items():
        assert facts["mad"] <= 0.15 and facts["strict_mismatches"] == 0, (name, variant, facts)


@pytest.mark.parametrize("model", ["qwen2", "gemma3"])
def test_real_chat_references_parse_as_teacher_forced_cases(model):
    rc = _refcheck()
    path = HERE / "data" / "refs" / model / "chat_refs.json"
    cases = rc.cases(path)
    assert len(cases) >= 5
    for c in cases:
        assert len(c.top) == len(c.gap) >= 1
        assert c.first_row + len(c.top) == len(c.ids)  # the last fed token predicts the last step


def test_the_llama_forward_matches_llama_cpp_on_the_iquants_file(tiny_reference):
    """End to end through the checker: today's llama forward on the IQ4_NL / IQ4_XS / MXFP4
    file against llama.cpp's logits (measured: mean |diff| ~0.10, no strict-row mismatch;
    llama.cpp's own flash-attention variant differs by ~0.09)."""
    from aotx.engine.model.loader import load_model

    rc = _refcheck()
    path, ref = tiny_reference("iquants")
    rep = rc.compare(rc.model_forward(load_model(path, device="cpu")), ref)
    print(rep.summary())
    rep.check()
    assert rep.mad < 0.25
