"""qwen35, qwen35moe and qwen3next on the CPU: the executor against the float64 interpreter of the
same Program (tests/program_reference.py, written from the op definitions), and bad
files refused at load with one line naming the tensor or key: a missing tensor, a tensor
these modules do not know (a variant they cannot run), missing or inconsistent
linear-attention keys. Fidelity against llama.cpp: tests/test_refs_hybrid.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from aotx.engine.errors import ModelError
from aotx.engine.model.batch import Segment
from tests.program_reference import reference_logits


def _build(path, int8=False):
    from aotx.engine.backend.cpu.backend import CpuBackend
    from aotx.engine.model.architectures import get_architecture
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.transformer import build

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    return build(cfg, gf, CpuBackend(int8_activations=int8), get_architecture(cfg.arch, str(path)))


def _writer(arch):
    from tests.models import qwen35, qwen35moe, qwen3next

    return {"qwen35": qwen35, "qwen35moe": qwen35moe, "qwen3next": qwen3next}[arch]


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe", "qwen3next"])
def test_cpu_program_matches_the_float64_interpreter(arch, tiny_tokenizer, tmp_path):
    """150 positions: the aligned chunks 0..127 in the chunked form, the rest recurrent."""
    model = _build(_writer(arch).write(tmp_path / f"{arch}.gguf", tiny_tokenizer))
    ids = np.random.default_rng(7).integers(0, 49152, 150).astype(np.int32)
    kv = model.new_kv_cache(1, 160, "f32")
    got = model.forward(ids, [Segment(0, 0, len(ids), all_logits=True)], kv)
    want = reference_logits(model.program, ids, n_ctx=160)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def _with_extra_tensor(src, dst, name, arr):
    """A copy of GGUF ``src`` with one more tensor (gguf's reader and writer)."""
    import gguf

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, str(r.fields["general.architecture"].contents()))
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vt = gguf.GGUFValueType(int(f.types[0]))
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(key, list(f.contents()))
        else:
            w.add_key_value(key, f.contents(), vt)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


BAD = [
    ("qwen35", dict(skip=["blk.0.ssm_a"]), r"'blk\.0\.ssm_a' is missing"),
    ("qwen35", dict(skip=["blk.1.attn_q_norm.weight"]), r"'blk\.1\.attn_q_norm\.weight' is missing"),
    ("qwen35", dict(metadata={"qwen35.ssm.state_size": None}), r"'qwen35\.ssm\.state_size' is missing"),
    ("qwen35", dict(metadata={"qwen35.rope.dimension_sections": None}),
     r"'qwen35\.rope\.dimension_sections' is missing"),
    ("qwen35", dict(metadata={"qwen35.ssm.group_count": 3}), r"ssm\.time_step_rank 4 .* not a multiple"),
    ("qwen35", dict(metadata={"qwen35.ssm.inner_size": 48}), r"ssm\.inner_size 48"),
    ("qwen35moe", dict(skip=["blk.0.ffn_gate_inp_shexp.weight"]), r"'blk\.0\.ffn_gate_inp_shexp\.weight' is missing"),
    ("qwen35moe", dict(metadata={"qwen35moe.expert_count": None, "qwen35moe.expert_used_count": None}),
     r"expert_count is 0"),
]


@pytest.mark.parametrize("arch, defects, msg", BAD)
def test_bad_files_are_refused_naming_what_is_wrong(arch, defects, msg, tiny_tokenizer, tmp_path):
    path = _writer(arch).write(tmp_path / "bad.gguf", tiny_tokenizer, **defects)
    with pytest.raises(ModelError, match=msg) as e:
        _build(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_tensor_the_module_does_not_know_is_refused(tiny_tokenizer, tmp_path):
    """A variant (here fused gate/up experts, a converter option) is never run half-right."""
    from tests.models import qwen35moe

    src = qwen35moe.write(tmp_path / "ok.gguf", tiny_tokenizer)
    path = _with_extra_tensor(src, tmp_path / "fused.gguf", "blk.0.ffn_gate_up_exps.weight",
                              np.zeros((8, 128, 64), np.float32))
    with pytest.raises(ModelError, match=r"tensor 'blk\.0\.ffn_gate_up_exps\.weight' is not part of the qwen35moe"):
        _build(path)
