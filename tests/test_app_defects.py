"""Regression tests for the defects a new user met in aotx-chat's first hour (issue 17).

Each test names its defect and fails on the tree before the fix. Pastes go through
Textual's terminal parser as a bracketed paste (``fakes.terminal.bracketed_paste``),
the way a terminal delivers them; media files are real (``fakes.media_files``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from textual.widgets import TextArea

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, make_app, settle  # noqa: E402
from fakes.media_files import write_png, write_wav  # noqa: E402
from fakes.terminal import bracketed_paste  # noqa: E402

from aotx.app.widgets.chips import AttachmentBar, Chip  # noqa: E402


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


async def until(pilot, cond, tries: int = 100) -> None:
    for _ in range(tries):
        if cond():
            return
        await pilot.pause(0.02)
    raise AssertionError("condition not reached")


def notice(app) -> str:
    return str(app.query_one("#input-notice").render())


def chips(app) -> list[str]:
    return [a.name for a in app.query_one(AttachmentBar).attachments]


# ---- defect 1: a bracketed paste was inserted twice --------------------------------

async def test_defect1_bracketed_paste_is_inserted_once():
    app, engine = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        assert app.chat_input.has_focus
        events = bracketed_paste(app, "hello there")
        assert [type(e).__name__ for e in events] == ["Paste"]
        await pilot.pause()
        assert app.chat_input.text == "hello there"  # was "hello therehello there"
        bracketed_paste(app, ", first line\nsecond line\n")
        await pilot.pause()
        assert app.chat_input.text == "hello there, first line\nsecond line\n"
        await pilot.press("enter")
        await settle(pilot)
        assert engine.submitted[-1][1] == "hello there, first line\nsecond line"  # sent stripped


async def test_defect1_a_large_paste_is_not_doubled():
    """The report: a 67 KB paste became a 30,030-token prompt, twice the paste."""
    big = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(1300))
    assert len(big) > 66_000
    app, _ = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        bracketed_paste(app, big)
        await pilot.pause()
        assert app.chat_input.text == big


async def test_defect1_paste_of_a_dropped_path_with_a_question(tmp_path):
    """A dropped file followed by typed words: the file becomes a chip, the words text."""
    app, _ = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        shot = write_png(tmp_path / "my shot.png")
        bracketed_paste(app, f"'{shot}' what does it say?")
        await settle(pilot)
        assert chips(app) == ["my shot.png"]
        assert app.chat_input.text == "what does it say?"


async def test_defect1_other_text_boxes_take_a_paste_once():
    app, _ = make_app(FakeEngine())
    async with app.run_test() as pilot:
        await settle(pilot)
        app.chat_input.insert("x")
        await pilot.press("enter")
        await settle(pilot)
        await pilot.press("f4")
        await until(pilot, lambda: app.screen.query("#system-prompt"))
        box = app.screen.query_one("#system-prompt", TextArea)
        box.focus()
        await pilot.pause()
        bracketed_paste(app, "Be brief.")
        await pilot.pause()
        assert box.text == "Be brief."
        assert app.chat_input.text == ""  # the paste did not also land in the input behind the dialog


# ---- defect 3: chips survived Ctrl+N and could not be removed from the keyboard ----

async def test_defect3_new_conversation_drops_the_chips_and_their_notice(tmp_path):
    app, engine = make_app(FakeEngine(media_text=lambda a: "OCR TEXT OF THE OLD PICTURE"))
    async with app.run_test() as pilot:
        await settle(pilot)
        bracketed_paste(app, str(write_png(tmp_path / "old.png")))
        await settle(pilot)
        assert chips(app) == ["old.png"] and notice(app)  # "Attached ..."
        await pilot.press("ctrl+n")
        await settle(pilot)
        assert chips(app) == []
        assert notice(app) == ""  # "Attached 1 file(s) to the next message." stayed
        app.chat_input.insert("a new topic")
        await pilot.press("enter")
        await settle(pilot)
        conv, text, atts = engine.submitted[-1]
        assert atts == [] and "OLD PICTURE" not in engine.convs[conv].messages[0].text


async def test_defect3_a_chip_is_removed_from_the_keyboard(tmp_path):
    app, engine = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        bracketed_paste(app, f"{write_png(tmp_path / 'a.png')} {write_wav(tmp_path / 'b.wav', 0.2)}")
        await settle(pilot)
        assert chips(app) == ["a.png", "b.wav"]
        await pilot.press("shift+tab")  # from the input back to the chips
        assert isinstance(app.focused, Chip) and app.focused.attachment.name == "b.wav"
        await pilot.press("delete")
        await settle(pilot)
        assert chips(app) == ["a.png"]
        assert "a.png" in notice(app) and "b.wav" not in notice(app)
        assert isinstance(app.focused, Chip)
        await pilot.press("backspace")
        await settle(pilot)
        assert chips(app) == [] and notice(app) == ""
        assert app.chat_input.has_focus


async def test_defect3_remove_attachments_is_in_the_palette(tmp_path):
    app, _ = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        titles = {c.title for c in app.get_system_commands(app.screen)}
        assert "Remove attachments" in titles
        bracketed_paste(app, str(write_png(tmp_path / "a.png")))
        await settle(pilot)
        assert chips(app) == ["a.png"]
        await pilot.press("shift+delete")
        await settle(pilot)
        assert chips(app) == [] and notice(app) == ""


# ---- defect 4: attachments the engine refuses were accepted as chips ----------------

async def test_defect4_refused_at_attach_time_with_the_one_limit_that_applies(tmp_path):
    big = write_png(tmp_path / "huge.png", 12000, 12000)
    long = write_wav(tmp_path / "hour.wav", 3600.0)
    assert big.stat().st_size < 1000 and long.stat().st_blocks * 512 < 1 << 20  # header-real, sparse
    app, engine = make_app(FakeEngine(media_text=lambda a: "text"))
    async with app.run_test() as pilot:
        await settle(pilot)
        bracketed_paste(app, str(big))
        await settle(pilot)
        assert chips(app) == []
        said = notice(app)
        assert "144,000,000 pixels" in said and "64,000,000" in said
        assert "89,478,485" not in said and "decompression bomb" not in said.lower()
        bracketed_paste(app, str(long))
        await settle(pilot)
        assert chips(app) == []
        assert "3,600 s of audio, longer than the 600 s" in notice(app)
        app.chat_input.insert("describe it")
        await pilot.press("enter")
        await settle(pilot)
        conv, text, atts = engine.submitted[-1]
        assert atts == [] and engine.convs[conv].messages[0].text == "describe it"


# ---- defect 5: a too-long prompt's refusal was shown out of view -------------------

async def test_defect5_refusal_of_a_long_prompt_is_where_the_user_looks():
    big = "".join(f"paragraph {i}: some pasted log output that goes on and on\n" for i in range(1200))
    app, engine = make_app(FakeEngine(max_prompt_chars=4000))
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        bracketed_paste(app, big)
        await pilot.pause()
        await pilot.press("enter")
        await settle(pilot)
        user = app.messages()[-1]
        assert user.position == "failed"
        # the refusal is above the input (always on screen), and the message's own notice
        # is at its end, inside the visible part of the chat
        assert notice(app).startswith("Too long for the context (too_long)")
        assert "back in the input" in notice(app)
        end = user.query(".msg-end-notices .msg-notice")
        assert end and any("Too long for the context" in str(n.render()) for n in end)
        await pilot.pause()
        chat = app.chat.region
        last = end.last().region
        assert chat.y <= last.y and last.bottom <= chat.bottom, (chat, last)
        # nothing reached the journal, and the words are back to shorten
        assert all(not c.messages for c in engine.convs.values())
        assert app.chat_input.text == big.strip()
