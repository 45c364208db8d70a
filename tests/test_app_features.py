"""ChatApp against the scripted engine: conversations, settings, help, palette, themes, attachments."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from textual.widgets import DataTable, Input

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, make_app, settle  # noqa: E402
from fakes.media_files import png_bytes, wav_header  # noqa: E402

from aotx.app.bindings import ACTIONS  # noqa: E402
from aotx.app.screens.help import HelpScreen  # noqa: E402
from aotx.app.widgets.chips import AttachmentBar  # noqa: E402

PNG = png_bytes(4, 4)
WAV = wav_header(800) + b"\x80" * 800  # 0.1 s at 8 kHz


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


async def until(pilot, cond, tries: int = 50) -> None:
    for _ in range(tries):
        if cond():
            return
        await pilot.pause(0.02)
    raise AssertionError("condition not reached")


def engine_with_history() -> FakeEngine:
    e = FakeEngine()
    e.add_conversation("Rust lifetimes", [("user", "what is 'a?"), ("assistant", "A **lifetime** name.")])
    e.add_conversation("Pasta recipe", [("user", "carbonara?"), ("assistant", "Eggs, guanciale, pecorino.")])
    return e


async def test_history_comes_from_engine_and_last_conversation_is_remembered(home):
    engine = engine_with_history()
    app, _ = make_app(engine)
    async with app.run_test() as pilot:
        await settle(pilot)
        assert app.sidebar.visible() == ["Pasta recipe", "Rust lifetimes"]  # newest first
        assert app.conv_id == "c4"
        app.sidebar.query_one("ListView").index = 1
        app.sidebar.query_one("ListView").action_select_cursor()
        await settle(pilot)
        assert app.conv_id == "c1"
        assert [m.text for m in app.messages()] == ["what is 'a?", "A **lifetime** name."]
        assert all(m.position == "durable" for m in app.messages())
    assert json.loads((home / "app_state.json").read_text())["last_conversation"] == "c1"
    app2, _ = make_app(engine)
    async with app2.run_test() as pilot:
        await settle(pilot)
        assert app2.conv_id == "c1"


async def test_create_rename_search_delete():
    engine = engine_with_history()
    app, _ = make_app(engine)
    async with app.run_test() as pilot:
        await settle(pilot)
        await pilot.press("ctrl+n")
        await settle(pilot)
        assert len(engine.convs) == 3 and app.messages() == []
        assert "New conversation" in app.sidebar.visible()
        await pilot.press("f2")
        await pilot.pause()
        inp = app.screen.query_one("#prompt-input", Input)
        inp.value = "Trip plans"
        await pilot.press("enter")
        await settle(pilot)
        assert engine.convs[app.conv_id].title == "Trip plans"
        assert app.sidebar.visible()[0] == "Trip plans"
        await pilot.press("f3")
        await pilot.press(*"pAs")
        await pilot.pause()
        assert app.sidebar.visible() == ["Pasta recipe"]
        app.sidebar.query_one("#search", Input).value = ""
        await pilot.pause()
        deleted = app.conv_id
        await pilot.press("f8")
        await pilot.pause()
        await pilot.press("y")
        await settle(pilot)
        assert deleted not in engine.convs
        assert "Trip plans" not in app.sidebar.visible()
        assert app.conv_id in engine.convs


async def test_first_message_titles_a_new_conversation():
    app, engine = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        await pilot.press("ctrl+n")
        await settle(pilot)
        app.chat_input.insert("How do magnets work?")
        await pilot.press("enter")
        await settle(pilot)
        assert engine.convs[app.conv_id].title == "How do magnets work?"


async def test_settings_modal_updates_system_prompt_and_sampling():
    engine = engine_with_history()
    app, _ = make_app(engine)
    async with app.run_test() as pilot:
        await settle(pilot)
        await pilot.press("f4")
        await until(pilot, lambda: app.screen.query("#system-prompt"))
        screen = app.screen
        await pilot.pause()
        # nothing had the focus when the dialog opened: typed keys went nowhere
        assert app.focused is screen.query_one("#system-prompt")
        screen.query_one("#system-prompt").text = "Answer in French."
        screen.query_one("#f-temperature", Input).value = "oops"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert "temperature must be a number" in str(screen.query_one("#settings-error").render())
        screen.query_one("#f-temperature", Input).value = "0"
        screen.query_one("#f-seed", Input).value = "7"
        await pilot.press("ctrl+s")
        await settle(pilot)
        conv = engine.convs[app.conv_id]
        assert conv.system_prompt == "Answer in French."
        assert conv.sampling.temperature == 0.0 and conv.sampling.seed == 7


async def test_help_lists_every_binding():
    app, _ = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        await pilot.press("f1")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        table = app.screen.query_one(DataTable)
        keys = {str(table.get_row_at(i)[0]) for i in range(table.row_count)}
        assert {a.key for a in ACTIONS} <= keys
        assert {"enter", "ctrl+j"} <= keys
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_command_palette_has_every_action():
    app, _ = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        titles = {c.title for c in app.get_system_commands(app.screen)}
        assert {a.title for a in ACTIONS if a.action != "quit"} <= titles
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"Next theme")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await until(pilot, lambda: app.theme_name == "light")


async def test_theme_switch_at_run_time_is_remembered(home):
    app, _ = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        assert app.has_class("theme-dark") and app.theme == "aotx-dark"
        await pilot.press("f6")
        assert app.has_class("theme-light") and not app.has_class("theme-dark")
        assert app.theme == "aotx-light"
    assert json.loads((home / "app_state.json").read_text())["theme"] == "light"
    app2, _ = make_app()
    async with app2.run_test() as pilot:
        assert app2.theme_name == "light"
    app3, _ = make_app(theme="dark")
    async with app3.run_test() as pilot:
        assert app3.theme_name == "dark"


async def test_more_than_two_themes_from_textual_and_all_remembered(home):
    from aotx.app.theming import THEMES

    assert {"dark", "light", "nord", "gruvbox", "tokyo-night", "dracula"} <= set(THEMES)
    app, _ = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        seen = []
        for _ in range(3):
            await pilot.press("f6")
            seen.append((app.theme_name, app.theme))
        assert seen[0] == ("light", "aotx-light")
        assert seen[1][0] == seen[1][1] and seen[1][0] not in ("dark", "light")  # a Textual theme by its name
        app.theme = "nord"  # Textual's own "Change theme" command sets this
        await pilot.pause()
        assert app.theme_name == "nord" and app.has_class("theme-textual") and not app.has_class("theme-dark")
    assert json.loads((home / "app_state.json").read_text())["theme"] == "nord"
    app2, _ = make_app()
    async with app2.run_test() as pilot:
        await settle(pilot)
        assert app2.theme_name == "nord" and app2.theme == "nord"


async def test_the_palettes_theme_list_has_aotxs_own_themes(home):
    """Textual's "Change theme" command listed Textual's themes only: AOTX's dark and light
    were missing (they are CSS over a paired theme). They are registered as aotx-dark and
    aotx-light, and choosing one there is choosing AOTX's theme."""
    app, _ = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        assert {"aotx-dark", "aotx-light"} <= set(app.available_themes)
        app.theme = "aotx-light"     # what the palette's choice does
        await pilot.pause()
        assert app.theme_name == "light" and app.has_class("theme-light")
    assert json.loads((home / "app_state.json").read_text())["theme"] == "light"


async def test_pasted_paths_become_chips_even_without_input_focus(tmp_path):
    (tmp_path / "my cat.png").write_bytes(PNG)
    (tmp_path / "voice.wav").write_bytes(WAV)
    app, engine = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        app.sidebar.query_one("ListView").focus()
        paste = f"'{tmp_path}/my cat.png' file://{str(tmp_path).replace(' ', '%20')}/voice.wav\n"
        app.post_message(__import__("textual").events.Paste(paste))
        await settle(pilot)
        bar = app.query_one(AttachmentBar)
        assert [a.name for a in bar.attachments] == ["my cat.png", "voice.wav"]
        assert app.chat_input.text == ""
        # a missing file gets a visible notice and stays text, as pasted; text pastes stay text
        app.chat_input.focus()
        await app.chat_input._on_paste(__import__("textual").events.Paste(f"{tmp_path}/gone.png"))
        await settle(pilot)
        assert "no such file" in str(app.query_one("#input-notice").render())
        assert app.chat_input.text == f"{tmp_path}/gone.png"
        app.chat_input.clear()
        await app.chat_input._on_paste(__import__("textual").events.Paste("what is this?"))
        await pilot.pause()
        assert app.chat_input.text == "what is this?"
        await pilot.press("enter")
        await settle(pilot)
        # until media profiles exist the engine refuses, and the app shows it
        sent = engine.submitted[-1]
        assert [a.kind for a in sent[2]] == ["image", "audio"] and len(sent[2][0].sha256) == 64
        user = app.messages()[-1]
        assert user.position == "failed"
        # the reason once, above the input; the message says what kind of refusal it was
        assert user.notices() == ["Not sent: The engine refused the attachment. The reason is above the input."]
        assert "refused the attachment: " in str(app.query_one("#input-notice").render())
        assert bar.attachments == []


async def test_attach_command_and_file_picker(tmp_path):
    (tmp_path / "a b.png").write_bytes(PNG)
    app, _ = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        app.chat_input.insert(rf"/attach {tmp_path}/a\ b.png")
        await pilot.press("enter")
        await settle(pilot)
        assert [a.name for a in app.query_one(AttachmentBar).attachments] == ["a b.png"]
        app.chat_input.insert(f"/attach {tmp_path}/notes.txt")
        await pilot.press("enter")
        await settle(pilot)
        assert "not an image or audio file" in str(app.query_one("#input-notice").render())
        # the picker returns a path the same way
        await pilot.press("f5")
        await pilot.pause()
        app.screen.query_one("#picker-path", Input).value = str(tmp_path / "a b.png")
        app.screen.query_one("#picker-path", Input).focus()
        await pilot.press("enter")
        await settle(pilot)
        assert len(app.query_one(AttachmentBar).attachments) == 1  # same file, not twice
        chip = app.query_one(".chip")
        await pilot.click(chip)
        await pilot.pause()
        assert app.query_one(AttachmentBar).attachments == []


async def test_no_app_key_is_shadowed_by_the_input():
    """Regression: TextArea binds f6/f7 (select line/all), which hid the theme and details keys."""
    app, _ = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        assert app.chat_input.has_focus
        for a in ACTIONS:
            for node, bindings in app.screen._binding_chain:
                hits = bindings.key_to_bindings.get(a.key)
                if hits:
                    assert hits[0].action in (a.action, f"app.{a.action}"), (a.key, node, hits[0].action)
                    break


def test_cli_flags_pass_engine_args_through():
    from aotx.app.main import engine_args, parse_args

    ns = parse_args(["--model", "/m/x.gguf", "--device", "cpu", "--theme", "light", "--socket", "/tmp/s"])
    assert engine_args(ns) == ["--model", "/m/x.gguf", "--device", "cpu"]
    assert ns.theme == "light" and ns.socket == "/tmp/s"
    assert engine_args(parse_args([])) == []


async def test_fork_at_focused_message_opens_the_new_conversation():
    engine = FakeEngine()
    engine.add_conversation("Trip", [("user", "where to?"), ("assistant", "Lisbon."),
                                     ("user", "when?"), ("assistant", "In May.")])
    app, _ = make_app(engine)
    async with app.run_test() as pilot:
        await settle(pilot)
        parent = app.conv_id
        first_reply = app.messages()[1]
        first_reply.focus()
        await pilot.press("f")  # on a message: fork here
        await settle(pilot)
        assert engine.forked == [(parent, first_reply.msg_id)]
        assert app.conv_id != parent and engine.convs[app.conv_id].title == "Trip (fork 1)"
        assert [m.text for m in app.messages()] == ["where to?", "Lisbon."]
        assert "Trip (fork 1)" in app.sidebar.visible() and "Trip" in app.sidebar.visible()
        assert "Forked “Trip” after message 2 of 4 into “Trip (fork 1)”" in str(app.query_one("#input-notice").render())
        assert [m.text for m in engine.convs[parent].messages][-1] == "In May."  # the original is unchanged
        # the key binding (input focused) forks at the last message; the fork goes on by itself
        fork1 = app.conv_id
        assert app.chat_input.has_focus
        await pilot.press("ctrl+g")
        await settle(pilot)
        assert engine.forked[-1] == (fork1, engine.convs[fork1].messages[-1].msg_id)
        assert app.conv_id not in (parent, fork1) and len(app.messages()) == 2
        app.chat_input.insert("and after?")
        await pilot.press("enter")
        await settle(pilot)
        assert [m.role for m in engine.convs[app.conv_id].messages] == ["user", "assistant"] * 2
        assert len(engine.convs[fork1].messages) == 2


async def test_fork_is_in_palette_and_help_and_refuses_with_nothing_to_fork():
    app, engine = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        assert "Fork conversation" in {c.title for c in app.get_system_commands(app.screen)}
        await pilot.press("ctrl+g")
        await settle(pilot)
        assert engine.forked == [] and "Nothing to fork" in str(app.query_one("#input-notice").render())
        await pilot.press("f1")
        await pilot.pause()
        table = app.screen.query_one(DataTable)
        assert "ctrl+g" in {str(table.get_row_at(i)[0]) for i in range(table.row_count)}


async def test_settings_speculative_choice_is_stored_in_the_conversation_sampling():
    from textual.widgets import Select

    engine = engine_with_history()
    app, _ = make_app(engine)
    async with app.run_test() as pilot:
        await settle(pilot)
        await pilot.press("f4")
        await until(pilot, lambda: app.screen.query("#f-speculative"))
        select = app.screen.query_one("#f-speculative", Select)
        assert select.value == ""  # engine default
        select.value = "off"
        await pilot.press("ctrl+s")
        await settle(pilot)
        assert engine.convs[app.conv_id].sampling.speculative == "off"
        await pilot.press("f4")
        await until(pilot, lambda: app.screen.query("#f-speculative"))
        assert app.screen.query_one("#f-speculative", Select).value == "off"
        app.screen.query_one("#f-speculative", Select).value = "ngram"
        await pilot.press("ctrl+s")
        await settle(pilot)
        assert engine.convs[app.conv_id].sampling.speculative == "ngram"


def test_parse_sampling_speculative():
    from aotx.app.screens.settings import parse_sampling
    from aotx.engine import protocol as P

    base = P.SamplingParams(speculative="ngram")
    values = {"temperature": "0", "top_k": "40", "top_p": "1", "min_p": "0", "repeat_penalty": "1",
              "max_tokens": "64", "seed": ""}
    assert parse_sampling(values, base).speculative == "ngram"  # untouched without the field
    assert parse_sampling({**values, "speculative": ""}, base).speculative == ""
    with pytest.raises(ValueError, match="speculative"):
        parse_sampling({**values, "speculative": "medusa"}, base)
    assert parse_sampling({**values, "speculative": "draft"}, base).speculative == "draft"


async def test_capsule_notice_speaks_plainly_and_only_when_it_helps():
    """Regression: "Context restored from a capsule: restored 29 tokens
    of context from a parked capsule (host memory) (no re-prefill)" on a brand-new chat.
    A new conversation has nothing to pick up: no notice; a continued one says so plainly."""
    from aotx.engine import protocol as P

    notices = [P.Notice(id=0, kind="capsule", resource="capsule", asked=29,
                        message="restored 29 tokens of context from a parked capsule (host memory)")]
    engine = FakeEngine(notices=notices)
    app, _ = make_app(engine)
    async with app.run_test() as pilot:
        await settle(pilot)
        app.chat_input.insert("hi")
        await pilot.press("enter")
        await settle(pilot)
        assert app.messages()[1].notices() == []
        app.chat_input.insert("and then?")
        await pilot.press("enter")
        await settle(pilot)
        notices = app.messages()[3].notices()
        assert notices == ["Picked up where this conversation left off."]
        assert not any(w in notices[0] for w in ("capsule", "prefill", "host memory"))


def test_notice_and_refusal_words_follow_codes():
    from aotx.engine.present.format import error_text, notice_text, refusal_text
    from aotx.engine import protocol as P

    n = P.Notice(id=0, kind="capsule", resource="capsule",
                 message="the capsule on disk belongs to model abc, not def: re-prefilling from the journal's tokens")
    assert notice_text(n) == "Read the earlier messages again: the saved state was made by another model."
    assert notice_text(n, had_history=False) == ""
    # by code, not wording: a media refusal whose text never says "media" is still about the attachment
    assert "refused the attachment" in error_text(P.Error(id=1, code="unsupported_media", message="no images"))
    assert "refused this message (too_long)" not in error_text(P.Error(id=1, code="bad_request", message="media x"))
    # busy is not only a conversation generating: a model that does not fit the memory budget
    # is refused with it too, after a refused notice naming the resource
    assert refusal_text("busy", "conversation c1 is generating") == \
        "The engine is busy: conversation c1 is generating"
    memory = P.Notice(id=1, kind="refused", resource="memory", message="model q does not fit")
    said = error_text(P.Error(id=1, code="busy", message="model q does not fit"), memory)
    assert said == "Not enough memory: model q does not fit" and "reply" not in said
    # protocol codes are not words for people
    assert not any(f"({c})" in refusal_text(c, "x") for c in ("too_long", "busy", "unsupported_media", "internal"))


async def test_engine_error_codes_drive_the_app():
    """A conversation deleted by another client: the app says so (code not_found) and refreshes the list."""
    engine = engine_with_history()
    app, _ = make_app(engine)
    async with app.run_test() as pilot:
        await settle(pilot)
        gone = app.conv_id
        del engine.convs[gone]
        await pilot.press("f2")
        await pilot.pause()
        app.screen.query_one("#prompt-input", Input).value = "New name"
        await pilot.press("enter")
        await settle(pilot)
        notice = str(app.query_one("#input-notice").render())
        assert notice.startswith("Not found on the engine")
        assert app.sidebar.visible() == ["Rust lifetimes"]


def test_a_model_notice_reads_as_its_sentence():
    """Regression: the TUI showed "Model: model. loading model
    qwen2.5-coder-0.5b-instruct-q4_k_m (468.6 MiB, qwen2 Q4_K_M)"."""
    from aotx.engine.present.format import notice_text
    from aotx.engine import protocol as P

    n = P.Notice(id=1, kind="model", resource="model", message="loading model qwen2.5-coder (468.6 MiB, qwen2 Q4_K_M)")
    assert notice_text(n) == "Loading model qwen2.5-coder (468.6 MiB, qwen2 Q4_K_M)."
    q = P.Notice(id=1, kind="queued", resource="slots", position=2, asked=1, free=0, message="")
    assert notice_text(q).startswith("Queued: slots")

