"""The interactive ``aotx run`` when the engine goes away between two messages.

``aotx stop`` (or a crash) while the chat waited for input: the chat ended with exit 2 at
the next message. Now it says what happened and the next message starts an engine with
the flags of the one that went away (its Welcome's ``engine_args``), then goes to it."""

from __future__ import annotations

import pytest

from tests.fakes.fake_engine import FakeEngine

from aotx.engine.cli.repl import Repl
from aotx.engine import protocol as P


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path / "home"))


class Term:
    def __init__(self):
        self.out, self.err = [], []


async def test_the_next_message_after_a_stop_starts_the_stopped_engine_again():
    engine = FakeEngine(reply=lambda t: f"echo {t}")
    engine.engine_args = ["--model", "/m/qwen.gguf", "--slots", "2"]
    term = Term()
    calls: list[list[str]] = []

    async def reconnect(args):
        calls.append(args)
        return await engine.connect(engine_args=args)

    repl = Repl(await engine.connect(), sampling=P.SamplingParams(temperature=0.0), read=None,
                write=term.out.append, err=term.err.append, reconnect=reconnect)
    await repl.start()
    assert await repl.handle("hello")
    engine.stop()
    assert await repl.handle("/show") and calls == [["--model", "/m/qwen.gguf", "--slots", "2"]]
    assert await repl.handle("again")
    assert engine.spawned_with == calls
    assert [t for _, t, _ in engine.submitted] == ["hello", "again"]
    assert "echo again" in "".join(term.out)
    assert any("starting the engine again" in e for e in term.err)
    assert sum(e.startswith("● you  ● reply") for e in term.err) == 2


async def test_a_message_the_stopped_engine_never_accepted_is_sent_to_the_next_one():
    """The stop came while the message was on its way: nothing was journaled, so it is sent
    once more, to the engine started again; the user does not type it twice."""
    engine = FakeEngine()
    term = Term()
    repl = Repl(await engine.connect(), sampling=P.SamplingParams(), read=None, write=term.out.append,
                err=term.err.append, reconnect=lambda args: engine.connect(engine_args=args))
    await repl.start()
    client = repl.client
    client.closed = False
    engine.stop()
    client.closed = False      # the close has not been read yet: the submit finds it
    assert await repl.handle("hello")
    assert [t for _, t, _ in engine.submitted][-1:] == ["hello"]
    assert engine.spawned_with == [list(engine.engine_args)]
