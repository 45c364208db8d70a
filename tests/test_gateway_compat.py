"""Gaps between the gateway and the APIs it imitates, each closed with a regression test
through the official clients (``openai``, ``anthropic``) where they read the field.

One engine subprocess (SmolLM2, CPU) serves the module and a gateway runs in-process;
a test that kills an engine starts its own.
"""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from tests.gateway_support import KEY, engine_call, gateway, start_engine, stop_engine  # noqa: E402

pytestmark = pytest.mark.realmodel


@pytest.fixture(scope="module")
def engine(tmp_path_factory, default_model_path):
    home = tmp_path_factory.mktemp("gwcompat")
    proc, sock = start_engine(home, None, slots=2, context=1024)
    yield sock, home
    stop_engine(proc)


@pytest.fixture(scope="module")
def gw(engine):
    with gateway(engine[0]) as url:
        yield url


@pytest.fixture()
def oa(gw):
    return openai.OpenAI(base_url=gw + "/v1", api_key=KEY, max_retries=0, timeout=300)


def _auth():
    return {"Authorization": f"Bearer {KEY}"}


def test_bug_logprobs_leave_out_the_end_of_generation_token(oa):
    """Chat logprobs listed one token more than the reply's text: the end-of-generation
    token (SmolLM2's ``<|im_end|>``) that ended it, as the last entry. OpenAI's logprobs
    are the returned content's tokens only: their bytes join to the content, streamed or not."""
    kw = dict(model="local", messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=200,
              logprobs=True, top_logprobs=2)
    r = oa.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "stop", "the reply did not end by itself: the test needs an end token"
    entries = c.logprobs.content
    assert b"".join(bytes(e.bytes) for e in entries) == c.message.content.encode(), [e.token for e in entries][-3:]
    assert len(entries) == r.usage.completion_tokens - 1  # the end token is counted, not listed
    streamed, text = [], ""
    for ch in oa.chat.completions.create(**kw, stream=True):
        for sc in ch.choices:
            text += sc.delta.content or ""
            if sc.logprobs and sc.logprobs.content:
                streamed += sc.logprobs.content
    assert text == c.message.content
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in entries]
