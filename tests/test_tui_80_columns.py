"""aotx-chat at 80 columns: what the status line and the model picker (Ctrl+O) keep when
the terminal is narrow (at 120 columns the picker leaves nothing out), the help's rows,
and the 80x24 layout (a narrower sidebar, the F4 dialog's buttons on screen)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, make_app, settle, until  # noqa: E402

from textual.widgets import Button, DataTable  # noqa: E402

from aotx.app.screens.model_picker import COLUMNS, ModelPicker, fit_columns, model_row  # noqa: E402
from aotx.app.widgets.status_bar import StatusBar  # noqa: E402
from aotx.engine import protocol as P  # noqa: E402

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


# ---- the model picker (Ctrl+O) --------------------------------------------------

QWEN = P.ModelInfo(name=LONG, size_bytes=491_400_064, arch="qwen2", quant="Q4_K_M", n_ctx_train=32768,
                   needs_bytes=900 << 20)
REMOTE = P.ModelInfo(name="cluster", kind="remote", url="http://gpu:8000/v1", arch="remote")


@pytest.mark.parametrize("width", [80, 120])
async def test_model_picker_columns_are_not_cut_at_80_columns(width):
    """The bug: at 80 columns (and at 120) the picker's rows ran past the dialog, the
    right-hand columns (what a model needs, whether it is loaded) cut off. Now every row
    fits the table: at 80 the architecture and quantization go and long names end in an
    ellipsis; at 120 every column and whole names show."""
    engine = FakeEngine()
    engine.extra_models = [QWEN, REMOTE]
    app, _ = make_app(engine)
    async with app.run_test(size=(width, 24)) as pilot:
        await settle(pilot)
        await pilot.press("ctrl+o")
        await pilot.pause(0.3)
        assert isinstance(app.screen, ModelPicker)
        table = app.screen.query_one(DataTable)
        assert table.virtual_size.width <= table.scrollable_content_region.width
        # the note under the table shows whole (it was cut at 80 columns: its last line hidden)
        note = app.screen.query_one(".dialog-note")
        cr = note.content_region
        assert note.get_content_height(cr.size, app.size, cr.width) <= cr.height, cr
        box = app.screen.query_one("#model-box").region
        assert box.right <= width and box.bottom <= 24
        labels = [c.label.plain for c in table.ordered_columns]
        names = [str(table.get_row_at(i)[0]) for i in range(table.row_count)]
        if width == 80:
            assert labels == ["model", "size", "context", "needs", ""]
            assert names[1].endswith("…") and LONG.startswith(names[1].strip()[:-1])
        else:
            assert labels == list(COLUMNS)
            assert names[1].strip() == LONG
        # the loaded mark stays, and the cursor on the current model; Enter still picks by name
        assert table.get_row_at(0)[-1] == "loaded" and table.cursor_row == 0
        await pilot.press("down", "enter")
        await pilot.pause(0.3)
        await settle(pilot)
        assert app.conv_id is None and app.next_model == LONG  # (no conversation yet: the next new one's)
        assert status_text(app).startswith(LONG)


def test_model_picker_fit_columns_drops_the_least_useful_first():
    rows = [model_row(m, current="") for m in (QWEN, REMOTE)]
    full = sum(max(len(COLUMNS[i]), *(len(r[i]) for r in rows)) + 2 for i in range(len(COLUMNS)))
    assert fit_columns(rows, full) == (list(range(len(COLUMNS))), len(rows[0][0]))
    assert fit_columns(rows, full - 1)[1] == len(rows[0][0]) - 1  # first the name column shrinks
    dropped = []
    for width in range(full, 20, -1):
        keep, name_width = fit_columns(rows, width)
        assert name_width + 2 + sum(max(len(COLUMNS[i]), *(len(r[i]) for r in rows)) + 2 for i in keep if i) <= width
        dropped += [COLUMNS[i] for i in range(len(COLUMNS)) if i not in keep and COLUMNS[i] not in dropped]
    assert dropped == ["arch", "quant", "needs", "context", "size"]
    assert fit_columns(rows, 21)[0] == [0, 6]  # the name and the loaded mark stay


async def test_help_rows_fit_80_columns():
    app, _ = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.press("f1")
        await pilot.pause()
        table = app.screen.query_one(DataTable)
        assert table.virtual_size.width <= table.scrollable_content_region.width, (
            table.virtual_size, table.scrollable_content_region)
        assert table.row_count >= 25
        box = app.screen.query_one("#help-box")
        assert box.region.right <= 80 and box.region.bottom <= 24


def _history() -> FakeEngine:
    e = FakeEngine()
    e.add_conversation("Rust lifetimes", [("user", "what is 'a?"), ("assistant", "A **lifetime** names a borrow.")])
    e.add_conversation("Pasta recipe", [("user", "carbonara?"), ("assistant", "Eggs, guanciale, pecorino. No cream.")])
    e.add_conversation("Trip", [("user", "where to in May?"), ("assistant", "Lisbon: warm, and the jacaranda bloom.")])
    return e


async def test_80x24_layout_sidebar_narrows_and_f4_buttons_are_on_screen():
    app, _ = make_app(_history())
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert app.screen.has_class("-narrow") and app.screen.has_class("-short")
        assert app.sidebar.region.width <= 24
        assert not app.sidebar.query_one("#legend").display
        assert app.chat_input.region.bottom <= 23 and app.chat_input.region.height >= 3
        await pilot.press("f4")
        await until(pilot, lambda: app.screen.query("#save"))
        await pilot.pause()
        for bid in ("save", "cancel"):
            b = app.screen.query_one(f"#{bid}", Button)
            assert 0 <= b.region.y and b.region.bottom <= 24 and b.region.right <= 80, (bid, b.region)
    app, _ = make_app(_history())
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        assert app.screen.has_class("-wide") and app.sidebar.region.width == 30
        assert app.sidebar.query_one("#legend").display
