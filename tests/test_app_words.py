"""Words on aotx-chat's screen are a person's, not the protocol's.

Seen by a new user: "position ● durable" in the details view, "(too_long)" in a refusal,
"(length)" in a reply's header, and "temperature: '' is not a valid float" after emptying
a field of F4."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fake_engine import FakeEngine, make_app, settle  # noqa: E402

from aotx.engine import protocol as P  # noqa: E402


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))


def test_an_emptied_settings_field_is_the_default_and_a_bad_one_is_named_in_words():
    from aotx.app.screens.settings import parse_sampling

    values = {"temperature": "", "top_k": "40", "top_p": "", "min_p": "", "repeat_penalty": "", "max_tokens": "",
              "seed": ""}
    sp = parse_sampling(values, P.SamplingParams(temperature=0.2))
    assert sp.temperature == P.SamplingParams().temperature and sp.top_k == 40
    with pytest.raises(ValueError) as e:
        parse_sampling({**values, "temperature": "warm"}, P.SamplingParams())
    assert str(e.value) == "temperature must be a number (0 = greedy; empty for the default), not “warm”"
    with pytest.raises(ValueError) as e:
        parse_sampling({**values, "top_k": "2.5"}, P.SamplingParams())
    assert "top k must be a whole number" in str(e.value) and "valid" not in str(e.value)


async def test_details_and_headers_say_what_positions_and_finishes_mean():
    from aotx.app.screens.details import details_lines

    app, _ = make_app(FakeEngine(reply=lambda t: "word " * 10))
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        app.chat_input.insert("hi")
        await pilot.press("enter")
        await settle(pilot)
        reply = app.messages()[-1]
        rows = dict(details_lines(reply))
        assert "position" not in rows
        assert rows["where it stands"] == "● durable: on disk, it survives a crash"
        assert rows["reply speed"] == "250.0 tok/s" and rows["first token after"] == "12 ms"
        assert not any("_" in k for k in rows)
        assert rows["how it ended"] == "ended by the model"
        reply.finish_reason = "length"
        assert reply._header_text() == "● Assistant (cut at its token limit)"
        assert dict(details_lines(reply))["how it ended"] == "cut at its token limit"
