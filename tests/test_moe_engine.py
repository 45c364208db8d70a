"""A mixture-of-experts file through the whole engine on the CPU: ``aotx run``
with the startup profile's expert stages and the plan's note, a conversation continued
from its slot's KV, the engine restarted (the journal recovers the conversation; the
stored calibration is reused), and a capsule round trip on each MoE architecture. The
CUDA side is tests/test_cuda_moe.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from aotx.engine.model.batch import Segment
from aotx.engine.model.loader import load_model


def _aotx(env, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "aotx.engine.cli.commands", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def _done(stdout: str) -> dict:
    return next(json.loads(line) for line in stdout.splitlines() if json.loads(line)["event"] == "done")


def test_aotx_run_on_a_moe_file_profile_journal_and_restart(request, tmp_path):
    path = request.getfixturevalue("tiny_model_path")("gptoss")
    env = dict(os.environ, AOTX_HOME=str(tmp_path / "home"), PYTHONDONTWRITEBYTECODE="1")
    sock = Path(tempfile.mkdtemp(prefix="aotx-m", dir="/tmp")) / "e.sock"
    common = ["--model", str(path), "--device", "cpu", "--socket", str(sock), "--json", "--temperature", "0",
              "--max-tokens", "5"]
    try:
        r = _aotx(env, "run", *common, "--slots", "2", "--context", "512", "--profile", "Hello")
        assert r.returncode == 0, r.stderr
        first = _done(r.stdout)
        assert len(first["completion_ids"]) == 5
        prof = next(json.loads(line) for line in r.stderr.splitlines() if line.startswith("{"))
        for stage in ("experts calibrate", "experts plan", "experts place", "experts replan"):
            assert stage in prof["stages_s"], prof
        note = prof["notes"]["experts"]
        assert note.startswith("experts: 32 in 4 layers: 32 host (100%)") and "no GPU" in note, note
        cid = first["conversation"]
        r = _aotx(env, "run", *common, "--conversation", cid, "more")
        assert r.returncode == 0, r.stderr
        second = _done(r.stdout)
        # the first turn's prompt and reply come from the slot's KV, not a new prefill
        assert second["timings"]["prompt_tokens_reused"] >= len(first["prompt_ids"])
        assert second["prompt_ids"][:len(first["prompt_ids"])] == first["prompt_ids"]
        assert _aotx(env, "stop", "--socket", str(sock)).returncode == 0
        r = _aotx(env, "run", *common, "--profile", "--conversation", cid, "again")
        assert r.returncode == 0, r.stderr
        third = _done(r.stdout)
        prof = next(json.loads(line) for line in r.stderr.splitlines() if line.startswith("{"))
        assert prof["notes"]["experts"].endswith("calibration: stored calibration reused")
        # the journal brought the conversation back: both earlier turns are in the prompt
        n2 = len(second["prompt_ids"]) + len(second["completion_ids"])
        assert third["prompt_ids"][:len(second["prompt_ids"])] == second["prompt_ids"]
        assert third["prompt_ids"][len(second["prompt_ids"]):n2] == second["completion_ids"]
    finally:
        _aotx(env, "stop", "--socket", str(sock), timeout=120)


@pytest.mark.parametrize("name", ["qwen3moe", "olmoe", "gptoss"])
def test_capsule_round_trip_on_a_moe_model_continues_bit_exactly(request, tmp_path, name):
    from aotx.engine.state import capsule as C

    lm = load_model(request.getfixturevalue("tiny_model_path")(name))
    m = lm.model
    ids = lm.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    n = len(ids)
    kv = m.new_kv_cache(2, 64)
    first = m.forward(np.asarray(ids, np.int32), [Segment(0, 0, n)], kv)
    C.save(C.snapshot(kv, 0, ids, fingerprint=lm.fingerprint), tmp_path / "c.caps")
    C.restore(C.load(tmp_path / "c.caps"), kv, 1, fingerprint=lm.fingerprint)

    def decode(slot):
        toks, raws, logits = [], [], first
        for p in range(n, n + 5):
            t = int(logits[0].argmax())
            toks.append(t)
            logits = m.forward(np.array([t], np.int32), [Segment(slot, p, 1)], kv)
            raws.append(logits.tobytes())
        return toks, raws

    assert decode(0) == decode(1)
