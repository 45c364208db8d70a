"""The preparation stage: a message's prompt
is made on a worker, never on the tick thread, within bounds.

An in-process Engine over a tiny llama whose GGUF carries the hostile chat template
of the report. One conversation streams a long raw reply (no template) while another
sends what used to stall everyone: the template (10^10 loop iterations), a 10 MB
message. The stream keeps producing tokens while those are refused, the refusal
names the template or the context, nothing is journaled, and the engine stops
promptly on request even mid-render (SIGTERM used to be ignored).
"""

from __future__ import annotations

import threading
import time

import pytest

from aotx.engine.errors import ErrorCode
from aotx.engine import protocol as P
from aotx.engine.model.loader import load_model
from aotx.engine.runtime.engine import Engine
from aotx.engine.runtime.store import open_store
from tests.fakes.sink import EventSink

HOSTILE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


class TimedSink(EventSink):
    """EventSink that also records when each token arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.token_times: list[float] = []

    def send(self, m) -> None:
        if isinstance(m, P.Token):
            self.token_times.append(time.monotonic())
        super().send(m)


@pytest.fixture(scope="module")
def hostile_lm(tiny_gguf, tmp_path_factory):
    p = tiny_gguf.write_tiny_llama(tmp_path_factory.mktemp("hostile") / "evil.gguf", context_length=4096,
                                   metadata={"tokenizer.chat_template": HOSTILE, "general.name": "Evil Tiny"})
    return load_model(p, device="cpu")


@pytest.fixture
def engine(hostile_lm, tmp_path):
    engines = []

    def start(journal: bool = False, n_ctx: int = 2048) -> Engine:
        store = open_store(tmp_path / f"j{len(engines)}" if journal else None)
        eng = Engine(hostile_lm, store, n_slots=2, n_ctx=n_ctx, prefill_chunk=64, device="cpu")
        eng.start()
        engines.append((eng, store))
        return eng

    yield start
    for eng, store in engines:
        eng.stop()
        store.close()


def create(eng: Engine, title: str) -> str:
    s = EventSink()
    eng.post(P.CreateConversation(id=1, title=title), s)
    return s.wait(30).conversation.conv_id


def start_stream(eng: Engine, n: int = 4000) -> TimedSink:
    """A long greedy raw reply (the template is never rendered for raw text; on this
    tiny model "the" runs to its max_tokens)."""
    conv = create(eng, "streamer")
    s = TimedSink()
    eng.post(P.SubmitMessage(id=7, conv_id=conv, text="the", raw=True,
                             sampling=P.SamplingParams(temperature=0.0, max_tokens=n)), s)
    return s


def tokens_between(s: TimedSink, t0: float, t1: float) -> int:
    return sum(1 for t in s.token_times if t0 <= t <= t1)


def test_hostile_template_is_refused_while_another_stream_flows(engine):
    """Regression: the template hung the engine; other clients timed
    out. It renders on a worker now: a stream started while it renders runs meanwhile
    (the old engine rendered on the tick thread: not one token until the render ended)."""
    eng = engine(n_ctx=4096)
    conv = create(eng, "victim of the template")
    s = EventSink()
    eng.post(P.SubmitMessage(id=9, conv_id=conv, text="hi"), s)
    time.sleep(0.2)  # the render is under way
    t0 = time.monotonic()
    stream = start_stream(eng)
    err = s.wait(120)
    t1 = time.monotonic()
    assert isinstance(err, P.Error) and err.code == ErrorCode.BAD_REQUEST, s.events
    assert err.message.startswith("tokenizer.chat_template of 'Evil Tiny' was stopped: it ran for more than 2 s "
                                  "of CPU time"), err.message
    assert tokens_between(stream, t0, t1) >= 100, (t1 - t0, len(stream.token_times))
    assert not s.all(P.Accepted)  # refused before acceptance
    # the conversation is free again and holds nothing of the refused message
    view = EventSink()
    eng.post(P.ShowConversation(id=10, conv_id=conv), view)
    assert view.wait(30).conversation.messages == []


def test_engine_stops_promptly_while_a_template_renders(engine):
    """Regression: SIGTERM was ignored while the template ran (the
    stop request waits for the tick, and the tick waited for the render)."""
    eng = engine()
    conv = create(eng, "stop me")
    eng.post(P.SubmitMessage(id=3, conv_id=conv, text="hi"), EventSink())
    time.sleep(0.2)  # the render is under way on a worker
    t0 = time.monotonic()
    eng.stop()
    assert not eng._thread.is_alive()
    assert time.monotonic() - t0 < 5


def test_ten_megabyte_message_is_refused_at_once_and_writes_nothing(engine):
    """Regression: a 10 MB message stopped another client's stream
    for up to 9.6 s (it was tokenized on the tick thread). It cannot fit the context
    whatever its tokens, so it is refused before any tokenization; journaled: nothing."""
    eng = engine(journal=True)
    conv = create(eng, "big paste")
    s = EventSink()
    text = "word " * 2_000_000
    t0 = time.monotonic()
    eng.post(P.SubmitMessage(id=5, conv_id=conv, text=text, raw=True), s)
    err = s.wait(60)
    t1 = time.monotonic()
    assert isinstance(err, P.Error) and err.code == ErrorCode.TOO_LONG, s.events
    assert "the message is 10,000,000 characters, at least" in err.message and "the context holds 2,048" in \
        err.message, err.message
    refused = s.one(P.Notice)
    assert refused.kind == "refused" and refused.resource == "context" and refused.free == 2048
    assert t1 - t0 < 10
    view = EventSink()
    eng.post(P.ShowConversation(id=6, conv_id=conv), view)
    assert view.wait(30).conversation.messages == []


def test_conversation_is_busy_while_its_message_is_prepared_and_cancel_ends_it(engine):
    eng = engine()
    conv = create(eng, "busy")
    first = EventSink()
    eng.post(P.SubmitMessage(id=11, conv_id=conv, text="hi"), first)  # the hostile template: ~2 s
    time.sleep(0.1)
    second = EventSink()
    eng.post(P.SubmitMessage(id=12, conv_id=conv, text="again", raw=True), second)
    err = second.wait(30)
    assert err.code == ErrorCode.BUSY and "is preparing a message" in err.message
    cancel = EventSink()
    eng.post(P.Cancel(id=13, conv_id=conv), cancel)
    assert isinstance(cancel.wait(30), P.Ok)
    ended = first.wait(30)
    assert ended.code == ErrorCode.CANCELLED and "nothing was written" in ended.message
    # free at once: a raw message is accepted and answered while the old render winds down
    third = EventSink()
    eng.post(P.SubmitMessage(id=14, conv_id=conv, text="hello", raw=True,
                             sampling=P.SamplingParams(temperature=0.0, max_tokens=3)), third)
    assert isinstance(third.wait(60), P.Committed), third.events
    time.sleep(3)  # the cancelled render's result arrives and is dropped: no second reply, no error
    assert len(first.all(P.Error)) == 1 and not first.all(P.Accepted)


def test_long_message_that_fits_is_tokenized_exactly(engine):
    """A message long enough to take the GIL-free tokenization path (and to pass the
    size floor) is prepared on a worker, with the same ids as a direct encode."""
    eng = engine(n_ctx=4096)
    conv = create(eng, "long")
    s = EventSink()
    text = "hello the world " * 300  # 4,800 characters: passes the size floor, ~1,500+ tokens
    eng.post(P.SubmitMessage(id=21, conv_id=conv, text=text, raw=True,
                             sampling=P.SamplingParams(temperature=0.0, max_tokens=2)), s)
    final = s.wait(120)
    assert isinstance(final, P.Committed), s.events
    acc = s.one(P.Accepted)
    tok = eng.lm.tokenizer
    assert acc.prompt_ids == tok.encode(text, add_special=True, parse_special=False)


def test_tokenizer_long_fragments_same_ids(hostile_lm):
    """encode() takes the GIL-free path for long fragments: the ids are the same."""
    tok = hostile_lm.tokenizer
    text = ("hello the world, héllo! 123 " * 400)
    assert len(text) > 4096
    short = [i for chunk in [text] for i in tok._hf.encode(chunk, add_special_tokens=False).ids]
    assert tok.encode(text) == short


def test_prepare_worker_survives_a_bug(engine, monkeypatch):
    """A bug in a preparation is an internal Error to that client, and the next message
    is prepared as usual (the worker thread lives on)."""
    eng = engine()
    conv = create(eng, "bug")
    real = eng.submitter._prepare
    calls = []

    def flaky(sub, history, parts=None):
        calls.append(1)
        if len(calls) == 1:
            raise ZeroDivisionError("boom")
        return real(sub, history, parts)

    monkeypatch.setattr(eng.submitter, "_prepare", flaky)
    s = EventSink()
    eng.post(P.SubmitMessage(id=31, conv_id=conv, text="x", raw=True), s)
    err = s.wait(30)
    assert err.code == ErrorCode.INTERNAL and "boom" in err.message
    s2 = EventSink()
    eng.post(P.SubmitMessage(id=32, conv_id=conv, text="x", raw=True,
                             sampling=P.SamplingParams(temperature=0.0, max_tokens=2)), s2)
    assert isinstance(s2.wait(60), P.Committed)
    assert threading.active_count() > 0


def test_preparer_keeps_each_clients_order_and_lets_clients_take_turns():
    """One client's preparations run in the order sent (its messages are accepted in
    that order); another client's message waits for at most one of them, not all."""
    from types import SimpleNamespace

    from aotx.engine.runtime.events import Inbox
    from aotx.engine.runtime.prepare import Preparer

    inbox = Inbox()
    prep = Preparer(inbox, n_workers=1)
    a, b = object(), object()

    def job(name, seconds):
        def work():
            time.sleep(seconds)
            return name, []
        return work

    for i in range(3):
        prep.submit(SimpleNamespace(sink=a), job(f"a{i}", 0.2))
    prep.submit(SimpleNamespace(sink=b), job("b0", 0.0))
    order = []
    while len(order) < 4:
        ev = inbox.get(10)
        assert ev is not None, order
        order.append(ev.text)
    assert order == ["a0", "b0", "a1", "a2"]

    prep2 = Preparer(inbox, n_workers=2)  # two workers: still one at a time per client
    for i in range(4):
        prep2.submit(SimpleNamespace(sink=a), job(f"a{i}", 0.05 * (4 - i)))  # later ones are quicker
    got = [inbox.get(10).text for _ in range(4)]
    assert got == ["a0", "a1", "a2", "a3"]
