"""Several models in one engine on a GPU: the default model and tiny
llama files loaded beside it through serve's loader (``serve.load_beside``), each
model's greedy reply beside the others equal to the same prompt on an engine holding
that model alone, on the device the model was loaded on (a file the CUDA backend cannot
run falls back to the CPU under --device auto). Skips without a CUDA device.

Run on the GPU machine as the other CUDA tests: ``python -m pytest -q -m cuda
tests/test_models_cuda.py`` (about a minute after the kernels compile).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from aotx.engine import protocol as P
from aotx.engine.runtime.catalog import Catalog
from aotx.engine.runtime.engine import Engine
from aotx.engine.runtime.store import open_store
from tests.fakes.inproc import Client, reply, stop

try:
    import cupy

    _why = "" if cupy.cuda.runtime.getDeviceCount() > 0 else "no CUDA device: CuPy sees 0 devices"
except Exception as e:  # noqa: BLE001 - ImportError, or the driver's CUDARuntimeError
    _why = f"no CUDA device: {type(e).__name__}: {e}"

pytestmark = [pytest.mark.cuda, pytest.mark.realmodel, pytest.mark.skipif(bool(_why), reason=_why or "-")]

TEXTS = {"": "The capital of France is", "t64": "hello there", "tiny-a": "the hello world"}


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny_gguf):
    h = tmp_path_factory.mktemp("models-cuda")
    (h / "models").mkdir()
    tiny_gguf.write_tiny_llama(h / "models" / "t64.gguf", seed=4, d_model=256, n_heads=4, n_kv_heads=2, ffn=512)
    tiny_gguf.write_tiny_llama(h / "models" / "tiny-a.gguf", seed=1)  # small heads: maybe CPU only
    return h


def _loader(entry):
    from aotx.engine.cli.serve import load_beside

    return load_beside(entry, "cuda", "auto")


def _engine(lm, home: Path) -> Engine:
    store = open_store(home / f"journal-{time.monotonic_ns()}")
    eng = Engine(lm, store, n_slots=2, n_ctx=256, prefill_chunk=64, device="cuda",
                 catalog=Catalog(home / "models"), loader=_loader)
    eng.start()
    return eng


def _run(eng: Engine, texts: dict[str, str]) -> dict[str, list[int]]:
    c = Client(eng)
    convs = {m: c.create(model=m) for m in texts}
    rids = {m: c.submit(convs[m].conv_id, t, n=8) for m, t in texts.items()}
    for m, rid in rids.items():
        end = reply(c.sink, rid)
        assert isinstance(end, P.Committed), (m, end)
    return {m: c.tokens(rid) for m, rid in rids.items()}


def test_models_beside_the_default_on_cuda_each_exactly_as_alone(default_model_path, home):
    from aotx.engine.model.loader import load_model

    lm = load_model(default_model_path, device="cuda")
    eng = _engine(lm, home)
    try:
        together = _run(eng, TEXTS)
        devices = {m: eng.models.get(m or lm.name).lm.backend for m in TEXTS}
        # each model's executor runs on the device its weights are on
        assert all(eng.models.get(m or lm.name).executor.device == d for m, d in devices.items()), devices
    finally:
        stop(eng)
    assert devices[""] == "cuda" and devices["t64"] == "cuda", devices
    for m, text in TEXTS.items():
        solo_lm = lm if not m else _loader(Catalog(home / "models").resolve(m))
        assert solo_lm.backend == devices[m]
        solo = _engine(solo_lm, home)
        try:
            alone = _run(solo, {"": text})[""]
        finally:
            stop(solo)
        assert together[m] == alone, (m, devices[m], together[m], alone)
