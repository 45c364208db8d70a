"""A hybrid model (the tiny qwen35: gated DeltaNet layers beside gated attention) on CUDA
against the CPU, and its recurrent state on the device (engine/backend/cuda/recurrent.py,
kernels/recurrent.cu).

* parity (qwen35, and qwen3next: a mixture of experts with grouped key heads): prefills (eager past the graph's rows, short ones through the graph) and decode
  ticks of 3 slots, a mixed eager batch, a verify window and its rollback: each logits array
  within test_cuda_parity's REL_TOL of the CPU's (float32 on both sides; the CPU's float path),
  the greedy tokens equal wherever the CPU's top two are not a near-tie;
* batch invariance: a slot's logits bit-identical decoded alone and beside other slots (another
  slot, another row, another graph bucket; the f16 KV cache the engine runs by default);
* rollback: a verify window rolled back to its kept rows leaves the state bit-identical to
  feeding those rows alone;
* capsules: a slot's capsule (KV and recurrent state, through the disk) restores byte-exact into
  another slot and decodes token-identically; KV alone (the state fresh) diverges.

The file is written with a toy vocabulary (no default model needed on the GPU machine).
Skips where CuPy or a CUDA device is absent. The lead's command (a GPU machine, one call):
    bash tests/tools/gpu_hybrid_check.sh          (carry: [".whl"])
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

from aotx.engine.model.batch import Segment  # noqa: E402
from aotx.engine.state import capsule as C  # noqa: E402

pytestmark = pytest.mark.cuda

REL_TOL = 1e-3          # test_cuda_parity's: float32 on both sides, only the order of sums differs
NEAR_TIE = 0.05
VOCAB = 512


def _toy_tokenizer():
    from gguf import GGUFValueType as V

    import tests.models as tm

    toks = tuple(f"t{i}" for i in range(VOCAB))
    kv = (("tokenizer.ggml.model", "gpt2", V.STRING), ("tokenizer.ggml.tokens", toks, V.ARRAY),
          ("tokenizer.ggml.token_type", tuple([1] * VOCAB), V.ARRAY))
    return tm.common.Tokenizer(kv, VOCAB)


def _build(path, device: str):
    from aotx.engine.model.architectures import build
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    if device == "cpu":
        from aotx.engine.backend.cpu.backend import CpuBackend

        return build(cfg, gf, CpuBackend(int8_activations=False))   # the float path: CUDA computes in float32
    from aotx.engine.backend.cuda.backend import CudaBackend

    return build(cfg, gf, CudaBackend(prefill="f32"))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """The tiny qwen35 file, and qwen3next's (a mixture of experts; grouped key heads, fused beta/alpha)."""
    from tests.models import qwen3next, qwen35

    d = tmp_path_factory.mktemp("hybridcuda")
    return {"qwen35": qwen35.write(d / "qwen35.gguf", _toy_tokenizer(), pre="qwen2"),
            "qwen3next": qwen3next.write(d / "qwen3next.gguf", _toy_tokenizer())}


@pytest.fixture(scope="module")
def cuda_model(paths):
    return _build(paths["qwen35"], "cuda")


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b.astype(np.float64)), 1e-30))


def _tok(rng, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, n).astype(np.int32)


def _scenario(model) -> list[np.ndarray]:
    """The same batches on either backend; every forward's logits."""
    rng = np.random.default_rng(35)
    kv = model.new_kv_cache(4, 512, "f32")
    out = [model.forward(_tok(rng, 9), [Segment(0, 0, 9, all_logits=True)], kv),      # graph: a short prefill
           model.forward(_tok(rng, 70), [Segment(1, 0, 70)], kv),                     # graph, 70 rows (CPU: a chunk)
           model.forward(_tok(rng, 150), [Segment(2, 0, 150)], kv)]                   # eager: past b_max
    pos = {0: 9, 1: 70, 2: 150}
    for _ in range(4):                                                                 # decode ticks of 3 slots
        out.append(model.forward(_tok(rng, 3), [Segment(s, pos[s], 1) for s in (0, 1, 2)], kv))
        pos = {s: p + 1 for s, p in pos.items()}
    # a mixed eager batch: decode rows beside a long prefill of the fourth slot
    out.append(model.forward(_tok(rng, 152), [Segment(0, pos[0], 1), Segment(3, 0, 150), Segment(1, pos[1], 1)], kv))
    pos[0] += 1
    pos[1] += 1
    pos[3] = 150
    # a verify window of 5 rows on slot 2, rolled back to 2 kept rows, then decode on
    out.append(model.forward(_tok(rng, 5), [Segment(2, pos[2], 5, all_logits=True)], kv))
    kv.state.rollback(2, pos[2] + 2)
    pos[2] += 2
    for _ in range(3):
        out.append(model.forward(_tok(rng, 4), [Segment(s, pos[s], 1) for s in (3, 2, 1, 0)], kv))
        pos = {s: p + 1 for s, p in pos.items()}
    return out


def test_logits_match_the_cpu_through_prefill_decode_and_a_rollback(paths, cuda_model):
    _parity("qwen35", _build(paths["qwen35"], "cpu"), cuda_model)


def _parity(name: str, cpu_model, cuda_model) -> None:
    cpu = _scenario(cpu_model)
    gpu = _scenario(cuda_model)
    worst, checked = 0.0, 0
    for i, (a, b) in enumerate(zip(gpu, cpu)):
        assert a.shape == b.shape, (i, a.shape, b.shape)
        assert np.isfinite(a).all(), i
        rel = _rel(a, b)
        worst = max(worst, rel)
        assert rel <= REL_TOL, f"forward {i}: relative error {rel:.2e} > {REL_TOL}"
        for r in range(b.shape[0]):
            top = np.sort(b[r])[-2:]
            if top[1] - top[0] >= NEAR_TIE:
                assert int(np.argmax(a[r])) == int(np.argmax(b[r])), (i, r)
                checked += 1
    assert checked > 20
    print(f"{name}: worst relative error {worst:.2e} over {len(gpu)} forwards; {checked} greedy tokens equal")


def _decode(model, kv, slot: int, pos: int, tok: int, n: int, others=()) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decode of ``slot`` for n steps; ``others``: (slot, pos, token) rows fed beside it
    (before and after it in the batch, by turns). Returns the tokens and the slot's logits."""
    toks, logits = [], []
    others = [list(o) for o in others]
    for i in range(n):
        segs, ids = [], []
        rows = [(s, p, t) for s, p, t in others]
        here = (slot, pos + i, tok)
        rows.insert(i % (len(rows) + 1), here)
        for s, p, t in rows:
            segs.append(Segment(s, p, 1))
            ids.append(t)
        lg = model.forward(np.asarray(ids, np.int32), segs, kv)
        row = [r[0] for r in rows].index(slot)
        logits.append(lg[row].copy())
        tok = int(np.argmax(lg[row]))
        toks.append(tok)
        for o in others:
            o[1] += 1
            o[2] = (o[2] * 7 + 3) % VOCAB
    return toks, logits


def test_a_slots_logits_are_bit_identical_alone_and_beside_others(cuda_model):
    m = cuda_model
    rng = np.random.default_rng(3)
    prompt = _tok(rng, 12)
    a = m.new_kv_cache(4, 256, "f16")          # the engine's default KV type
    first = int(np.argmax(m.forward(prompt, [Segment(0, 0, 12)], a)[0]))
    alone, lg_alone = _decode(m, a, 0, 12, first, 6)
    b = m.new_kv_cache(4, 256, "f16")
    p1, p3 = _tok(rng, 20), _tok(rng, 7)
    lg = m.forward(np.concatenate([p1, prompt, p3]), [Segment(1, 0, 20), Segment(2, 0, 12), Segment(3, 0, 7)], b)
    assert int(np.argmax(lg[1])) == first
    beside, lg_beside = _decode(m, b, 2, 12, first, 6, others=[(1, 20, 5), (3, 7, 9), (0, 0, 11)])
    assert alone == beside
    for i, (x, y) in enumerate(zip(lg_alone, lg_beside)):
        assert x.tobytes() == y.tobytes(), f"decode step {i}: the slot's logits depend on the batch"


def test_a_rollback_leaves_the_state_of_the_kept_rows(cuda_model):
    m = cuda_model
    rng = np.random.default_rng(5)
    prompt, window = _tok(rng, 10), _tok(rng, 6)
    a = m.new_kv_cache(2, 128, "f16")
    m.forward(prompt, [Segment(0, 0, 10)], a)
    m.forward(window, [Segment(0, 10, 6, all_logits=True)], a)
    a.state.rollback(0, 13)
    b = m.new_kv_cache(2, 128, "f16")
    m.forward(prompt, [Segment(1, 0, 10)], b)
    m.forward(window[:3], [Segment(1, 10, 3, all_logits=True)], b)
    sa, sb = a.state.snapshot(0, 13), b.state.snapshot(1, 13)
    for name in a.state.names:
        assert sa[name].tobytes() == sb[name].tobytes(), name
    ka, va = a.snapshot_slot(0, 13)
    kb, vb = b.snapshot_slot(1, 13)
    assert ka.tobytes() == kb.tobytes() and va.tobytes() == vb.tobytes()


def test_a_capsule_restores_byte_exact_and_decodes_identically_kv_alone_diverges(cuda_model, tmp_path):
    m = cuda_model
    rng = np.random.default_rng(9)
    ids = _tok(rng, 40).tolist()
    kv = m.new_kv_cache(2, 128, "f32")
    first = int(np.argmax(m.forward(np.asarray(ids, np.int32), [Segment(0, 0, 40)], kv)[0]))
    straight = [first] + _decode(m, kv, 0, 40, first, 23)[0]
    kv = m.new_kv_cache(2, 128, "f32")
    first = int(np.argmax(m.forward(np.asarray(ids, np.int32), [Segment(0, 0, 40)], kv)[0]))
    head = [first] + _decode(m, kv, 0, 40, first, 3)[0]
    fed = ids + head[:-1]
    cap = C.snapshot(kv, 0, fed, fingerprint="tiny-qwen35", pending_token=head[-1])
    assert cap.header.state == list(kv.state.names) == ["conv.0", "delta.1"]
    C.save(cap, tmp_path / "h.caps")
    back = C.load(tmp_path / "h.caps")
    m.forward(_tok(rng, 60), [Segment(1, 0, 60)], kv)          # slot 1 holds something else first
    C.restore(back, kv, 1, fingerprint="tiny-qwen35")
    again = C.snapshot(kv, 1, fed, fingerprint="tiny-qwen35")
    for name in cap.header.state:
        assert again.state[name].tobytes() == cap.state[name].tobytes(), name
    assert again.k.tobytes() == cap.k.tobytes() and again.v.tobytes() == cap.v.tobytes()
    full = _decode(m, kv, 1, cap.n_tokens, head[-1], 20)[0]
    assert head + full == straight
    # KV alone: every attention layer's K/V back, the recurrent state fresh at that position
    kv.restore_slot(1, cap.k, cap.v, cap.n_tokens)
    for b in kv.state.buffers:
        b[1] = 0.0
    cupy.cuda.Device().synchronize()          # the zeros (default stream) before the graph's stream reads them
    kv.state.pos[1] = cap.n_tokens
    kv_only = _decode(m, kv, 1, cap.n_tokens, head[-1], 20)[0]
    assert kv_only != full, "the recurrent state made no difference"


def test_qwen3next_is_refused_until_it_matches_the_cpu(paths, monkeypatch):
    """The one H100 run (2026-12-07) put qwen3next's CUDA logits 5.9e-2 from the CPU's at the
    first prefill (qwen35's: 8.5e-7): a hybrid model with experts is refused in one line."""
    from aotx.engine.errors import ModelError

    monkeypatch.delenv("AOTX_CUDA_HYBRID_MOE", raising=False)
    with pytest.raises(ModelError, match="does not yet match the CPU on CUDA"):
        _build(paths["qwen3next"], "cuda")


@pytest.mark.xfail(reason="qwen3next on CUDA: relative error 5.9e-2 at the first forward (H100, 2026-12-07)",
                   strict=False)
def test_qwen3next_logits_match_the_cpu(paths, monkeypatch):
    """Qwen3-Next's layout (grouped key heads, beta and alpha from one matrix, deinterleaved;
    a mixture of experts on the host moe step) through the same scenario (AOTX_CUDA_HYBRID_MOE=1
    lets it compile)."""
    monkeypatch.setenv("AOTX_CUDA_HYBRID_MOE", "1")
    _parity("qwen3next", _build(paths["qwen3next"], "cpu"), _build(paths["qwen3next"], "cuda"))
