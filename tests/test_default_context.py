"""The context a slot serves (runtime/admission.choose_context): the model's trained context
where slots x context x KV bytes fit the budget, else the largest that fits, said out loud
below 4,096; ``--context`` past the model's is clamped with a notice. And on a real engine:
the start names the numbers and a clamp reaches the user, not only the log."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aotx.engine.runtime.admission import CONTEXT_FLOOR, choose_context
from tests import cli_support
from tests.gateway_support import start_engine, stop_engine

PER_TOKEN = 1000          # bytes of KV a token in these cases


def kv(slots: int, n: int) -> int:
    return slots * n * PER_TOKEN


def budget(room_tokens: int):
    """fits(n): 8 slots of n tokens fit when 8 n <= room_tokens."""
    return lambda n: 8 * n <= room_tokens


def test_the_trained_context_when_it_fits():
    c = choose_context(None, 8192, budget(8 * 8192), kv, 8, 12 << 30, "f16")
    assert c.n_ctx == 8192 and not c.notice
    assert c.line.startswith("context 8,192 tokens per slot, the model's trained context: 8 slots x 8,192 tokens x")
    assert "of f16 KV a token" in c.line and "of the 12.0 GiB budget" in c.line


def test_else_the_largest_that_fits_in_steps_of_256():
    c = choose_context(None, 131072, budget(8 * 20000), kv, 8, 1 << 30, "q8_0")
    assert c.n_ctx == 19968 and not c.notice           # 78 x 256: 20,000 does not divide
    assert "the most the budget holds" in c.line and "trained 131,072" in c.line


def test_below_4096_it_says_so_with_the_way_out():
    c = choose_context(None, 32768, budget(8 * 3000), kv, 8, 1 << 30, "f16")
    assert c.n_ctx == 2816 < CONTEXT_FLOOR
    assert "room for 2,816 tokens of context per slot, below 4,096" in c.notice
    assert "--memory-budget" in c.notice and "--kv-type q8_0" in c.notice


def test_a_model_trained_for_less_than_4096_is_not_a_notice():
    c = choose_context(None, 2048, budget(8 * 2048), kv, 8, 1 << 30, "f16")
    assert c.n_ctx == 2048 and not c.notice


def test_context_past_the_models_is_clamped_with_a_notice():
    c = choose_context(100000, 8192, budget(1 << 40), kv, 8, 1 << 30, "f16", model="SmolLM2")
    assert c.n_ctx == 8192
    assert c.notice == ("--context 100,000 is more than the 8,192 tokens SmolLM2 was trained for: each slot holds "
                        "8,192 (past it the model's positions mean nothing)")
    c = choose_context(1024, 8192, budget(1 << 40), kv, 8, 1 << 30, "f16")
    assert c.n_ctx == 1024 and not c.notice


@pytest.mark.realmodel
def test_an_engine_clamps_context_where_users_see_it(tmp_path, default_model_path):
    proc, sock = start_engine(tmp_path, None, slots=1, context=99999, timeout=180,
                              sock=Path(f"/tmp/aotx-dc-{os.getpid()}.sock"))
    try:
        st = cli_support.aotx(tmp_path, "status", "--socket", str(sock))
        assert st.returncode == 0, st.stderr
        assert "context 8192 tokens per slot" in st.stdout
        assert "notice  --context 99,999 is more than the 8,192 tokens" in st.stdout, st.stdout
        log = (tmp_path / "engine.log").read_text()
        assert "context 8,192 tokens per slot" in log
    finally:
        stop_engine(proc)
        sock.unlink(missing_ok=True)
