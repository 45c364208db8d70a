"""Recovery, verify and compaction against damaged journals: every damage gives a
clear report naming segment and offset, no bad record is ever returned, a torn
tail past the acknowledged point is cut, and damage is salvaged: every valid
record after it is kept, with a byte-exact copy of the damaged segment."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from aotx.engine.errors import JournalError
from aotx.engine.journal import (
    ConversationCreated, ConversationDeleted, Journal, MessageAccepted, MessageFinished, TokensCommitted,
    compact, dump, recover, verify,
)
from aotx.engine.journal.records import (
    FORMAT_VERSION, HEADER_BYTES, RECEIPT_FILES, Gap, encode_receipt, encode_segment_header,
)


def records(n: int):
    """A deterministic journal: two conversations, one deleted, replies of tokens."""
    out = [ConversationCreated("a", "A", 1.0), ConversationCreated("b", "B", 2.0),
           MessageAccepted("a", "u1", "user", "hello"), MessageAccepted("a", "r1", "assistant")]
    i = 0
    while len(out) < n - 3:
        out.append(TokensCommitted("a", "r1", i, [i, i + 1], f"<{i}>"))
        i += 2
    out += [MessageFinished("a", "r1", "stop", 4, i), ConversationDeleted("b"),
            MessageAccepted("a", "u2", "user", "more")]
    return out


def write(directory, recs, segment_bytes=4096, every=5):
    with Journal(directory, segment_bytes=segment_bytes) as j:
        for k, r in enumerate(recs):
            j.publish(r, tick=k // every)
            if k % every == every - 1:
                j.flush()
    return sorted(Path(directory).glob("*.seg"))


REC = records(200)


@pytest.fixture
def journal(tmp_path):
    segs = write(tmp_path, REC)
    assert len(segs) >= 4
    return tmp_path, segs


def assert_prefix(entries):
    """Recovered entries are exactly the first len(entries) records written."""
    assert [e.seq for e in entries] == list(range(1, len(entries) + 1))
    assert [e.record for e in entries] == REC[:len(entries)]


def assert_salvaged(entries):
    """Recovered entries are the records written, each under its own seq, except the
    seqs a Gap says were lost; returns the lost seqs."""
    lost = set()
    expected = 1
    for e in entries:
        assert e.seq == expected
        if isinstance(e.record, Gap):
            lost |= set(range(e.seq, e.record.last_seq + 1))
            expected = e.record.last_seq + 1
        else:
            assert e.record == REC[e.seq - 1]
            expected = e.seq + 1
    assert expected == len(REC) + 1  # everything after the damage is there
    return lost


def acknowledge(d, seq):
    """Set the journal's acknowledged mark (both its RECEIPT files) to ``seq``: what a
    writer that crashed before receipting the later records leaves."""
    for name in RECEIPT_FILES:
        (Path(d) / name).write_bytes(encode_receipt(1, 0, seq))


def test_clean_journal_recovers_everything(journal):
    d, segs = journal
    rep = recover(d, keep_records=True)
    assert rep.problem is None and rep.bytes_dropped == 0 and rep.n_records == len(REC)
    assert_prefix(rep.records)
    assert rep.segments == list(range(1, len(segs) + 1))
    a = rep.table.get("a")
    assert [m.status for m in a.messages] == ["complete", "complete", "complete"]
    assert rep.table.get("b") is None
    assert a.messages[-1].receipt.last_seq == len(REC)  # durable under the record's own boundary
    assert "3 conversations" not in rep.summary() and f"up to seq {len(REC)}" in rep.summary()
    v = verify(d)
    assert v.ok and v.n_records == len(REC) and v.problem is None


def _cut_tail_and_check(d, segs, new_size, kind):
    last = segs[-1]
    size = last.stat().st_size
    v = verify(d)
    assert not v.ok and v.problem.kind == kind and v.problem.segment == len(segs)
    rep = recover(d, keep_records=True)
    assert_prefix(rep.records)
    assert rep.problem and kind in rep.problem and f"segment {len(segs)}" in rep.problem
    assert rep.bytes_dropped == size - last.stat().st_size
    assert verify(d).ok  # the tail is gone: new writes never follow garbage
    with Journal(d) as j:  # and the journal takes new work after it
        seq = j.publish(MessageAccepted("a", "u9", "user", "after"), 0)
        assert seq == rep.last_seq + 1
    assert verify(d).ok and verify(d).last_seq == seq
    return rep


def test_truncated_last_segment_is_cut_at_the_last_whole_record(journal):
    d, segs = journal
    acknowledge(d, len(REC) - 1)  # the last record was never receipted
    last = segs[-1]
    data = last.read_bytes()
    last.write_bytes(data[:len(data) - 7])
    rep = _cut_tail_and_check(d, segs, None, "torn")
    assert rep.n_records == len(REC) - 1


def test_a_torn_record_after_good_ones_is_dropped(journal):
    d, segs = journal
    from aotx.engine.journal.records import encode_frame
    frame = encode_frame(TokensCommitted("a", "r1", 999, [1], "torn"), 99, len(REC) + 1)
    with open(segs[-1], "ab") as f:
        f.write(frame[: len(frame) // 2])
    rep = _cut_tail_and_check(d, segs, None, "torn")
    assert rep.n_records == len(REC) and rep.bytes_dropped == len(frame) // 2


def test_a_zero_filled_tail_is_dropped(journal):
    d, segs = journal
    with open(segs[-1], "ab") as f:
        f.write(b"\x00" * 8192)
    rep = _cut_tail_and_check(d, segs, None, "zeros")
    assert rep.n_records == len(REC) and rep.bytes_dropped == 8192


def test_a_reply_cut_by_the_crash_is_interrupted_with_its_tokens(tmp_path):
    recs = records(60)[:-3]  # no MessageFinished
    write(tmp_path, recs)
    rep = recover(tmp_path)
    r1 = rep.table.get("a").message("r1")
    assert r1.status == "interrupted" and rep.interrupted == ["r1"]
    assert r1.token_ids == [t for r in recs if isinstance(r, TokensCommitted) for t in r.token_ids]
    assert "1 interrupted reply" in rep.summary()


def test_segment_whose_creation_was_cut_short_is_removed(journal):
    d, segs = journal
    nxt = d / f"{len(segs) + 1:010d}.seg"
    nxt.write_bytes(encode_segment_header(len(segs) + 1, len(REC) + 1)[:11])
    assert verify(d).problem.kind == "torn"
    rep = recover(d)
    assert not nxt.exists() and rep.n_records == len(REC) and rep.next_seq == len(REC) + 1
    with Journal(d) as j:
        assert j.publish(ConversationCreated("c"), 0) == len(REC) + 1
    assert verify(d).ok


def test_an_empty_last_segment_is_fine(journal):
    d, segs = journal
    (d / f"{len(segs) + 1:010d}.seg").write_bytes(encode_segment_header(len(segs) + 1, len(REC) + 1))
    assert verify(d).ok
    with Journal(d) as j:
        assert j.recovery.next_seq == len(REC) + 1
        assert j.publish(ConversationCreated("c"), 0) == len(REC) + 1
    assert verify(d).ok


def test_missing_middle_segment_is_salvaged_keeping_every_later_record(journal):
    d, segs = journal
    segs[1].unlink()
    v = verify(d)
    assert not v.ok and v.problem.kind == "gap" and "segment 2 is missing" in v.problem.message
    for repair in (False, True):  # the engine's start and `aotx journal repair` salvage alike
        if repair:
            segs[1].unlink()
        rep = recover(d, repair=repair, keep_records=True)
        lost = assert_salvaged(rep.records)
        assert lost and min(lost) > 1  # segment 2's records, and only those
        assert rep.damage and rep.damage[0]["missing"] and rep.damage[0]["n_lost"] == len(lost)
        assert "segment 2 was missing" in rep.notices()[0]
        assert verify(d).ok and segs[1].exists()  # recreated, holding the Gap
    with Journal(d) as j:  # closed: its drain thread and the directory lock end with the test
        assert j.recovery.problem is None


def test_missing_first_segment_is_salvaged(journal):
    d, segs = journal
    segs[0].unlink()
    assert verify(d).problem.kind == "gap" and "segment 1 is missing" in verify(d).problem.message
    rep = recover(d, keep_records=True)
    lost = assert_salvaged(rep.records)
    assert min(lost) == 1 and rep.damage[0]["n_lost"] == len(lost) and "segment 1 was missing" in rep.notices()[0]
    assert verify(d).ok and segs[0].exists()  # recreated, holding the Gap


def test_newer_format_version_is_always_refused(journal):
    d, segs = journal
    data = bytearray(segs[2].read_bytes())
    data[:HEADER_BYTES] = encode_segment_header(3, 0, 0, version=FORMAT_VERSION + 1)
    segs[2].write_bytes(bytes(data))
    v = verify(d)
    assert v.problem.kind == "version" and v.problem.segment == 3
    for repair in (False, True):
        with pytest.raises(JournalError, match=f"format version {FORMAT_VERSION + 1}"):
            recover(d, repair=repair)
    assert segs[2].exists() and segs[3].exists()


def test_corruption_before_the_last_segment_is_salvaged_with_a_byte_exact_copy(journal):
    d, segs = journal
    data = bytearray(segs[1].read_bytes())
    data[HEADER_BYTES + 40] ^= 0x01
    segs[1].write_bytes(bytes(data))
    v = verify(d)
    assert not v.ok and "CRC32C mismatch" in v.problem.message and v.problem.segment == 2
    assert v.n_records == len(REC) - 1  # verify reads across the damage too
    sizes = {p.name: p.stat().st_size for p in segs}
    rep = recover(d, keep_records=True)
    assert assert_salvaged(rep.records) == {rep.damage[0]["first_lost"]}
    assert rep.damage[0]["segment"] == 2 and rep.damage[0]["copy"].startswith("0000000002.seg.")
    assert (d / rep.damage[0]["copy"]).read_bytes() == bytes(data)  # byte for byte
    assert {p.name: p.stat().st_size for p in segs} == sizes  # the Gap took the bad bytes' place
    assert verify(d).ok and verify(d).gaps[0]["first_seq"] == rep.damage[0]["first_lost"]
    assert recover(d).damage == []  # salvaged once; later starts read it clean


# ---- bit flips anywhere -------------------------------------------------------------------

_ORIG = None


def _original() -> Path:
    global _ORIG
    if _ORIG is None:
        _ORIG = Path(tempfile.mkdtemp(prefix="aotx-journal-orig-"))
        write(_ORIG, REC)
    return _ORIG


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(pos=st.integers(min_value=0), bit=st.integers(min_value=0, max_value=7), repair=st.booleans())
def test_any_bit_flip_is_reported_salvaged_and_never_read_back(pos, bit, repair):
    orig = _original()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "j"
        shutil.copytree(orig, d, ignore=shutil.ignore_patterns("LOCK"))
        segs = sorted(d.glob("*.seg"))
        total = sum(p.stat().st_size for p in segs)
        pos %= total
        for p in segs:
            size = p.stat().st_size
            if pos < size:
                data = bytearray(p.read_bytes())
                data[pos] ^= 1 << bit
                p.write_bytes(bytes(data))
                break
            pos -= size
        v = verify(d)
        assert not v.ok and v.problem is not None
        assert v.n_records <= len(REC)  # a flip in a segment header loses no record
        for e in dump(d):  # nothing that fails its check is ever returned
            assert e.record == REC[e.seq - 1]
        rep = recover(d, repair=repair, keep_records=True)  # every record was acknowledged: damage, never a tail
        assert rep.damage and rep.bytes_dropped == 0
        lost = assert_salvaged(rep.records)
        assert len(lost) <= 2 or rep.damage[0]["kind"] in ("gap", "sequence")
        assert verify(d).ok


# ---- compaction -----------------------------------------------------------------------------

def test_compact_keeps_live_conversations_and_drops_deleted(journal):
    d, segs = journal
    before = recover(d).table
    rep = compact(d)
    assert rep.segment == len(segs) + 1 and rep.removed == list(range(1, len(segs) + 1))
    assert rep.conversations == 1 and rep.dropped == 1 and rep.bytes_after < rep.bytes_before
    assert [p.name for p in sorted(d.glob("*.seg"))] == [f"{len(segs) + 1:010d}.seg"]
    after = recover(d)
    assert rep.parts == 1 and after.n_records == 3  # Checkpoint, one CheckpointPart, CheckpointEnd
    assert after.problem is None and after.last_seq == len(REC) + 3
    assert [c.conv_id for c in after.table.live()] == ["a"] and "b" not in after.table.conversations
    for m1, m2 in zip(before.get("a").messages, after.table.get("a").messages, strict=True):
        assert (m1.msg_id, m1.text, m1.token_ids, m1.status) == (m2.msg_id, m2.text, m2.token_ids, m2.status)
    with Journal(d) as j:  # appends after the checkpoint, seqs continue
        assert j.publish(MessageAccepted("a", "u3", "user", "x"), 0) == len(REC) + 4
    rep2 = recover(d)
    assert rep2.table.get("a").messages[-1].msg_id == "u3" and verify(d).ok


def test_compaction_crash_leftovers_recover_to_the_same_conversations(journal):
    d, segs = journal
    saved = {p.name: p.read_bytes() for p in segs}
    compact(d)
    cp_name = sorted(d.glob("*.seg"))[0].name
    # crash after the rename, before the old segments were removed
    for name, data in saved.items():
        (d / name).write_bytes(data)
    # and a tmp file of a later compaction that crashed before its rename
    (d / "0000000099.seg.tmp").write_bytes(b"partial")
    rep = recover(d)
    assert rep.superseded == list(range(1, len(segs) + 1)) and rep.segments == [int(cp_name[:10])]
    assert not (d / "0000000099.seg.tmp").exists()
    assert [c.conv_id for c in rep.table.live()] == ["a"]
    assert compact(d).removed == list(range(1, len(segs) + 2))


def test_a_broken_checkpoint_falls_back_to_the_older_segments_it_would_replace(journal):
    d, segs = journal
    saved = {p.name: p.read_bytes() for p in segs}
    compact(d)
    cp = sorted(d.glob("*.seg"))[0]
    for name, data in saved.items():  # a crash after the rename, before the old segments went
        (d / name).write_bytes(data)
    data = bytearray(cp.read_bytes())
    data[HEADER_BYTES + 30] ^= 0xFF
    cp.write_bytes(bytes(data))
    acknowledge(d, len(REC))  # the compaction itself never receipts anything
    assert "CRC32C" in verify(d).problem.message
    rep = recover(d, keep_records=True)
    assert rep.segments[0] == 1 and rep.superseded == []  # the old chain again, the checkpoint skipped
    assert [e.record for e in rep.records[:len(REC)]] == REC
    assert [c.conv_id for c in rep.table.live()] == ["a"]


def test_compact_of_an_empty_journal_does_nothing(tmp_path):
    rep = compact(tmp_path)
    assert rep.segment is None and list(tmp_path.glob("*.seg")) == []


def test_compact_refuses_while_an_engine_holds_the_journal(journal):
    d, _ = journal
    with Journal(d):
        with pytest.raises(JournalError, match="in use"):
            compact(d)
