"""What a starting engine shows: a first start is not a silent minute.

A first run sat on ``writing · context 37/4096`` (aotx-chat) or on nothing (``aotx run``)
while the engine compiled its kernels. The engine now writes its stage beside its socket
while it loads (``cli/startup.py``), a child compiling kernels ahead writes its count, and
clients show them: "compiling kernels (first start only) ▕████░░░░░░░░▏ 1 of 3: matmul Q4_1".
The files go once the engine is loaded."""

from __future__ import annotations

import json
from pathlib import Path

from aotx.engine.cli.startup import StartupProgress
from aotx.engine.ipc.client import read_progress
from aotx.engine.present.format import progress_bar, startup_text


def test_the_engine_writes_its_stage_and_the_client_reads_it(tmp_path):
    import subprocess
    import sys

    sock = tmp_path / "engine.sock"
    # a child "compiling ahead" that takes a moment: the stage before the warm-up waits for it
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    p = StartupProgress(sock, child)
    assert read_progress(sock) == {"stage": "opening the model file", "since": 0.0}
    p("open", 0.3)
    assert read_progress(sock)["stage"] == "reading the weights"
    # the child compiling ahead writes its count; shown while the stage is compiling
    Path(str(sock) + ".kernels").write_text(json.dumps({"stage": "compiling kernels", "done": 1, "total": 3,
                                                        "detail": "matmul Q4_1"}))
    assert "done" not in read_progress(sock)          # not while the weights are read
    p("weights", 4.0)
    assert read_progress(sock)["stage"] == "reading the tokenizer"
    p.main.write_text(json.dumps({"stage": "compiling kernels"}))   # what p("tokenizer") says as it waits
    got = read_progress(sock)
    assert got["stage"] == "compiling kernels" and (got["done"], got["total"]) == (1, 3), got
    assert startup_text(got) == "compiling kernels (first start only) ▕████░░░░░░░░▏ 1 of 3: matmul Q4_1"
    p("tokenizer", 1.0)             # waits for the child, then the warm-up runs
    assert child.poll() == 0 and read_progress(sock)["stage"] == "warming up"
    p.close()
    assert read_progress(sock) == {} and not list(tmp_path.iterdir())


def test_the_progress_bar():
    assert progress_bar(0, 4, 4) == "▕░░░░▏" and progress_bar(4, 4, 4) == "▕████▏"
    assert progress_bar(1, 3, 12) == "▕████░░░░░░░░▏" and progress_bar(1, 16, 4) == "▕▎░░░▏"
    assert progress_bar(1, 0) == ""
    assert startup_text({"stage": "reading the weights"}) == "reading the weights"


async def test_aotx_chat_shows_a_starting_engines_progress_above_the_input(tmp_path, monkeypatch):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from app_fake_engine import make_app, settle

    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    app, _ = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        app._on_spawn(startup_text({"stage": "compiling kernels", "done": 1, "total": 3, "detail": "matmul Q4_1"}))
        await pilot.pause()
        said = str(app.query_one("#input-notice").render())
        assert said.startswith("Starting the engine: compiling kernels (first start only) ▕") and "1 of 3" in said
        await settle(pilot)
        app.ready = False
        await app._connect()     # the engine answers: the progress goes
        assert str(app.query_one("#input-notice").render()) == ""


def test_a_start_with_the_kernels_cached_says_warming_up_not_compiling(tmp_path):
    sock = tmp_path / "engine.sock"
    p = StartupProgress(sock, None)
    p("tokenizer", 1.0)
    assert read_progress(sock)["stage"] == "warming up"
    p.close()
