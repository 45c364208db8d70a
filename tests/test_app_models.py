"""aotx-chat and several models: the model picker (Ctrl+O), the model
of each conversation in the status line and the sidebar, switching mid-conversation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, make_app, settle  # noqa: E402

from aotx.app.screens.model_picker import ModelPicker, model_row  # noqa: E402
from aotx.app.widgets.sidebar import ConversationItem  # noqa: E402
from aotx.engine import protocol as P  # noqa: E402

QWEN = P.ModelInfo(name="qwen2.5-0.5b-instruct-q4_k_m", size_bytes=491_400_064, arch="qwen2", quant="Q4_K_M",
                   n_ctx_train=32768, needs_bytes=900 << 20)
REMOTE = P.ModelInfo(name="cluster", kind="remote", url="http://gpu:8000/v1", arch="remote")


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    return tmp_path


def test_model_rows_show_size_arch_quant_context_and_state():
    assert model_row(QWEN, current="") == ("  qwen2.5-0.5b-instruct-q4_k_m", "468.6 MiB", "qwen2", "Q4_K_M", "32768",
                                            "900.0 MiB", "")
    loaded = P.ModelInfo(name="a", loaded=True, size_bytes=1 << 20)
    assert model_row(loaded, current="a")[0] == "▸ a" and model_row(loaded, current="a")[-1] == "loaded"
    # a loaded model shows the context it serves, not its file's
    served = P.ModelInfo(name="q", loaded=True, n_ctx_train=32768, n_ctx=4096)
    assert model_row(served, current="")[4] == "4096"
    assert model_row(REMOTE, current="")[1] == "remote"


async def test_ctrl_o_switches_the_open_conversation_and_keeps_its_history():
    engine = FakeEngine()
    engine.extra_models = [QWEN, REMOTE]
    app, _ = make_app(engine)
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        app.chat_input.insert("hello")
        await pilot.press("enter")
        await settle(pilot)
        conv_id = app.conv_id
        assert engine.model in app.status_bar.line()
        # a conversation on the default model: no model line under its title
        assert not [w for i in app.query(ConversationItem) if i.conv_id == conv_id for w in i.query(".conv-model")]
        await pilot.press("ctrl+o")
        await pilot.pause(0.3)
        assert isinstance(app.screen, ModelPicker)
        await pilot.press("down", "enter")  # the second row: qwen
        await pilot.pause(0.3)
        await settle(pilot)
        assert engine.convs[conv_id].model == QWEN.name
        assert app.status_bar.line().startswith(QWEN.name)
        assert "reads its history again" in str(app.query_one("#input-notice").render())
        assert [m.role for m in app.messages()] == ["user", "assistant"]  # the history is still there
        labels = [i for i in app.query(ConversationItem) if i.conv_id == conv_id]
        assert labels and labels[0].model == QWEN.name
        assert [str(w.render()).strip() for w in labels[0].query(".conv-model")] == [QWEN.name]


async def test_picked_model_is_used_for_the_next_new_conversation():
    engine = FakeEngine()
    engine.extra_models = [QWEN]
    app, _ = make_app(engine)
    async with app.run_test() as pilot:
        await settle(pilot)
        await pilot.press("ctrl+o")
        await pilot.pause(0.3)
        await pilot.press("down", "enter")
        await pilot.pause(0.3)
        assert app.next_model == QWEN.name
        app.chat_input.insert("hi")
        await pilot.press("enter")
        await settle(pilot)
        assert engine.convs[app.conv_id].model == QWEN.name


async def test_f4_settings_opens_the_model_picker():
    engine = FakeEngine()
    engine.extra_models = [QWEN]
    app, _ = make_app(engine)
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        app.chat_input.insert("hello")
        await pilot.press("enter")
        await settle(pilot)
        await pilot.press("f4")
        await pilot.pause(0.3)
        await pilot.click("#pick-model")
        await pilot.pause(0.3)
        assert isinstance(app.screen, ModelPicker)
        await pilot.press("down", "enter")
        await pilot.pause(0.5)
        from aotx.app.screens.settings import SettingsScreen

        assert isinstance(app.screen, SettingsScreen)  # the picker closes back onto the dialog
        assert engine.convs[app.conv_id].model == QWEN.name
        await pilot.press("escape")
        await settle(pilot)  # (settle waits for every worker: the dialog's too)
        assert app.status_bar.line().startswith(QWEN.name)


async def test_aotx_chat_model_flag_opens_a_new_conversation_on_that_model():
    """Regression: `aotx-chat --model qwen.gguf` with an engine
    running opened the last conversation and answered on the default model, saying
    nothing; Ctrl+N's new conversations ignored the chosen model too."""
    engine = FakeEngine()
    old = engine.add_conversation("Say hello 1", [("user", "hi"), ("assistant", "hello")])
    path = "/models/qwen2.5-0.5b-instruct-q4_k_m.gguf"
    app, _ = make_app(engine, model=path)
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        assert app.conv_id is None and not app.messages()          # not the last conversation
        notice = str(app.query_one("#input-notice").render())
        assert "New conversation on qwen2.5-0.5b-instruct-q4_k_m" in notice
        assert app.status_bar.line().startswith("qwen2.5-0.5b-instruct-q4_k_m")   # the status line names it
        app.chat_input.insert("hello")
        await pilot.press("enter")
        await settle(pilot)
        assert app.conv_id != old.conv_id and engine.convs[app.conv_id].model == path
        await pilot.press("ctrl+n")
        await settle(pilot)
        assert app.conv_id not in (None, old.conv_id) and engine.convs[app.conv_id].model == path


def _engine_exiting(code: int, message: str, calls: list):
    """A client factory whose spawned engine always exits ``code`` before answering."""
    from aotx.engine.errors import EngineError

    async def factory(on_spawn):
        calls.append(1)
        raise EngineError(f"the engine exited with code {code} before answering: {message} (details in x)",
                          engine_exit=code, engine_message=message)

    return factory


async def test_aotx_chat_exits_when_the_engine_it_started_refuses_its_arguments():
    """Regression: `aotx-chat --model qwen-coder` (a name naming
    nothing) or a GGUF of an architecture AOTX lacks opened the TUI and restarted the
    engine every 5 s for ever ("Cannot reach the engine ... Retrying in 5 s"). An engine
    that exits 2 before answering refused its arguments: the app ends, exit code 2."""
    from aotx.app.app import ChatApp

    calls: list = []
    app = ChatApp(_engine_exiting(2, "qwen-coder: no such model", calls), status_poll_s=0)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause(0.5)
    assert app.return_code == 2 and calls == [1]


async def test_aotx_chat_keeps_retrying_an_engine_that_crashed_at_start():
    """An engine that crashed (exit 1, say out of memory) may start next time: retry, as before."""
    from aotx.app.app import ChatApp

    calls: list = []
    app = ChatApp(_engine_exiting(1, "killed", calls), status_poll_s=0)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause(1.5)
        assert app.return_code is None and len(calls) >= 2
        assert "Retrying" in str(app.query_one("#input-notice").render())


def test_aotx_chat_with_a_file_as_its_home_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """Regression: `AOTX_HOME=afile aotx-chat` printed a
    traceback ending in StorageError ("a file stands where a directory should be"), exit 1."""
    from aotx.app.main import main

    f = tmp_path / "afile"
    f.write_text("not a directory")
    monkeypatch.setenv("AOTX_HOME", str(f))
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aotx-chat: ") and "Traceback" not in err and len(err.strip().splitlines()) == 1
