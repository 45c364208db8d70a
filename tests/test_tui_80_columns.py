"""aotx-chat at 80 columns: what the status line and the model picker (Ctrl+O) keep when
the terminal is narrow, and that at 120 columns nothing is left out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, make_app, settle  # noqa: E402

from aotx.app.widgets.status_bar import StatusBar  # noqa: E402

LONG = "qwen2.5-coder-0.5b-instruct-q4_k_m"


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    return tmp_path


def status_text(app) -> str:
    return str(app.query_one("#engine-status").render())


@pytest.mark.parametrize("model", ["SmolLM2-135M-Instruct Q4_1", LONG])
async def test_status_line_at_80x24_drops_the_model_name_last(model):
    """The bug: at 80x24 the status line dropped the model's name first and kept the
    device and the budget; the name now stays and the least useful items go."""
    app, _ = make_app(FakeEngine(model=model, n_ctx=8192))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        line = status_text(app)
        assert line.startswith(model + " · "), line
        assert "ready" in line and "budget" not in line and "cpu" not in line
        assert len(line) <= 80


def test_status_line_drop_order_least_useful_first():
    bar = StatusBar()
    bar.model, bar.device, bar.state, bar.n_ctx = LONG, "cuda:0", "ready", 4096
    bar.used, bar.budget = 216 << 20, 1 << 30
    full = bar.line()
    assert full == f"{LONG} · cuda:0 · ready · replies run to the context (4096 tokens) · budget 216.0 MiB used / 808.0 MiB free"
    widths = range(len(full), 0, -1)
    lines = [bar.line(w) for w in widths]
    assert all(len(ln) <= w for ln, w in zip(lines, widths))
    # what goes, in order: the budget's words, the budget, the device, the speed hint; then the name is cut
    steps = list(dict.fromkeys(lines))
    assert steps[:5] == [full,
                         f"{LONG} · cuda:0 · ready · replies run to the context (4096 tokens) · 808.0 MiB free",
                         f"{LONG} · cuda:0 · ready · replies run to the context (4096 tokens)",
                         f"{LONG} · ready · replies run to the context (4096 tokens)",
                         f"{LONG} · ready"]
    assert bar.line(30) == "qwen2.5-coder-0.5b-in… · ready"
    assert bar.line(10) == "qwen2.5-c…"  # too narrow for both: the name's start, still
    # a state's detail goes before the name is cut
    bar.state, bar.detail = "loading", "weights 3/30"
    assert bar.line(len(LONG) + 10) == f"{LONG} · loading"
