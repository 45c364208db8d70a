"""Gemma 4's mixture-of-experts variant (26B-A4B) on the CPU, on tiny files of
tests/models/gemma4.py with the synthetic Gemma 4 vocabulary (a few hundred tokens: fast):
the executor against the float64 interpreter of the same Program (the ``moe`` op with a
router reading its own input, GeGLU experts and per-expert down scales); the fused
``ffn_gate_up_exps`` and the separate gate/up stacks giving the same bits; bad files
refused at load naming the missing tensor or key; the CUDA plan refusing the layer in one
line. Fidelity against llama.cpp (teacher-forced logits and greedy tokens on
``gemma4moe``): tests/test_refs_hybrid.py; batch invariance: tests/test_batch_invariance.py
(every file of tests/models.HYBRID).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from aotx.engine.errors import ModelError
from aotx.engine.model.batch import Segment
from tests.test_refs_hybrid import _build

#: tests/models.HYBRID's gemma4moe in two layers (one sliding, one global) and the small vocabulary
MOE = dict(n_expert=16, n_expert_used=4, ple=0, shared_kv=0, n_layers=2, swa=(True, False))


@functools.cache
def _vocab():
    from tests.models import gemma4

    return gemma4.synthetic_vocab()


def _write(path, **over):
    from tests.models import gemma4

    return gemma4.write(path, _vocab(), **{**MOE, **over})


@pytest.fixture(scope="module")
def g4moe(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("g4moe") / "gemma4moe.gguf")


def _ids(n, vocab, seed=3):
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


def test_cpu_program_matches_the_float64_interpreter(g4moe):
    from aotx.engine.backend.cpu.backend import CpuBackend
    from aotx.engine.model.architectures import gemma4
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.transformer import build
    from tests.program_reference import reference_logits

    gf = GGUFFile.open(g4moe)
    model = build(ModelConfig.from_metadata(gf.metadata, str(g4moe)), gf, CpuBackend(), gemma4)
    moe = model.program.moe_nodes()
    assert len(moe) == 2 and all(len(n.inputs) == 2 and n.attrs["act"] == "gelu_tanh"
                                 and n.attrs["down_scale"] is not None for n in moe)
    ids = _ids(14, model.cfg.vocab_size)        # past the window of 8
    got = model.forward(ids, [Segment(0, 0, 14, all_logits=True)], model.new_kv_cache(1, 16, "f32"))
    want = reference_logits(model.program, ids, n_ctx=16)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_fused_and_separate_gate_up_experts_give_the_same_bits(g4moe, tmp_path):
    """``ffn_gate_up_exps`` (each expert's gate rows, then its up rows) read as two stacks
    over the file's rows, against ``ffn_gate_exps`` / ``ffn_up_exps`` of the same values."""
    apart = _write(tmp_path / "apart.gguf", fused_gate_up=False)
    a, b = _build(g4moe), _build(apart)
    ids = _ids(20, a.cfg.vocab_size)
    seg = [Segment(0, 0, 20, all_logits=True)]
    assert np.array_equal(a.forward(ids, seg, a.new_kv_cache(1, 24)), b.forward(ids, seg, b.new_kv_cache(1, 24)))


BAD = [
    (dict(skip=["blk.1.ffn_gate_inp.scale"]), r"'blk\.1\.ffn_gate_inp\.scale' is missing"),
    (dict(skip=["blk.0.pre_ffw_norm_2.weight"]), r"'blk\.0\.pre_ffw_norm_2\.weight' is missing"),
    (dict(skip=["blk.1.ffn_gate_up_exps.weight"]),
     r"'blk\.1\.ffn_gate_up_exps\.weight' is missing \(the file has neither .*'blk\.1\.ffn_gate_exps\.weight'"),
    (dict(skip=["blk.0.ffn_down_exps.weight"]), r"'blk\.0\.ffn_down_exps\.weight' is missing"),
    (dict(metadata={"gemma4.expert_feed_forward_length": None}), r"'gemma4\.expert_feed_forward_length' is missing"),
    (dict(metadata={"gemma4.expert_used_count": None}), r"gemma4\.expert_used_count 0"),
]


@pytest.mark.parametrize("defects, msg", BAD)
def test_bad_files_are_refused_naming_what_is_missing(defects, msg, tmp_path):
    path = _write(tmp_path / "bad.gguf", **defects)
    with pytest.raises(ModelError, match=msg) as e:
        _build(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_per_expert_gate_scales_are_refused_by_name(tmp_path):
    """llama.cpp's generic pass would scale the gate matmul by ``ffn_gate_exps.scale``;
    a file that has one is a variant this module does not run, refused, not run half-right."""
    from tests.test_qwen35 import _with_extra_tensor

    src = _write(tmp_path / "apart.gguf", fused_gate_up=False)
    path = _with_extra_tensor(src, tmp_path / "scaled.gguf", "blk.0.ffn_gate_exps.scale", np.ones(16, np.float32))
    with pytest.raises(ModelError, match=r"tensor 'blk\.0\.ffn_gate_exps\.scale' is not part of the gemma4"):
        _build(path)


def test_the_cuda_plan_refuses_the_layer_in_one_line(g4moe):
    """The CUDA steps compute none of the layer's new features: the plan (pure Python, no
    GPU needed) refuses the program naming them, before any kernel could run it half-right."""
    from aotx.engine.backend.cuda import plan as cuda_plan

    with pytest.raises(cuda_plan.PlanError) as e:
        cuda_plan.plan(_build(g4moe).program)
    msg = str(e.value)
    assert "\n" not in msg and "blk.0.ffn_moe_out" in msg and "--device cpu" in msg
    for feature in ("a router with its own input", "gelu_tanh", "per-expert down scales"):
        assert feature in msg
