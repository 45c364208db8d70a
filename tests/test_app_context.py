"""The TUI and context policies: F4 sets the conversation's policy, a reply whose prompt left
earlier messages out carries a marker where it happened (live and when the conversation is
opened again), and its details name the cut."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, make_app, settle  # noqa: E402

from aotx.app.screens.details import details_lines  # noqa: E402
from aotx.engine import protocol as P  # noqa: E402


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


async def test_f4_sets_the_context_policy_of_the_conversation():
    from textual.widgets import Select

    engine = FakeEngine()
    engine.add_conversation("Long talk", [("user", "hi"), ("assistant", "hello")])
    app, _ = make_app(engine)
    async with app.run_test() as pilot:
        await settle(pilot)
        await pilot.press("f4")
        await until(pilot, lambda: app.screen.query("#f-context"))
        select = app.screen.query_one("#f-context", Select)
        assert select.value == ""  # the engine's default
        select.value = "stop"
        await pilot.press("ctrl+s")
        await settle(pilot)
        assert engine.convs[app.conv_id].context == "stop"
        await pilot.press("f4")
        await until(pilot, lambda: app.screen.query("#f-context"))
        assert app.screen.query_one("#f-context", Select).value == "stop"


async def test_a_reply_whose_prompt_was_cut_carries_the_marker_and_its_details():
    engine = FakeEngine()
    conv = engine.add_conversation("Long talk", [("user", "one"), ("assistant", "two"), ("user", "three"),
                                                 ("assistant", "four")])
    conv.messages[-1].context = P.ContextCut(policy="rolling", n_messages=2, n_out=2, n_tokens=1234,
                                             first=conv.messages[0].msg_id, last=conv.messages[1].msg_id,
                                             kept_from=conv.messages[2].msg_id)
    app, _ = make_app(engine)
    async with app.run_test() as pilot:
        await settle(pilot)
        w = app.chat_widgets[conv.messages[-1].msg_id]
        assert w.notices() == ["✂ 2 earlier messages (1,234 tokens) left the prompt here, 2 in all; the journal keeps "
                               "them (context policy rolling)."]
        assert app.chat_widgets[conv.messages[1].msg_id].notices() == []
        rows = dict(details_lines(w))
        assert rows["context cut"] == "2 earlier messages (1,234 tokens) left the prompt, 2 out in all (policy rolling)"


async def test_the_marker_appears_live_on_the_reply_whose_prompt_was_cut():
    cut = P.ContextCut(policy="middle", n_messages=4, n_out=6, n_tokens=900, kept_from="m9")
    engine = FakeEngine(notices=[P.Notice(id=0, kind="context", resource="context", asked=900, cut=cut,
                                          message="4 earlier messages (900 tokens) left the prompt")])
    engine.add_conversation("Long talk", [("user", "hi"), ("assistant", "hello")])
    app, _ = make_app(engine)
    async with app.run_test() as pilot:
        await settle(pilot)
        app.chat_input.insert("and now?")
        await pilot.press("enter")
        await settle(pilot)
        reply = [w for w in app.chat_widgets.values() if w.role == "assistant"][-1]
        assert reply.notices() == ["✂ 4 earlier messages (900 tokens) left the prompt here, 6 in all; the journal "
                                   "keeps them (context policy middle)."]
        assert reply.context == cut
