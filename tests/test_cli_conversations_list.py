"""``aotx conversations list``: newest first, with when, the model and what made each.

It printed id, messages and title only, oldest first: no date, no model, and a one-shot
``aotx run`` could not be told from a chat. The origin is journaled with the conversation
(``CreateConversation.origin``) and survives a restart."""

from __future__ import annotations

import time

from aotx.engine import protocol as P
from aotx.engine.cli.local import print_conversation_list
from aotx.engine.present.format import fmt_when


def test_the_list_has_when_model_and_origin_newest_first(capsys):
    now = time.time()
    convs = [P.ConversationView(conv_id="c1", title="Old chat", created_at=now - 9 * 86400,
                                updated_at=now - 9 * 86400, n_messages=4, model="SmolLM2-135M-Instruct.Q4_1"),
             P.ConversationView(conv_id="c2", title="What is 2+2?", created_at=now - 120, updated_at=now - 120,
                                n_messages=2, model="qwen2.5-coder-0.5b-instruct-q4_k_m", origin="run")]
    print_conversation_list(convs, as_json=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "UPDATED", "MESSAGES", "MODEL", "FROM", "TITLE"]
    assert lines[1].startswith("c2") and "2 minutes ago" in lines[1] and "qwen2.5-coder" in lines[1]
    assert "aotx run" in lines[1] and lines[1].endswith("What is 2+2?")
    assert lines[2].startswith("c1") and "chat" in lines[2] and time.strftime("%Y-") in lines[2]
    print_conversation_list(convs, as_json=True)
    import json

    d = json.loads(capsys.readouterr().out)
    assert [c["id"] for c in d] == ["c2", "c1"] and d[0]["origin"] == "run" and d[1]["model"].startswith("SmolLM2")


def test_fmt_when_speaks_like_ollama_list():
    now = 1_700_000_000.0
    assert [fmt_when(now - s, now) for s in (5, 60, 3 * 3600, 30 * 3600, 3 * 86400)] == [
        "just now", "1 minute ago", "3 hours ago", "yesterday", "3 days ago"]
    assert fmt_when(0) == "-"


def test_the_origin_is_journaled_and_recovered(tmp_path):
    from aotx.engine.runtime.store import open_store

    store = open_store(tmp_path / "journal")
    cid = store.create("What is 2+2?", None, None, origin="run").conv_id
    chat = store.create("A chat", None, None).conv_id
    store.close()
    store = open_store(tmp_path / "journal")
    try:
        views = {v.conv_id: v for v in store.list_views()}
        assert views[cid].origin == "run" and views[chat].origin == ""
    finally:
        store.close()
    assert P.validate(P.CreateConversation(id=1, origin="run")) is None
    why = None
    try:
        P.validate(P.CreateConversation(id=1, origin="cron"))
    except Exception as e:  # noqa: BLE001 - the engine's own refusal
        why = str(e)
    assert why and "origin 'cron'" in why
