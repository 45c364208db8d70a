"""lfm2 (Liquid's LFM2: gated short convolutions beside attention) on the CPU: the executor
against the float64 interpreter of the same Program (tests/program_reference.py), the
convolution state in capsules (the full restore is token-identical, KV alone diverges),
the variants refused at load in one line naming what is missing (lfm2moe, the ColBERT
``dense_2`` head, a bidirectional file, missing keys), and the CUDA plan refusing the
``mul`` op in one line. Fidelity against llama.cpp: tests/test_refs_hybrid.py; batch
invariance: tests/test_batch_invariance.py (both list every file of tests/models.HYBRID).
"""

from __future__ import annotations

import numpy as np
import pytest
from aotx.engine.errors import ModelError
from aotx.engine.model.batch import Segment
from aotx.engine.state import capsule as C

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


def test_cpu_program_matches_the_float64_interpreter(tiny_model_path):
    """40 positions (past the window of 8 and the parallel convolution's 16 rows)."""
    model = _build(tiny_model_path("lfm2"))
    assert [(L.kind, L.shape) for L in model.program.state_layers] == [("conv", (2, 64))] * 3
    assert len(model.program.kv_layers) == 1
    ids = np.random.default_rng(7).integers(0, 49152, 40).astype(np.int32)
    kv = model.new_kv_cache(1, 48, "f32")
    got = model.forward(ids, [Segment(0, 0, len(ids), all_logits=True)], kv)
    want = reference_logits(model.program, ids, n_ctx=48)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


@pytest.fixture(scope="module")
def lm(tiny_model_path):
    """The tiny lfm2 file loaded as the engine loads it (int8 activations)."""
    from aotx.engine.model.loader import load_model

    return load_model(tiny_model_path("lfm2"))


def _greedy(lm, kv, slot, pos, tok, n):
    out = []
    for i in range(n):
        tok = int(np.argmax(lm.model.forward(np.asarray([tok], np.int32), [Segment(slot, pos + i, 1)], kv)[0]))
        out.append(tok)
    return out


def _prefill(lm, kv, slot, ids):
    return int(np.argmax(lm.model.forward(np.asarray(ids, np.int32), [Segment(slot, 0, len(ids))], kv)[0]))


def test_the_conv_state_is_in_the_capsule_and_load_bearing(lm, tmp_path):
    """Snapshot, disk and restore carry the three conv states byte for byte; greedy decode
    after a full restore is token-identical to decode without it; restoring the KV alone
    (the conv states fresh) diverges."""
    ids = lm.tokenizer.encode("The quick brown fox jumps over the lazy dog, and the dog", parse_special=True)
    kv = lm.model.new_kv_cache(2, 64)
    first = _prefill(lm, kv, 0, ids)
    straight = [first] + _greedy(lm, kv, 0, len(ids), first, 15)
    kv = lm.model.new_kv_cache(2, 64)
    first = _prefill(lm, kv, 0, ids)
    head = [first] + _greedy(lm, kv, 0, len(ids), first, 3)
    cap = C.snapshot(kv, 0, ids + head[:-1], fingerprint=lm.fingerprint, pending_token=head[-1])
    assert cap.header.state == list(kv.state.names) == ["conv.0", "conv.1", "conv.2"]
    C.save(cap, tmp_path / "lfm2.caps")
    back = C.load(tmp_path / "lfm2.caps")
    _prefill(lm, kv, 1, list(range(500, 530)))           # slot 1 holds something else first
    C.restore(back, kv, 1, fingerprint=lm.fingerprint)
    for name in cap.header.state:
        assert C.snapshot(kv, 1, ids + head[:-1], fingerprint=lm.fingerprint).state[name].tobytes() == \
            cap.state[name].tobytes()
    full = _greedy(lm, kv, 1, cap.n_tokens, head[-1], 12)
    assert head + full == straight
    # KV alone: the attention layer's K/V back, every conv state fresh at that position
    kv.restore_slot(1, cap.k, cap.v, cap.n_tokens)
    for b in kv.state.buffers:
        b[1] = 0.0
    kv.state.pos[1] = cap.n_tokens
    kv_only = _greedy(lm, kv, 1, cap.n_tokens, head[-1], 12)
    assert kv_only != full, kv_only


def _refused(tiny_tokenizer, tmp_path, match, **kw):
    from tests.models import lfm2

    path = lfm2.write(tmp_path / "bad.gguf", tiny_tokenizer, **kw)
    with pytest.raises(ModelError, match=match) as e:
        _build(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw, match", [
    ({"metadata": {"lfm2.shortconv.l_cache": None}}, r"'lfm2\.shortconv\.l_cache' is missing"),
    ({"metadata": {"lfm2.attention.causal": False}}, r"attention\.causal is false"),
    ({"layers": "CCCC"}, r"lfm2\.attention\.head_count_kv is 0"),
    ({"skip": ["blk.1.shortconv.conv.weight"]}, r"'blk\.1\.shortconv\.conv\.weight' is missing"),
    ({"skip": ["token_embd_norm.weight"]}, r"'token_embd_norm\.weight' is missing"),
])
def test_bad_files_are_refused_naming_what_is_wrong(tiny_tokenizer, tmp_path, kw, match):
    _refused(tiny_tokenizer, tmp_path, match, **kw)


def test_the_colbert_head_and_lfm2moe_are_refused_by_name(tiny_tokenizer, tmp_path):
    from aotx.engine.model.architectures import get_architecture

    from tests.models import lfm2
    from tests.test_qwen35 import _with_extra_tensor

    src = lfm2.write(tmp_path / "ok.gguf", tiny_tokenizer)
    path = _with_extra_tensor(src, tmp_path / "colbert.gguf", "dense_2.weight", np.zeros((128, 64), np.float32))
    with pytest.raises(ModelError, match=r"tensor 'dense_2\.weight' is not part of the lfm2 architecture"):
        _build(path)
    with pytest.raises(ModelError, match=r"architecture 'lfm2moe' is not supported"):
        get_architecture("lfm2moe")


def test_cuda_refuses_lfm2_in_one_line(tiny_model_path):
    """The plan is a pure function (no GPU needed): no CUDA step computes ``mul``."""
    from aotx.engine.backend.cuda import plan as CP

    with pytest.raises(CP.PlanError) as e:
        CP.plan(_build(tiny_model_path("lfm2")).program)
    assert "\n" not in str(e.value) and "--device cpu" in str(e.value) and "lfm2" in str(e.value)
