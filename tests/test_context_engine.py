"""Long conversations on the engine: context policies end to end, on the default model.

A conversation that outgrows its context goes on under the default policy ("rolling"):
older turns leave the prompt, every turn is answered, the journal keeps every message,
the cut is shown where it happens (a ``context`` notice with the numbers, the reply's
``context`` in the conversation) and the turns after a cut reuse the prompt's KV.
"stop" refuses as before, saying how to go on. A reply that reaches the end of the
context goes on under the same policy, or ends with a notice saying why.
"""

from __future__ import annotations

import asyncio

from aotx.engine import protocol as P
from aotx.engine.errors import EngineError
from aotx.engine.runtime.store import open_store

SYSTEM = "You are a patient assistant. Answer in one short sentence."
TOPICS = ["rain", "bread", "the moon", "chess", "rivers", "owls", "glass", "trains"]


def greedy(n: int) -> P.SamplingParams:
    return P.SamplingParams(temperature=0.0, repeat_penalty=1.0, max_tokens=n)


async def turn(c, conv_id: str, text: str, n: int, timeout: float = 120) -> list:
    out = []

    async def go():
        async for ev in c.submit(conv_id, text, sampling=greedy(n)):
            out.append(ev)

    await asyncio.wait_for(go(), timeout)
    return out


def done(evs) -> P.Committed:
    got = [e for e in evs if isinstance(e, P.Committed)]
    assert len(got) == 1, [e for e in evs if isinstance(e, (P.Error, P.Notice))]
    return got[0]


async def test_a_64_turn_conversation_at_1024_tokens_runs_to_the_end(engine_server, tmp_path):
    """The goal of the default policy: 64 turns through a 1,024-token context, every turn
    answered, every message in the journal (read back from disk), the cuts shown, and the
    turns between cuts prefilled only from where the last prompt's KV ends."""
    h = engine_server(slots=1, context=1024, prefill_chunk=256)
    c = await h.connect()
    conv = (await c.create_conversation(title="long", system_prompt=SYSTEM)).conv_id
    cuts, reused, prompts = [], 0, []
    for i in range(64):
        evs = await turn(c, conv, f"Turn {i}: tell me one fact about {TOPICS[i % len(TOPICS)]}.", 8)
        assert not any(isinstance(e, P.Error) for e in evs), evs
        end = done(evs)
        assert end.finish_reason in ("stop", "length") and end.n_completion >= 1
        acc = next(e for e in evs if isinstance(e, P.Accepted))
        prompts.append(len(acc.prompt_ids))
        assert len(acc.prompt_ids) + 8 <= 1024
        notes = [e for e in evs if isinstance(e, P.Notice) and e.kind == "context"]
        if notes:
            cuts.append((i, notes[0].cut))
            assert notes[0].cut is not None and notes[0].cut.n_messages > 0
            assert "left the prompt" in notes[0].message
        elif i:
            reused += end.timings["prompt_tokens_reused"] > 0
    assert cuts, "64 turns of this length must outgrow 1,024 tokens"
    first = cuts[0][0]
    # a cut leaves the prompt at most half the context, so several turns pass between cuts,
    # each reusing the KV of the one before
    assert all(b - a >= 3 for (a, _), (b, _) in zip(cuts, cuts[1:])), [i for i, _ in cuts]
    assert reused >= 64 - len(cuts) - 2, (reused, len(cuts))
    assert prompts[first] <= 1024 // 2 + 64
    view = await c.show(conv)
    assert len(view.messages) == 128
    assert all(m.status == "complete" for m in view.messages), [m.status for m in view.messages]
    with_cut = [m for m in view.messages if m.context is not None]
    assert len(with_cut) == len(cuts) and all(m.role == "assistant" for m in with_cut)
    ids = [m.msg_id for m in view.messages]
    # each cut keeps a later start than the one before, at a user message
    starts = [ids.index(m.context.kept_from) for m in with_cut]
    assert starts == sorted(starts) and all(view.messages[s].role == "user" for s in starts)
    await c.close()
    h.stop()
    again = open_store(tmp_path / "journal0")       # every message, read back from the journal's files
    try:
        got = again.get(conv)
        assert len(got.messages) == 128 and [m.msg_id for m in got.messages] == ids
        assert [m.text for m in got.messages] == [m.text for m in view.messages]
    finally:
        again.close()


async def test_stop_refuses_a_history_that_does_not_fit_and_says_how_to_go_on(engine_server):
    h = engine_server(slots=1, context=256)
    c = await h.connect()
    history = [("user", f"Tell me about {t}, please, in some detail.") if k % 2 == 0 else
               ("assistant", f"{t.capitalize()} is a large subject with many parts worth a long talk.")
               for t in TOPICS for k in range(2)]
    conv = (await c.create_conversation(messages=history, context="stop")).conv_id
    assert (await c.show(conv)).context == "stop"
    evs = await turn(c, conv, "And one more thing?", 4)
    notice = next(e for e in evs if isinstance(e, P.Notice))
    assert notice.kind == "refused" and "`/context rolling`" in notice.message, notice
    assert isinstance(evs[-1], P.Error) and evs[-1].code == "too_long"
    view = await c.set_context(conv, "rolling")
    assert view.context == "rolling"
    evs = await turn(c, conv, "And one more thing?", 4)
    done(evs)
    note = next(e for e in evs if isinstance(e, P.Notice) and e.kind == "context")
    assert note.cut.policy == "rolling" and note.cut.n_messages >= 2
    with_cut = [m for m in (await c.show(conv)).messages if m.context is not None]
    assert len(with_cut) == 1 and with_cut[0].context.kept_from
    await c.close()


async def test_a_bad_policy_is_refused_naming_it(engine_server):
    h = engine_server(slots=1, context=256)
    c = await h.connect()
    conv = (await c.create_conversation()).conv_id
    try:
        await c.set_context(conv, "forever")
        raise AssertionError("a bad policy was taken")
    except EngineError as e:
        assert "forever" in str(e) and "rolling" in str(e)
    await c.close()


COUNT = "Write a long story about a dragon, at least 500 words."  # greedy: runs past 250 tokens


async def test_a_reply_reaching_the_end_of_the_context_goes_on_after_a_cut(engine_server):
    """Under "rolling" a reply that fills the context is not cut short: the earlier turns
    leave the prompt, the reply so far is prefilled again after it, and decoding goes on
    to the reply's own limit. Its tokens and text stay one reply, in the stream and in the
    journal."""
    h = engine_server(slots=1, context=256, prefill_chunk=256)
    c = await h.connect()
    history = [("user", f"Tell me about {t}.") if k % 2 == 0 else
               ("assistant", f"{t.capitalize()} is interesting in many ways.") for t in TOPICS[:6] for k in range(2)]
    conv = (await c.create_conversation(messages=history)).conv_id
    evs = await turn(c, conv, COUNT, 160, timeout=300)
    end = done(evs)
    acc = next(e for e in evs if isinstance(e, P.Accepted))
    toks = [e for e in evs if isinstance(e, P.Token)]
    assert len(acc.prompt_ids) + end.n_completion > 256, "the reply must reach the end of the context"
    assert end.finish_reason in ("length", "stop") and end.n_completion == len(toks)
    notes = [e for e in evs if isinstance(e, P.Notice) and e.kind == "context"]
    assert notes and notes[-1].cut is not None and notes[-1].cut.during_reply, notes
    assert "goes on" in notes[-1].message
    # positions start again lower after the cut (the prompt got shorter), each one step on
    pos = [t.pos for t in toks]
    drops = [i for i in range(1, len(pos)) if pos[i] != pos[i - 1] + 1]
    assert len(drops) == len(notes) and all(pos[i] < pos[i - 1] for i in drops)
    assert max(pos) < 256
    reply = (await c.show(conv)).messages[-1]
    assert reply.text == "".join(t.text for t in toks) == end.text
    assert reply.token_ids == [t.token_id for t in toks]
    assert reply.context is not None and reply.context.during_reply
    await c.close()


async def test_a_reply_that_fills_the_context_alone_ends_with_a_notice(engine_server):
    h = engine_server(slots=1, context=96, prefill_chunk=256)
    c = await h.connect()
    conv = (await c.create_conversation()).conv_id
    evs = await turn(c, conv, COUNT, 200, timeout=300)
    end = done(evs)
    assert end.finish_reason == "context"
    note = next(e for e in evs if isinstance(e, P.Notice) and e.kind == "context")
    assert "reached the end of the context (96 tokens) and stopped" in note.message
    assert "the newest turn and the reply alone fill it" in note.message
    await c.close()
