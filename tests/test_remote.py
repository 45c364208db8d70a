"""A remote OpenAI-compatible engine as a model.

The journal, the three positions and receipts stay here while the reply comes from
the endpoint. These tests drive an in-process Engine (default model loaded once per
session) whose models folder holds ``<name>.remote.json`` entries pointing at:

* ``tests/fakes/openai_server.py``: a scripted server for what a real one will not do
  on cue (drop the stream midway, answer 429/503, answer garbage) and for ordering
  checks (when the request arrived);
* AOTX's own gateway (a real OpenAI-compatible server: ``aotx gateway`` in a
  subprocess with its own data dir), here and in ``test_remote_peers.py`` with
  llama-cpp-python's server and a kill -9 of this engine.
"""

from __future__ import annotations

import pytest

from aotx.engine import protocol as P
from aotx.engine.runtime.catalog import RemoteSpec, write_remote
from tests.fakes.inproc import Client, answer, make_engine, reply, stop
from tests.fakes.openai_server import FakeOpenAI, free_port


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    return tmp_path


def add_remote(home, name: str, url: str, **kw) -> None:
    write_remote(home / "models", name, RemoteSpec(url=url, model=kw.pop("model", name), **kw))


def test_a_remote_reply_is_journaled_with_markers_and_receipts(loaded_model, home):
    with FakeOpenAI(delay_s=0.02) as srv:
        add_remote(home, "big", srv.url, model="org/Big-72B", api_key="sk-test")
        eng = make_engine(loaded_model, home)
        try:
            c = Client(eng)
            inner = c.sink
            conv = c.create(model="big", system_prompt="Be brief.")
            rid, end = None, None
            rid = c.post(lambda i: P.SubmitMessage(id=i, conv_id=conv.conv_id, text="Hi there",
                                                   sampling=P.SamplingParams(temperature=0.0, max_tokens=50)))
            end = reply(inner, rid)
            assert isinstance(end, P.Committed), end
            assert end.finish_reason == "stop" and end.text == "Hello from the remote side."
            assert end.n_completion == 6 and end.n_prompt == 7  # the server's usage
            # the user's message was durable before the request went out
            durable_at = next(t for t, e in zip(inner.times, inner.events)
                              if isinstance(e, P.Durable) and e.id == rid)
            (sent_at, body), = srv.requests
            assert durable_at < sent_at
            assert body["model"] == "org/Big-72B" and body["stream"] is True and body["max_tokens"] == 50
            assert body["messages"] == [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Hi there"}]
            assert srv.headers == ["Bearer sk-test"]
            # tokens committed as they arrived, each tick's with its seq; then the final receipt
            toks = inner.of(P.Token, rid)
            assert "".join(t.text for t in toks) == end.text and all(t.token_id == -1 for t in toks)
            last = inner.until(lambda e: isinstance(e, P.Durable) and e.id == rid and e.msg_id == end.msg_id)
            assert last.receipt.last_seq >= end.seq
        finally:
            stop(eng)
    # a restart finds it all, with receipts, on its model
    eng = make_engine(loaded_model, home)
    try:
        c = Client(eng)
        view = c.call(P.ShowConversation, P.ConversationInfo, conv_id=conv.conv_id).conversation
        assert view.model == "big"
        user, rep = view.messages
        assert user.text == "Hi there" and user.receipt is not None
        assert rep.text == "Hello from the remote side." and rep.status == "complete" and rep.model == "big"
        assert rep.receipt is not None
    finally:
        stop(eng)


def test_a_stream_dropped_midway_is_interrupted_and_the_conversation_goes_on(loaded_model, home):
    with FakeOpenAI(mode="drop", drop_after=3) as srv:
        add_remote(home, "flaky", srv.url)
        eng = make_engine(loaded_model, home)
        try:
            c = Client(eng)
            conv = c.create(model="flaky")
            rid, end = c.run(conv.conv_id, "Tell me", raw=False, n=50)
            assert isinstance(end, P.Committed) and end.finish_reason == "interrupted", end
            assert end.text == "Hello from the"
            assert any("dropped the stream midway" in n.message for n in c.sink.of(P.Notice, rid))
            view = c.call(P.ShowConversation, P.ConversationInfo, conv_id=conv.conv_id).conversation
            assert view.messages[-1].status == "interrupted" and view.messages[-1].text == "Hello from the"
            # continuable: the next message carries the interrupted reply in its history
            srv.mode = "ok"
            rid2, end2 = c.run(conv.conv_id, "Go on", raw=False, n=50)
            assert isinstance(end2, P.Committed) and end2.finish_reason == "stop", end2
            msgs = srv.requests[-1][1]["messages"]
            assert msgs[-2:] == [{"role": "assistant", "content": "Hello from the"},
                                 {"role": "user", "content": "Go on"}]
        finally:
            stop(eng)


def test_429_is_retried_then_served(loaded_model, home):
    with FakeOpenAI(mode="status", status=429, fail_times=2) as srv:
        add_remote(home, "busy", srv.url)
        eng = make_engine(loaded_model, home)
        try:
            c = Client(eng)
            conv = c.create(model="busy")
            _, end = c.run(conv.conv_id, "Hi", raw=False, n=20)
            assert isinstance(end, P.Committed) and end.text == "Hello from the remote side.", end
            assert len(srv.requests) == 3
        finally:
            stop(eng)


def test_503_fails_that_reply_only_and_keeps_the_message(loaded_model, home):
    with FakeOpenAI(mode="status", status=503) as srv:
        add_remote(home, "down", srv.url)
        eng = make_engine(loaded_model, home)
        try:
            c = Client(eng)
            conv = c.create(model="down")
            local = c.create()
            rid = c.submit(conv.conv_id, "Hi", raw=False, n=20)
            rid_local = c.submit(local.conv_id, "The capital of France is", n=4)
            err = answer(c.sink, rid)
            assert isinstance(err, P.Error) and err.code == "busy" and "HTTP 503" in err.message, err
            assert "the server is busy (503)" in err.message
            end_local = reply(c.sink, rid_local)  # the local model was not disturbed
            assert isinstance(end_local, P.Committed) and end_local.n_completion == 4
            assert len(srv.requests) == 4  # the first try and three retries
            view = c.call(P.ShowConversation, P.ConversationInfo, conv_id=conv.conv_id).conversation
            assert view.messages[0].text == "Hi" and view.messages[1].status == "failed"
        finally:
            stop(eng)


@pytest.mark.parametrize("what", ["not there", "garbage"])
def test_a_server_that_is_not_there_or_answers_garbage_is_a_clear_error(loaded_model, home, what):
    with FakeOpenAI(mode="garbage") as srv:
        url = srv.url if what == "garbage" else f"http://127.0.0.1:{free_port()}/v1"
        add_remote(home, "odd", url)
        eng = make_engine(loaded_model, home)
        try:
            c = Client(eng)
            conv = c.create(model="odd")
            rid = c.submit(conv.conv_id, "Hi", raw=False)
            err = answer(c.sink, rid)
            assert isinstance(err, P.Error), err
            want = "does not answer" if what == "not there" else "not an OpenAI event stream"
            assert want in err.message and "remote model odd" in err.message, err.message
            assert len(err.message.splitlines()) == 1
            # nothing else broke: the engine serves the default model
            local = c.create()
            _, end = c.run(local.conv_id, "Hi", n=2)
            assert isinstance(end, P.Committed)
        finally:
            stop(eng)


def test_remote_refuses_attachments_and_lists_as_remote(loaded_model, home, tmp_path):
    with FakeOpenAI() as srv:
        add_remote(home, "big", srv.url, context=32768)
        eng = make_engine(loaded_model, home)
        try:
            c = Client(eng)
            by = {m.name: m for m in c.call(P.ListModels, P.ModelList).models}
            assert by["big"].kind == "remote" and by["big"].url == srv.url and by["big"].n_ctx_train == 32768
            conv = c.create(model="big")
            f = tmp_path / "a.png"
            f.write_bytes(b"\x89PNG")
            rid = c.post(lambda i: P.SubmitMessage(id=i, conv_id=conv.conv_id, text="see",
                                                   attachments=[P.Attachment(path=str(f), kind="image")]))
            err = answer(c.sink, rid)
            assert isinstance(err, P.Error) and "attachments are not sent to the remote model big" in err.message
            assert srv.requests == []
        finally:
            stop(eng)


def test_cancel_a_remote_reply(loaded_model, home):
    with FakeOpenAI(words=[f" w{i}" for i in range(200)], delay_s=0.05) as srv:
        add_remote(home, "slow", srv.url)
        eng = make_engine(loaded_model, home)
        try:
            c = Client(eng)
            conv = c.create(model="slow")
            rid = c.submit(conv.conv_id, "Count", raw=False, n=500)
            c.sink.until(lambda e: isinstance(e, P.Token) and e.id == rid)
            c.post(lambda i: P.Cancel(id=i, target=rid))
            end = reply(c.sink, rid)
            assert isinstance(end, P.Committed) and end.finish_reason == "cancelled"
            assert 0 < end.n_completion < 200
        finally:
            stop(eng)


def test_a_key_variable_missing_from_the_engines_environment_is_refused_before_journaling(
        loaded_model, home, monkeypatch):
    """Regression: `VLLM_API_KEY=x aotx run --model big` against an engine started
    without it said only "the API key variable VLLM_API_KEY is not set" (it was set, in the
    wrong process) and journaled the message with a failed reply. Now the message says it
    is the engine's environment and how to fix it, and nothing is journaled."""
    monkeypatch.delenv("AOTX_TEST_NO_SUCH_KEY", raising=False)
    with FakeOpenAI() as srv:
        add_remote(home, "big", srv.url, api_key_env="AOTX_TEST_NO_SUCH_KEY")
        eng = make_engine(loaded_model, home)
        try:
            c = Client(eng)
            conv = c.create(model="big")
            rid = c.post(lambda i: P.SubmitMessage(id=i, conv_id=conv.conv_id, text="Hi",
                                                   sampling=P.SamplingParams(max_tokens=5)))
            err = answer(c.sink, rid)
            assert isinstance(err, P.Error) and err.code == "bad_request", err
            assert "AOTX_TEST_NO_SUCH_KEY is not set in the engine's environment" in err.message, err.message
            assert "`aotx stop`" in err.message
            assert not c.sink.of(P.Accepted, rid)  # refused, not accepted then failed
            assert srv.requests == []
            view = c.call(P.ShowConversation, P.ConversationInfo, conv_id=conv.conv_id).conversation
            assert view.messages == []
        finally:
            stop(eng)


def test_bug_a_multi_line_data_event_was_refused_and_each_reply_opened_a_client(loaded_model, home):
    """The SSE format lets one event's data span several ``data:`` lines (joined with
    newlines); the reader took each line as an event and refused the stream. It also
    opened an HTTP client per reply. Now events are read with httpx-sse and every reply of a
    remote model goes over its one client (its kept-alive connection: one client port)."""
    with FakeOpenAI(mode="multiline") as srv:
        add_remote(home, "ml", srv.url, model="m")
        eng = make_engine(loaded_model, home)
        try:
            c = Client(eng)
            for _ in range(2):
                conv = c.create(model="ml")
                rid = c.post(lambda i: P.SubmitMessage(id=i, conv_id=conv.conv_id, text="Hi",
                                                       sampling=P.SamplingParams(max_tokens=20)))
                end = reply(c.sink, rid)
                assert isinstance(end, P.Committed) and end.text == "Hello from the remote side.", end
                assert end.finish_reason == "stop" and end.n_prompt == 7
            assert len(srv.peers) == 2 and srv.peers[0] == srv.peers[1]  # one connection, kept alive
        finally:
            stop(eng)
