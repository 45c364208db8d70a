"""The interactive ``aotx run`` against the scripted engine:
slash commands, settings saved in the conversation, attachments, fork, markers.
The terminal end to end (tmux, the real default model) is tests/test_repl_tmux.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fakes.media_files import write_png  # noqa: E402
from tests.fakes.fake_engine import FakeEngine  # noqa: E402

from aotx.engine.cli.repl import Command, Repl, apply_setting, parse_command  # noqa: E402
from aotx.engine import protocol as P  # noqa: E402


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path / "home"))


@pytest.mark.parametrize("line,cmd", [
    ("/bye", Command("bye", "")), ("/set temperature 0.2", Command("set", "temperature 0.2")),
    ("  /SYSTEM  Be brief.  ", Command("system", "Be brief.")),
    ("/attach '/tmp/a b.png'", Command("attach", "'/tmp/a b.png'")),
    ("hello", None), ("//etc is a path", None), ("a /set in the middle", None),
])
def test_parse_command(line, cmd):
    assert parse_command(line) == cmd


def test_apply_setting_checks_values():
    sp = P.SamplingParams()
    assert apply_setting(sp, "temperature 0.2").temperature == 0.2
    assert apply_setting(sp, "top-k 5").top_k == 5
    assert apply_setting(sp, "seed random").seed is None
    assert apply_setting(sp, "speculative ngram").speculative == "ngram"
    for bad, why in [("temprature 1", "unknown setting"), ("temperature hot", "not a valid float"),
                     ("top_p 2", "between 0 and 1"), ("max_tokens 0", "must be positive"),
                     ("temperature nan", "not a number"), ("speculative medusa", "not one of"),
                     ("temperature", "give a value")]:
        with pytest.raises(ValueError, match=why):
            apply_setting(sp, bad)


class Term:
    """A scripted terminal: lines to read, what was written to stdout and stderr."""

    def __init__(self, lines):
        self.lines, self.out, self.err = list(lines), [], []

    def read(self, prompt):
        if not self.lines:
            raise EOFError
        line = self.lines.pop(0)
        if line is KeyboardInterrupt:
            raise KeyboardInterrupt
        return line


async def drive(engine: FakeEngine, lines, **kw):
    term = Term(lines)
    client = await engine.connect()
    repl = Repl(client, sampling=P.SamplingParams(temperature=0.0), read=term.read, write=term.out.append,
                err=term.err.append, **kw)
    await repl.start()
    while True:
        line = repl.read_message()
        if line is None or not await repl.handle(line):
            break
    return repl, term


async def test_repl_chats_with_settings_system_prompt_fork_and_markers(tmp_path):
    engine = FakeEngine(reply=lambda t: f"echo {t}")
    repl, term = await drive(engine, [
        "/set temperature 0.3", "/system Answer in French.", "Hello there", KeyboardInterrupt, "/show",
        '"""first line', "second line", 'end"""', "/fork", "after the fork", "/bye", "never read"])
    convs = list(engine.convs.values())
    original, fork = convs[0], convs[1]
    assert original.title == "Hello there" and fork.title == "Hello there (fork 1)"
    # settings and the system prompt went with the conversation (the engine has them)
    assert original.system_prompt == "Answer in French." and original.sampling.temperature == 0.3
    assert [(c, t) for c, t, _ in engine.submitted] == [
        (original.conv_id, "Hello there"), (original.conv_id, "first line\nsecond line\nend"),
        (fork.conv_id, "after the fork")]
    out = "".join(term.out)
    assert "echo Hello there" in out and "echo after the fork" in out
    turns = [e for e in term.err if "reply" in e and "tokens" in e]
    assert len(turns) == 3 and all(t.startswith("● you  ● reply") for t in turns), turns
    assert "context " in turns[0] and "250.0 tok/s" in turns[0]
    assert any("Ctrl-D or /bye" in e for e in term.err)
    assert any(e.startswith(f"{original.conv_id} “Hello there”") and "temperature=0.3" in e for e in term.err)
    assert any("you are in the fork" in e for e in term.err)
    assert repl.conv_id == fork.conv_id
    assert term.lines == ["never read"]


async def test_repl_attach_checks_files_and_sends_them(tmp_path):
    engine = FakeEngine(media_text=lambda a: "A CAT")
    shot = write_png(tmp_path / "my cat.png")
    repl, term = await drive(engine, [f"/attach {tmp_path}/missing.png", f"/attach '{shot}'", "what is this?"])
    assert any("not attached" in e and "no such file" in e for e in term.err)
    assert any("attached to the next message: my cat.png" in e for e in term.err)
    conv, text, atts = engine.submitted[-1]
    assert text == "what is this?" and [a.name for a in atts] == ["my cat.png"]
    assert any("A CAT" in e for e in term.err)  # what the attachment became


async def test_repl_refusal_is_shown_with_the_failed_marker_and_the_attachments_kept(tmp_path):
    engine = FakeEngine(max_prompt_chars=10)
    repl, term = await drive(engine, ["this message is far too long for the context"])
    assert any(e.startswith("✗ Too long for the context: ") for e in term.err), term.err
    assert all(not c.messages for c in engine.convs.values())


async def test_repl_continues_a_conversation():
    engine = FakeEngine()
    conv = engine.add_conversation("Old talk", [("user", "hi"), ("assistant", "hello")])
    conv.sampling = P.SamplingParams(temperature=0.9, max_tokens=77)
    repl, term = await drive(engine, ["/set", "and now?"], conv_id=conv.conv_id)
    assert term.err[0] == "continuing “Old talk” (2 messages); /help lists the commands"
    assert any("temperature=0.9" in e and "max_tokens=77" in e for e in term.err)
    assert engine.submitted[-1][:2] == (conv.conv_id, "and now?")


async def test_repl_context_shows_and_sets_the_conversations_policy():
    engine = FakeEngine()
    repl, term = await drive(engine, ["/context", "/context forever", "/context stop", "Hello", "/context middle",
                                      "/show"])
    conv = next(iter(engine.convs.values()))
    assert term.err[1] == ("context policy: rolling (the engine's default); the context holds 2,048 tokens; "
                           "/context rolling, middle or stop sets it")
    assert any("'forever' is not one of rolling, middle, stop" in e for e in term.err)
    assert "context policy: stop; the context holds 2,048 tokens" in term.err
    assert conv.context == "middle"   # set before the first message (kept for it), then saved with it
    assert term.err[-1].endswith("context policy: middle; the context holds 2,048 tokens")


async def test_bug_one_message_was_counted_as_1_messages():
    """Regression: "(1 messages)" in the CLI's and the TUI's lines; now "1 message"
    (units.plural, used by every such line)."""
    from aotx.engine.units import plural

    assert (plural(0, "message"), plural(1, "message"), plural(2, "message")) == ("0 messages", "1 message",
                                                                                   "2 messages")
    engine = FakeEngine()
    conv = engine.add_conversation("One", [("user", "hi")])
    repl, term = await drive(engine, ["and now?"], conv_id=conv.conv_id)
    assert term.err[0] == "continuing “One” (1 message); /help lists the commands"


async def test_repl_with_model_chats_with_that_model():
    """Regression: `aotx run --model qwen... ` with no prompt
    (the terminal chat) ignored --model: the banner and every reply were the default's."""
    engine = FakeEngine()
    repl, term = await drive(engine, ["hello", "/new", "again"], model="/m/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    assert "qwen2.5-coder-0.5b-instruct-q4_k_m on cpu (the engine's default is" in term.err[0]
    convs = list(engine.convs.values())
    assert len(convs) == 2 and {c.model for c in convs} == {"/m/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"}
    assert engine.submit_models == ["/m/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"] * 2


def test_run_repl_refuses_a_missing_model_file_before_connecting(tmp_path):
    """`aotx run --model missing.gguf` at a terminal: one line, exit 2, no engine started."""
    import argparse

    from aotx.engine.cli.repl import run_repl
    from aotx.engine.errors import AotxError

    def connect():
        raise AssertionError("connected before the model argument was checked")

    args = argparse.Namespace(temperature=None, top_k=None, top_p=None, min_p=None, repeat_penalty=None, seed=None,
                              max_tokens=None, stop=[], speculative=None, model=str(tmp_path / "missing.gguf"),
                              conversation=None, system=None, attach=[])
    try:
        rc = run_repl(args, connect=connect)
    except AotxError as e:
        assert "missing.gguf" in str(e)
    else:
        assert rc == 2


def test_repl_help_fits_80_columns():
    """Regression: the `aotx run` chat's /help wrapped mid-word at 80 columns."""
    from aotx.engine.cli.repl import HELP

    assert max(len(line) for line in HELP.splitlines()) <= 80
    assert "/attach" in HELP and "/bye" in HELP and '"""' in HELP
