"""The persistent decode step on the device (tests/tools/persistent_step.py: an experiment the
engine does not run).

Its promise: a bucket of up to 8 rows runs as one kernel launch (every step's blocks over
virtual blocks, a grid barrier between steps) and gives the SAME BITS as the graph of
kernels, because it calls the same block functions with the same arguments. Checked here
by value: logits and greedy ids of persistent ("on") and graph ("off") programs over
several decode ticks, at 1, 3 and 8 rows, f16 and f32 KV, on a llama (Q4_1 like the
default model; a Q4_K_M-like mix) and a qwen2 (biases, NEOX RoPE); which programs it
covers and why not (int8 activations); the default model when installed.

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
from tests.tools import persistent_step  # noqa: E402

pytestmark = pytest.mark.cuda
VOCAB = 512


def _build(path, **kw):
    from aotx.engine.model.architectures import build
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile

    gf = GGUFFile.open(path)
    return build(ModelConfig.from_metadata(gf.metadata, str(path)), gf, persistent_step.backend(**kw))


@pytest.fixture(scope="module", params=("q41", "q4km"))
def llama_path(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("pers")
    if request.param == "q41":     # the default model's mix: Q4_1 layers, a tied Q8_0 embedding
        return write_llama(d / "q41.gguf", n_layers=3, d_model=192, n_heads=3, n_kv_heads=1, ffn=512, vocab=VOCAB,
                           qtype=T.Q4_1, emb_qtype=T.Q8_0, seed=5)
    return write_llama(d / "q4km.gguf", n_layers=3, d_model=256, n_heads=4, n_kv_heads=2, ffn=768, vocab=VOCAB,
                       qtype=T.Q4_K, emb_qtype=T.Q4_K, out_qtype=T.Q6_K,
                       layer_types={"attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K}, seed=6)


def _decode(m, rows: int, kv_type: str, ticks: int = 6, vocab: int = VOCAB):
    """Prefill ``rows`` slots (19 tokens each, through the graph), then ``ticks`` greedy
    decode ticks of all of them: (logits of every tick, ids of every tick)."""
    rng = np.random.default_rng(rows)
    kv = m.new_kv_cache(8, 96, kv_type)
    for s in range(rows):
        m.forward(rng.integers(0, vocab, 19).astype(np.int32), [Segment(s, 0, 19)], kv)
    cur = rng.integers(0, vocab, rows).astype(np.int32)
    logits, ids = [], []
    for i in range(ticks):
        cur = m.greedy(cur, [Segment(s, 19 + i, 1) for s in range(rows)], kv)
        logits.append(cupy.asnumpy(m.last_logits()).copy())
        ids.append(cur.copy())
    return logits, ids


@pytest.mark.parametrize("kv_type", ("f16", "f32"))
def test_persistent_step_gives_the_graphs_bits(llama_path, kv_type):
    on, off = _build(llama_path, persistent="on"), _build(llama_path, persistent="off")
    for rows in (1, 3, 8):
        lp, ip = _decode(on, rows, kv_type)
        lg, ig = _decode(off, rows, kv_type)
        assert on.compiled.persistent_reason is None, on.compiled.persistent_note
        for t, (a, b) in enumerate(zip(lp, lg)):
            assert np.isfinite(a).all()
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), \
                f"{rows} rows, tick {t}: max |diff| {np.abs(a - b).max()}"
        assert all(np.array_equal(a, b) for a, b in zip(ip, ig))
    assert off.compiled.persistent_note == "off: off"


def test_persistent_step_runs_qwen2_biases(tiny_models, tiny_tokenizer, tmp_path):
    path = tiny_models.qwen2.write(tmp_path / "q2.gguf", tiny_tokenizer, n_layers=2, d_model=128, n_heads=4,
                                   n_kv_heads=2, ffn=256)
    on, off = _build(path, persistent="on"), _build(path, persistent="off")
    V = tiny_tokenizer.n_vocab
    lp, ip = _decode(on, 3, "f16", ticks=4, vocab=V)
    lg, ig = _decode(off, 3, "f16", ticks=4, vocab=V)
    assert on.compiled.persistent_reason is None, on.compiled.persistent_note
    for a, b in zip(lp, lg):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_int8_activations_keep_the_graph_of_kernels(llama_path):
    m = _build(llama_path, persistent="on", int8_activations=True, int8_min_bytes=0)
    _decode(m, 1, "f16", ticks=1)
    assert m.compiled.persistent_note.startswith("off: int8 activations"), m.compiled.persistent_note


def test_default_model_runs_persistent_with_the_graphs_tokens(default_model_path):
    on, off = _build(default_model_path, persistent="auto"), _build(default_model_path, persistent="off")  # "auto": on below 1 GiB
    prompt = np.arange(100, 140, dtype=np.int32)
    out = []
    for m in (on, off):
        kv = m.new_kv_cache(2, 256)
        m.forward(prompt, [Segment(0, 0, len(prompt))], kv)
        tok, toks = np.array([1], np.int32), []
        for i in range(24):
            tok = m.greedy(tok, [Segment(0, len(prompt) + i, 1)], kv)
            toks.append(int(tok[0]))
        out.append((toks, cupy.asnumpy(m.last_logits())))
    assert on.compiled.persistent_reason is None, on.compiled.persistent_note
    assert out[0][0] == out[1][0]
    assert np.array_equal(out[0][1].view(np.uint32), out[1][1].view(np.uint32))
