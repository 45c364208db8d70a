"""Attachments in aotx-chat: chips that go with the next message (dropped by a new
conversation, removed from the keyboard or the palette), files the engine would refuse
refused when attached with the one limit that applies, and a reopened conversation that
shows its attachments as it did live.

Files go in as a terminal delivers them, a bracketed paste through Textual's parser
(``fakes.terminal.bracketed_paste``); media files are real (``fakes.media_files``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, chips, make_app, notice, settle  # noqa: E402
from fakes.media_files import write_png, write_wav  # noqa: E402
from fakes.terminal import bracketed_paste  # noqa: E402

from aotx.app.widgets.chips import Chip  # noqa: E402


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


async def test_new_conversation_drops_the_chips_and_their_notice(tmp_path):
    """Regression: chips (and "Attached 1 file(s) to the next message.") survived Ctrl+N and
    went with the new conversation's first message."""
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


async def test_a_chip_is_removed_from_the_keyboard(tmp_path):
    """Regression: a chip could not be removed without the mouse."""
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


async def test_remove_attachments_is_in_the_palette(tmp_path):
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


async def test_refused_at_attach_time_with_the_one_limit_that_applies(tmp_path):
    """Regression: attachments the engine refuses (too many pixels, too long) were accepted
    as chips; the refusal now comes at attach time, naming AOTX's limit, not Pillow's."""
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


async def test_reopened_conversation_shows_attachments_as_it_did_live(tmp_path):
    engine = FakeEngine(media_text=lambda a: "the quick brown fox")
    app, _ = make_app(engine)
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        bracketed_paste(app, str(write_wav(tmp_path / "clip.wav", 0.3)))
        await settle(pilot)
        app.chat_input.insert("what is said?")
        await pilot.press("enter")
        await settle(pilot)
        live = app.messages()[0]
        live_view = (live.text, live.notices(), [a.name for a in live.attachments])
        assert live_view[0] == "what is said?" and live_view[2] == ["clip.wav"]
        assert "the quick brown fox" in live_view[1][0]
        conv = app.conv_id
    app2, _ = make_app(engine)
    async with app2.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        assert app2.conv_id == conv
        again = app2.messages()[0]
        assert again.text == "what is said?"  # not the transcript block the journal keeps
        assert [a.name for a in again.attachments] == ["clip.wav"]
        assert again.notices() == ["Transcript of clip.wav, as the model received it:\nthe quick brown fox"]
        assert live_view[1][0] == "Transcript of clip.wav (fake-specialist), as the model received it:\n" \
                                  "the quick brown fox"
        # a retry sends the words, with the file, not the block again
        await pilot.press("ctrl+r")
        await settle(pilot)
        assert engine.submitted[-1][1] == "what is said?" and [a.name for a in engine.submitted[-1][2]] == ["clip.wav"]


async def test_the_file_picker_starts_here_and_hides_dotfiles(tmp_path, monkeypatch):
    """F5 started in $HOME and listed every dotfile (.cache, .bashrc, ...). It starts where
    aotx-chat was started and lists folders and attachable files, hidden ones left out."""
    from textual.widgets import DirectoryTree

    from aotx.app.screens.file_picker import FilePicker

    here = tmp_path / "work"
    here.mkdir()
    (here / ".hidden").mkdir()
    (here / ".bashrc").write_text("x")
    (here / "notes.txt").write_text("x")
    (here / "shots").mkdir()
    (here / "cat.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    monkeypatch.chdir(here)
    app, _ = make_app()
    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot)
        await pilot.press("f5")
        await pilot.pause(0.5)
        assert isinstance(app.screen, FilePicker) and app.screen.root == here
        tree = app.screen.query_one(DirectoryTree)
        for _ in range(50):
            if tree.root.children:
                break
            await pilot.pause(0.05)
        assert sorted(str(n.label) for n in tree.root.children) == ["cat.png", "shots"]
        await pilot.press("escape")


def test_app_state_is_written_private(home):
    """The app wrote app_state.json world-readable and `aotx serve` said at most starts that
    it made it private again."""
    import stat

    from aotx.app import state as app_state

    app_state.update_state(theme="light")
    mode = stat.S_IMODE((home / "app_state.json").stat().st_mode)
    assert mode == 0o600, oct(mode)
