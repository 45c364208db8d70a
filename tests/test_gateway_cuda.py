"""Constrained decoding on CUDA: the sampling kernel's token mask against the host's.

The mask hook of ``cuda_sampling.sample_rows`` (a row's bitmask address in its
sampler-table words 16-17, ``MaskTable`` on the device): for random logits and random
masks, the kernel's greedy and sampled ids equal ``sampling.sample`` with the same mask
on the host (the host chain is the reference; its own masking is checked in
test_gateway_engine.py), a forbidden id is never picked, and an engine on the GPU keeps a
JSON-schema reply valid through the device path. Every test here skips without CuPy and
a CUDA device. Run on the GPU machine: ``python -m pytest -q -rs tests/test_gateway_cuda.py``.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from aotx.engine.backend.cuda import sampling as CS
from aotx.engine.runtime.constraints import mask_bits
from aotx.engine.runtime.sampling import SamplerConfig, SamplerState, sample

try:
    import cupy

    _why = "" if cupy.cuda.runtime.getDeviceCount() > 0 else "no CUDA device: CuPy sees 0 devices"
except Exception as e:  # noqa: BLE001 - ImportError, or the driver's CUDARuntimeError
    _why = f"no CUDA device: {type(e).__name__}: {e}"

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(bool(_why), reason=_why or "-")]


class _Row:
    """A sampler state with a mask address, as the executor hands it to ``fill_row``."""

    def __init__(self, st: SamplerState, mask_ptr: int):
        self.seed, self.step, self.history, self.mask_ptr = st.seed, st.step, st.history, mask_ptr


def _random_masks(rng, R: int, V: int, density: float) -> np.ndarray:
    bits = rng.random((R, V)) < density
    bits[np.arange(R), rng.integers(0, V, R)] = True  # at least one allowed id per row
    words = (V + 31) // 32
    padded = np.zeros((R, words * 32), bool)
    padded[:, :V] = bits
    return np.packbits(padded, axis=1, bitorder="little").view(np.int32).reshape(R, words)


def _kernel(logits: np.ndarray, cfgs, states, masks: np.ndarray | None) -> np.ndarray:
    from aotx.engine.backend.cuda.backend import NVRTC_OPTIONS

    R, V = logits.shape
    k = cupy.RawModule(code=CS.SRC, options=NVRTC_OPTIONS).get_function("sample_rows")
    table = CS.MaskTable(V, rows=8)  # grows to R rows
    ptrs = table.load(masks) if masks is not None else [0] * R
    prm = np.zeros((R, CS.P_WORDS), np.int32)
    hist = np.zeros((R, CS.H_MAX), np.int32)
    for j in range(R):
        CS.fill_row(prm[j], hist[j], cfgs[j], _Row(states[j], ptrs[j]), tick=3)
        assert prm[j, 16:18].view(np.uint64)[0] == ptrs[j]
    lg = cupy.asarray(logits)
    ids = cupy.empty(R, cupy.int32)
    rec = cupy.empty((R, CS.REC_WORDS), cupy.int32)
    z = cupy.zeros(R, cupy.int32)
    k((R,), (1024,), (lg, np.int32(V), np.int32(V), cupy.asarray(prm), cupy.asarray(hist), z, z, np.uint64(0), ids,
                        rec))
    out = ids.get()
    del table
    return out


@pytest.mark.parametrize("cfg", [
    SamplerConfig(temperature=0.0, repeat_penalty=1.0),
    SamplerConfig(temperature=0.0, repeat_penalty=1.3, repeat_last_n=64),
    SamplerConfig(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    SamplerConfig(temperature=1.0, top_k=1024, top_p=1.0, min_p=0.0),
], ids=["greedy", "greedy-penalty", "default", "k1024-no-filters"])
@pytest.mark.parametrize("density", [0.0005, 0.3])
def test_masked_kernel_equals_masked_host_chain(cfg, density):
    rng = np.random.default_rng(7)
    R, V = 256, 151936  # Qwen2.5's vocabulary: 4748 mask words
    logits = (rng.standard_normal((R, V)) * 3).astype(np.float32)
    masks = _random_masks(rng, R, V, density)
    states = [SamplerState(seed=int(rng.integers(0, 2**63)), step=int(rng.integers(0, 500)),
                           history=rng.integers(0, V, 40).tolist()) for _ in range(R)]
    want = np.asarray([sample(logits[j].copy(), cfg, copy.deepcopy(states[j]), masks[j]) for j in range(R)])
    got = _kernel(logits, [cfg] * R, states, masks)
    allowed = np.stack([mask_bits(masks[j], V) for j in range(R)])
    assert allowed[np.arange(R), got].all(), "the kernel picked an id its mask forbids"
    same = int((got == want).sum())
    assert same >= R - 1, f"{R - same} of {R} rows differ from the host chain"


def test_unmasked_rows_are_unchanged_by_the_hook():
    """Rows without a mask (address 0) beside masked rows sample as before the hook."""
    rng = np.random.default_rng(3)
    R, V = 64, 49152
    logits = (rng.standard_normal((R, V)) * 3).astype(np.float32)
    cfg = SamplerConfig(temperature=0.7)
    states = [SamplerState(seed=j, step=j) for j in range(R)]
    want = [sample(logits[j].copy(), cfg, copy.deepcopy(states[j])) for j in range(R)]
    assert (_kernel(logits, [cfg] * R, states, None) == np.asarray(want)).sum() >= R - 1


def test_engine_on_cuda_keeps_a_json_schema_reply_valid(request, tmp_path):
    """The engine on the GPU with a constrained greedy reply: the device path (mask table
    + kernel) runs and the reply is valid JSON of the schema. The default model where it
    is installed, else a random-weight model of its shape (the GPU machine has no model
    file: tests/tools/bench_constraints.synthetic_model); the schema is bounded, so even
    noise under the mask closes its JSON within the token limit."""
    jsonschema = pytest.importorskip("jsonschema")
    try:
        default_model_path = request.getfixturevalue("default_model_path")
    except pytest.skip.Exception:
        from tests.tools.bench_constraints import synthetic_model

        default_model_path = synthetic_model(tmp_path)
    from aotx.engine import protocol as P
    from aotx.engine.model.loader import load_model
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store
    from tests.fakes.sink import EventSink

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10 ** 8}},
              "required": ["city", "population"], "additionalProperties": False}
    texts = {}
    for device in ("cuda",):
        lm = load_model(default_model_path, device=device)
        eng = Engine(lm, open_store(None), n_slots=2, n_ctx=512, device=device)
        eng.start()
        try:
            s = EventSink()
            eng.post(P.CreateConversation(id=1), s)
            conv = s.wait().conversation.conv_id
            eng.post(P.SubmitMessage(id=2, conv_id=conv, text="The largest city of France as JSON.",
                                     sampling=P.SamplingParams(temperature=0.0, max_tokens=96),
                                     constraint=P.Constraint(kind="json_schema", grammar=json.dumps(schema))), s)
            c = s.wait()
            assert isinstance(c, P.Committed) and c.finish_reason == "stop", s.events
            texts[device] = c.text
            if device == "cuda":
                assert lm.model.compiled.mask_table is not None, "the device path did not use the mask table"
        finally:
            eng.stop()
    jsonschema.validate(json.loads(texts["cuda"]), schema)
