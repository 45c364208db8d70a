"""The flash-style prefill attention (``attn_prefill`` in cuda_src.py) on the GPU.

Two checks:
* the kernel alone against a float64 numpy reference of IR.md section 5 (causal within the
  segment, sliding window, GQA, scale, gpt-oss sinks), for head dimensions 32/64/96/128, GQA
  ratios 1 and 4, segments of 1, 17, 64, 300 and 1030 rows (not multiples of the 64-row and
  64-key tiles) starting at position 0 and later (a prompt's second chunk), float16 and float32
  KV. The output is poisoned (NaN) before the launch and its padding columns hold a sentinel;
  the cache is poisoned (NaN) everywhere the segment must not read: other slots, keys before
  the segment's first window key, keys past its last row. Tolerance: ||out - ref|| / ||ref||
  <= REL (float16 inputs to the tensor cores, float32 sums: ~1e-3 expected) and each row
  within ROW_REL.
* ``CudaProgram.forward`` of tiny generated models (llama at head dims 64 and 128, gemma3 with
  its sliding window, gpt-oss with sinks) on a two-chunk long prompt: logits of every row with
  the kernel within E2E_REL of the cuBLAS path it replaces (``attention.FLASH_ATTENTION =
  False``), and the kernel did run (``ATT_KERNEL_WORK`` = 0 sends these tiny prompts down the
  long-segment path).

Not bit-identical to anything: the eager path never is (cuda_program's docstring).
Skips with a visible reason where CuPy or a CUDA device is absent, or the device is older
than sm_80 (no float16 mma.sync m16n8k16: the cuBLAS path runs there). GPU time: ~20-40 s,
most of it NVRTC and the float64 references.
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

pytestmark = pytest.mark.cuda

REL = 3e-3          # whole output, relative (measured worst is printed)
ROW_REL = 1e-2      # any one row, relative
E2E_REL = 5e-3      # logits, flash vs cuBLAS path
SENTINEL = 7777.0   # padding columns of the output, which the kernel must not write
VOCAB = 512


@pytest.fixture(scope="module")
def backend():
    from aotx.engine.backend.cuda.backend import CudaBackend

    be = CudaBackend()
    cc = int(be.device.compute_capability)
    if cc < 80:
        pytest.skip(f"compute capability {cc}: attn_prefill needs sm_80 (the cuBLAS path runs there)")
    return be


@pytest.fixture(scope="module")
def kernels(backend):
    from aotx.engine.backend.cuda import source as S

    return backend.module([f"attn_prefill<{hd},{kvt}>" for hd in S.FLASH_HEAD_DIMS for kvt in (0, 1)])


def _reference(q, K, V, slot, pos, n, H, KV, hd, scale, window, sinks) -> np.ndarray:
    """(n, H * hd) float64: IR.md section 5's attention of rows at pos .. pos + n - 1."""
    G = H // KV
    lo_seg = max(0, pos + 1 - window) if window > 0 else 0
    T = pos + n
    keys = np.arange(lo_seg, T)
    p = pos + np.arange(n)[:, None]
    lo = np.maximum(0, p + 1 - window) if window > 0 else np.zeros_like(p)
    allowed = (keys[None, :] <= p) & (keys[None, :] >= lo)
    out = np.empty((n, H * hd))
    for h in range(H):
        k = K[slot, h // G, lo_seg:T].astype(np.float64)
        v = V[slot, h // G, lo_seg:T].astype(np.float64)
        s = scale * (q[:, h * hd:(h + 1) * hd].astype(np.float64) @ k.T)
        s = np.where(allowed, s, -np.inf)
        m = s.max(axis=1, keepdims=True)
        if sinks is not None:
            m = np.maximum(m, float(sinks[h]))
        e = np.exp(s - m)
        den = e.sum(axis=1, keepdims=True)
        if sinks is not None:
            den = den + np.exp(float(sinks[h]) - m)
        out[:, h * hd:(h + 1) * hd] = (e @ v) / den
    return out


def _case(kernels, hd, H, KV, kvt, n, pos, window, with_sinks, seed=0) -> tuple[float, float]:
    """Run attn_prefill once on random data; returns (relative error, worst row's)."""
    rng = np.random.default_rng(seed + 1000 * hd + 10 * n + pos)
    n_slots, slot = 3, 1
    n_ctx = pos + n + 37
    dt = np.float16 if kvt else np.float32
    K = rng.standard_normal((n_slots, KV, n_ctx, hd)).astype(dt)
    V = rng.standard_normal((n_slots, KV, n_ctx, hd)).astype(dt)
    lo_seg = max(0, pos + 1 - window) if window > 0 else 0
    for a in (K, V):                    # what the segment must never read
        a[np.arange(n_slots) != slot] = np.nan
        a[slot, :, :lo_seg] = np.nan
        a[slot, :, pos + n:] = np.nan
    qd = H * hd
    ldq, ldo = qd + 24, qd + 8
    q = np.full((n, ldq), np.nan, np.float32)      # columns past the heads: never read
    q[:, :qd] = rng.standard_normal((n, qd)).astype(np.float32) * 3.0
    sinks = rng.standard_normal(H).astype(np.float32) * 2.0 if with_sinks else None
    scale = 1.0 / np.sqrt(hd)
    out = np.full((n, ldo), SENTINEL, np.float32)
    out[:, :qd] = np.nan                            # poisoned: every element must be written
    dq, dK, dV, dout = cupy.asarray(q), cupy.asarray(K), cupy.asarray(V), cupy.asarray(out)
    dsinks = cupy.asarray(sinks) if sinks is not None else None
    kernels[f"attn_prefill<{hd},{kvt}>"](
        ((n + 63) // 64, H), (128,),
        (dq, np.int32(ldq), dK, dV, np.int32(slot), np.int32(pos), np.int32(n), np.int32(H), np.int32(KV),
         np.int32(n_ctx), np.float32(scale), np.int32(window), dsinks if dsinks is not None else np.uint64(0),
         dout, np.int32(ldo)))
    got = dout.get()
    where = f"hd {hd}, {H}/{KV} heads, kv {'f16' if kvt else 'f32'}, n {n} at {pos}, window {window}, " \
            f"sinks {with_sinks}"
    assert (got[:, qd:] == SENTINEL).all(), f"{where}: padding columns written"
    assert np.isfinite(got[:, :qd]).all(), f"{where}: {int((~np.isfinite(got[:, :qd])).sum())} outputs not finite"
    ref = _reference(q, K, V, slot, pos, n, H, KV, hd, scale, window, sinks)
    err = got[:, :qd].astype(np.float64) - ref
    rel = float(np.linalg.norm(err) / np.linalg.norm(ref))
    row = float((np.linalg.norm(err, axis=1) / np.linalg.norm(ref, axis=1)).max())
    assert rel <= REL and row <= ROW_REL, f"{where}: relative error {rel:.2e} (worst row {row:.2e})"
    return rel, row


# (n, pos, window, sinks): short and long, first chunk and later ones, window on/off, sinks on/off
SEGMENTS = [(1, 0, 0, False), (17, 40, 0, True), (300, 0, 0, False), (300, 129, 100, True), (1030, 0, 0, True),
            (1030, 700, 256, False)]


@pytest.mark.parametrize("kvt", [1, 0], ids=["kv-f16", "kv-f32"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("hd", [64, 128])
def test_attn_prefill_matches_float64(kernels, hd, heads, kvt):
    H, KV = heads
    worst = max(_case(kernels, hd, H, KV, kvt, *seg) for seg in SEGMENTS)
    print(f"hd {hd} heads {H}/{KV} kvt {kvt}: worst relative error {worst[0]:.2e} (row {worst[1]:.2e})")


@pytest.mark.parametrize("hd,H,KV,n,pos,window,sinks", [
    (32, 4, 1, 200, 50, 16, True),          # gemma3 / gpt-oss-like: a window far shorter than the tiles
    (32, 4, 2, 1030, 3, 0, False),
    (96, 3, 1, 130, 0, 0, True),
    (96, 6, 3, 513, 1000, 4096, False),     # a window longer than the context so far: no effect
    (64, 4, 2, 64, 5, 1, True),             # window 1: each row sees itself only
    (128, 8, 1, 65, 0, 0, False),           # GQA 8; one full row tile and one row
])
def test_attn_prefill_other_shapes(kernels, hd, H, KV, n, pos, window, sinks):
    for kvt in (1, 0):
        _case(kernels, hd, H, KV, kvt, n, pos, window, sinks)


def _toy_tokenizer(tm):
    from gguf import GGUFValueType as V

    toks = tuple(f"t{i}" for i in range(VOCAB))
    kv = (("tokenizer.ggml.model", "gpt2", V.STRING), ("tokenizer.ggml.tokens", toks, V.ARRAY),
          ("tokenizer.ggml.token_type", tuple([1] * VOCAB), V.ARRAY))
    return tm.common.Tokenizer(kv, VOCAB)


@pytest.fixture(scope="module")
def model_files(tiny_models, tiny_gguf, tmp_path_factory):
    from tests.models.cuda_testmodel import write_llama

    root = tmp_path_factory.mktemp("cuda-flash")
    tok = _toy_tokenizer(tiny_models)
    return {
        "llama-hd64": tiny_gguf.write_tiny_llama(root / "llama64.gguf", seed=4, d_model=256, n_heads=4, n_kv_heads=2,
                                                 ffn=512, vocab=VOCAB, context_length=1024),
        "llama-hd128": write_llama(root / "llama128.gguf", n_layers=2, d_model=512, n_heads=4, n_kv_heads=1,
                                   ffn=512, vocab=VOCAB, seed=5),
        "gemma3": tiny_models.gemma3.write(root / "gemma3.gguf", tok),           # hd 32, window 16
        "gptoss": tiny_models.gptoss.write(root / "gptoss.gguf", tok),           # hd 32, sinks, window 16
    }


def _build(path):
    from aotx.engine.backend.cuda.backend import CudaBackend
    from aotx.engine.model.architectures import build
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    return build(cfg, gf, CudaBackend(prefill="f32", expert_int8=False))


@pytest.mark.parametrize("name", ["llama-hd64", "llama-hd128", "gemma3", "gptoss"])
def test_forward_with_flash_attention_matches_the_cublas_path(backend, model_files, name, monkeypatch):
    from aotx.engine.backend.cuda import attention as CA

    monkeypatch.setattr(CA, "ATT_KERNEL_WORK", 0)       # these tiny prompts take the long-segment path
    calls = []
    flash = CA.AttendStep._flash

    def counted(self, prog, c, segs):
        calls.append(len(segs))
        return flash(self, prog, c, segs)

    monkeypatch.setattr(CA.AttendStep, "_flash", counted)
    m = _build(model_files[name])
    assert all(a.flash is not None for a in m.compiled.steps if isinstance(a, CA.AttendStep)), \
        "every attention step should have the flash kernel at this head dimension"
    toks = np.random.default_rng(3).integers(0, m.cfg.vocab_size, 400).astype(np.int32)
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(CA, "FLASH_ATTENTION", on)
        kv = m.new_kv_cache(2, 512, "f16")
        outs = [m.forward(toks[:230], [Segment(1, 0, 230, all_logits=True)], kv),            # first chunk
                m.forward(toks[230:400], [Segment(1, 230, 160, all_logits=True),               # second chunk
                                          Segment(0, 0, 10, all_logits=True)], kv),          # + a short one
                m.forward(toks[:1], [Segment(1, 390, 1)], kv)]                               # decode after it
        runs[on] = [np.asarray(o) for o in outs]
    assert calls, "the flash kernel never ran"
    worst = 0.0
    for i, (a, b) in enumerate(zip(runs[True], runs[False])):
        assert a.shape == b.shape and np.isfinite(a).all(), f"{name} step {i}"
        rel = float(np.linalg.norm(a - b) / np.linalg.norm(b))
        worst = max(worst, rel)
        assert rel <= E2E_REL, f"{name} step {i}: ||flash - cuBLAS|| / ||cuBLAS|| = {rel:.2e} > {E2E_REL}"
    print(f"{name}: worst relative logits difference flash vs cuBLAS {worst:.2e}")
