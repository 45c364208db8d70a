"""Sampling on the device (``cuda_sampling``) against the host sampler chain
(``runtime/sampling.py``, itself checked against llama.cpp's order in
test_sampling.py), and the CUDA graph's new batch shapes (multi-token rows of one slot:
verify windows and short prefills).

Runs everywhere: the sampler-table packing, numpy's Philox re-derived from the
Random123 round function (the formula the kernel uses), and the engine's mirroring of
device draws (step counter, penalty history) through a CPU model given a ``sample()``
that runs the host chain on copies of the state. The CUDA tests skip with a visible
reason where CuPy or a CUDA device is absent: the kernel against ``sampling.sample``
on thousands of random rows, graph versus eager logits for multi-token segments,
speculative greedy equal to plain greedy with verify windows inside the graph, and the
engine with device sampling equal to host sampling for the same seed.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from aotx.engine.backend.cuda import sampling as CS
from aotx.engine.model.batch import Segment
from aotx.engine.runtime.sampling import SamplerConfig, SamplerState, sample, uniform
from tests.fakes.models import HostDeviceSampler, HostOnly

try:
    import cupy

    _why = "" if cupy.cuda.runtime.getDeviceCount() > 0 else "no CUDA device: CuPy sees 0 devices"
except Exception as e:  # noqa: BLE001 - ImportError, or the driver's CUDARuntimeError
    _why = f"no CUDA device: {type(e).__name__}: {e}"

needs_cuda = pytest.mark.skipif(bool(_why), reason=_why or "-")

M64 = (1 << 64) - 1


def _philox_w0(counter: int, key: int) -> int:
    """Random123's Philox4x64-10, word 0, counter (counter, 0, 0, 0), key (key, 0): the
    formula of ``philox4x64_w0`` in the kernel, in Python integers."""
    m0, m1 = 0xD2E7470EE14C6C93, 0xCA5A826395121157
    w0, w1 = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B
    c, k = [counter & M64, 0, 0, 0], [key & M64, 0]
    for r in range(10):
        if r:
            k = [(k[0] + w0) & M64, (k[1] + w1) & M64]
        p0, p1 = m0 * c[0], m1 * c[2]
        c = [(p1 >> 64) ^ c[1] ^ k[0], p1 & M64, (p0 >> 64) ^ c[3] ^ k[1], p0 & M64]
    return c[0]


@pytest.mark.parametrize("seed,step", [(0, 0), (5, 1), (12345678901234, 77), (2**63 + 5, 2**40), (M64, 3)])
def test_kernel_philox_formula_is_numpys_draw(seed, step):
    assert (_philox_w0(step + 1, seed) >> 11) * 2.0**-53 == uniform(seed, step)


def test_fill_row_packs_the_sampler_table():
    prm = np.zeros(CS.P_WORDS, np.int32)
    hist = np.zeros(CS.H_MAX, np.int32)
    cfg = SamplerConfig(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1, repeat_last_n=4)
    st = SamplerState(seed=2**40 + 3, step=9, history=[5, 6, 6, 7, 8, 9])
    assert CS.fill_row(prm, hist, cfg, st, tick=12, extra_history=[5])
    assert prm[0] == CS.MODE_SAMPLE and prm[1] == 40 and prm[3] == 12
    assert prm[2] == 4 and list(hist[:4]) == [7, 8, 9, 5]      # the last 4 tokens, with this tick's draft
    assert prm.view(np.float32)[4] == np.float32(1.1)
    assert prm[6:8].view(np.float64)[0] == 0.7 and prm[8:10].view(np.float64)[0] == 0.95
    assert prm[10:12].view(np.float64)[0] == 0.05
    assert prm[12:14].view(np.uint64)[0] == 2**40 + 3 and prm[14:16].view(np.uint64)[0] == 9
    assert not CS.fill_row(prm, hist, SamplerConfig(repeat_penalty=1.0, temperature=0.0), st, tick=1)
    assert prm[0] == CS.MODE_GREEDY and prm.view(np.float32)[4] == 1.0
    assert not CS.fill_row(prm, hist, None, None, tick=1) and prm[0] == CS.MODE_SKIP


@pytest.mark.parametrize("cfg,drafts,ok", [
    (SamplerConfig(repeat_penalty=1.0, temperature=0.0), 3, True),
    (SamplerConfig(temperature=0.0, repeat_penalty=1.2), 3, False),
    (SamplerConfig(repeat_penalty=1.0, temperature=0.7, top_k=40), 0, True),
    (SamplerConfig(repeat_penalty=1.0, temperature=0.7, top_k=40), 2, False),   # acceptance p/q runs on the host
    (SamplerConfig(repeat_penalty=1.0, temperature=0.7, top_k=0), 0, False),    # whole-vocabulary top-p: host
    (SamplerConfig(repeat_penalty=1.0, temperature=0.7, top_k=2000), 0, False),
])
def test_device_ok_names_what_the_kernel_runs_exactly(cfg, drafts, ok):
    assert CS.device_ok(cfg, drafts) is ok


def test_fits_history_bounds_the_penalty_window_not_the_vocabulary():
    cfg = SamplerConfig(repeat_penalty=1.1, repeat_last_n=64)
    st = SamplerState(seed=1, history=list(range(500)))
    assert CS.fits_history(cfg, st)
    assert CS.fits_history(SamplerConfig(repeat_penalty=1.1, repeat_last_n=CS.H_MAX - 16), st)
    assert not CS.fits_history(SamplerConfig(repeat_penalty=1.1, repeat_last_n=CS.H_MAX - 15), st)
    assert not CS.fits_history(SamplerConfig(repeat_penalty=1.1, repeat_last_n=-1), st)
    assert CS.fits_history(SamplerConfig(repeat_penalty=1.0, repeat_last_n=-1), st)


class _SampleOnHost(HostDeviceSampler):
    """A CPU model with the CUDA model's ``sample()`` contract: ids from the host chain
    run on copies of each row's state (the caller mirrors the draws). Counts the calls."""

    def __init__(self, model):
        super().__init__(model)
        self.calls = 0

    def sample(self, tokens, segments, kv, rows, tick=0):
        self.calls += 1
        return super().sample(tokens, segments, kv, rows, tick)


@pytest.fixture(scope="module")
def tiny_cpu(tiny_gguf, tmp_path_factory):
    from aotx.engine.model.loader import load_model

    path = tiny_gguf.write_tiny_llama(tmp_path_factory.mktemp("devsamp") / "t.gguf", seed=3)
    return load_model(path)


def _run(lm, texts, sp: dict, speculative="off", slots=2):
    """Like test_cuda_state._generate with sampling settings of our own (top-k on)."""
    from aotx.engine import protocol as P
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store
    from tests.fakes.sink import EventSink

    eng = Engine(lm, open_store(None), n_slots=slots, n_ctx=256, speculative=speculative, device=lm.backend)
    eng.start()
    outs = []
    try:
        for i, text in enumerate(texts):
            s = EventSink()
            eng.post(P.CreateConversation(id=1, title=f"t{i}"), s)
            assert s.done.wait(30)
            cid = s.events[0].conversation.conv_id
            s = EventSink()
            eng.post(P.SubmitMessage(id=2, conv_id=cid, text=text, raw=True,
                                     sampling=P.SamplingParams(max_tokens=40, **sp)), s)
            assert s.done.wait(120)
            assert not [e for e in s.events if isinstance(e, P.Error)]
            outs.append([e.token_id for e in s.events if isinstance(e, P.Token)])
    finally:
        eng.stop()
    return outs


TEXTS = ["the cat sat on the mat and the cat sat on the mat and the", "a b c d e f a b c d e f a b"]
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, repeat_penalty=1.2, repeat_last_n=16, seed=11)


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_engine_mirrors_device_draws_exactly(tiny_cpu, speculative):
    """Device sampling returns ids only; the engine must advance step and history as the
    host sampler would, or the next draw differs: same seed, same tokens."""
    base = _run(tiny_cpu, TEXTS, SAMPLED, speculative)
    wrapped = _SampleOnHost(tiny_cpu.model)
    got = _run(dataclasses.replace(tiny_cpu, model=wrapped), TEXTS, SAMPLED, speculative)
    assert got == base
    assert wrapped.calls > 0
    assert len(set(map(tuple, base))) == 2 and all(len(o) == 40 for o in base)


# ---- CUDA ------------------------------------------------------------------------------


def _kernel_ids(logits: np.ndarray, rows: list) -> np.ndarray:
    """Run ``sample_rows`` alone on host logits (R, V) float32."""
    from aotx.engine.backend.cuda.backend import NVRTC_OPTIONS

    R, V = logits.shape
    k = cupy.RawModule(code=CS.SRC, options=NVRTC_OPTIONS).get_function("sample_rows")
    prm = np.zeros((R, CS.P_WORDS), np.int32)
    hist = np.zeros((R, CS.H_MAX), np.int32)
    for j, (cfg, st) in enumerate(rows):
        CS.fill_row(prm[j], hist[j], cfg, st, tick=1)
    lg = cupy.asarray(logits)
    ids = cupy.empty(R, cupy.int32)
    rec = cupy.empty((R, CS.REC_WORDS), cupy.int32)
    z = cupy.zeros(R, cupy.int32)
    k((R,), (1024,), (lg, np.int32(V), np.int32(V), cupy.asarray(prm), cupy.asarray(hist), z, z, np.uint64(0), ids,
                        rec))
    assert (rec[:, 0].get() == 1).all()
    return ids.get()


@needs_cuda
@pytest.mark.parametrize("cfg", [
    SamplerConfig(repeat_penalty=1.0, temperature=0.0),
    SamplerConfig(temperature=0.0, repeat_penalty=1.5, repeat_last_n=64),
    SamplerConfig(repeat_penalty=1.0, temperature=0.7, top_k=40, top_p=0.95, min_p=0.05),
    SamplerConfig(temperature=1.3, top_k=1024, top_p=0.9, min_p=0.0, repeat_penalty=1.1),
    SamplerConfig(repeat_penalty=1.0, temperature=0.5, top_k=1, top_p=1.0, min_p=0.0),
    SamplerConfig(repeat_penalty=1.0, temperature=2.0, top_k=200, top_p=1.0, min_p=0.1),
], ids=["greedy", "greedy-penalty", "default", "k1024", "k1", "minp"])
def test_cuda_sample_rows_equals_host_chain(cfg):
    rng = np.random.default_rng(0)
    R, V = 512, 49152
    logits = (rng.standard_normal((R, V)) * 3).astype(np.float32)
    logits[:8, :100] = 7.0  # ties at the top: lowest id first
    rows, want = [], []
    for j in range(R):
        st = SamplerState(seed=int(rng.integers(0, 2**63)), step=int(rng.integers(0, 1000)),
                          history=rng.integers(0, V, 80).tolist())
        rows.append((cfg, st))
        want.append(sample(logits[j].copy(), cfg, copy.deepcopy(st)))
    got = _kernel_ids(logits, rows)
    same = int((got == np.asarray(want)).sum())
    assert same >= R - 1, f"{R - same} of {R} rows differ"  # one boundary case allowed (pairwise vs serial sums)


@needs_cuda
@pytest.mark.parametrize("V", [151936, 262144], ids=["qwen2-vocab", "gemma3-vocab"])
def test_cuda_penalty_at_large_vocabularies_equals_host_chain(V):
    """Regression (tests/test_gateway_cuda.py's greedy-penalty case at Qwen's
    151,936 ids): the penalty's distinct-id bitmap covered 131,072 ids in shared memory and
    a larger vocabulary wrote past it (cudaErrorIllegalAddress, every later kernel failed).
    Each id is now penalized once at its first place in the window, for any vocabulary."""
    rng = np.random.default_rng(11)
    R = 64
    logits = (rng.standard_normal((R, V)) * 3).astype(np.float32)
    cfgs = [SamplerConfig(temperature=0.0, repeat_penalty=1.5, repeat_last_n=200),
            SamplerConfig(temperature=0.8, top_k=40, repeat_penalty=1.3, repeat_last_n=200)]
    rows, want = [], []
    for j in range(R):
        cfg = cfgs[j % 2]
        hist = rng.integers(0, V, 200)
        hist[::3] = hist[0]                       # repeats: penalized once, not 67 times
        top = int(np.argmax(logits[j]))
        hist[1] = top                             # the unpenalized argmax is in the window
        st = SamplerState(seed=int(rng.integers(0, 2**63)), step=j, history=hist.tolist())
        rows.append((cfg, st))
        want.append(sample(logits[j].copy(), cfg, copy.deepcopy(st)))
    got = _kernel_ids(logits, rows)
    same = int((got == np.asarray(want)).sum())
    assert same >= R - 1, f"{R - same} of {R} rows differ"


@needs_cuda
def test_cuda_graph_runs_multi_token_rows_like_eager(tiny_pair):
    """A short prefill and a verify window go through the graph; logits match the CPU
    backend's for the same batch."""
    cpu, gpu = tiny_pair
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 300, 40).astype(np.int32)
    segs1 = [Segment(0, 0, 20, logits=True), Segment(1, 0, 12, all_logits=True)]
    segs2 = [Segment(0, 20, 5, all_logits=True), Segment(1, 12, 3, logits=True)]
    outs = []
    for lm in (cpu, gpu):
        kv = lm.model.new_kv_cache(2, 64)
        a = lm.model.forward(toks[:32], segs1, kv)
        b = lm.model.forward(toks[32:40], segs2, kv)
        outs.append((a, b))
    from aotx.engine.model.batch import BatchLayout

    assert gpu.model.compiled._graph_ok(BatchLayout.of(segs1), gpu.model.new_kv_cache(2, 64))
    for (ca, cb), (ga, gb) in [(outs[0], outs[1])]:
        assert ga.shape == ca.shape == (13, gpu.config.vocab_size) and gb.shape == cb.shape == (6, gpu.config.vocab_size)
        for c, g in ((ca, ga), (cb, gb)):
            rel = float(np.linalg.norm(g - c) / np.linalg.norm(c))
            assert rel < 2e-3, rel


@needs_cuda
@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_cuda_engine_device_sampling_equals_host_sampling(tiny_pair, speculative):
    _, gpu = tiny_pair
    counted = _Counting(gpu.model)
    got = _run(dataclasses.replace(gpu, model=counted), TEXTS, SAMPLED, speculative)
    assert counted.calls > 0
    base = _run(dataclasses.replace(gpu, model=_HostOnly(gpu.model)), TEXTS, SAMPLED, speculative)
    assert got == base


class _Counting:
    def __init__(self, model):
        self._m, self.calls = model, 0

    def __getattr__(self, name):
        return getattr(self._m, name)

    def sample(self, *a, **kw):
        self.calls += 1
        return self._m.sample(*a, **kw)


class _HostOnly(HostOnly):
    """Hides the device sampler: logits come back and the host samples."""


@needs_cuda
def test_cuda_speculative_greedy_equals_plain_with_verify_in_the_graph(tiny_pair):
    _, gpu = tiny_pair
    greedy = dict(temperature=0.0, seed=1, repeat_penalty=1.0)
    plain = _run(gpu, TEXTS, greedy, "off", slots=1)
    spec = _run(gpu, TEXTS, greedy, "ngram", slots=1)
    assert spec == plain
