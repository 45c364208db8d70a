"""The two real files on the CPU: Qwen2.5-Coder-0.5B-Instruct (qwen2) and
Gemma 3 270M (gemma3), through the new one-forward design.

* teacher-forced against llama.cpp's chat references (tests/data/refs/<model>/chat_refs.json,
  made by helper refs with llama-cpp-python; skipped until they exist);
* greedy decoding of 4 conversations at once equals each one alone (batch invariance);
* speculative decoding by prompt lookup (ngram) equals plain greedy, token for token;
* a capsule round trip (snapshot, disk, restore into another slot) continues byte-exactly;
* ``aotx run --model FILE`` answers on the CPU.
The files come from the fixtures ``qwen2_model_path`` / ``gemma3_model_path`` (helper
refs; they skip with the pip command when the PyPI parts are not installed).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from aotx.engine import protocol as P
from aotx.engine.model.batch import Segment
from tests.fakes.sink import EventSink

HERE = Path(__file__).resolve().parent
MODELS = ["qwen2", "gemma3"]
DEVICE = os.environ.get("AOTX_REAL_DEVICE", "cpu")   # "cuda" on a GPU machine (tests/tools/gpu_real.sh)
PROMPTS = ["def reverse_string(s):", "The capital of France is", "Three prime numbers: 2, 3,",
           "A hash map is"]


@pytest.fixture(scope="module", params=MODELS)
def real(request):
    """(name, LoadedModel) of one real file on DEVICE (the CPU unless AOTX_REAL_DEVICE says),
    loaded once per module."""
    try:
        path = request.getfixturevalue(f"{request.param}_model_path")
    except pytest.FixtureLookupError:
        pytest.skip(f"needs helper refs' {request.param}_model_path fixture (tests/conftest.py)")
    from aotx.engine.model.loader import load_model

    return request.param, load_model(path, device=DEVICE)


def _refcheck():
    mod = sys.modules.get("aotx_tests_refcheck")
    if mod is None:
        spec = importlib.util.spec_from_file_location("aotx_tests_refcheck", HERE / "refcheck.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return mod


def test_teacher_forced_matches_llama_cpp(real):
    """Teacher-forced rows against llama.cpp's, with refcheck's bounds (argmax equal wherever
    the reference gap is >= 0.5, mean |diff| on the top-5 <= 0.5). The reference is llama.cpp's
    teacher-forced forward of the same tokens in one eval (``teacher_forced_refs.json``, made
    by tests/tools/make_refs_teacher_forced.py) where it exists, as AOTX is fed here; else the
    logits llama.cpp computed while generating (``chat_refs.json``). They are not the same:
    llama.cpp's CPU kernels differ between 1-row decode and many-row batches, and on Gemma 3
    270M (norm weights up to 301 amplify its int8 activation rounding) its generating run and
    its one-eval run of the same tokens differ by mean |diff| 0.195 and flip a row of reference
    gap 0.517; AOTX is at 0.038 from an independent float64 forward (tests/tools/gemma3_check.py).
    """
    name, lm = real
    ref = HERE / "data" / "refs" / name / "teacher_forced_refs.json"
    if not ref.is_file():
        ref = ref.with_name("chat_refs.json")
    if not ref.is_file():
        pytest.skip(f"no llama.cpp chat references for {name} yet ({ref})")
    rc = _refcheck()
    rep = rc.compare(rc.model_forward(lm), json.loads(ref.read_text()))
    print(rep.summary())
    rep.check()


def _replies(lm, prompts: list[str], *, n_slots: int, speculative: str = "off", max_tokens: int = 6,
             kv_type: str = "f16", raw: bool = True) -> list[list[int]]:
    """Greedy replies to ``prompts`` (raw text: short prompts keep this affordable on a
    shared 2-core machine), all submitted at once to one engine of ``n_slots``."""
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store

    eng = Engine(lm, open_store(None), n_slots=n_slots, n_ctx=512, speculative="off", kv_type=kv_type)
    eng.start()
    try:
        sinks = []
        for i, text in enumerate(prompts):
            s = EventSink()
            eng.post(P.CreateConversation(id=100 + i, title="t"), s)
            cid = s.wait(60).conversation.conv_id
            sinks.append((s, cid))
        for i, (s, cid) in enumerate(sinks):
            eng.post(P.SubmitMessage(id=200 + i, conv_id=cid, text=prompts[i], raw=raw, sampling=P.SamplingParams(
                temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, max_tokens=max_tokens, seed=1,
                speculative=speculative)), s)
        out = []
        for s, _ in sinks:
            done = s.wait(1200)
            assert isinstance(done, P.Committed), s.events
            out.append([e.token_id for e in s.events if isinstance(e, P.Token)])
        return out
    finally:
        eng.stop()


def test_four_concurrent_conversations_equal_each_alone(real):
    name, lm = real
    together = _replies(lm, PROMPTS, n_slots=4)
    alone = [_replies(lm, [p], n_slots=1)[0] for p in PROMPTS]
    assert together == alone
    assert all(len(r) > 0 for r in alone)


def _row_invariant_matmul() -> bool:
    """The row-invariant matmul (``QuantMatrix.numerics``): one kernel for every row count. Before
    it, K-quant weights (both real files) go through BLAS, whose sums depend on the row
    count, so a verify window's rows can differ from decode steps by float rounding."""
    from aotx.engine.backend.cpu.matmul import QuantMatrix

    return hasattr(QuantMatrix, "numerics")


def test_speculative_ngram_equals_plain_greedy(real):
    name, lm = real
    if DEVICE == "cpu" and not _row_invariant_matmul():
        pytest.xfail("needs the row-invariant CPU matmul for K-quant files")
    prompts = ["def add(a, b):\n    return a + b\n\n\ndef add(", "one two three four one two three four one two"]
    plain = _replies(lm, prompts, n_slots=2, max_tokens=16)
    lookup = _replies(lm, prompts, n_slots=2, max_tokens=16, speculative="ngram")
    assert lookup == plain


def test_capsule_round_trip_continues_byte_exactly(real, tmp_path):
    from aotx.engine.state import capsule as C

    name, lm = real
    m = lm.model
    ids = lm.tokenizer.encode(PROMPTS[0])
    kv = m.new_kv_cache(2, 128)
    n = len(ids)
    first = m.forward(np.asarray(ids, np.int32), [Segment(0, 0, n)], kv)
    cap = C.snapshot(kv, 0, ids, fingerprint=lm.fingerprint)
    C.save(cap, tmp_path / "c.caps")
    back = C.load(tmp_path / "c.caps")
    assert back.header.kv_type == "f16"
    C.restore(back, kv, 1, fingerprint=lm.fingerprint)

    def decode(slot: int, logits: np.ndarray) -> tuple[list[int], list[bytes]]:
        toks, raws = [], []
        for p in range(n, n + 6):
            t = int(logits[0].argmax())
            toks.append(t)
            logits = m.forward(np.array([t], np.int32), [Segment(slot, p, 1)], kv)
            raws.append(logits.tobytes())
        return toks, raws

    a = decode(0, first)
    b = decode(1, first)
    assert a == b                      # same tokens and bit-identical logits from the restored slot


def test_aotx_run_answers(real, tmp_path):
    name, lm = real
    home = tmp_path / "home"
    sock = Path(tempfile.mkdtemp(prefix="aotx-r", dir="/tmp")) / "e.sock"
    env = dict(os.environ, AOTX_HOME=str(home), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "aotx.engine.cli.commands"]
    try:
        r = subprocess.run(cmd + ["run", "--model", str(lm.path), "--device", DEVICE, "--socket", str(sock),
                                  "--slots", "1", "--context", "512", "--json", "--temperature", "0",
                                  "--max-tokens", "6", "Hello"],
                           capture_output=True, text=True, env=env, timeout=900)
        assert r.returncode == 0, r.stderr
        events = [json.loads(line) for line in r.stdout.splitlines()]
        done = next(e for e in events if e["event"] == "done")
        assert done["completion_ids"] and done["text"].strip(), done
    finally:
        subprocess.run(cmd + ["stop", "--socket", str(sock)], capture_output=True, env=env, timeout=120)
