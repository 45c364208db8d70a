"""ChatApp against the scripted engine: startup, sending, streaming, positions, notices."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, make_app, notice, settle  # noqa: E402
from fakes.terminal import bracketed_paste  # noqa: E402

from aotx.engine import protocol as P  # noqa: E402


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    return tmp_path


async def type_and_send(pilot, text: str) -> None:
    pilot.app.chat_input.insert(text)
    await pilot.press("enter")


async def test_input_usable_before_engine_ready_and_queued_message_sent():
    engine = FakeEngine(load_steps=3)
    engine.hold_loading = True
    app, _ = make_app(engine)
    async with app.run_test() as pilot:
        assert app.chat_input.has_focus
        await pilot.press(*"hi")
        assert app.chat_input.text == "hi"
        assert not app.ready
        await pilot.press("enter")
        user = app.messages()[0]
        assert user.position == "queued"
        await pilot.pause(0.3)
        assert app.status_bar.state == "loading" and "weights" in app.status_bar.line()
        assert not engine.submitted
        engine.hold_loading = False
        await pilot.pause(1.0)
        await settle(pilot)
        assert app.ready
        assert engine.submitted[0][1] == "hi"
        assert [m.role for m in app.messages()] == ["user", "assistant"]
        assert app.status_bar.state == "ready"
        assert "budget" in app.status_bar.line() and "free" in app.status_bar.line()


async def test_reply_streams_and_positions_reach_durable():
    app, engine = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        await type_and_send(pilot, "hello")
        await settle(pilot)
        user, reply = app.messages()
        assert user.position == "durable" and user.receipt is not None
        assert reply.position == "durable" and reply.receipt.last_seq >= reply.seq
        assert reply.text == engine.reply("hello")
        assert reply.finish_reason == "stop"
        # the conversation got a title from the first message and is remembered
        assert app.sidebar.visible() == ["hello"]
        state = (Path(__import__("os").environ["AOTX_HOME"]) / "app_state.json").read_text()
        assert app.conv_id in state


async def test_positions_are_shown_while_streaming():
    engine = FakeEngine(token_delay=0.02, reply=lambda t: "word " * 40)
    app, _ = make_app(engine)
    async with app.run_test() as pilot:
        await settle(pilot)
        await type_and_send(pilot, "go")
        seen = set()
        for _ in range(100):
            await pilot.pause(0.02)
            ms = app.messages()
            if len(ms) == 2:
                seen.add(ms[1].position)
                header = str(ms[1].query_one(".msg-header").render())
                assert header[0] in "○◐●"
            if app.active is None and len(ms) == 2:
                break
        await settle(pilot)
        assert "committed" in seen
        assert app.messages()[1].position == "durable"


async def test_notices_appear_inline_in_plain_words():
    notices = [P.Notice(id=0, kind="queued", resource="slots", message="waiting for a free slot", asked=1, free=0,
                        position=2),
               P.Notice(id=0, kind="held", resource="journal", message="", asked=8192, free=1024)]
    app, _ = make_app(FakeEngine(notices=notices))
    async with app.run_test() as pilot:
        await settle(pilot)
        await type_and_send(pilot, "hi")
        await settle(pilot)
        lines = app.messages()[1].notices()
        assert lines[0].startswith("Queued: slots — asked 1 slot, 0 slots free, position 2 in the queue.")
        assert lines[1] == "Held: journal — asked 8.0 KiB, 1.0 KiB free."


async def test_escape_cancels_running_reply():
    app, engine = make_app(FakeEngine(token_delay=0.01, reply=lambda t: "x" * 4000))
    async with app.run_test() as pilot:
        await settle(pilot)
        await type_and_send(pilot, "long")
        for _ in range(50):
            await pilot.pause(0.02)
            if app.active and app.active.accepted and app.messages()[-1].n_tokens > 2:
                break
        await pilot.press("escape")
        await settle(pilot)
        reply = app.messages()[-1]
        assert engine.cancelled and reply.finish_reason == "cancelled"
        assert reply.position == "cancelled"
        assert len(reply.text) < 4000


async def test_retry_truncates_and_resubmits():
    app, engine = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        await type_and_send(pilot, "first")
        await settle(pilot)
        first_user = app.messages()[0].msg_id
        await pilot.press("ctrl+r")
        await settle(pilot)
        assert engine.truncated == [first_user]
        assert [s[1] for s in engine.submitted] == ["first", "first"]
        assert [m.role for m in app.messages()] == ["user", "assistant"]
        conv = engine.convs[app.conv_id]
        assert [m.role for m in conv.messages] == ["user", "assistant"]


async def test_edit_last_message_and_resend():
    app, engine = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        await type_and_send(pilot, "helo")
        await settle(pilot)
        await pilot.press("ctrl+t")
        assert app.chat_input.text == "helo" and app.editing is not None
        app.chat_input.clear()
        await type_and_send(pilot, "hello")
        await settle(pilot)
        assert [m.text for m in app.messages() if m.role == "user"] == ["hello"]
        assert [m.text for m in engine.convs[app.conv_id].messages if m.role == "user"] == ["hello"]


async def test_copy_message_and_code_block():
    app, engine = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        await type_and_send(pilot, "code")
        await settle(pilot)
        await pilot.press("ctrl+b")
        assert app.clipboard == engine.reply("code")
        from aotx.app.widgets.markdown_view import CodeBlock
        fence = app.messages()[1].query_one(CodeBlock)
        await pilot.click(fence)
        assert app.clipboard == "print('code')"
        app.messages()[0].focus()
        await pilot.press("c")
        assert app.clipboard == "code"


async def test_ctrl_j_newline_enter_sends():
    app, engine = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        await pilot.press("a", "ctrl+j", "b")
        assert app.chat_input.text == "a\nb"
        await pilot.press("enter")
        await settle(pilot)
        assert engine.submitted[0][1] == "a\nb"


async def test_engine_crash_is_reported_and_conversation_recovered():
    engine = FakeEngine(token_delay=0.005, reply=lambda t: "tok " * 200)
    engine.crash_after_tokens = 20
    app, _ = make_app(engine)
    async with app.run_test() as pilot:
        await settle(pilot)
        await type_and_send(pilot, "hi")
        for _ in range(100):
            await pilot.pause(0.02)
            if engine.connects >= 2 and app.ready and app.active is None:
                break
        engine.crash_after_tokens = None
        await settle(pilot)
        assert engine.connects == 2
        user, reply = app.messages()
        assert user.position == "durable"
        assert reply.position == "interrupted"
        assert any("stopped" in n for n in reply.notices())
        assert reply.text == "tok " * 20  # the tokens that reached the journal
        # the conversation goes on
        await type_and_send(pilot, "again")
        await settle(pilot)
        assert app.messages()[-1].position == "durable"


async def test_details_screen_shows_receipt():
    app, _ = make_app()
    async with app.run_test() as pilot:
        await settle(pilot)
        await type_and_send(pilot, "hi")
        await settle(pilot)
        reply = app.messages()[1]
        reply.focus()
        await pilot.press("i")
        await pilot.pause()
        body = str(app.screen.query_one("#details-body").render())
        assert f"receipt up to seq  {reply.receipt.last_seq}" in body
        assert reply.msg_id in body and "tokens" in body
        await pilot.press("escape")
        assert not app.screen.query("#details-body")


async def test_arrow_keys_move_between_messages():
    e = FakeEngine()
    e.add_conversation("Rust lifetimes", [("user", "what is 'a?"), ("assistant", "A **lifetime** names a borrow.")])
    e.add_conversation("Pasta recipe", [("user", "carbonara?"), ("assistant", "Eggs, guanciale, pecorino. No cream.")])
    e.add_conversation("Trip", [("user", "where to in May?"), ("assistant", "Lisbon: warm, and the jacaranda bloom.")])
    app, _ = make_app(e)
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        ms = app.messages()
        assert app.chat_input.has_focus and app.chat_input.text == ""
        await pilot.press("up")  # from the empty input: the last message
        assert app.focused is ms[-1]
        await pilot.press("up")
        assert app.focused is ms[-2]
        await pilot.press("up")  # the first stays the first
        assert app.focused is ms[0]
        await pilot.press("down")
        assert app.focused is ms[1]
        await pilot.press("down")  # past the last: back to the input
        assert app.chat_input.has_focus


async def test_refusal_of_a_long_prompt_is_where_the_user_looks():
    """Regression: a too-long prompt's refusal was shown out of view."""
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
        assert notice(app).startswith("Too long for the context: ")
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
