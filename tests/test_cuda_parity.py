"""CUDA backend against the CPU backend: logits on tiny random models, greedy on the default shape.

Every model is written with ``cuda_testmodel.write_llama`` (random blocks of one tensor
type, or a mix) and run through the same scenario on both backends: prefill with every
row's logits, prefill with the last row's, decode steps of two and three slots (the CUDA
graph path, buckets 2 and 4 with a padded row), a mixed batch (decode row + prefill
chunk) and a decode at position 150 (attention split over the context). Each CUDA logits
array must satisfy ||cuda - cpu|| / ||cpu|| <= REL_TOL (float32 on both sides; only the
order of summation differs). The CPU side runs its float path (``int8_activations=False``):
its int8-activation kernels are an approximation of their own.

On the default model's shape (random weights; the real file when installed) the two
backends must produce the same greedy tokens up to the first near-tie (CPU top-two gap
< NEAR_TIE), where either answer is legitimate.

Skips with a visible reason where CuPy or a CUDA device is absent (CI).
"""

from __future__ import annotations

import numpy as np
import pytest

try:
    import cupy

    _n_dev = cupy.cuda.runtime.getDeviceCount()
except Exception as e:  # noqa: BLE001 - ImportError, or the driver's CUDARuntimeError
    pytest.skip(f"no CUDA device: {type(e).__name__}: {e}", allow_module_level=True)
if _n_dev < 1:
    pytest.skip("no CUDA device: CuPy sees 0 devices", allow_module_level=True)

from gguf import GGMLQuantizationType as T  # noqa: E402

from tests.models.cuda_testmodel import SMOLLM2_135M, write_llama  # noqa: E402
from aotx.engine.errors import ModelError  # noqa: E402
from aotx.engine.model.batch import Segment  # noqa: E402

pytestmark = pytest.mark.cuda

REL_TOL = 1e-3
NEAR_TIE = 0.05


def _build(path, device: str):
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.architectures import build

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    if device == "cpu":
        from aotx.engine.backend.cpu.backend import CpuBackend

        be = CpuBackend(int8_activations=False)  # the float path: CUDA computes in float32
    else:
        from aotx.engine.backend.cuda.backend import CudaBackend

        be = CudaBackend(prefill="f32")  # the eager path's float32 GEMM (tensor cores: test_cuda_invariance)
    return build(cfg, gf, be)


def _scenario(model, vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    tok = lambda n: rng.integers(0, vocab, n).astype(np.int32)  # noqa: E731
    kv = model.new_kv_cache(4, 256, "f32")  # float32 on both sides (test_cuda_program covers f16)
    out = [model.forward(tok(9), [Segment(1, 0, 9, all_logits=True)], kv),
           model.forward(tok(5), [Segment(0, 0, 5)], kv)]
    for i in range(3):
        out.append(model.forward(tok(2), [Segment(0, 5 + i, 1), Segment(1, 9 + i, 1)], kv))
    out.append(model.forward(tok(7), [Segment(0, 8, 1), Segment(2, 0, 6)], kv))
    out.append(model.forward(tok(3), [Segment(2, 6, 1), Segment(1, 12, 1), Segment(0, 9, 1)], kv))
    out.append(model.forward(tok(150), [Segment(3, 0, 150, logits=False)], kv))
    out.append(model.forward(tok(1), [Segment(3, 150, 1)], kv))
    out.append(model.forward(tok(2), [Segment(3, 151, 1), Segment(2, 7, 1)], kv))
    return out


def _compare(path, vocab: int) -> float:
    cpu = _scenario(_build(path, "cpu"), vocab)
    gpu = _scenario(_build(path, "cuda"), vocab)
    worst = 0.0
    for i, (a, b) in enumerate(zip(gpu, cpu)):
        assert a.shape == b.shape, f"step {i}: CUDA logits {a.shape}, CPU {b.shape}"
        if b.size == 0:
            continue
        assert np.isfinite(a).all(), f"step {i}: CUDA logits are not finite"
        rel = float(np.linalg.norm(a - b) / np.linalg.norm(b))
        worst = max(worst, rel)
        assert rel <= REL_TOL, f"step {i}: ||cuda - cpu|| / ||cpu|| = {rel:.2e} > {REL_TOL}"
    return worst


TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_logits_match_cpu_per_type(tmp_path, qtype):
    path = write_llama(tmp_path / f"{qtype.name}.gguf", qtype=qtype, seed=int(qtype))
    worst = _compare(path, 512)
    print(f"{qtype.name}: worst relative logits error {worst:.2e}")


def test_logits_match_cpu_mixed_types_untied_odd_vocab(tmp_path):
    """q/k/v of different types (three QKV launches), gate and up of different types,
    an untied Q6_K output with an odd vocabulary (the padded row), Q8_0 embedding."""
    path = write_llama(tmp_path / "mixed.gguf", qtype=T.Q4_K, emb_qtype=T.Q8_0, out_qtype=T.Q6_K, vocab=511,
                       layer_types={"attn_v.weight": T.Q6_K, "ffn_up.weight": T.Q5_K, "ffn_down.weight": T.Q6_K})
    print(f"mixed: worst relative logits error {_compare(path, 511):.2e}")


def test_logits_match_cpu_head_dim_128(tmp_path):
    path = write_llama(tmp_path / "hd128.gguf", qtype=T.Q8_0, n_heads=2, n_kv_heads=1)
    print(f"hd128: worst relative logits error {_compare(path, 512):.2e}")


def test_unsupported_type_is_refused(tmp_path):
    path = write_llama(tmp_path / "iq2xxs.gguf", qtype=T.Q8_0, layer_types={"ffn_up.weight": T.IQ2_XXS})
    with pytest.raises(ModelError, match="IQ2_XXS"):
        _build(path, "cuda")


def _greedy_agreement(path, vocab: int, prompt_len: int = 12, steps: int = 24) -> tuple[int, int, str]:
    """(tokens agreed, steps compared, why it stopped)."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, vocab, prompt_len).astype(np.int32)
    runs = []
    for dev in ("cpu", "cuda"):
        m = _build(path, dev)
        kv = m.new_kv_cache(1, prompt_len + steps + 1, "f32")
        lg = m.forward(prompt, [Segment(0, 0, prompt_len)], kv)
        toks, gaps = [], []
        for i in range(steps):
            row = lg[-1]
            t = int(np.argmax(row))
            top2 = np.partition(row, -2)[-2:]
            toks.append(t)
            gaps.append(float(top2[1] - top2[0]))
            if dev == "cuda":
                ids = m.greedy(np.array([t], np.int32), [Segment(0, prompt_len + i, 1)], kv)
                lg = m.last_logits().get()
                assert int(ids[0]) == int(np.argmax(lg[0])), "device argmax disagrees with the host's"
            else:
                lg = m.forward(np.array([t], np.int32), [Segment(0, prompt_len + i, 1)], kv)
        runs.append((toks, gaps))
    (ct, cg), (gt, _) = runs
    for i, (a, b) in enumerate(zip(ct, gt)):
        if a != b:
            assert cg[i] < NEAR_TIE, f"step {i}: CPU greedy {a}, CUDA {b}, CPU top-two gap {cg[i]:.3f}"
            return i, steps, f"near-tie at step {i} (gap {cg[i]:.3f})"
    return steps, steps, "all agree"


def test_greedy_matches_cpu_default_shape_random(tmp_path):
    path = write_llama(tmp_path / "smollm_shape.gguf", seed=1, **SMOLLM2_135M)
    agreed, n, why = _greedy_agreement(path, SMOLLM2_135M["vocab"])
    print(f"default shape, random weights: {agreed}/{n} greedy tokens agree ({why})")


@pytest.mark.realmodel
def test_greedy_matches_cpu_default_model(default_model_path):
    agreed, n, why = _greedy_agreement(default_model_path, 49152, steps=32)
    print(f"default model: {agreed}/{n} greedy tokens agree ({why})")


# ---- the default model against llama.cpp's references (as tests/test_real_model.py does on the CPU)

GAP_STRICT = 0.5
REF_NEAR_TIE = 0.1


@pytest.fixture(scope="module")
def cuda_lm(default_model_path):
    from aotx.engine.model.loader import load_model

    return load_model(default_model_path, device="cuda")


@pytest.fixture(scope="module")
def chat_refs(refs_dir):
    import json

    return json.loads((refs_dir / "chat_refs.json").read_text())["results"]


@pytest.mark.realmodel
@pytest.mark.parametrize("name", ["short_question", "code_request", "list_request", "emoji_accents", "long_prompt"])
def test_teacher_forced_logits_match_llamacpp_cuda(cuda_lm, chat_refs, name):
    """Teacher-forced: where llama.cpp's top-two gap is >= 0.5 our argmax equals its
    top-1; the mean |logit - llama.cpp| over the reference top-5 ids stays <= 0.5."""
    ref = next(r for r in chat_refs if r["name"] == name)
    prompt, completion = ref["prompt_token_ids"], ref["completion_token_ids"]
    ids = np.asarray(prompt + completion, np.int32)
    kv = cuda_lm.model.new_kv_cache(1, len(ids) + 1)
    logits = cuda_lm.model.forward(ids, [Segment(0, 0, len(ids), all_logits=True)], kv)
    rows = logits[len(prompt) - 1: len(prompt) - 1 + len(completion)]
    diffs = []
    for step, (row, top5, gap) in enumerate(zip(rows, ref["greedy_step_top5"],
                                               ref["greedy_step_top1_minus_top2_logit"])):
        diffs.extend(abs(float(row[i]) - v) for i, v in top5)
        if gap >= GAP_STRICT:
            assert int(np.argmax(row)) == top5[0][0], f"{name} step {step}: argmax {int(np.argmax(row))}, " \
                                                      f"llama.cpp {top5[0][0]} (gap {gap})"
    mad = float(np.mean(diffs))
    print(f"{name}: mean |logit - llama.cpp| on the reference top-5 = {mad:.4f} over {len(rows)} steps")
    assert mad <= 0.5, f"{name}: mean |logit - llama.cpp| = {mad:.3f} (> 0.5)"


@pytest.mark.realmodel
@pytest.mark.parametrize("name", ["code_request", "emoji_accents", "long_prompt"])
def test_device_greedy_reproduces_reference_until_a_near_tie(cuda_lm, chat_refs, name):
    """Greedy on the device (graph replay + device argmax) reproduces llama.cpp's
    completion up to its first near-tie (reference top-two gap < 0.1)."""
    ref = next(r for r in chat_refs if r["name"] == name)
    gaps = ref["greedy_step_top1_minus_top2_logit"]
    n = next((i for i, g in enumerate(gaps) if g < REF_NEAR_TIE), len(gaps))
    prompt = ref["prompt_token_ids"]
    m = cuda_lm.model
    kv = m.new_kv_cache(1, len(prompt) + n + 1)
    out = [int(m.greedy(np.asarray(prompt, np.int32), [Segment(0, 0, len(prompt))], kv)[0])]
    for i in range(n - 1):
        out.append(int(m.greedy(np.asarray([out[-1]], np.int32), [Segment(0, len(prompt) + i, 1)], kv)[0]))
    print(f"{name}: {n} greedy tokens equal to llama.cpp's before its first near-tie")
    assert out == ref["completion_token_ids"][:n]
