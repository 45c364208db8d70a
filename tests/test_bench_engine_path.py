"""``aotx bench --engine-path`` (engine/cli/bench_path.py): the harness the lead measures with runs
end to end on the default model, small, and reports what it says it reports."""

from __future__ import annotations

import argparse

import pytest

from aotx.engine.cli import bench_path as bench
from aotx.engine.errors import UsageError


def test_engine_path_small_run_reports_each_measure(default_model_path):
    r = bench.bench_engine_path(str(default_model_path), "cpu", sizes=(24,), decode_tokens=4, repeats=1)
    assert r["config"]["numerics"] == "cpu-int8"          # the engine's executor, as aotx run --json says
    p = r["prefill"][24]
    assert p["prompt_tokens_reused"] == 0                  # each prompt distinct: nothing reused
    assert 20 <= p["prompt_tokens"] <= 32, p
    assert p["prompt_tokens_per_s"] > 0 and p["cpu_ms_per_token"] > 0
    assert set(r["decode"]) == {"off", "auto"}
    for d in r["decode"].values():
        assert 1 <= d["completion_tokens"] <= 4 and d["decode_tokens_per_s"] > 0
    assert r["model_alone"]["prefill_tok_s"][24] > 0 and r["model_alone"]["decode_tok_s"] > 0


def test_a_missing_peer_python_is_a_usage_error(default_model_path, tmp_path):
    args = argparse.Namespace(model=str(default_model_path), quick=True, peer=str(tmp_path / "no-python"),
                              json=True)
    with pytest.raises(UsageError, match="no such Python"):
        bench.run_engine_path(args, "cpu")
