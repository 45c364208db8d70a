"""The plain dicts behind `aotx journal ...` and `aotx conversations ...`."""

from __future__ import annotations

import json

import pytest

from aotx.engine.errors import JournalError
from aotx.engine.journal import (
    ConversationCreated, Journal, MessageAccepted, MessageFinished, TokensCommitted, cli_support as cli,
)


@pytest.fixture
def jdir(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    from aotx.engine.paths import journal_dir

    d = journal_dir()
    with Journal(d) as j:
        for r in [ConversationCreated("c1", "Hello", 5.0), MessageAccepted("c1", "u", "user", "hi"),
                  MessageAccepted("c1", "a", "assistant"), TokensCommitted("c1", "a", 3, [10, 11], "Yo"),
                  MessageFinished("c1", "a", "stop", 3, 2)]:
            j.publish(r, 1)
    return d


def test_verify_and_dump_use_the_data_dir_and_are_json(jdir):
    v = cli.verify_cmd()
    assert v["ok"] and v["records"] == 5 and v["problem"] is None and v["directory"] == str(jdir)
    rows = list(cli.dump_cmd())
    assert [r["type"] for r in rows][:2] == ["ConversationCreated", "MessageAccepted"]
    assert rows[3]["token_ids"] == [10, 11] and rows[3]["seq"] == 4 and rows[3]["segment"] == 1
    json.dumps(v), json.dumps(rows)
    lines = list(cli.dump_lines())
    assert len(lines) == 5 and "TokensCommitted" in lines[3] and "token_ids=[10, 11]" in lines[3]


def test_verify_reports_the_first_problem_with_segment_and_offset(jdir):
    seg = jdir / "0000000001.seg"
    with open(seg, "ab") as f:
        f.write(b"\x07" * 30)
    v = cli.verify_cmd()
    assert not v["ok"] and v["problem"]["segment"] == 1 and v["problem"]["offset"] == seg.stat().st_size - 30
    assert v["problem"]["kind"] in ("torn", "corrupt")


def test_conversations_list_and_show_with_receipts(jdir):
    convs = cli.conversations_list_cmd()
    assert [c["conv_id"] for c in convs] == ["c1"] and convs[0]["n_messages"] == 2 and "messages" not in convs[0]
    show = cli.conversation_show_cmd("c1")
    a = show["messages"][1]
    assert a["token_ids"] == [10, 11] and a["status"] == "complete" and a["receipt"]["last_seq"] == 5
    with pytest.raises(JournalError, match="no conversation 'zz'.*c1"):
        cli.conversation_show_cmd("zz")
    json.dumps(show)


def test_compact_and_repair_commands(jdir):
    assert cli.compact_cmd()["conversations"] == 1
    assert cli.repair_cmd()["problem"] is None
    assert cli.conversation_show_cmd("c1")["messages"][1]["text"] == "Yo"
