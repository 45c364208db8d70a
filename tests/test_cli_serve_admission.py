"""``aotx serve`` admits only what can work, on a tiny model.

Regressions: ``--memory-budget 500G`` on a 23 GiB machine sized 24.3 GiB of KV with no
warning; ``--context 100000000`` logged that it exceeds the trained 8,192 and sized
100M tokens anyway; the speech and OCR specialists took 1.1 GiB of the budget before
any audio or picture was used, so ``--memory-budget 1G`` refused a text-only chat.
Also the engine's side of attachments: an attachment that cannot be used refuses the message
(nothing journaled) instead of putting its refusal text into the prompt.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fakes.media_files import write_png  # noqa: E402
from tests.fakes.sink import EventSink  # noqa: E402

from aotx.engine import protocol as P  # noqa: E402
from aotx.engine.runtime import admission  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tiny_gguf, tmp_path_factory):
    return tiny_gguf.write_tiny_llama(tmp_path_factory.mktemp("adm") / "tiny.gguf")  # trained context: 256


def serve_args(model: Path, **kw) -> argparse.Namespace:
    base = dict(model=str(model), device="cpu", slots=2, context=None, memory_budget=None, no_journal=False,
                draft_model=None, speculative=None, draft_p_min=None, mmproj="none")
    return argparse.Namespace(**(base | kw))


def build(args):
    from aotx.engine.cli.serve import build_engine

    return build_engine(args)


def test_memory_budget_past_the_machine_is_clamped_and_said(tiny, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    caplog.set_level(logging.WARNING, logger="aotx.serve")
    eng, store = build(serve_args(tiny, memory_budget="500T"))
    try:
        have = admission.machine_memory_bytes()
        assert eng.budget.total == have
        assert any("--memory-budget 500T is more than this machine's" in r.getMessage() for r in caplog.records)
        assert eng.status_reply(1).budget_bytes == have
    finally:
        store.close()


def test_context_past_the_trained_one_is_capped_and_said(tiny, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    caplog.set_level(logging.WARNING, logger="aotx.serve")
    eng, store = build(serve_args(tiny, context=100_000_000))
    try:
        assert eng.n_ctx == 256 and eng.kv.n_ctx == 256
        assert eng.status_reply(1).n_ctx == 256
        assert any("--context 100,000,000 is more than the 256 tokens" in r.getMessage() for r in caplog.records)
    finally:
        store.close()


def test_specialists_are_not_counted_before_an_attachment_needs_them(tiny, tmp_path, monkeypatch):
    """A budget the text model fits but the speech model does not: a text chat starts
    and works; an image (OCR) is refused by name, with the numbers, and nothing is written."""
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    eng, store = build(serve_args(tiny, memory_budget="200M", context=128))
    prof = eng.submitter.media_profile
    assert prof is not None and prof.route("image").route == "specialist"
    ocr = prof.route("image")
    assert ocr.memory_bytes > eng.budget.free, "the test needs a budget the OCR specialist does not fit"
    assert not [n for n, _ in eng.budget.terms if n.startswith("media: ")]
    eng.start()
    try:
        s = EventSink()
        eng.post(P.CreateConversation(id=1, title="t"), s)
        conv = s.wait().conversation.conv_id
        eng.post(P.SubmitMessage(id=2, conv_id=conv, text="hello", sampling=P.SamplingParams(temperature=0,
                                                                                              max_tokens=3)), s)
        assert isinstance(s.wait(), P.Committed)  # a text-only chat fits
        pic = write_png(tmp_path / "shot.png", 8, 8)
        s = EventSink()
        eng.post(P.SubmitMessage(id=3, conv_id=conv, text="what does it say?",
                                 attachments=[P.Attachment(path=str(pic), kind="image", name="shot.png")]), s)
        err = s.wait()
        assert isinstance(err, P.Error) and err.code == "unsupported_media", s.events
        assert "shot.png: rapidocr needs" in err.message and "--memory-budget" in err.message
        s = EventSink()
        eng.post(P.ShowConversation(id=4, conv_id=conv), s)
        assert len(s.wait().conversation.messages) == 2  # the refused message wrote nothing
    finally:
        eng.stop()
        store.close()


def test_a_specialist_is_counted_once_when_first_needed(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    eng, store = build(serve_args(tiny, memory_budget="4G", context=128))
    try:
        used = eng.budget.used
        assert eng.count_media("media: whisper-base", 300 << 20) == ""
        assert dict(eng.budget.terms)["media: whisper-base"] == 300 << 20 and eng.budget.used == used + (300 << 20)
        assert eng.count_media("media: whisper-base", 300 << 20) == ""  # counted once
        assert eng.budget.used == used + (300 << 20)
        assert "media: whisper-base" in {b.name for b in eng.status_reply(1).budget}
        why = eng.count_media("media: huge", eng.budget.free + 1)
        assert why.startswith("huge needs") and "is free" in why
    finally:
        store.close()


def test_an_attachment_that_cannot_be_used_refuses_the_message(tiny, tmp_path, monkeypatch):
    """Regression: the question went to the model with the refusal text inside
    the prompt ("decompression bomb DOS attack"). Now the message is refused, and nothing
    reaches the journal or the model."""
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    eng, store = build(serve_args(tiny, memory_budget="4G", context=128))
    eng.start()
    try:
        s = EventSink()
        eng.post(P.CreateConversation(id=1, title="t"), s)
        conv = s.wait().conversation.conv_id
        bad = tmp_path / "broken.png"
        bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
        eng.post(P.SubmitMessage(id=2, conv_id=conv, text="describe this",
                                 attachments=[P.Attachment(path=str(bad), kind="image", name="broken.png")]), s)
        err = s.wait()
        assert isinstance(err, P.Error) and err.code == "unsupported_media", s.events
        assert err.message.startswith("broken.png: ") and "nothing was sent" in err.message
        assert not s.all(P.Accepted)
        eng.post(P.ShowConversation(id=3, conv_id=conv), s)
        assert s.wait().conversation.messages == []
    finally:
        eng.stop()
        store.close()


def test_expert_cache_on_a_dense_model_is_said_not_silent(tiny, tmp_path, monkeypatch, caplog):
    # regression: `--expert-cache lfu` on a dense model passed without a word
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    caplog.set_level(logging.WARNING, logger="aotx.serve")
    eng, store = build(serve_args(tiny, expert_cache="lfu"))
    try:
        said = [r.getMessage() for r in caplog.records if "--expert-cache" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith("--expert-cache lfu has no effect:") \
            and said[0].endswith("has no mixture-of-experts layers"), said
    finally:
        store.close()
    caplog.clear()
    eng, store = build(serve_args(tiny, expert_cache="static"))      # the default: nothing to say
    try:
        assert not [r for r in caplog.records if "--expert-cache" in r.getMessage()]
    finally:
        store.close()


def test_serve_refuses_an_unreadable_memory_budget_before_loading(monkeypatch):
    """Regression: `aotx serve --memory-budget 5X` loaded the model (seconds, gigabytes) and
    only then refused the size."""
    from aotx.engine.cli import serve
    from aotx.engine.errors import UsageError
    from aotx.engine.model import loader

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flag was checked")

    monkeypatch.setattr(loader, "load_model", no_load)
    args = argparse.Namespace(device="cpu", keep_alive=None, draft_model=None, model="/nonexistent.gguf",
                              memory_budget="5X")
    with pytest.raises(UsageError, match=r"--memory-budget: cannot read '5X' as a size"):
        serve.build_engine(args)
