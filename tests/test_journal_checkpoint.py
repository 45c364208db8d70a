"""Streamed checkpoints (issue 15, must-have 6): a checkpoint of any size is written
in bounded chunks beside the live records, never as one buffer in the ring; the
segments it replaces go once its end is durable; a crash mid-checkpoint leaves
the older segments as the starting point."""

from __future__ import annotations

import pytest

from aotx.engine.journal import (
    ConversationCreated, ConversationDeleted, ConversationTable, Journal, MessageAccepted, MessageFinished,
    TokensCommitted, compact, dump, recover, verify,
)
from aotx.engine.journal import records as R


def _view(table):
    out = []
    for c in table.live():
        d = c.to_dict(messages=True)
        d.pop("seq", None)
        for m in d.get("messages", []):
            m.pop("receipt", None)
            m.pop("seq", None)
        out.append(d)
    return out


def fill(j: Journal, table: ConversationTable, n_convs: int, text_bytes: int, tick: int = 0) -> None:
    """Conversations whose live data adds up to about n_convs * text_bytes bytes."""
    def pub(r):
        table.apply(r, j.publish(r, tick), tick)

    for k in range(n_convs):
        pub(ConversationCreated(f"c{k}", f"conversation {k}", float(k)))
        for m in range(4):
            assert j.reserve(text_bytes // 4 + 200) or j.wait_durable(j.last_seq, 10) and j.reserve(text_bytes // 4 + 200)
            pub(MessageAccepted(f"c{k}", f"u{m}", "user", chr(97 + m % 26) * (text_bytes // 4)))
            j.flush()
    pub(ConversationDeleted("c0"))
    j.flush()
    j.wait_durable(j.last_seq, 10)


def test_an_online_checkpoint_larger_than_the_journal_buffer_streams(tmp_path):
    """Regression: online compaction stopped once live data passed the 8 MiB buffer (`a
    checkpoint of 183022672 bytes does not fit the journal buffer of 8388608 bytes`) and
    the journal grew without bound. Here the buffer is 64 KiB and the live data 2 MiB."""
    table = ConversationTable()
    with Journal(tmp_path, buffer_bytes=64 << 10, segment_bytes=256 << 10) as j:
        fill(j, table, 64, 32 << 10)
        before = len(list(tmp_path.glob("*.seg")))
        assert before >= 8
        end = j.checkpoint(table, 1)
        assert j.wait_durable(end, 10)
        table.apply(MessageAccepted("c1", "after", "user", "after the checkpoint"),
                    j.publish(MessageAccepted("c1", "after", "user", "after the checkpoint"), 2))
    segs = sorted(tmp_path.glob("*.seg"))
    frames = list(dump(tmp_path))
    assert int(segs[0].name[:10]) == frames[0].segment  # the checkpoint segment replaced every older one
    assert len(segs) <= 2  # (and the record after it may open the next: the checkpoint outgrew a segment)
    parts = [e for e in frames if isinstance(e.record, R.CheckpointPart)]
    assert isinstance(frames[0].record, R.Checkpoint) and frames[0].record.streamed
    assert len(parts) >= 63 and max(e.end - e.offset for e in parts) < 64 << 10  # bounded chunks
    assert any(isinstance(e.record, R.CheckpointEnd) for e in frames)
    rep = recover(tmp_path)
    assert rep.problem is None and len(rep.table.live()) == 63
    assert _view(rep.table) == _view(table)


def test_a_long_conversation_is_split_into_consecutive_parts(tmp_path):
    table = ConversationTable()
    with Journal(tmp_path, part_bytes=4096) as j:
        def pub(r):
            table.apply(r, j.publish(r, 0))

        pub(ConversationCreated("long", "a long one"))
        for i in range(100):
            pub(MessageAccepted("long", f"m{i}", "user", f"message {i} " * 20))
        pub(MessageAccepted("long", "r", "assistant"))
        pub(TokensCommitted("long", "r", 0, list(range(500)), "tokens"))
        pub(MessageFinished("long", "r", "stop", 10, 500))
        j.flush()
        j.checkpoint(table, 1)
    parts = [e.record for e in dump(tmp_path) if isinstance(e.record, R.CheckpointPart)]
    assert len(parts) > 5 and all(p.more for p in parts[:-1]) and not parts[-1].more
    assert recover(tmp_path).table.get("long").message("r").token_ids == list(range(500))
    assert _view(recover(tmp_path).table) == _view(table)


def test_records_published_during_a_checkpoint_replay_on_top_of_it(tmp_path):
    """The engine steps a checkpoint one chunk at a time while conversations change:
    each part holds its conversation as of the moment it was written, and the live
    records around the parts replay on top of it."""
    table = ConversationTable()
    with Journal(tmp_path, part_bytes=256) as j:
        def pub(r, tick=0):
            table.apply(r, j.publish(r, tick), tick)

        for k in range(6):
            pub(ConversationCreated(f"c{k}", f"t{k}", float(k)))
            pub(MessageAccepted(f"c{k}", "r", "assistant"))
            pub(TokensCommitted(f"c{k}", "r", 0, [k], f"<{k}>" * 20))
        j.flush()
        run = j.begin_checkpoint(table, 1)
        assert run is not None and j.begin_checkpoint(table, 1) is None  # one at a time
        steps = 0
        while not j.checkpoint_step(run, table, 2 + steps):
            steps += 1
            for k in range(6):  # every conversation changes between chunks
                if table.get(f"c{k}") is not None:
                    pub(TokensCommitted(f"c{k}", "r", len(table.get(f"c{k}").message("r").token_ids), [steps], "."))
            if steps == 2:
                pub(ConversationDeleted("c5"))
                pub(ConversationCreated("new", "made mid-checkpoint"))
            j.flush()
            j.wait_durable(j.last_seq, 10)
        assert steps >= 3 and run.done
        pub(MessageFinished("c1", "r", "stop"))
    rep = recover(tmp_path)
    assert rep.segments == [int(sorted(tmp_path.glob("*.seg"))[0].name[:10])]  # the checkpoint is the start
    table.finish_recovery()  # replies never finished: recovery marks them interrupted
    assert _view(rep.table) == _view(table) and rep.table.ignored == 0


def test_a_crash_mid_checkpoint_starts_from_the_segments_it_would_have_replaced(tmp_path):
    table = ConversationTable()
    with Journal(tmp_path, part_bytes=256, segment_bytes=4096) as j:
        def pub(r):
            table.apply(r, j.publish(r, 0))

        for k in range(8):
            pub(ConversationCreated(f"c{k}", f"t{k}"))
            pub(MessageAccepted(f"c{k}", "u", "user", "q" * 300))
            j.flush()
        run = j.begin_checkpoint(table, 1)
        j.wait_durable(run.begin_seq, 10)
        assert not j.checkpoint_step(run, table, 1)  # one chunk, then the "crash": no CheckpointEnd
        j.wait_durable(j.last_seq, 10)
        pub(MessageAccepted("c3", "u2", "user", "after"))
    assert len(list(tmp_path.glob("*.seg"))) >= 2  # nothing was removed
    rep = recover(tmp_path)
    assert rep.segments[0] == 1 and rep.problem is None
    assert _view(rep.table) == _view(table)
    with Journal(tmp_path) as j:  # and the next checkpoint completes
        t = recover_table(j)
        j.checkpoint(t, 2)
    assert len(list(tmp_path.glob("*.seg"))) == 1 and _view(recover(tmp_path).table) == _view(table)


def test_an_abandoned_checkpoint_lets_segments_rotate_again(tmp_path):
    table = ConversationTable()
    with Journal(tmp_path, segment_bytes=4096, part_bytes=256) as j:
        def pub(r):
            table.apply(r, j.publish(r, 0))

        for k in range(4):
            pub(ConversationCreated(f"c{k}", "t"))
        run = j.begin_checkpoint(table, 1)
        j.wait_durable(run.begin_seq, 10)
        j.abort_checkpoint(run)
        assert not j.checkpointing
        for i in range(200):
            pub(MessageAccepted("c1", f"m{i}", "user", "x" * 60))
            j.flush()
        j.wait_durable(j.last_seq, 10)
        assert j.stats()["segments_created"] >= 4  # rotation resumed after the abandoned checkpoint
    rep = recover(tmp_path)
    assert rep.segments[0] == 1 and _view(rep.table) == _view(table)


def recover_table(j: Journal) -> ConversationTable:
    return j.recovery.table


def test_offline_compaction_streams_one_conversation_at_a_time(tmp_path):
    table = ConversationTable()
    with Journal(tmp_path, buffer_bytes=64 << 10, segment_bytes=1 << 20) as j:
        fill(j, table, 40, 16 << 10)
    rep = compact(tmp_path)
    assert rep.parts == 39 and rep.conversations == 39 and rep.dropped == 1
    sizes = [e.end - e.offset for e in dump(tmp_path)]
    assert max(sizes) < 32 << 10  # no record holds more than one conversation
    assert _view(recover(tmp_path).table) == _view(table) and verify(tmp_path).ok


def test_the_engine_store_steps_its_checkpoint_without_waiting(tmp_path):
    from aotx.engine.runtime.store import open_store

    store = open_store(tmp_path, buffer_bytes=64 << 10, segment_bytes=16 << 10)
    try:
        for k in range(30):
            store.create(f"chat {k}", None, None, messages=[("user", "x" * 2000)])
            store.flush()
            store.journal.wait_durable(store.journal.last_seq, 10)
        live = _view(store.table)
        for tick in range(200):  # the engine calls this after every tick; receipts step it too
            store.maybe_checkpoint(tick)
            store.flush()
            store.journal.wait_durable(store.journal.last_seq, 10)
            store.note_receipt(store.journal.last_receipt)
            if store.journal.stats()["checkpoints"] >= 1 and not store.journal.checkpointing:
                break
        assert store.journal.stats()["checkpoints"] >= 1
    finally:
        store.close()
    rep = recover(tmp_path)
    assert [v["conv_id"] for v in _view(rep.table)] == [v["conv_id"] for v in live]
    assert len(list(tmp_path.glob("*.seg"))) <= 3


@pytest.mark.parametrize("legacy", [True])
def test_a_format_1_checkpoint_still_reads(tmp_path, legacy):
    """Journals compacted by an older AOTX hold one inline Checkpoint record."""
    import time

    from aotx.engine.journal.records import FLAG_CHECKPOINT, encode_frame, encode_segment_header

    table = ConversationTable()
    table.apply(ConversationCreated("old", "from version 1"), 1)
    table.apply(MessageAccepted("old", "m", "user", "hi"), 2)
    cp = R.Checkpoint(covers_seq=2, conversations=table.snapshot(), created_at=time.time())
    (tmp_path / "0000000003.seg").write_bytes(encode_segment_header(3, 3, FLAG_CHECKPOINT, version=1)
                                              + encode_frame(cp, 0, 3))
    rep = recover(tmp_path)
    assert rep.problem is None and rep.table.get("old").message("m").text == "hi" and rep.next_seq == 4
