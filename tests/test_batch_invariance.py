"""Batch invariance of the forward pass on tiny GGUF files.

The promise (DESIGN.md, engine/model/batch.py): for a given model, backend and KV
type (f32, f16, q8_0, q4_0), the logits of a row depend only on that row's token, its position and the KV it
attends to - not on the other rows of the batch, the batch size, the segment length, the
prefill chunking, the slot, or whether the row is a decode, prefill or verify row.

Property, checked with hypothesis on every tiny file of `tiny_file_names()` (the one
list: a llama file per tensor type the CPU runs, and every architecture of
tests/models.TINY and .MOE): several sequences are fed to one KV cache
through a random schedule - random slots, random chunk lengths (decode rows, verify
windows, prefill chunks), several sequences per batch in random order, and verify windows
whose draft tokens are rejected and rolled back (kv.clear, and a hybrid model's recurrent
state with kv.state.rollback) before the true tokens come -
and every logits row must be bit-identical to the same row of the sequence computed
alone in slot 0 of a fresh cache, in one segment. Bounded for CI: a few examples per
file, sequences of at most 24 tokens, 2-layer models.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aotx.engine.model.batch import Segment

ROOT = Path(__file__).resolve().parent
N_CTX = 64
MAX_LEN = 24


def _llama_types() -> list[T]:
    from aotx.engine.backend import quants

    wanted = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K,
              T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4)
    return [t for t in wanted if t in quants.SUPPORTED_TYPES]


def _architectures() -> list[str]:
    """The names of tests/models.TINY (every tiny architecture file), tests/models.MOE
    (the tiny mixture-of-experts files) and tests/models.HYBRID (qwen35, qwen35moe, gemma4)."""
    import tests.models as models

    return sorted(models.TINY) + sorted(getattr(models, "MOE", {})) + sorted(getattr(models, "HYBRID", {}))


def tiny_file_names() -> list[str]:
    """THE list of tiny files this test runs on: ``llama-<TYPE>`` for every tensor type
    the CPU backend supports, then every architecture name of tests/models.TINY."""
    return [f"llama-{t.name}" for t in _llama_types()] + _architectures()


@pytest.fixture(scope="module")
def tiny_file(request, tmp_path_factory):
    """Factory: name (from tiny_file_names) -> path of that tiny GGUF, written once."""
    root = tmp_path_factory.mktemp("invariance")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            if name.startswith("llama-"):
                tiny = request.getfixturevalue("tiny_gguf")
                made[name] = Path(tiny.write_tiny_llama(root / f"{name}.gguf", qtype=T[name[6:]], seed=7))
            else:
                made[name] = Path(request.getfixturevalue("tiny_model_path")(name))
        return made[name]

    return get


def _load(path: Path):
    from aotx.engine.model.loader import load_model

    return load_model(path, device="cpu")   # every architecture of tests/models runs: no skip


def _kv_types(model) -> list[str | None]:
    """The KV types new_kv_cache takes (None: its only one, before the kv_type argument):
    f32, f16, and llama.cpp's q8_0 and q4_0 blocks where the model's head size is a
    multiple of their 32 values."""
    if "kv_type" not in inspect.signature(model.new_kv_cache).parameters:
        return [None]
    out = ["f32", "f16"]
    for t in ("q8_0", "q4_0"):
        try:
            model.kv_cache_bytes(1, N_CTX, t)
        except ValueError:   # a head size that is not a multiple of 32
            continue
        out.append(t)
    return out


def _new_kv(model, n_slots: int, kv_type):
    return model.new_kv_cache(n_slots, N_CTX) if kv_type is None else model.new_kv_cache(n_slots, N_CTX, kv_type=kv_type)


@st.composite
def schedules(draw, vocab: int, kv_types: list):
    """(sequences, kv_type, steps): each step a list of (sequence index, n true tokens,
    draft tokens to reject after them) fed as one batch, in that order."""
    n_seq = draw(st.integers(1, 3))
    seqs = [draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=MAX_LEN)) for _ in range(n_seq)]
    done = [0] * n_seq
    steps = []
    while any(d < len(s) for d, s in zip(done, seqs)):
        live = [i for i in range(n_seq) if done[i] < len(seqs[i])]
        chosen = draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        step = []
        for i in chosen:
            left = len(seqs[i]) - done[i]
            n = draw(st.sampled_from(sorted({1, min(left, 3), min(left, 7), left})))
            room = N_CTX - done[i] - n
            drafts = draw(st.lists(st.integers(0, vocab - 1), max_size=min(3, room))) if n < left else []
            step.append((i, n, drafts))
            done[i] += n
        steps.append(step)
    return seqs, draw(st.sampled_from(kv_types)), steps


def _alone(model, tokens: list[int], kv_type) -> np.ndarray:
    kv = _new_kv(model, 1, kv_type)
    return model.forward(np.asarray(tokens, np.int32), [Segment(0, 0, len(tokens), all_logits=True)], kv)


@pytest.mark.parametrize("name", tiny_file_names())
def test_every_logits_row_equals_the_row_computed_alone(name, tiny_file):
    lm = _load(tiny_file(name))
    model = lm.model
    vocab = lm.config.vocab_size
    kv_types = _kv_types(model)
    cache: dict = {}

    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(schedules(vocab, kv_types), st.randoms(use_true_random=False))
    def check(schedule, rnd):
        seqs, kv_type, steps = schedule
        slots = list(range(len(seqs) + 1))
        rnd.shuffle(slots)                     # sequence i lives in slot slots[i]; one slot stays idle
        kv = _new_kv(model, len(slots), kv_type)
        pos = [0] * len(seqs)
        for step in steps:
            segs, toks, want = [], [], []
            for i, n, drafts in step:
                toks += seqs[i][pos[i]:pos[i] + n] + drafts
                segs.append(Segment(slots[i], pos[i], n + len(drafts), all_logits=True))
                key = (tuple(seqs[i]), kv_type)
                if key not in cache:
                    cache[key] = _alone(model, seqs[i], kv_type)
                want.append((cache[key][pos[i]:pos[i] + n], n, len(drafts)))
            out = model.forward(np.asarray(toks, np.int32), segs, kv)
            row = 0
            for (i, n, drafts), (ref, n_true, n_draft) in zip(step, want):
                np.testing.assert_array_equal(out[row:row + n_true], ref,
                                              err_msg=f"{name}: sequence {i} rows {pos[i]}..{pos[i] + n_true - 1}")
                row += n_true + n_draft
                if n_draft:                    # the verify window's rejected drafts: roll back their KV
                    kv.clear(slots[i], pos[i] + n_true, pos[i] + n_true + n_draft)
                    if getattr(kv, "state", None) is not None:   # and a hybrid model's recurrent state
                        kv.state.rollback(slots[i], pos[i] + n_true)
                pos[i] += n_true

    check()


def test_the_list_covers_every_cpu_tensor_type():
    """Guards the test's own list: a tensor type the CPU backend supports but this test
    skips would leave that type's batch invariance unchecked."""
    from aotx.engine.backend import quants

    names = set(tiny_file_names())
    missing = [t.name for t in quants.SUPPORTED_TYPES if f"llama-{t.name}" not in names]
    assert not missing, missing
