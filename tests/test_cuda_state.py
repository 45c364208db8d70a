"""The KV cache interface the runtime uses (rollback, capsule snapshot/restore) on both
backends, and the engine's device-greedy path (ids from ``model.greedy()`` instead of
host logits).

The CPU tests run everywhere: the CPU KV cache's snapshot/restore methods (f16 and f32), and the
engine's device-greedy path driven through a CPU model given a ``greedy()`` (argmax of
its own logits), which must produce exactly the tokens of the logits path, with and
without speculative decoding. The CUDA tests skip with a visible reason where CuPy or a
CUDA device is absent: ``CudaKVCache.clear`` against the CPU cache, byte-exact capsule
round trips (host and device homes, disk), token-identical greedy decode after a
restore, a CPU capsule restored into the CUDA cache, and the engine on CUDA (greedy on
the device == the logits path, speculative rollback, parking a slot's capsule).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from aotx.engine import protocol as P
from aotx.engine.model.batch import Segment
from tests.fakes.models import HostDeviceSampler, host_chain
from tests.fakes.sink import EventSink

try:
    import cupy

    _n_dev = cupy.cuda.runtime.getDeviceCount()
    _why = "" if _n_dev > 0 else "no CUDA device: CuPy sees 0 devices"
except Exception as e:  # noqa: BLE001 - ImportError, or the driver's CUDARuntimeError
    _why = f"no CUDA device: {type(e).__name__}: {e}"

needs_cuda = pytest.mark.skipif(bool(_why), reason=_why or "-")


class _GreedyOnHost(HostDeviceSampler):
    """A CPU model with the device-sampling contract (``greedy()``: the argmax of its own
    logits, ids only): drives the engine's device-greedy path on any machine. Counts the
    calls of each kind: "greedy" when only ids came back, "forward" when logits did
    (``sample()`` runs the host chain on logits it copies, as a host sampler would)."""

    def __init__(self, model):
        super().__init__(model)
        self.calls = {"greedy": 0, "forward": 0}

    def forward(self, tokens, segments, kv):
        self.calls["forward"] += 1
        return self._m.forward(tokens, segments, kv)

    def greedy(self, tokens, segments, kv):
        self.calls["greedy"] += 1
        lg = self._m.forward(tokens, segments, kv)
        return np.argmax(lg, axis=1).astype(np.int32) if lg.shape[0] else np.empty(0, np.int32)

    def sample(self, tokens, segments, kv, rows, tick=0):
        return host_chain(self.forward(tokens, segments, kv), rows)


class _Counting(_GreedyOnHost):
    """Counts the calls of a model that has its own greedy() and sample() (CUDA);
    both count as "greedy" (ids picked on the device)."""

    def greedy(self, tokens, segments, kv):
        self.calls["greedy"] += 1
        return self._m.greedy(tokens, segments, kv)

    def sample(self, tokens, segments, kv, rows, tick=0):
        self.calls["greedy"] += 1
        return self._m.sample(tokens, segments, kv, rows, tick=tick)


class _NoGreedy(_GreedyOnHost):
    """Declares no device sampling: the engine copies logits and samples on the host."""

    device_path = "host"


def _generate(lm, texts, *, temperature=0.0, repeat_penalty=1.0, speculative="off", slots=2, max_tokens=40,
              capsules=None):
    """Run ``texts`` one after another as raw prompts (each its own conversation) through
    an Engine on ``lm``; returns the token ids of each reply and the Committed messages."""
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store

    eng = Engine(lm, open_store(None), n_slots=slots, n_ctx=256, speculative=speculative, capsules=capsules,
                 device=lm.backend)
    eng.start()
    outs, dones = [], []
    try:
        for i, text in enumerate(texts):
            s = EventSink()
            eng.post(P.CreateConversation(id=1, title=f"t{i}"), s)
            assert s.done.wait(30)
            cid = s.events[0].conversation.conv_id
            s = EventSink()
            eng.post(P.SubmitMessage(id=2, conv_id=cid, text=text, raw=True,
                                     sampling=P.SamplingParams(temperature=temperature, seed=5, max_tokens=max_tokens,
                                                               top_k=0, top_p=1.0, min_p=0.0,
                                                               repeat_penalty=repeat_penalty)), s)
            assert s.done.wait(120)
            errs = [e for e in s.events if isinstance(e, P.Error)]
            assert not errs, errs
            outs.append([e.token_id for e in s.events if isinstance(e, P.Token)])
            dones.append(next(e for e in s.events if isinstance(e, P.Committed)))
    finally:
        eng.stop()
    return outs, dones


TEXTS = ["the cat sat on the mat and the cat sat on the mat and the", "a b c d e f a b c d e f a b"]


# ---- CPU (runs everywhere) -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_cpu(tiny_gguf, tmp_path_factory):
    from aotx.engine.model.loader import load_model

    path = tiny_gguf.write_tiny_llama(tmp_path_factory.mktemp("state") / "t.gguf", seed=3)
    return load_model(path)


@pytest.mark.parametrize("kv_type,dtype", [("f16", np.float16), ("f32", np.float32)])
def test_cpu_kv_snapshot_restore_methods(tiny_cpu, kv_type, dtype):
    m = tiny_cpu.model
    kv = m.new_kv_cache(3, 32, kv_type)
    m.forward(np.arange(10, dtype=np.int32), [Segment(0, 0, 10)], kv)
    L, KV, n_ctx, hd = kv.slot_shape
    assert (L, KV, n_ctx) == (tiny_cpu.config.n_layers, tiny_cpu.config.n_kv_heads, 32)
    k, v = kv.snapshot_slot(0, 10)
    assert k.shape == (L, KV, 10, hd) and k.dtype == dtype and k.any()
    kv.restore_slot(2, k, v, 7)
    k2, v2 = kv.snapshot_slot(2, 10)
    assert k2[:, :, :7].tobytes() == k[:, :, :7].tobytes() and v2[:, :, :7].tobytes() == v[:, :, :7].tobytes()
    assert not k2[:, :, 7:].any() and not v2[:, :, 7:].any()


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_engine_device_greedy_path_matches_logits_path(tiny_cpu, speculative):
    base, _ = _generate(tiny_cpu, TEXTS, speculative=speculative)
    wrapped = _GreedyOnHost(tiny_cpu.model)
    got, _ = _generate(dataclasses.replace(tiny_cpu, model=wrapped), TEXTS, speculative=speculative)
    assert got == base
    assert wrapped.calls["greedy"] > 0 and wrapped.calls["forward"] == 0


@pytest.mark.parametrize("kw", [{"temperature": 0.8}, {"repeat_penalty": 1.3}], ids=["sampled", "penalty"])
def test_engine_samples_on_host_unless_plain_greedy(tiny_cpu, kw):
    base, _ = _generate(tiny_cpu, TEXTS[:1], **kw)
    wrapped = _GreedyOnHost(tiny_cpu.model)
    got, _ = _generate(dataclasses.replace(tiny_cpu, model=wrapped), TEXTS[:1], **kw)
    assert got == base
    assert wrapped.calls["greedy"] == 0 and wrapped.calls["forward"] > 0


# ---- CUDA ------------------------------------------------------------------------------


@needs_cuda
def test_cuda_clear_zeroes_exactly_those_positions(tiny_pair):
    cpu, gpu = tiny_pair
    toks = np.arange(1, 21, dtype=np.int32)
    kvs = []
    for lm in (cpu, gpu):
        kv = lm.model.new_kv_cache(2, 32)
        lm.model.forward(toks, [Segment(0, 0, 12), Segment(1, 0, 8)], kv)
        kv.clear(0, 5, 9)
        kvs.append(kv)
    kc, vc = kvs[0].snapshot_slot(0, 32)
    kg, vg = kvs[1].snapshot_slot(0, 32)
    assert not kg[:, :, 5:9].any() and not vg[:, :, 5:9].any()
    assert kg[:, :, :5].all() and kg[:, :, 9:12].all()
    assert not kg[:, :, 12:].any()
    np.testing.assert_allclose(kg, kc, rtol=1e-3, atol=1e-4)
    k1, _ = kvs[1].snapshot_slot(1, 8)
    assert k1.all(), "clear touched another slot"


@needs_cuda
@pytest.mark.parametrize("home", ["host", "device", "disk"])
def test_cuda_capsule_round_trip_is_byte_exact_and_greedy_identical(tiny_pair, tmp_path, home):
    from aotx.engine.state import capsule as C

    _, gpu = tiny_pair
    m = gpu.model
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 300, 40).astype(np.int32)
    kv = m.new_kv_cache(3, 128)
    m.forward(prompt, [Segment(0, 0, 40)], kv)
    if home == "device":
        k, v = kv.snapshot_slot(0, 40, device=True)
        assert isinstance(k, cupy.ndarray)
        kv.restore_slot(2, k, v, 40)
    else:
        cap = C.snapshot(kv, 0, prompt.tolist(), fingerprint=gpu.fingerprint, backend="cuda")
        if home == "disk":
            C.save(cap, tmp_path / "c.caps")
            cap = C.load(tmp_path / "c.caps")
        assert C.restore(cap, kv, 2, fingerprint=gpu.fingerprint) == 40
    a, b = kv.snapshot_slot(0, 40), kv.snapshot_slot(2, 40)
    assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()
    # greedy continuation from the original slot and from the restored one, in one batch
    ta = tb = int(prompt[-1])
    outs_a, outs_b = [], []
    for i in range(24):
        ids = m.greedy(np.array([ta, tb], np.int32), [Segment(0, 40 + i, 1), Segment(2, 40 + i, 1)], kv)
        ta, tb = int(ids[0]), int(ids[1])
        outs_a.append(ta)
        outs_b.append(tb)
    assert outs_a == outs_b


@needs_cuda
def test_cpu_capsule_restores_into_cuda(tiny_pair):
    from aotx.engine.state import capsule as C

    cpu, gpu = tiny_pair
    assert cpu.fingerprint == gpu.fingerprint
    prompt = np.random.default_rng(2).integers(0, 300, 30).astype(np.int32)
    kc = cpu.model.new_kv_cache(1, 64)
    cpu.model.forward(prompt, [Segment(0, 0, 30)], kc)
    cap = C.snapshot(kc, 0, prompt.tolist(), fingerprint=cpu.fingerprint)
    kg = gpu.model.new_kv_cache(2, 64)
    C.restore(cap, kg, 1, fingerprint=gpu.fingerprint)
    nxt = np.array([7], np.int32)
    ref = cpu.model.forward(nxt, [Segment(0, 30, 1)], kc)
    got = gpu.model.forward(nxt, [Segment(1, 30, 1)], kg)
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert rel < 1e-3, rel


@needs_cuda
@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_cuda_engine_device_greedy_matches_logits_path(tiny_pair, speculative):
    _, gpu = tiny_pair
    counted = _Counting(gpu.model)
    got, dones = _generate(dataclasses.replace(gpu, model=counted), TEXTS, speculative=speculative)
    assert counted.calls["greedy"] > 0 and counted.calls["forward"] == 0
    hidden = _NoGreedy(gpu.model)
    base, _ = _generate(dataclasses.replace(gpu, model=hidden), TEXTS, speculative=speculative)
    assert got == base
    if speculative == "ngram":
        plain, _ = _generate(gpu, TEXTS, speculative="off")
        assert got == plain, "speculative greedy must equal plain greedy (rollback via kv.clear)"


@needs_cuda
def test_cuda_engine_parks_and_restores_capsules(tiny_pair):
    """One slot, two conversations taking turns: each turn parks the other's capsule
    (snapshot from the CUDA cache) and the next turn of a conversation restores it."""
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store
    from aotx.engine.state.cache import CapsuleCache

    _, gpu = tiny_pair
    eng = Engine(gpu, open_store(None), n_slots=1, n_ctx=256, device="cuda",
                 capsules=CapsuleCache(None, host_bytes=64 << 20, fingerprint=gpu.fingerprint))
    eng.start()
    try:
        convs = []
        for i in range(2):
            s = EventSink()
            eng.post(P.CreateConversation(id=1, title=f"c{i}"), s)
            assert s.done.wait(30)
            convs.append(s.events[0].conversation.conv_id)
        notes, reused = [], []
        for turn in range(2):
            for j, cid in enumerate(convs):
                s = EventSink()
                eng.post(P.SubmitMessage(id=10 + turn, conv_id=cid, text=f"{TEXTS[j]} {turn}",
                                         sampling=P.SamplingParams(repeat_penalty=1.0, temperature=0.0,
                                                                   max_tokens=12)), s)
                assert s.done.wait(60)
                assert not [e for e in s.events if isinstance(e, P.Error)]
                notes += [e.message for e in s.events if isinstance(e, P.Notice) and e.kind == "capsule"]
                reused.append(next(e for e in s.events if isinstance(e, P.Committed)).timings)
    finally:
        eng.stop()
    assert any("picked up where this conversation left off" in n for n in notes), notes
    assert reused[2].get("prompt_tokens_reused", 0) > 16, reused[2]
