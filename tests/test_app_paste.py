"""Pastes and drops: a table test of parse_pasted_paths (what real terminals send when a
file is dropped), file sniffing, and aotx-chat taking a bracketed paste exactly once, in
whichever text box has the focus (pastes go through Textual's terminal parser,
``fakes.terminal.bracketed_paste``, the way a terminal delivers them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from textual.widgets import TextArea  # noqa: E402

from aotx.engine.present.attach import make_attachment, sniff  # noqa: E402
from aotx.engine.present.paste import PastedItem, parse_pasted_paths  # noqa: E402
from app_fake_engine import FakeEngine, chips, make_app, settle, until  # noqa: E402
from fakes.media_files import write_png  # noqa: E402
from fakes.terminal import bracketed_paste  # noqa: E402

H = "/home/u"


def P(*paths: str) -> list[PastedItem]:
    return [PastedItem("path", p) for p in paths]


def T(text: str) -> list[PastedItem]:
    return [PastedItem("text", text)]


CASES = [
    # name, paste, expected
    ("plain", "/tmp/cat.png", P("/tmp/cat.png")),
    ("trailing space (gnome-terminal)", "/tmp/cat.png ", P("/tmp/cat.png")),
    ("trailing newline", "/tmp/cat.png\n", P("/tmp/cat.png")),
    ("leading and trailing whitespace", "  \t/tmp/cat.png \r\n", P("/tmp/cat.png")),
    ("single quotes (gnome, konsole)", "'/tmp/my cat.png' ", P("/tmp/my cat.png")),
    ("double quotes", '"/tmp/my cat.png"', P("/tmp/my cat.png")),
    ("escaped space (iTerm2, kitty)", r"/tmp/my\ cat.png", P("/tmp/my cat.png")),
    ("escaped parens and ampersand", r"/tmp/a\ \(1\)\ \&\ b.jpg", P("/tmp/a (1) & b.jpg")),
    ("escaped quote", r"/tmp/it\'s.wav", P("/tmp/it's.wav")),
    ("file URL", "file:///tmp/cat.png", P("/tmp/cat.png")),
    ("file URL percent-encoded", "file:///tmp/my%20cat%20%28x%29.png", P("/tmp/my cat (x).png")),
    ("file URL localhost", "file://localhost/tmp/a.wav", P("/tmp/a.wav")),
    ("file URL utf-8", "file:///tmp/%C3%A9t%C3%A9.jpg", P("/tmp/été.jpg")),
    ("several file URLs on lines", "file:///tmp/a.png\r\nfile:///tmp/b.png\r\n", P("/tmp/a.png", "/tmp/b.png")),
    ("several paths with spaces", "/tmp/a.png /tmp/b.wav", P("/tmp/a.png", "/tmp/b.wav")),
    ("several quoted", "'/tmp/a b.png' '/tmp/c d.wav'", P("/tmp/a b.png", "/tmp/c d.wav")),
    ("several escaped", r"/tmp/a\ b.png /tmp/c\ d.png", P("/tmp/a b.png", "/tmp/c d.png")),
    ("several on lines", "/tmp/a.png\n/tmp/b.png\n", P("/tmp/a.png", "/tmp/b.png")),
    ("tilde", "~/Pictures/cat.png", P(H + "/Pictures/cat.png")),
    ("tilde quoted", "'~/My Pictures/cat.png'", P(H + "/My Pictures/cat.png")),
    ("relative dot", "./cat.png", P("./cat.png")),
    ("relative dotdot", "../x/cat.png", P("../x/cat.png")),
    ("unescaped spaces, one line", "/tmp/My Photos/cat 1.png", P("/tmp/My Photos/cat 1.png")),
    ("non-media path still a path", "/etc/hosts", P("/etc/hosts")),
    ("mixed quoting styles", "'/tmp/a b.png' /tmp/c\\ d.wav \"/tmp/e f.ogg\"",
     P("/tmp/a b.png", "/tmp/c d.wav", "/tmp/e f.ogg")),
    # cases from public bug reports
    ("quoted path then text", "'/tmp/cat.jpg' describe this", P("/tmp/cat.jpg") + T("describe this")),
    ("double-quoted path then a question", '"/tmp/my cat.png" what is in it?',
     P("/tmp/my cat.png") + T("what is in it?")),
    ("escaped path then text", r"/tmp/my\ cat.png what is it?", P("/tmp/my cat.png") + T("what is it?")),
    ("file URL then text", "file:///tmp/a%20b.wav transcribe", P("/tmp/a b.wav") + T("transcribe")),
    ("two quoted paths then text", "'/tmp/a.png' '/tmp/b.png' compare these",
     P("/tmp/a.png", "/tmp/b.png") + T("compare these")),
    ("quoted path then text with an apostrophe", "'/tmp/cat.jpg' what's this?",
     P("/tmp/cat.jpg") + T("what's this?")),
    ("quoted path line, then a text line", "'/tmp/a.png'\nwhat is this?\nand this?",
     P("/tmp/a.png") + T("what is this?\nand this?")),
    ("backslash-escaped space, relative", r"Example\ file.wav", P("Example file.wav")),
    ("backslash-escaped, relative, trailing space", "Screen\\ Shot\\ 2024-01-01\\ at\\ 9.41.00.png ",
     P("Screen Shot 2024-01-01 at 9.41.00.png")),
    ("quoted relative name", "'my cat.png'", P("my cat.png")),
    ("Windows-quoted path", r'"C:\Users\me\My Pictures\cat 1.png"', P(r"C:\Users\me\My Pictures\cat 1.png")),
    ("Windows path unquoted", r"C:\Users\me\cat.png", P(r"C:\Users\me\cat.png")),
    ("Windows path with forward slashes", "C:/Users/me/cat.png", P("C:/Users/me/cat.png")),
    ("Windows-quoted path then text", r'"D:\clips\a b.wav" what is said?', P(r"D:\clips\a b.wav") + T("what is said?")),
    ("two Windows-quoted paths", r'"C:\a b\x.png" "C:\c\y.png"', P(r"C:\a b\x.png", r"C:\c\y.png")),
    ("Windows UNC path", r"\\nas\photos\cat.png", P(r"\\nas\photos\cat.png")),
    ("POSIX quote-in-quotes idiom", "'/tmp/it'\\''s.png'", P("/tmp/it's.png")),
    # text stays text
    ("quoted word, no extension", "'hello' world", T("'hello' world")),
    ("quoted prose", '"to be or not to be" who said it?', T('"to be or not to be" who said it?')),
    ("unmarked path then prose stays text", "/tmp/cat.png what is it", T("/tmp/cat.png what is it")),
    ("escaped name that is not media", r"my\ notes.txt", T(r"my\ notes.txt")),
    ("drive-like word in prose", "Plan C: go home", T("Plan C: go home")),
    ("a word", "hello", T("hello")),
    ("a sentence", "what is in this picture?", T("what is in this picture?")),
    ("a sentence with a path", "look at /tmp/cat.png please", T("look at /tmp/cat.png please")),
    ("path then prose", "/usr/bin/foo is great", T("/usr/bin/foo is great")),
    ("apostrophe", "don't do that", T("don't do that")),
    ("http URL", "https://example.com/cat.png", T("https://example.com/cat.png")),
    ("code with slashes", "a = b / c", T("a = b / c")),
    ("a lone slash", "/", T("/")),
    ("lines of prose", "first line\nsecond line", T("first line\nsecond line")),
    ("path line and prose line", "/tmp/a.png\nwhat is this?", T("/tmp/a.png\nwhat is this?")),
    ("comment-like", "# heading", T("# heading")),
    ("file: without slashes", "file:notes.txt", T("file:notes.txt")),
    ("markdown with path", "`/tmp/a.png`", T("`/tmp/a.png`")),
    ("empty", "", []),
    ("whitespace only", "  \n ", []),
]


@pytest.mark.parametrize("paste,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_parse_pasted_paths(paste: str, expected: list[PastedItem]) -> None:
    assert parse_pasted_paths(paste, home=H) == expected


PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 32  # sniffing reads only the magic bytes
WAV = b"RIFF\x24\0\0\0WAVEfmt " + b"\0" * 32


@pytest.mark.parametrize("head,kind", [
    (PNG, "image"), (b"\xff\xd8\xff\xe0" + b"\0" * 12, "image"), (b"GIF89a" + b"\0" * 10, "image"),
    (b"RIFF\0\0\0\0WEBPVP8 ", "image"), (WAV, "audio"), (b"fLaC" + b"\0" * 12, "audio"),
    (b"OggS" + b"\0" * 12, "audio"), (b"ID3\x04" + b"\0" * 12, "audio"), (b"hello world, text", None),
])
def test_sniff(head: bytes, kind: str | None) -> None:
    assert sniff(head) == kind


def test_make_attachment(tmp_path) -> None:
    from fakes.media_files import png_bytes, write_wav

    (tmp_path / "cat.png").write_bytes(png_bytes(3, 3))
    (tmp_path / "fake.png").write_bytes(b"not really a png")
    write_wav(tmp_path / "a.wav", 0.5)
    ok = make_attachment(str(tmp_path / "cat.png"))
    assert ok.attachment and ok.attachment.kind == "image" and len(ok.attachment.sha256) == 64
    assert make_attachment(str(tmp_path / "a.wav")).attachment.kind == "audio"
    assert "no such file" in make_attachment(str(tmp_path / "missing.png")).problem
    assert "match no known format" in make_attachment(str(tmp_path / "fake.png")).problem
    assert "not an image or audio" in make_attachment(str(tmp_path / "notes.txt")).problem
    (tmp_path / "dir.png").mkdir()
    assert "not a regular file" in make_attachment(str(tmp_path / "dir.png")).problem


# ---- a bracketed paste in the app: inserted once -------------------------------------

@pytest.fixture
def app_home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.mark.usefixtures("app_home")
async def test_bracketed_paste_is_inserted_once():
    """Regression: a bracketed paste was inserted twice ("hello therehello there")."""
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


@pytest.mark.usefixtures("app_home")
async def test_a_large_paste_is_not_doubled():
    """The report: a 67 KB paste became a 30,030-token prompt, twice the paste."""
    big = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(1300))
    assert len(big) > 66_000
    app, _ = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        bracketed_paste(app, big)
        await pilot.pause()
        assert app.chat_input.text == big


@pytest.mark.usefixtures("app_home")
async def test_paste_of_a_dropped_path_with_a_question(tmp_path):
    """A dropped file followed by typed words: the file becomes a chip, the words text."""
    app, _ = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        shot = write_png(tmp_path / "my shot.png")
        bracketed_paste(app, f"'{shot}' what does it say?")
        await settle(pilot)
        assert chips(app) == ["my shot.png"]
        assert app.chat_input.text == "what does it say?"


@pytest.mark.usefixtures("app_home")
async def test_other_text_boxes_take_a_paste_once():
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


# ---- what a paste becomes: a dropped file, or the text as pasted -------------------

def test_split_paste_attaches_only_files_that_are_there(tmp_path) -> None:
    """A pasted line that starts with `/` but names no image or audio file here was
    swallowed: "Not attached: ..." and the text gone from the input. Now it stays text."""
    from fakes.media_files import png_bytes

    from aotx.engine.present.paste import split_paste

    (tmp_path / "cat.png").write_bytes(png_bytes(3, 3))
    (tmp_path / "dir.png").mkdir()
    cat = str(tmp_path / "cat.png")
    assert split_paste(f"'{cat}' what is it?").paths == [cat]
    assert split_paste(f"'{cat}' what is it?").text == "what is it?"
    for text in ("/api/v1/users", "/usr/bin/env", "/etc/hosts", "/usr/bin/env python3 -m http.server",
                 "/tmp/My Notes/todo.txt"):
        s = split_paste(text)
        assert (s.paths, s.text, s.note) == ([], text, ""), text
    for text in (str(tmp_path / "missing.png"), f"'{tmp_path}/dir.png'", f"'{cat}' '{tmp_path}/gone.wav'"):
        s = split_paste(text)
        assert s.paths == [] and s.text == text and "pasted as text" in s.note, text


async def test_a_pasted_api_path_stays_in_the_input():
    """Bracketed pastes of paths that are not dropped media files go into the input, as
    typed, with no chip and no 'Not attached' notice."""
    from app_fake_engine import make_app, settle
    from fakes.terminal import bracketed_paste

    from aotx.app.widgets.chips import AttachmentBar

    app, _ = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        bracketed_paste(app, "/api/v1/users")
        await settle(pilot)
        assert app.chat_input.text == "/api/v1/users"
        bracketed_paste(app, " and /usr/bin/env")
        await settle(pilot)
        assert app.chat_input.text == "/api/v1/users and /usr/bin/env"
        assert not app.query_one(AttachmentBar).attachments
        assert "Not attached" not in str(app.query_one("#input-notice").render())
        app.chat_input.clear()
        bracketed_paste(app, "/tmp/no-such-dir/cat.png")
        await settle(pilot)
        assert app.chat_input.text == "/tmp/no-such-dir/cat.png"
        assert "pasted as text" in str(app.query_one("#input-notice").render())
