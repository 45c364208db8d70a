"""Hybrid models (qwen35; qwen3next, a mixture of experts) on the CUDA backend's host code
against fake CuPy: ``python -m tests.tools.gpu_dryrun_hybrid``.

Like ``tests/tools/gpu_dryrun.py``: every launch is checked by ``gpu_fake_cupy`` (argument
lists against the kernels' signatures in ``kernels/recurrent.cu``, pointers inside their
allocations, the recurrent kernels' state and undo spans per row), the model's kernels do
not run. Scenarios on the tiny qwen35 file (``tests/models/qwen35.py``) with a toy
vocabulary: the plan (the recurrent steps, the M-RoPE table), an eager prefill past the
graph's rows, short prefills and 3-slot decode ticks through the captured graph (padding
rows on the scratch slot), a verify window and its rollback, snapshot / restore byte-exact,
the refusals (a segment off the state's position, a slot twice in a batch), KV types f16 and
f32, fused and generic kernels, prefill f32 and gemv; then the recurrent kernels emulated in
numpy (``gpu_fake_cupy``'s mirror of ``recurrent.cu``) through the steps' own launches,
against the CPU's kernels (``cpu/recurrent.py``): outputs and state of several segments at
once, and a rollback's state equal to the kept rows' own. Prints one line per scenario and
``hybrid dry run OK`` last; exit code 1 on the first failure. Run in a subprocess by
tests/test_cuda_host.py.
"""

from __future__ import annotations

import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np

VOCAB = 512


def _toy_tokenizer(tm):
    from gguf import GGUFValueType as V

    toks = tuple(f"t{i}" for i in range(VOCAB))
    kv = (("tokenizer.ggml.model", "gpt2", V.STRING), ("tokenizer.ggml.tokens", toks, V.ARRAY),
          ("tokenizer.ggml.token_type", tuple([1] * VOCAB), V.ARRAY))
    return tm.common.Tokenizer(kv, VOCAB)


def _build(path, **kw):
    from aotx.engine.backend.cuda.backend import CudaBackend
    from aotx.engine.model.architectures import build
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    return build(cfg, gf, CudaBackend(**kw))


def _exercise(model, kv_type: str) -> str:
    """Every path a qwen35 forward takes; returns a short note."""
    from aotx.engine.model.batch import Segment

    c = model.compiled
    names = {type(s).__name__ for s in c.steps}
    for want in ("ShortConvStep", "DeltaRuleStep", "L2NormStep", "SigmoidGateStep", "DeinterleaveStep"):
        assert want in names, (want, sorted(names))
    rng = np.random.default_rng(0)
    toks = rng.integers(0, VOCAB, 300).astype(np.int32)
    kv = model.new_kv_cache(4, 256, kv_type)
    st = kv.state
    assert st is not None and st.names == ("conv.0", "delta.1"), st.names
    model.forward(toks[:150], [Segment(0, 0, 150, all_logits=True)], kv)        # eager: past b_max
    model.forward(toks[:40], [Segment(1, 0, 20), Segment(2, 0, 20)], kv)         # graph: two short prefills
    for i in range(3):                                                          # decode ticks of 3 slots
        model.forward(toks[:3], [Segment(0, 150 + i, 1), Segment(1, 20 + i, 1), Segment(2, 20 + i, 1)], kv)
    assert [st.position(s) for s in range(3)] == [153, 23, 23], st.pos
    model.greedy(toks[:2], [Segment(2, 23, 1), Segment(0, 153, 1)], kv)            # ids on the device
    # a verify window of 5 rows (graph), then its rollback to 2 kept rows
    model.forward(toks[:5], [Segment(1, 23, 5, all_logits=True)], kv)
    assert st.undo[1] == (23, 5), st.undo
    st.rollback(1, 25)
    assert st.position(1) == 25 and 1 not in st.undo
    # the same window eagerly (one slot twice is refused, so: a window beside a long prefill)
    model.forward(toks[:135], [Segment(3, 0, 130, logits=False), Segment(1, 25, 5, all_logits=True)], kv)
    st.rollback(1, 26)
    st.rollback(1, 26)                     # already there: nothing to do
    # snapshot / restore: byte-exact (the fake's device memory is real)
    snap = st.snapshot(0, 154)
    assert {k: v.shape for k, v in snap.items()} == {n: tuple(L.shape) for n, L in zip(st.names, st.layers)}
    for b in st.buffers:
        b[0] = 0.5
    st.restore(0, snap, 154)
    again = st.snapshot(0, 154)
    assert all(again[k].tobytes() == snap[k].tobytes() for k in snap)
    # the delta buffers are transposed on the device: a restored CPU-layout buffer reads back the same
    d = snap["delta.1"].copy()
    d[0, 1, 2], d[0, 2, 1] = 7.0, -3.0
    st.restore(2, {**snap, "delta.1": d}, 154)
    assert float(st.buffers[1][2, 0, 2, 1]) == 7.0 and float(st.buffers[1][2, 0, 1, 2]) == -3.0
    # refusals, before any row runs
    for segs, msg in (([Segment(0, 100, 1)], "stands at position 154"),
                      ([Segment(3, 130, 2), Segment(3, 132, 1)], "two segments"),
                      ([Segment(7, 0, 1)], "out of range")):
        try:
            model.forward(toks[:sum(s.n for s in segs)], segs, kv)
        except ValueError as e:
            assert msg in str(e), (msg, str(e))
        else:
            raise AssertionError(f"{segs} not refused")
    try:
        st.snapshot(0, 10)
    except ValueError:
        pass
    else:
        raise AssertionError("a snapshot off the state's position was taken")
    try:
        st.restore(0, {"conv.0": snap["conv.0"]}, 154)
    except ValueError:
        pass
    else:
        raise AssertionError("a restore without every buffer was taken")
    return f"{len(c.steps)} steps, state {sum(int(b.nbytes) for b in st.buffers)} bytes"


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.tools import gpu_fake_cupy as fake

    fake.install()
    import tests.models as tm
    from tests.models import qwen35

    tmp = Path(tempfile.mkdtemp(prefix="aotx-dryrun-hybrid-"))
    tok = _toy_tokenizer(tm)
    path = qwen35.write(tmp / "qwen35.gguf", tok, pre="qwen2")
    scenarios = [("qwen35 default kernels, kv f16", {}, "f16"), ("qwen35 prefill f32, kv f32", {"prefill": "f32"}, "f32"),
                 ("qwen35 generic kernels", {"fuse": False}, "f16"), ("qwen35 prefill gemv", {"prefill": "gemv"}, "f16")]
    for label, kw, kv_type in scenarios:
        before = fake.stats["launches"]
        try:
            note = _exercise(_build(path, **kw), kv_type)
        except Exception:  # noqa: BLE001 - report the scenario and stop
            print(f"FAIL {label}")
            traceback.print_exc()
            return 1
        print(f"ok   {label}: {fake.stats['launches'] - before} launches; {note}")
    print(f"hybrid dry run OK: {fake.stats['launches']} launches, {fake.stats['captures']} graph captures, "
          f"kernels: {', '.join(sorted(fake.stats['kernels']))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
