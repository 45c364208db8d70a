"""StopChecker: EOG ids, stop strings that span tokens (nothing leaks), max
tokens, the context limit; and the whole streaming path on a real completion."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aotx.engine.model.gguf_file import GGUFFile
from aotx.engine.model.termination import StopChecker
from aotx.engine.model.tokenizer import StreamDecoder, Tokenizer


def run(checker: StopChecker, deltas, ids=None):
    """Feed deltas (token ids default to 100, 101, ...); return (emitted chunks, reason)."""
    out = []
    for k, d in enumerate(deltas):
        emit, reason = checker.feed(ids[k] if ids else 100 + k, d)
        out.append(emit)
        if reason:
            return out, reason
    out.append(checker.flush())
    return out, None


def test_eog_token_stops_and_its_text_is_not_emitted():
    out, reason = run(StopChecker({2}), ["Hi", " there", "<|im_end|>", "more"], ids=[10, 11, 2, 12])
    assert reason == "stop" and "".join(out) == "Hi there"


def test_stop_string_spanning_tokens_never_leaks():
    deltas = ["Hello", " wor", "ld<", "|st", "op|", ">", "after"]
    out, reason = run(StopChecker(set(), ["<|stop|>"]), deltas)
    assert reason == "stop" and "".join(out) == "Hello world"
    assert out == ["Hello", " wor", "ld", "", "", ""]


def test_held_text_is_released_when_it_is_not_a_stop_string():
    out, reason = run(StopChecker(set(), ["</end>"]), ["a <", "/e", "x", " b"])
    assert reason is None and out == ["a ", "", "</ex", " b", ""]


def test_earliest_stop_string_wins_and_text_before_it_is_emitted():
    out, reason = run(StopChecker(set(), ["World", "lo W"]), ["Hel", "lo World"])
    assert reason == "stop" and "".join(out) == "Hel"


def test_stop_string_inside_one_delta():
    out, reason = run(StopChecker(set(), ["\n\n"]), ["one\n\ntwo"])
    assert reason == "stop" and out == ["one"]


def test_eog_releases_held_text():
    out, reason = run(StopChecker({0}, ["STOP"]), ["ok ST", ""], ids=[5, 0])
    assert reason == "stop" and "".join(out) == "ok ST"


def test_max_tokens_is_length_and_flushes_held_text():
    out, reason = run(StopChecker(set(), ["<x>"], max_tokens=3), ["a", "b", "c<", "x>"])
    assert reason == "length" and "".join(out) == "abc<"


def test_stop_on_the_last_allowed_token_is_stop():
    out, reason = run(StopChecker(set(), ["END"], max_tokens=2), ["E", "ND"])
    assert reason == "stop" and "".join(out) == ""


def test_context_limit():
    out, reason = run(StopChecker(set(), n_ctx=10, n_prompt=7), ["a", "b", "c", "d"])
    assert reason == "context" and "".join(out) == "abc"


def test_feeding_after_finish_and_bad_limits_raise():
    c = StopChecker({1})
    c.feed(1, "")
    with pytest.raises(ValueError):
        c.feed(2, "x")
    with pytest.raises(ValueError):
        StopChecker(set(), max_tokens=0)


@settings(max_examples=300, deadline=None)
@given(before=st.text("ab<|>xy", max_size=20), stop=st.text("ab<|>", min_size=1, max_size=5),
       after=st.text("ab<|>xy", max_size=10), cuts=st.lists(st.integers(0, 40), max_size=8))
def test_output_is_exactly_the_text_before_the_first_stop(before, stop, after, cuts):
    text = before + stop + after
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, reason = run(StopChecker(set(), [stop]), deltas)
    expected = text[: text.find(stop)]
    assert reason == "stop" and "".join(out) == expected
    emitted = ""
    for chunk in out:  # never anything that is not part of the final output
        emitted += chunk
        assert expected.startswith(emitted)


# --- the real streaming path ---------------------------------------------------------

def test_stop_string_across_tokens_of_a_reference_completion(default_model_path, refs_dir):
    tok = Tokenizer.from_metadata(GGUFFile.open(default_model_path).metadata)
    ref = json.loads((refs_dir / "chat_refs.json").read_text(encoding="utf-8"))["results"][0]
    ids, text = ref["completion_token_ids"], ref["completion_text"]
    stop = "Cité"
    assert stop in text
    # The stop string is not one token: it spans several.
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)
    sd, checker, shown = StreamDecoder(tok), StopChecker(tok.eog_ids, [stop], max_tokens=48), ""
    for i in ids:
        emit, reason = checker.feed(i, sd.feed(i))
        shown += emit
        assert "Cit" not in shown
        if reason:
            break
    assert reason == "stop" and shown == text[: text.index(stop)]


def test_stop_checker_names_the_stop_string_that_ended_generation():
    sc = StopChecker([0], ["END", "x"])
    assert sc.feed(5, "abc") == ("abc", None) and sc.matched == ""
    assert sc.feed(6, "dEN") == ("d", None)
    assert sc.feed(7, "D!") == ("", "stop") and sc.matched == "END"
    sc = StopChecker([0], ["END"])
    sc.feed(5, "hi")
    assert sc.feed(0, "") == ("", "stop") and sc.matched == ""  # an end-of-generation token, no stop string
