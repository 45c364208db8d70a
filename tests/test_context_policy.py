"""Context policies (engine/runtime/context.py): where a prompt that outgrows the context is cut.

The renderer here is a stand-in for a chat template: every message costs a known number
of tokens, so each expected cut is computed by hand from the policy's rule (the prompt
is cut at a user turn once it leaves less than ``room`` tokens, to at most half the
context; "middle" keeps the first exchange; "stop" never cuts).
"""

from __future__ import annotations

import pytest

from aotx.engine.runtime import context as C


def conv(n_turns: int, user: int = 10, reply: int = 20) -> C.History:
    """``n_turns`` user/assistant exchanges; a message's content is its token count."""
    msgs = []
    for i in range(n_turns):
        msgs.append((f"u{i}", {"role": "user", "content": user}))
        msgs.append((f"a{i}", {"role": "assistant", "content": reply}))
    return C.History({"role": "system", "content": 5}, msgs)


def render_with(turn: int):
    calls = []

    def render(kept):
        calls.append(len(kept))
        return [0] * (sum(m["content"] for m in kept) + turn)

    render.calls = calls
    return render


def test_a_prompt_that_leaves_room_is_not_cut():
    h = conv(3)           # 5 + 3 * 30 + turn 10 = 105 tokens
    got = C.fit("rolling", 512, h, render_with(10), room=128)
    assert len(got.ids) == 105 and got.cut is None and got.start == 0


def test_rolling_cuts_the_oldest_turns_to_half_the_context():
    h = conv(20)          # 5 + 600 + 10 = 615 > 512 - 128
    got = C.fit("rolling", 512, h, render_with(10), room=128)
    # the smallest tail from a user turn with 5 + 30 k + 10 <= 256: k = 8 exchanges (255 tokens)
    assert len(got.ids) == 255 and got.start == 24
    cut = got.cut
    assert (cut.n_messages, cut.n_out, cut.n_tokens) == (24, 24, 615 - 255)
    assert (cut.first, cut.last, cut.kept_from, cut.policy) == ("u0", "a11", "u12", "rolling")
    assert not cut.during_reply


def test_the_next_turn_extends_the_same_prompt_until_it_fills_again():
    """After a cut the prompt starts at the cut's message: later turns are not cut again
    (their KV is reused) until the prompt once more leaves less than ``room``."""
    h = conv(20)
    h.start = 24                 # where the journaled cut left it
    got = C.fit("rolling", 512, h, render_with(10), room=128)
    assert got.cut is None and len(got.ids) == 5 + 8 * 30 + 10
    h = conv(31)
    h.start = 24                 # 5 + 19 * 30 + 10 = 585: cut again, past the old start
    got = C.fit("rolling", 512, h, render_with(10), room=128)
    assert got.start > 24 and len(got.ids) <= 256 and got.cut.n_out == got.start


def test_middle_keeps_the_first_exchange():
    h = conv(20)
    got = C.fit("middle", 512, h, render_with(10), room=128)
    # head: u0, a0 (30 tokens); the smallest tail with 5 + 30 + 30 k + 10 <= 256: k = 7
    assert len(got.ids) == 255 and got.head == 2 and got.start == 26
    assert (got.cut.first, got.cut.last, got.cut.kept_from, got.cut.n_messages) == ("u1", "a12", "u13", 24)


def test_stop_never_cuts():
    h = conv(20)
    got = C.fit("stop", 512, h, render_with(10), room=128)
    assert got.cut is None and len(got.ids) == 615   # the caller refuses it


def test_a_turn_longer_than_half_the_context_keeps_what_still_leaves_room():
    h = conv(4, user=10, reply=100)
    got = C.fit("rolling", 512, h, render_with(300), room=64)   # 5 + 440 + 300
    # no tail fits in 256; the smallest that leaves 64: the last exchange (5 + 110 + 300)
    assert len(got.ids) == 415 and got.start == 6 and got.cut.kept_from == "u3"
    got = C.fit("rolling", 512, h, render_with(400), room=64)
    # only the newest turn leaves 64 (405): the prompt holds no earlier message
    assert len(got.ids) == 405 and got.start == len(h.messages) and got.cut.kept_from == ""


def test_a_turn_that_cannot_fit_at_all_gives_none():
    h = conv(2)
    assert C.fit("rolling", 512, h, render_with(600), room=64) is None


def test_a_reply_reaching_the_end_is_cut_with_its_own_tokens_kept():
    h = conv(10)
    h.start = 4
    got = C.fit("rolling", 512, h, render_with(10), room=64, extra=200, must_cut=True)
    # prompt + 200 reply tokens <= 256: 5 + 30 k + 10 <= 56 -> k = 1
    assert len(got.ids) == 45 and got.start == 18 and got.cut.during_reply
    assert got.cut.n_messages == 14 and got.cut.n_out == 18


def test_a_reply_that_fills_the_context_alone_cannot_go_on():
    h = conv(0)
    assert C.fit("rolling", 512, h, render_with(10), room=64, extra=500, must_cut=True, min_room=32) is None


def test_cuts_fall_on_user_turns_only():
    msgs = [("u0", {"role": "user", "content": 10}), ("a0", {"role": "assistant", "content": 10}),
            ("t0", {"role": "tool", "content": 200}), ("a1", {"role": "assistant", "content": 10}),
            ("u1", {"role": "user", "content": 10}), ("a2", {"role": "assistant", "content": 10})]
    h = C.History(None, msgs)
    got = C.fit("rolling", 256, h, render_with(10), room=64)
    assert got.start == 4 and got.cut.kept_from == "u1"


def test_the_search_renders_few_prompts():
    """Bisection over the cut points: a 200-turn history costs a handful of renders."""
    h = conv(200)
    r = render_with(10)
    C.fit("rolling", 1024, h, r, room=256)
    assert len(r.calls) <= 12


def test_start_of_follows_the_latest_cut_still_in_the_conversation():
    msgs = [(f"m{i}", {"role": "user"}) for i in range(6)]
    assert C.start_of(msgs, ["m2", "m4"]) == 4
    assert C.start_of(msgs[:4], ["m2", "m4"]) == 2      # an edit dropped m4
    assert C.start_of(msgs, []) == 0


@pytest.mark.parametrize("policy", ["rolling", "middle"])
def test_cut_text_says_what_left_and_that_the_journal_keeps_it(policy):
    cut = C.P.ContextCut(policy=policy, n_messages=6, n_out=10, n_tokens=1234)
    text = C.cut_text(cut)
    assert "6 earlier messages (1,234 tokens) left the prompt, 10 in all" in text
    assert f"context policy {policy}" in text and "journal keeps every message" in text
