"""The engine checks every field of every operation, whoever the client is, and a refused
operation writes nothing.

Regression tests: before, the engine protocol accepted temperature NaN, repeat_penalty
-2 or 0 and max_tokens -5 (the CLI and the gateway checked them, the engine did not) and
journaled garbage; a ``CreateConversation`` refused for "no journal credit" had already
journaled the conversation and its first message. The messages are the CLI's own for
the same value (``--temperature`` on the command line, ``temperature`` in an operation).
"""

from __future__ import annotations

import math

import pytest

from aotx.engine.errors import ErrorCode, UsageError
from aotx.engine import protocol as P
from tests.fakes.sink import EventSink

BAD_SAMPLING = [  # (field, value, the CLI flag's text for it or None when the CLI has no such flag)
    ("temperature", math.nan, "nan"),
    ("temperature", -0.5, "-0.5"),
    ("temperature", 101.0, "101"),
    ("repeat_penalty", -2.0, "-2"),
    ("repeat_penalty", 0.0, "0"),
    ("max_tokens", -5, "-5"),
    ("max_tokens", 0, "0"),
    ("top_p", 1.5, "1.5"),
    ("top_p", math.nan, "nan"),
    ("min_p", -0.1, "-0.1"),
    ("top_k", -1, "-1"),
    ("seed", -1, "-1"),
    ("repeat_last_n", -2, None),
]


def _cli_message(flag_value: str, field: str) -> str:
    from aotx.engine.cli.commands import build_parser

    with pytest.raises(UsageError) as e:
        build_parser().parse_args(["run", "--" + field.replace("_", "-"), flag_value, "hi"])
    return str(e.value)


@pytest.mark.parametrize("field,value,flag", BAD_SAMPLING, ids=[f"{f}={v}" for f, v, _ in BAD_SAMPLING])
def test_sampling_problem_names_the_field_as_the_cli_does(field, value, flag):
    why = P.sampling_problem(P.SamplingParams(**{field: value}))
    assert why is not None and why.startswith(f"{field} must be "), why
    if flag is not None:  # the CLI's message for the same value, its flag in the field's place
        cli = _cli_message(flag, field)
        assert why.replace(field, "--" + field.replace("_", "-"), 1) in cli, (why, cli)


@pytest.mark.parametrize("sp,problem", [
    (P.SamplingParams(), None),
    (P.SamplingParams(temperature=0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, repeat_last_n=-1,
                      seed=(1 << 64) - 1, max_tokens=1, stop=["\n"], speculative="ngram"), None),
    (P.SamplingParams(top_k=2.5), "top_k must be an integer, got 2.5"),
    (P.SamplingParams(temperature="hot"), "temperature must be a number, got 'hot'"),
    (P.SamplingParams(temperature=True), "temperature must be a number, got True"),
    (P.SamplingParams(seed=1 << 64), "seed must be between 0 and 18446744073709551615"),
    (P.SamplingParams(stop=["x"] * 65), "stop strings: at most 64"),
    (P.SamplingParams(stop=["x" * 1025]), "stop strings: at most 64 of at most 1024 characters"),
    (P.SamplingParams(stop=[3]), "stop must be a list of strings"),
    (P.SamplingParams(speculative="medusa"), "speculative mode 'medusa' is not available"),
])
def test_sampling_problem_table(sp, problem):
    got = P.sampling_problem(sp)
    assert (got is None) if problem is None else (got is not None and got.startswith(problem)), got


@pytest.mark.parametrize("op,problem", [
    (P.Cancel(id=1, target=-3), "target must be a request id"),
    (P.SubmitMessage(id=1, conv_id="c", text="x", attachments=[P.Attachment(path="a.mp4", kind="video")]),
     "a.mp4: unknown attachment kind 'video'"),
    (P.SubmitMessage(id=1, conv_id="c", text="x", attachments=[P.Attachment(path="", kind="image")]),
     "an attachment needs the path"),
    (P.SubmitMessage(id=1, conv_id="c", text=5), "text must be a string"),
    (P.SubmitMessage(id="1", conv_id="c", text="x"), "id must be an integer"),
    (P.CreateConversation(id=1, messages=[P.PriorMessage(role="system", text="x")]), "prior message role 'system'"),
    (P.UpdateConversation(id=1, conv_id="c", sampling=P.SamplingParams(min_p=2.0)), "min_p must be between"),
    (P.Welcome(protocol=1, engine="x", model="m", device="cpu"), "unexpected message type Welcome"),
])
def test_operation_problem_table(op, problem):
    got = P.operation_problem(op)
    assert got is not None and got.startswith(problem), got


# ---- the engine, whoever the client is --------------------------------------------------


@pytest.fixture(scope="module")
def tiny_lm(tiny_gguf, tmp_path_factory):
    from aotx.engine.model.loader import load_model

    return load_model(tiny_gguf.write_tiny_llama(tmp_path_factory.mktemp("validation") / "t.gguf", seed=3))


@pytest.fixture
def engine(tiny_lm, tmp_path):
    """factory(buffer_bytes) -> a started Engine on a journal of that buffer size."""
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store

    made = []

    def start(buffer_bytes: int = 8 << 20):
        store = open_store(tmp_path / f"journal{len(made)}", buffer_bytes=buffer_bytes)
        eng = Engine(tiny_lm, store, n_slots=2, n_ctx=128)
        eng.start()
        made.append(eng)
        return eng

    yield start
    for eng in made:
        eng.stop()
        eng.store.close()


def _ask(eng, op):
    s = EventSink()
    eng.post(op, s)
    return s.wait(60), s


def _create(eng, **kw) -> str:
    done, _ = _ask(eng, P.CreateConversation(id=1, **kw))
    assert isinstance(done, P.ConversationInfo), done
    return done.conversation.conv_id


@pytest.mark.parametrize("field,value,flag", BAD_SAMPLING, ids=[f"{f}={v}" for f, v, _ in BAD_SAMPLING])
def test_engine_refuses_bad_sampling_and_writes_nothing(engine, field, value, flag):
    eng = engine()
    cid = _create(eng)
    seq = eng.store.journal.last_seq
    bad = P.SamplingParams(**{field: value})
    for op in (P.SubmitMessage(id=2, conv_id=cid, text="hello", raw=True, sampling=bad),
               P.CreateConversation(id=3, title="t", sampling=bad),
               P.UpdateConversation(id=4, conv_id=cid, sampling=bad)):
        err, sink = _ask(eng, op)
        assert isinstance(err, P.Error) and err.code == ErrorCode.BAD_REQUEST, sink.events
        assert err.message == P.sampling_problem(bad)
        assert not sink.all(P.Accepted)
    assert eng.store.journal.last_seq == seq, "a refused operation wrote records"
    assert [c.conv_id for c in eng.store.table.live()] == [cid]
    # the engine still serves a valid message on the same conversation
    done, sink = _ask(eng, P.SubmitMessage(id=5, conv_id=cid, text="hello", raw=True,
                                           sampling=P.SamplingParams(temperature=0.0, max_tokens=3)))
    assert isinstance(done, P.Committed) and done.n_completion >= 1, sink.events


def test_refused_create_for_journal_credit_leaves_nothing_behind(engine):
    """A conversation whose first message cannot get journal credit is
    refused whole; before, the conversation and the message were journaled anyway."""
    eng = engine(buffer_bytes=64 << 10)
    st = eng.store
    seq = st.journal.last_seq
    big = "x" * (100 << 10)  # larger than the journal's buffer: can never fit
    err, _ = _ask(eng, P.CreateConversation(id=1, title="big", messages=[P.PriorMessage(role="user", text=big)]))
    assert isinstance(err, P.Error) and err.code == ErrorCode.TOO_LONG and "journal" in err.message, err
    assert st.journal.last_seq == seq and not list(st.table.live())
    # fits the buffer, but not now: the credit is taken (the disk is behind)
    free = st.journal.free_bytes
    assert st.journal.reserve(free - 1000)
    err, _ = _ask(eng, P.CreateConversation(id=2, title="later", messages=[P.PriorMessage(role="user",
                                                                                            text="y" * 20_000)]))
    assert isinstance(err, P.Error) and err.code == ErrorCode.BUSY and "journal credit" in err.message, err
    assert st.journal.last_seq == seq and not list(st.table.live())
    st.journal.release(free - 1000)
    cid = _create(eng, title="later", messages=[P.PriorMessage(role="user", text="y" * 20_000)])
    assert st.view(cid).n_messages == 1


def test_message_without_credit_is_held_then_runs(engine):
    """No journal credit for a message: a "held" notice, nothing written, and the message
    runs once receipts free the buffer."""
    eng = engine(buffer_bytes=64 << 10)
    st = eng.store
    cid = _create(eng)
    seq = st.journal.last_seq
    taken = st.journal.free_bytes - 500
    assert st.journal.reserve(taken)
    s = EventSink()
    eng.post(P.SubmitMessage(id=7, conv_id=cid, text="hello", raw=True,
                             sampling=P.SamplingParams(temperature=0.0, max_tokens=3)), s)
    deadline = 50
    while not s.all(P.Notice) and deadline:
        s.done.wait(0.1)
        deadline -= 1
    held = s.one(P.Notice)
    assert held.kind == "held" and held.resource == "journal" and held.asked > held.free, held
    assert st.journal.last_seq == seq and not s.all(P.Accepted)
    st.journal.release(taken)
    _create(eng, title="another")  # its records flush: the receipt lets the held message through
    done = s.wait(60)
    assert isinstance(done, P.Committed) and done.n_completion >= 1, s.events
    assert s.one(P.Accepted).conv_id == cid
