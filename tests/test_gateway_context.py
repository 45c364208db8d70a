"""The gateway and context policies: ``context_policy`` in a chat request sets the
conversation's policy, and a reply whose prompt left earlier messages out says so in its
``aotx.context`` (the engine's cuts, with their numbers)."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from tests.gateway_support import KEY, engine_call, gateway, start_engine, stop_engine  # noqa: E402

CHAT = "/v1/chat/completions"
TOPICS = ["rain", "bread", "the moon", "chess", "rivers", "owls", "glass", "trains"]
HISTORY = [m for t in TOPICS for m in ({"role": "user", "content": f"Tell me about {t}, in some detail please."},
                                       {"role": "assistant", "content": f"{t.capitalize()} is a large subject with "
                                                                        f"many parts worth a long talk."})]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, default_model_path):
    home = tmp_path_factory.mktemp("gw-context")
    proc, sock = start_engine(home, None, slots=1, context=256, timeout=120)
    yield sock
    stop_engine(proc)


@pytest.fixture(scope="module")
def gw(engine):
    with gateway(engine) as url:
        yield url


def post(gw, body):
    with httpx.Client(base_url=gw, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as h:
        return h.post(CHAT, json=body)


def test_a_history_past_the_context_is_cut_and_the_response_says_where(gw, engine):
    r = post(gw, {"messages": HISTORY + [{"role": "user", "content": "And glass?"}], "max_tokens": 2,
                  "temperature": 0})
    assert r.status_code == 200, r.text
    aotx = r.json()["aotx"]
    (cut,) = aotx["context"]
    assert cut["policy"] == "rolling" and cut["n_messages"] >= 2 and cut["n_tokens"] > 0
    assert cut["n_out"] == cut["n_messages"] and cut["n_out"] % 2 == 0     # whole exchanges, from the oldest
    view = engine_call(engine, lambda c: c.show(aotx["conversation"]))
    assert len(view.messages) == len(HISTORY) + 2                          # the journal keeps every message
    assert view.messages[-1].context is not None and view.messages[-1].context.n_out == cut["n_out"]


def test_context_policy_stop_refuses_as_before(gw):
    r = post(gw, {"messages": HISTORY + [{"role": "user", "content": "And glass?"}], "max_tokens": 2,
                  "context_policy": "stop"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = post(gw, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "context_policy": "forever"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "context_policy", r.text
    assert "rolling, middle, stop" in r.json()["error"]["message"]


def test_a_short_conversation_has_no_context_field(gw):
    r = post(gw, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and "context" not in r.json()["aotx"], r.text
