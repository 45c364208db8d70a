"""The conversation table: transitions, receipts, interrupted replies, snapshots."""

from __future__ import annotations

import msgspec

from aotx.engine.protocol import ConversationView
from aotx.engine.journal import records as R
from aotx.engine.journal.conversations import ConversationTable, Receipt


def _play(table, records, start=1):
    for i, r in enumerate(records):
        table.apply(r, start + i, tick=i)
    return start + len(records) - 1


CHAT = [
    R.ConversationCreated("c1", "first", 10.0, "Be brief.", {"temperature": 0.0}),
    R.MessageAccepted("c1", "u1", "user", "hi", attachments=[R.AttachmentRef("aa", "image", "x.png", "/x.png")],
                      created_at=11.0),
    R.MessageAccepted("c1", "a1", "assistant"),
    R.TokensCommitted("c1", "a1", 12, [5, 6], "Hel"),
    R.TokensCommitted("c1", "a1", 14, [7], "lo"),
    R.MessageFinished("c1", "a1", "stop", 12, 3),
]


def test_a_chat_builds_messages_tokens_and_status():
    t = ConversationTable()
    _play(t, CHAT)
    c = t.get("c1")
    assert [m.msg_id for m in c.messages] == ["u1", "a1"]
    u, a = c.messages
    assert (u.status, u.text, u.attachments[0].sha256) == ("complete", "hi", "aa")
    assert (a.status, a.text, a.token_ids, a.start_pos, a.finish_reason) == ("complete", "Hello", [5, 6, 7], 12, "stop")
    assert (a.n_prompt, a.n_completion, t.last_seq, c.updated_at) == (12, 3, 6, 11.0)
    assert t.finish_recovery() == []


def test_status_follows_the_reply_and_finish_reasons():
    t = ConversationTable()
    _play(t, CHAT[:3])
    assert t.get("c1").messages[1].status == "accepted"
    t.apply(CHAT[3], 4)
    assert t.get("c1").messages[1].status == "streaming"
    for reason, status in [("cancelled", "cancelled"), ("error", "failed"), ("length", "complete"),
                           ("interrupted", "interrupted")]:
        t.apply(R.MessageFinished("c1", "a1", reason), t.last_seq + 1)
        assert t.get("c1").messages[1].status == status


def test_unfinished_replies_are_interrupted_after_recovery_and_keep_their_tokens():
    t = ConversationTable()
    _play(t, CHAT[:4] + [R.MessageAccepted("c1", "a2", "assistant")])
    cut = t.finish_recovery()
    assert [m.msg_id for m in cut] == ["a1", "a2"]
    a1 = t.get("c1").message("a1")
    assert (a1.status, a1.token_ids, a1.text, a1.finish_reason) == ("interrupted", [5, 6], "Hel", "interrupted")


def test_rename_update_truncate_delete_capsule():
    t = ConversationTable()
    n = _play(t, CHAT)
    n = _play(t, [R.ConversationRenamed("c1", "renamed"), R.ConversationUpdated("c1", "Be long.", {"top_k": 5}),
                  R.CapsuleStored("c1", "/p", "fp", 15)], n + 1)
    c = t.get("c1")
    assert (c.title, c.system_prompt, c.sampling, c.capsule.n_tokens) == ("renamed", "Be long.", {"top_k": 5}, 15)
    n = _play(t, [R.ConversationTruncated("c1", "a1")], n + 1)
    assert [m.msg_id for m in c.messages] == ["u1"] and c.capsule is None
    _play(t, [R.ConversationDeleted("c1")], n + 1)
    assert t.get("c1") is None and t.live() == []


def test_records_whose_conversation_or_message_start_was_lost_rebuild_them_marked_salvaged():
    """A record whose conversation's creation (or a reply's start) was lost to damage used
    to be dropped with every later record of that conversation; each record names its
    conversation, so the conversation is rebuilt and says what it is missing."""
    t = ConversationTable()
    _play(t, [R.MessageAccepted("nope", "m", "user", "x", created_at=5.0), R.ConversationCreated("c"),
              R.MessageFinished("c", "missing", "stop"), R.ConversationTruncated("c", "missing2"),
              R.ConversationCreated("c", "dup"), R.TokensCommitted("c", "r", 7, [1, 2], "ab"),
              R.TokensCommitted("c", "r", 11, [3], "c")])
    nope = t.get("nope")
    assert nope.salvaged.startswith("its creation was lost") and nope.created_at == 5.0
    assert [(m.msg_id, m.text, m.status) for m in nope.messages] == [("m", "x", "complete")]
    c = t.get("c")
    assert c.title == "" and c.salvaged == ""
    assert [(m.msg_id, m.status, m.salvaged != "") for m in c.messages] == [("missing", "complete", True),
                                                                              ("r", "streaming", True)]
    assert c.message("r").token_ids == [1, 2, 3] and "positions 9..10 were lost" in c.message("r").salvaged
    assert t.ignored == 2  # the truncation of an unknown message, the second creation


def test_records_of_a_deleted_conversation_stay_ignored():
    t = ConversationTable()
    _play(t, [R.ConversationCreated("c"), R.ConversationDeleted("c"), R.MessageAccepted("c", "m", "user", "x"),
              R.ConversationDeleted("gone"), R.MessageAccepted("gone", "m", "user", "x")])
    assert t.live() == [] and t.ignored == 2


def test_replayed_sequence_numbers_change_nothing():
    t = ConversationTable()
    _play(t, CHAT)
    t.apply(R.TokensCommitted("c1", "a1", 15, [9], "!"), 5)
    assert t.get("c1").message("a1").token_ids == [5, 6, 7]


def test_receipts_mark_messages_durable_in_order():
    t = ConversationTable()
    _play(t, CHAT[:4])  # u1 at seq 2, a1 last touched at seq 4
    done = t.note_receipt(Receipt(1, 100, 3))
    assert [m.msg_id for m in done] == ["u1"]
    assert t.get("c1").message("a1").receipt is None
    t.apply(CHAT[4], 5)
    assert [m.msg_id for m in t.note_receipt(Receipt(1, 200, 5))] == ["a1"]
    assert t.get("c1").message("a1").receipt == Receipt(1, 200, 5)


def test_snapshot_checkpoint_round_trip_drops_deleted():
    t = ConversationTable()
    n = _play(t, CHAT + [R.ConversationCreated("gone"), R.ConversationDeleted("gone")])
    cp = R.Checkpoint(covers_seq=n, conversations=t.snapshot())
    cp = msgspec.msgpack.decode(msgspec.msgpack.encode(cp), type=R.Checkpoint)
    u = ConversationTable()
    u.apply(cp, n + 1)
    assert [c.conv_id for c in u.live()] == ["c1"] and "gone" not in u.conversations
    a, b = u.get("c1"), t.get("c1")
    assert [(m.msg_id, m.text, m.token_ids, m.status) for m in a.messages] == \
        [(m.msg_id, m.text, m.token_ids, m.status) for m in b.messages]
    assert u.note_receipt(Receipt(9, 1, n + 1))  # messages become durable under the checkpoint


def test_to_dict_converts_to_the_protocol_view():
    t = ConversationTable()
    _play(t, CHAT)
    t.note_receipt(Receipt(1, 500, 6))
    view = msgspec.convert(t.get("c1").to_dict(), ConversationView)
    assert view.n_messages == 2 and view.messages[1].token_ids == [5, 6, 7]
    assert view.messages[1].receipt.last_seq == 6 and view.messages[0].attachments[0].path == "/x.png"
    assert t.to_dict()[0]["conv_id"] == "c1" and "messages" not in t.to_dict()[0]
