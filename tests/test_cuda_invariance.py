"""Batch invariance on CUDA (issue 16 item 1, CUDA half) and the kernel choice on the device (issue 19).

The CUDA backend's promise (engine/backend/cuda/program.py, "Batch invariance"): through
the graph a row's logits depend only on its token, position and the KV it attends to,
bit for bit, whatever the batch bucket, the other rows, the GEMV variant the kernel
choice picked, and whether the row is a decode, verify or short-prefill row; the eager
path agrees bit for bit too when it runs the graph's kernels (``prefill="gemv"``), and
within about 1e-3 with its tensor-core GEMMs (the default).

Also, on the device: the kernel-choice tuner checks every GEMV candidate against the
default variant bit for bit (none may differ), writes an artifact that the next load
reuses without timing, and a corrupt artifact still loads (defaults, the reason named).

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

from aotx.engine.model.batch import Segment  # noqa: E402
from tests.models.cuda_testmodel import write_llama  # noqa: E402

pytestmark = pytest.mark.cuda
VOCAB = 512


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A Q4_K_M-like mix (Q6_K V and down projections, untied Q6_K output) with 4 layers."""
    return write_llama(tmp_path_factory.mktemp("inv") / "q4km.gguf", n_layers=4, d_model=256, n_heads=4,
                       n_kv_heads=2, ffn=768, vocab=VOCAB, qtype=T.Q4_K, emb_qtype=T.Q4_K, out_qtype=T.Q6_K,
                       layer_types={"attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K}, seed=3)


def _build(path, **kw):
    from aotx.engine.backend.cuda.backend import CudaBackend
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.architectures import build

    gf = GGUFFile.open(path)
    kw.setdefault("int8_min_bytes", 0)           # int8 activations when asked, even on this tiny model
    return build(ModelConfig.from_metadata(gf.metadata, str(path)), gf, CudaBackend(**kw))


@pytest.fixture(scope="module", params=(False, True), ids=("f32", "int8"))
def model(model_path, request):
    """The model with float32 activations, and with int8 activations in every decode GEMV of
    an integer type (``int8_activations``: what the engine loads; quant_rows + dp4a)."""
    return _build(model_path, int8_activations=request.param)


def _prefilled(m, n_slots=64, prompt_len=20, seed=0):
    """A cache with every slot prefilled (through the graph: 20 rows per batch)."""
    rng = np.random.default_rng(seed)
    kv = m.new_kv_cache(n_slots, 128)
    prompts = rng.integers(0, VOCAB, (n_slots, prompt_len)).astype(np.int32)
    for s in range(n_slots):
        m.forward(prompts[s], [Segment(s, 0, prompt_len)], kv)
    return kv


def test_a_decode_row_is_bit_identical_in_every_bucket_and_batch(model):
    """Slot 0's next row (token 7 at position 20) alone, then beside 1 .. 63 other slots'
    rows (buckets 2 .. 64, a GEMV of 1, 2, 4, 8 or 16 rows per block), first or last in
    the batch, and as the first row of a verify window: the same bits every time."""
    kv = _prefilled(model)
    ref = model.forward(np.array([7], np.int32), [Segment(0, 20, 1)], kv)[0]
    rng = np.random.default_rng(1)
    for n in (2, 3, 5, 8, 16, 17, 33, 64):
        others = [Segment(s, 20, 1) for s in range(1, n)]
        toks = np.concatenate([[7], rng.integers(0, VOCAB, n - 1)]).astype(np.int32)
        got = model.forward(toks, [Segment(0, 20, 1)] + others, kv)
        assert got[0].tobytes() == ref.tobytes(), f"batch of {n}: slot 0's row differs"
        got = model.forward(toks[::-1].copy(), others[::-1] + [Segment(0, 20, 1)], kv)
        assert got[-1].tobytes() == ref.tobytes(), f"batch of {n}, slot 0 last: its row differs"
    # a verify window (4 rows of slot 0) next to decode rows: its first row is the decode row
    win = np.array([7, 11, 13, 17], np.int32)
    got = model.forward(np.concatenate([win, [3, 4]]).astype(np.int32),
                        [Segment(0, 20, 4, all_logits=True), Segment(1, 20, 1), Segment(2, 20, 1)], kv)
    assert got[0].tobytes() == ref.tobytes()
    alone = model.forward(win, [Segment(0, 20, 4, all_logits=True)], kv)
    assert alone.tobytes() == got[:4].tobytes()


def test_chunked_prefill_through_the_graph_is_bit_identical(model):
    """A 96-token prompt in one graph batch (bucket 128) and in chunks of 7 (bucket 8):
    the same logits for its last row and the same K/V."""
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, VOCAB, 96).astype(np.int32)
    kv1, kv2 = model.new_kv_cache(2, 128), model.new_kv_cache(2, 128)
    a = model.forward(prompt, [Segment(1, 0, 96)], kv1)
    b = None
    for p0 in range(0, 96, 7):
        n = min(7, 96 - p0)
        b = model.forward(prompt[p0:p0 + n], [Segment(1, p0, n)], kv2)
    assert a.tobytes() == b.tobytes()
    ka, va = kv1.snapshot_slot(1, 96)
    kb, vb = kv2.snapshot_slot(1, 96)
    assert ka.tobytes() == kb.tobytes() and va.tobytes() == vb.tobytes()


@pytest.mark.parametrize("int8", (False, True), ids=("f32", "int8"))
def test_eager_prefill_with_the_graphs_kernels_is_bit_identical_to_the_graph(model_path, int8):
    """prefill="gemv": a 150-row prefill (more rows than a graph takes: the eager path)
    gives every row the same bits as the same prompt through the graph in chunks of 50."""
    m = _build(model_path, prefill="gemv", int8_activations=int8)
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, VOCAB, 150).astype(np.int32)
    kv1, kv2 = m.new_kv_cache(2, 256), m.new_kv_cache(2, 256)
    eager = m.forward(prompt, [Segment(0, 0, 150, all_logits=True)], kv1)
    rows = [m.forward(prompt[p0:p0 + 50], [Segment(0, p0, 50, all_logits=True)], kv2) for p0 in (0, 50, 100)]
    graph = np.concatenate(rows)
    assert eager.shape == graph.shape == (150, VOCAB)
    bad = [i for i in range(150) if eager[i].tobytes() != graph[i].tobytes()]
    assert not bad, f"rows {bad[:10]} differ between the eager path and the graph"
    assert m.prefill_weight_bytes == 0


def test_tensor_core_prefill_stays_close_to_float32(model_path):
    """The default eager GEMMs (float16 where the input is normed or an attention output,
    TF32 elsewhere) and each forced mode against the float32 SGEMM path, on a 150-row
    prefill with every row's logits: ||x - x_f32|| / ||x_f32|| <= 1e-2, with dense
    dequantized weight copies (the default for a model this small: prefill_weight_bytes
    counts them) and on tiles (the scratch tile is then the only weight memory added)."""
    from aotx.engine.backend.cuda.gemm import TILE_BYTES

    rng = np.random.default_rng(5)
    prompt = rng.integers(0, VOCAB, 150).astype(np.int32)

    def run(m):
        kv = m.new_kv_cache(1, 256)
        return m.forward(prompt, [Segment(0, 0, 150, all_logits=True)], kv)

    ref = run(_build(model_path, prefill="f32", dense_prefill=False))
    for kw in ({}, {"prefill": "f16"}, {"prefill": "tf32"}, {"dense_prefill": False},
               {"prefill": "f16", "dense_prefill": False}, {"prefill": "f32"}):
        m = _build(model_path, **kw)
        got = run(m)
        assert np.isfinite(got).all()
        rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        print(f"prefill {kw}: relative error against float32 on tiles {rel:.2e}")
        assert rel <= (1e-5 if kw.get("prefill") == "f32" else 1e-2), (kw, rel)
        g = m.compiled.gemm
        if kw.get("dense_prefill", True):      # a small model: dense copies, made on the first prefill
            assert m.prefill_weight_bytes == g.dense_bytes > 0 and len(g._dense) == len(g._dense_ok)
        else:
            assert m.prefill_weight_bytes == TILE_BYTES and not g._dense
    modes = set(_build(model_path).compiled._pm.values())
    assert modes == {"f16", "tf32"}, modes      # f16 on normed/attention inputs, TF32 on the down projection


@pytest.mark.parametrize("int8", (False, True), ids=("f32", "int8"))
def test_the_tuner_finds_no_gemv_variant_that_differs_and_its_artifact_is_reused(model_path, tmp_path, int8):
    """policy force on the device: every candidate of every (site, bucket) is checked bit
    for bit against the default variant (a difference would be a batch-invariance bug)
    and timed; the artifact is keyed to this device; a reuse load times nothing and gives
    the same logits; a corrupt artifact loads with the defaults and says so."""
    import json

    from aotx.engine.backend import kernel_choice as KC

    m = _build(model_path, tune="force", artifact_root=tmp_path, tune_budget_s=600, int8_activations=int8)
    res = m.compiled.kernel_choice
    differs = {k: v for k, v in res.notes.items() if "differs" in v or "rejected" in v}
    assert not differs, differs
    assert res.count("tuned") == len(res.choice) and res.written is True
    path = res.path
    doc = json.loads(path.read_text())
    assert doc["key"] == m.backend.device_key().as_dict()
    kv = _prefilled(m, n_slots=4)
    tok = np.array([5, 6, 7, 8], np.int32)
    segs = [Segment(s, 20, 1) for s in range(4)]
    a = m.forward(tok, segs, kv)

    m2 = _build(model_path, tune="reuse", artifact_root=tmp_path, int8_activations=int8)
    res2 = m2.compiled.kernel_choice
    assert res2.status == "ok" and res2.count("artifact") == len(res2.choice) and res2.seconds == 0
    assert res2.choice == res.choice
    b = m2.forward(tok, segs, _prefilled(m2, n_slots=4))
    assert a.tobytes() == b.tobytes()

    path.write_text("{ truncated")
    m3 = _build(model_path, tune="reuse", artifact_root=tmp_path, int8_activations=int8)
    res3 = m3.compiled.kernel_choice
    assert res3.status == "corrupt" and "artifact corrupt" in res3.summary()
    c = m3.forward(tok, segs, _prefilled(m3, n_slots=4))
    assert c.tobytes() == a.tobytes()                  # another variant, the same bits
    assert KC.read_artifact(path, m.backend.device_key())[0] == "corrupt"


def test_int8_activations_stay_close_to_float32_logits(model_path):
    """int8 activations (the engine's default) against float32 activations, same weights and
    the same prompt through the graph: the logits of every row within 5e-2 relative (the
    rounding of each 32-input block to int8, about 0.4% per input, through 4 layers), and the
    same greedy token on most rows; identical logits would mean the int8 path did not run."""
    a, b = _build(model_path), _build(model_path, int8_activations=True)
    assert b.compiled.int8_activations and any(g.q8 for g in b.compiled.gemvs)
    rng = np.random.default_rng(9)
    prompt = rng.integers(0, VOCAB, 40).astype(np.int32)
    la = a.forward(prompt, [Segment(0, 0, 40, all_logits=True)], a.new_kv_cache(1, 64))
    lb = b.forward(prompt, [Segment(0, 0, 40, all_logits=True)], b.new_kv_cache(1, 64))
    rel = np.linalg.norm(la - lb, axis=1) / np.linalg.norm(la, axis=1)
    assert float(rel.max()) < 5e-2, rel
    assert float(rel.max()) > 0.0
    assert float((la.argmax(1) == lb.argmax(1)).mean()) >= 0.8
