"""The writer: seqs, receipts after fsync, group commit, credits, rotation, failure."""

from __future__ import annotations

import os
import threading
import time

import pytest

from aotx.engine.errors import JournalError
from aotx.engine.journal import (
    ConversationCreated, ConversationDeleted, ConversationTable, Journal, MessageAccepted, TokensCommitted, dump, recover, verify,
)
from aotx.engine.journal.records import frame_size


def tok(i: int) -> TokensCommitted:
    return TokensCommitted("c", "m", i, [i], f"t{i}")


def test_publish_flush_receipt_and_reopen_continues(tmp_path):
    receipts = []
    with Journal(tmp_path, on_receipt=receipts.append) as j:
        seqs = [j.publish(tok(i), tick=i) for i in range(10)]
        assert seqs == list(range(1, 11))
        j.flush()
        assert j.wait_durable(10, timeout=5)
        assert receipts[-1].last_seq == 10 and receipts[-1].segment == 1
        assert receipts[-1].offset == os.path.getsize(tmp_path / "0000000001.seg")
    with Journal(tmp_path) as j:
        assert j.recovery.last_seq == 10 and j.recovery.problem is None
        assert j.publish(tok(10), 11) == 11
    assert [e.seq for e in dump(tmp_path)] == list(range(1, 12))
    assert [e.record for e in dump(tmp_path)] == [tok(i) for i in range(11)]


def test_one_fsync_covers_a_flush_of_many_records(tmp_path):
    syncs = []
    with Journal(tmp_path, sync=lambda fd: (syncs.append(fd), os.fdatasync(fd))) as j:
        base = len(syncs)  # the new segment's header
        for i in range(1000):
            j.publish(tok(i), 1)
        j.flush()
        j.wait_durable(1000, 5)
        assert len(syncs) - base == 1
        assert j.stats()["fsyncs"] == 1


def test_queued_blocks_coalesce_into_one_fsync_when_the_disk_is_slow(tmp_path):
    gate = threading.Event()

    def slow_sync(fd):
        gate.wait(5)
        os.fdatasync(fd)

    receipts = []
    j = Journal(tmp_path, sync=os.fdatasync, on_receipt=receipts.append)
    j._sync = slow_sync  # header already written; now make data syncs wait
    for i in range(200):  # 200 flushes while the disk is stuck: one block each
        j.publish(tok(i), i)
        j.flush()
    gate.set()
    assert j.wait_durable(200, 5)
    j.close()
    st = j.stats()
    assert st["blocks"] == 200 and st["fsyncs"] <= 3, st
    assert receipts[-1].last_seq == 200


def test_receipts_come_after_the_sync_in_seq_order_and_name_bytes_on_disk(tmp_path):
    events = []
    path = tmp_path / "0000000001.seg"

    def on_receipt(r):
        data = path.read_bytes()
        assert len(data) >= r.offset  # the bytes it covers are in the file
        events.append(("receipt", r.last_seq))

    with Journal(tmp_path, on_receipt=on_receipt,
                 sync=lambda fd: (events.append(("sync", None)), os.fdatasync(fd))) as j:
        for i in range(300):
            j.publish(tok(i), i)
            if i % 7 == 0:
                j.flush()
    seqs = [s for e, s in events if e == "receipt"]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs) and seqs[-1] == 300
    for k, (e, _) in enumerate(events):
        if e == "receipt":
            assert events[k - 1][0] == "sync"


def test_credits_run_out_while_the_disk_is_stuck_then_come_back(tmp_path):
    gate = threading.Event()
    j = Journal(tmp_path, buffer_bytes=4096)
    j._sync = lambda fd: (gate.wait(5), os.fdatasync(fd))
    size = frame_size(tok(0))
    n = 0
    t0 = time.monotonic()
    while j.reserve(size):
        j.publish(tok(0), n)  # same size every time
        n += 1
        j.flush()
    assert time.monotonic() - t0 < 1  # never blocked
    assert n == 4096 // size
    with pytest.raises(JournalError, match="no journal credit"):
        j.publish(tok(n), n)  # unreserved and no room
    assert not j.reserve(size)
    gate.set()
    assert j.wait_durable(n, 5)
    assert j.reserve(size) and j.stats()["reserved"] == size
    j.release(size)
    assert j.stats()["reserved"] == 0
    j.close()


def test_a_record_wrapping_the_ring_is_written_intact(tmp_path):
    with Journal(tmp_path, buffer_bytes=4096) as j:
        for i in range(500):  # ~20 laps of the ring with odd-sized records
            r = TokensCommitted("c", "m", i, list(range(i % 37)), "x" * (i % 53))
            assert j.reserve(frame_size(r)) or j.wait_durable(j.last_seq, 5) and j.reserve(frame_size(r))
            j.publish(r, i)
            if i % 3 == 0:
                j.flush()
    got = [e.record for e in dump(tmp_path)]
    assert len(got) == 500 and got[499].text == "x" * (499 % 53)
    assert verify(tmp_path).ok


def test_segments_rotate_at_the_size_limit(tmp_path):
    with Journal(tmp_path, segment_bytes=4096) as j:
        for i in range(400):
            j.publish(tok(i), i)
            if i % 10 == 9:
                j.flush()
    segs = sorted(p.name for p in tmp_path.glob("*.seg"))
    assert len(segs) > 5
    for p in tmp_path.glob("*.seg"):
        assert p.stat().st_size <= 4096
    v = verify(tmp_path)
    assert v.ok and v.n_records == 400 and v.segments == list(range(1, len(segs) + 1))


def test_wait_durable_flushes_and_times_out_when_the_disk_is_stuck(tmp_path):
    gate = threading.Event()
    j = Journal(tmp_path)
    seq = j.publish(tok(0), 0)
    assert j.wait_durable(seq, 5)  # flushed on the caller's behalf
    j._sync = lambda fd: gate.wait(5)
    seq = j.publish(tok(1), 1)
    assert j.wait_durable(seq, 0.05) is False
    with pytest.raises(JournalError, match="will not become durable"):
        j.wait_durable(seq + 5, 0.05)
    gate.set()
    assert j.wait_durable(seq, 5)
    j.close()


def test_a_failed_sync_fails_the_journal_for_good(tmp_path):
    errors = []
    j = Journal(tmp_path, on_error=errors.append)

    def bad(fd):
        raise OSError(5, "Input/output error")

    j._sync = bad
    seq = j.publish(tok(0), 0)
    with pytest.raises(JournalError, match="failed"):
        j.wait_durable(seq, 5)
    assert isinstance(errors[0], OSError)
    assert not j.reserve(10)
    with pytest.raises(JournalError):
        j.publish(tok(1), 1)
    with pytest.raises(JournalError, match="failed"):
        j.close()


def test_one_writer_per_directory(tmp_path):
    with Journal(tmp_path):
        with pytest.raises(JournalError, match="in use"):
            Journal(tmp_path)
        with pytest.raises(JournalError, match="in use"):
            recover(tmp_path)
    Journal(tmp_path).close()  # the lock is released on close


def test_concurrent_publishers_get_unique_ordered_seqs(tmp_path):
    with Journal(tmp_path) as j:
        def work(k):
            for i in range(200):
                j.publish(TokensCommitted("c", f"m{k}", i, [i], ""), 0)
                if i % 17 == 0:
                    j.flush()
        ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        [t.start() for t in ts]
        [t.join() for t in ts]
    entries = list(dump(tmp_path))
    assert [e.seq for e in entries] == list(range(1, 801))
    for k in range(4):
        assert [e.record.start_pos for e in entries if e.record.msg_id == f"m{k}"] == list(range(200))


def test_online_checkpoint_replaces_older_segments(tmp_path):
    table = ConversationTable()
    with Journal(tmp_path, segment_bytes=4096) as j:
        def pub(r):
            table.apply(r, j.publish(r, 0))
        pub(ConversationCreated("keep", "k"))
        pub(ConversationCreated("c", "gone"))
        pub(MessageAccepted("keep", "m", "assistant"))
        for i in range(300):
            pub(TokensCommitted("keep", "m", i, [i], "."))
            if i % 10 == 0:
                j.flush()
        pub(ConversationDeleted("c"))
        assert j.wait_durable(j.last_seq, 5)
        assert len(list(tmp_path.glob("*.seg"))) > 2
        with pytest.raises(JournalError, match="table at seq"):
            j.checkpoint(ConversationTable(), 0)
        seq = j.checkpoint(table, 0)
        assert j.wait_durable(seq, 5)
        pub(TokensCommitted("keep", "m", 300, [300], "!"))
    segs = sorted(p.name for p in tmp_path.glob("*.seg"))
    assert len(segs) == 1  # the checkpoint segment, with the record after it
    rep = recover(tmp_path)
    assert [c.conv_id for c in rep.table.live()] == ["keep"]
    assert rep.table.get("keep").message("m").token_ids == list(range(301))
    assert rep.last_seq == seq + 1 and rep.problem is None


def test_a_record_larger_than_the_buffer_is_refused_by_name(tmp_path):
    with Journal(tmp_path, buffer_bytes=4096) as j:
        assert j.free_bytes == 4096
        with pytest.raises(JournalError, match="exceeds the journal buffer of 4096 bytes"):
            j.publish(MessageAccepted("c", "m", "user", "x" * 5000), 0)
        assert j.publish(MessageAccepted("c", "m", "user", "fits"), 0) == 1


def test_every_new_segment_is_made_durable_in_its_directory(tmp_path):
    from aotx.engine.fileio import FileIO

    calls = []

    class Counting(FileIO):
        def fsync_dir(self, path):
            calls.append(str(path))
            super().fsync_dir(path)

    with Journal(tmp_path, segment_bytes=4096, fs=Counting()) as j:
        base = len(calls)  # the RECEIPT file and the first segment
        for i in range(300):
            j.publish(tok(i), i)
            if i % 10 == 9:
                j.flush()
    created = j.stats()["segments_created"]
    assert created == len(list(tmp_path.glob("*.seg"))) > 3
    assert base == 2 and calls == [str(tmp_path)] * (created + 1)  # + the RECEIPT file
