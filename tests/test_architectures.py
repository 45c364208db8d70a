"""The five architectures (llama incl. Llama 3.x, qwen2, qwen3, gemma3, phi3) on the CPU:
teacher-forced fidelity against llama.cpp on every tiny reference file, the CPU program
against the float64 interpreter of the same Program, batching and chunking rules with
sliding windows, and bad input: every defect one ModelError line naming the tensor or key
and the file, raised before any weight is loaded (and exit code 2 from the CLI).

The tiny files and llama.cpp's references come from helper ``refs`` (tests/models/,
tests/data/refs/tiny/, tests/refcheck.py, fixtures ``tiny_model_path``/``tiny_reference``);
where those are not in this checkout the tests skip, saying so.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from aotx.engine.errors import ModelError
from aotx.engine.model.batch import Segment
from aotx.engine.model.loader import load_model

HERE = Path(__file__).resolve().parent
TINY_REFS = HERE / "data" / "refs" / "tiny"
TINY_NAMES = sorted(p.stem for p in TINY_REFS.glob("*.json")) if TINY_REFS.is_dir() else []


def _by_path(name: str, file: str):
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, HERE / file)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return mod


def _fixture(request, name: str):
    return request.getfixturevalue(name)   # tests/conftest.py defines every one of them


@pytest.fixture(scope="module")
def tiny_cache():
    return {}


def tiny(request, tiny_cache, name: str, int8: bool = True):
    """The tiny reference file ``name`` loaded on the CPU (once per module and int8 choice)."""
    key = (name, int8)
    if key not in tiny_cache:
        path = _fixture(request, "tiny_model_path")(name)
        tiny_cache[key] = load_model(path, int8_activations=int8)
    return tiny_cache[key]


def rel_err(got, ref) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))


def all_logits(lm, ids, kv_type: str = "f16") -> np.ndarray:
    kv = lm.model.new_kv_cache(1, len(ids) + 1, kv_type)
    return lm.model.forward(np.asarray(ids, np.int32), [Segment(0, 0, len(ids), all_logits=True)], kv)


# ------------------------------------------------------------------ against llama.cpp

@pytest.mark.parametrize("name", TINY_NAMES)
def test_tiny_file_matches_llama_cpp_teacher_forced(request, tiny_cache, name):
    """The acceptance rule on every tiny file: argmax equal where llama.cpp's top-two gap
    is >= 0.5, mean |logit diff| on its top-5 <= 0.5 (observed 0.05 .. 0.10)."""
    path, ref = _fixture(request, "tiny_reference")(name)
    refcheck = _by_path("aotx_tests_refcheck", "refcheck.py")
    lm = tiny(request, tiny_cache, name)
    report = refcheck.compare(refcheck.model_forward(lm), ref)
    report.check()
    assert report.mad < 0.25, report.summary()   # far inside the bound: a lost feature costs 0.25 .. 13


@pytest.mark.parametrize("name", TINY_NAMES)
def test_tiny_file_cpu_program_matches_float64_interpreter(request, tiny_cache, name):
    """The CPU executor (float32, f32 KV, float activations) computes the traced Program:
    the float64 interpreter of tests/program_reference.py agrees to float32 rounding."""
    path, ref = _fixture(request, "tiny_reference")(name)
    lm = tiny(request, tiny_cache, name, int8=False)
    ids = ref["prompts"][-1]["token_ids"][:40]
    want = _by_path("aotx_tests_program_reference", "program_reference.py").reference_logits(
        lm.model.program, ids, n_ctx=len(ids) + 1)
    assert rel_err(all_logits(lm, ids, "f32"), want) < 1e-4


@pytest.mark.parametrize("name", ["gemma3", "phi3-longrope", "qwen3"])
def test_chunks_decode_steps_and_mixed_batches_agree(request, tiny_cache, name):
    """Sliding windows and long-rope across prefill chunks, decode steps and a batch shared
    with another slot: the same logits (float32 rounding) as the sequence at once."""
    path, ref = _fixture(request, "tiny_reference")(name)
    lm = tiny(request, tiny_cache, name, int8=False)
    ids = ref["prompts"][-1]["token_ids"][:40]       # longer than gemma3's tiny window (16)
    n = len(ids)
    whole = all_logits(lm, ids, "f32")
    kv = lm.model.new_kv_cache(3, n + 1, "f32")
    other = np.asarray(ref["prompts"][0]["token_ids"][:20], np.int32)
    rows = [lm.model.forward(np.asarray(ids[:22], np.int32), [Segment(2, 0, 22, all_logits=True)], kv)]
    for p in range(22, 25):                          # decode steps, next to another slot's prefill
        toks = np.concatenate([[ids[p]], other[:1 + 18 * (p == 22)]]).astype(np.int32)
        segs = [Segment(2, p, 1), Segment(0, 0, len(toks) - 1, logits=False)] if p == 22 else [Segment(2, p, 1)]
        rows.append(lm.model.forward(toks if p == 22 else toks[:1], segs, kv)[:1])
    rows.append(lm.model.forward(np.asarray(ids[25:], np.int32), [Segment(2, 25, n - 25, all_logits=True)], kv))
    assert rel_err(np.concatenate(rows), whole) < 1e-4


def test_gemma3_window_and_local_rope_base_matter(request, tiny_cache):
    """Guards the test above: the window and the sliding layers' RoPE base change the logits."""
    import dataclasses

    from aotx.engine.backend.cpu.backend import CpuBackend
    from aotx.engine.model.architectures import gemma3
    from aotx.engine.model.transformer import build

    lm = tiny(request, tiny_cache, "gemma3", int8=False)
    ids = _fixture(request, "tiny_reference")("gemma3")[1]["prompts"][-1]["token_ids"][:40]
    base = all_logits(lm, ids, "f32")
    for change in ({"sliding_window": None}, {"rope_base_swa": lm.config.rope_base}):
        cfg = dataclasses.replace(lm.config, **change)
        m = build(cfg, lm.gguf, CpuBackend(), gemma3)
        kv = m.new_kv_cache(1, len(ids) + 1, "f32")
        other = m.forward(np.asarray(ids, np.int32), [Segment(0, 0, len(ids), all_logits=True)], kv)
        assert rel_err(other, base) > 1e-2, change


# ------------------------------------------------------------------ bad input

# (tiny file, defects for its writer, what the one-line message must say)
BAD = [
    ("qwen3", dict(skip=["blk.1.attn_q_norm.weight"]), r"'blk\.1\.attn_q_norm\.weight' is missing"),
    ("gemma3", dict(skip=["blk.0.post_ffw_norm.weight"]), r"'blk\.0\.post_ffw_norm\.weight' is missing"),
    ("phi3", dict(skip=["blk.1.attn_qkv.weight"]), r"'blk\.1\.attn_qkv\.weight' is missing"),
    ("llama3", dict(skip=["blk.0.ffn_gate.weight"]), r"'blk\.0\.ffn_gate\.weight' is missing"),
    ("qwen2", dict(shapes={"blk.0.attn_q.bias": (32,)}), r"'blk\.0\.attn_q\.bias' has shape \[32\], expected \[64\]"),
    ("gemma3", dict(shapes={"blk.1.attn_k_norm.weight": (16,)}), r"'blk\.1\.attn_k_norm\.weight' has shape"),
    ("phi3", dict(shapes={"blk.0.ffn_up.weight": (256, 256)}), r"'blk\.0\.ffn_up\.weight' has shape"),
    ("qwen3", dict(metadata={"qwen3.attention.head_count_kv": 3}),
     r"head_count is 4, not a multiple of head_count_kv 3"),
    ("gemma3", dict(metadata={"gemma3.attention.head_count": 8}), r"'blk\.0\.attn_q\.weight' has shape"),
    ("gemma3", dict(metadata={"gemma3.attention.sliding_window": 40000}),
     r"gemma3\.attention\.sliding_window 40000 is larger than the trained context"),
    ("gemma3", dict(metadata={"gemma3.attention.sliding_window": 0}), r"gemma3\.attention\.sliding_window is 0"),
    ("gemma3", dict(metadata={"gemma3.attention.sliding_window_pattern": [True, False]}),
     r"sliding_window_pattern has 2 entries for 6 layers"),
    ("llama3", dict(metadata={"llama.rope.scaling.type": "dynamic"}), r"'dynamic', an unknown RoPE scaling type"),
    ("qwen2", dict(metadata={"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.original_context_length": 0}),
     r"rope\.scaling\.original_context_length is 0; it must be positive"),
    ("qwen2", dict(metadata={"qwen2.rope.dimension_count": 8}), r"rope\.dimension_count 8 differs from the head"),
]


@pytest.fixture
def broken(request, tmp_path):
    """Factory: the tiny file ``name`` written with ``defects``."""
    models = _fixture(request, "tiny_models")
    tok = _fixture(request, "tiny_tokenizer")
    args = dict(models.TINY)

    def make(name: str, defects: dict) -> Path:
        module, kw = args[name]
        return module.write(tmp_path / f"{name}-broken.gguf", tok, **kw, **defects)

    return make


@pytest.mark.parametrize("name,defects,pattern", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_file_is_one_line_naming_it_before_any_weight_loads(broken, monkeypatch, name, defects, pattern):
    import re

    from aotx.engine.backend.cpu.backend import CpuBackend

    path = broken(name, defects)
    loads: list[str] = []
    real_matrix, real_vector = CpuBackend.matrix, CpuBackend.vector
    monkeypatch.setattr(CpuBackend, "matrix", lambda self, t: loads.append(t.name) or real_matrix(self, t))
    monkeypatch.setattr(CpuBackend, "vector", lambda self, t: loads.append(t.name) or real_vector(self, t))
    with pytest.raises(ModelError) as ei:
        load_model(path)
    msg = str(ei.value)
    assert str(path) in msg and "\n" not in msg, msg
    assert re.search(pattern, msg), msg
    assert loads == [], f"weights were loaded before the defect was found: {loads[:3]}"


def test_unsupported_tensor_type_is_found_before_any_weight_loads(tiny_gguf, tmp_path, monkeypatch):
    """The last layer's matrix has a type the CPU cannot read (IQ2_XXS): refused by name
    before the first layer's weights are touched."""
    from aotx.engine.backend.cpu.backend import CpuBackend

    path = tiny_gguf.write_tiny_llama(tmp_path / "m.gguf", d_model=256, ffn=256,
                                      tensor_types={"blk.1.ffn_down.weight": T.IQ2_XXS})
    loads: list[str] = []
    real = CpuBackend.matrix
    monkeypatch.setattr(CpuBackend, "matrix", lambda self, t: loads.append(t.name) or real(self, t))
    with pytest.raises(ModelError, match=r"'blk\.1\.ffn_down\.weight' has tensor type IQ2_XXS, which the CPU"):
        load_model(path)
    assert loads == []


def test_bad_file_exits_2_from_the_cli(broken, tmp_path):
    path = broken("gemma3", dict(skip=["blk.0.post_ffw_norm.weight"]))
    env = dict(os.environ, AOTX_HOME=str(tmp_path / "home"), PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", "logits", "--model", str(path), "hi"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "post_ffw_norm" in lines[0] and str(path) in lines[0], r.stderr
    assert "Traceback" not in r.stderr
