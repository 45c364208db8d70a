"""Damage versus a torn tail: the journal knows how far it
has acknowledged (its RECEIPT file), so a bad record at or before that point, or a
bad record followed by valid ones, is damage: recovery keeps a byte-exact copy,
salvages every valid record after it, names the conversations and messages
affected, and the engine starts. Only a tail past the acknowledged point with
nothing valid after it is cut."""

from __future__ import annotations

from pathlib import Path

import pytest

from aotx.engine.journal import (
    ConversationCreated, Journal, MessageAccepted, MessageFinished, TokensCommitted, dump, recover, verify,
)
from aotx.engine.journal import cli_support
from aotx.engine.journal import records as _records

RECEIPT_FILES = getattr(_records, "RECEIPT_FILES", ("RECEIPT",))  # every file the writer keeps its mark in

# names new with this fix are imported inside the tests, so that on the tree before it
# each regression test runs and fails on its assertions rather than at collection


def _new():
    from aotx.engine.journal import records as R
    from aotx.engine.journal.segments import JournalScan

    return R.RECEIPT_FILE, R.Gap, R.decode_receipt, R.encode_receipt, JournalScan


def three_conversations(n_records: int = 64):
    """Three conversations, each a user message and a reply of many token records."""
    recs = []
    for k in range(3):
        recs += [ConversationCreated(f"conv{k}", f"Chat {k}", float(k)),
                 MessageAccepted(f"conv{k}", f"user{k}", "user", f"question {k}"),
                 MessageAccepted(f"conv{k}", f"reply{k}", "assistant")]
    pos = [0, 0, 0]
    i = 0
    while len(recs) < n_records - 3:
        k = i % 3
        recs.append(TokensCommitted(f"conv{k}", f"reply{k}", pos[k], [i, i + 1], f" w{i}"))
        pos[k] += 2
        i += 1
    recs += [MessageFinished(f"conv{k}", f"reply{k}", "stop", 3, pos[k]) for k in range(3)]
    return recs


def write(d: Path, recs, every: int = 4, **kw) -> list[tuple[int, int]]:
    """Publish ``recs`` with a flush every ``every`` records; returns (seq, offset) of each."""
    where = []
    with Journal(d, **kw) as j:
        for i, r in enumerate(recs):
            where.append(j.publish(r, i // every))
            if i % every == every - 1:
                j.flush()
    entries = list(dump(d))
    return [(e.seq, e.offset) for e in entries]


def set_receipt(d: Path, data: bytes) -> None:
    """The acknowledged mark, in every file the writer keeps it in."""
    for name in RECEIPT_FILES:
        (d / name).write_bytes(data)


def flip(path: Path, offset: int, bit: int = 0) -> bytes:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))
    return bytes(data)


def test_one_flipped_bit_in_an_acknowledged_record_of_the_last_segment_loses_only_that_record(tmp_path):
    """Regression: one flipped bit inside the last segment (an acknowledged record, not a
    torn tail) made the next start cut the segment there: 54 of 64 durable records and
    2 of 3 conversations gone, the file truncated, no copy kept."""
    recs = three_conversations(64)
    where = write(tmp_path, recs)  # every record acknowledged (receipted) before the flip
    seg = tmp_path / "0000000001.seg"
    size = seg.stat().st_size
    seq, off = where[9]  # a TokensCommitted of conv0's reply
    damaged = flip(seg, off + 40)  # inside its payload
    with Journal(tmp_path) as j:  # the engine's start
        rep = j.recovery
    assert rep.n_records == 64 and rep.last_seq == 64  # 63 records and the Gap in place of the bad one
    assert [c.conv_id for c in rep.table.live()] == ["conv0", "conv1", "conv2"]
    assert seg.stat().st_size == size  # nothing truncated: the Gap took the bad bytes' place
    RECEIPT_FILE, Gap, decode_receipt, encode_receipt, JournalScan = _new()
    [d] = rep.damage
    assert (d["first_lost"], d["last_lost"], d["segment"], d["offset"]) == (seq, seq, 1, off)
    assert (tmp_path / d["copy"]).read_bytes() == damaged  # the copy is byte for byte what was found
    bad = recs[seq - 1]
    assert {"conv_id": bad.conv_id, "msg_id": bad.msg_id} in [
        {k: a[k] for k in ("conv_id", "msg_id") if k in a} for a in d["affected"]]
    notice = rep.notices()[0]
    assert f"“Chat 0” ({bad.conv_id}): message {bad.msg_id}" in notice and d["copy"] in notice
    assert "DAMAGE" in rep.summary() and "1 record(s) lost" in rep.summary()
    # every other record is there, with its content
    got = {e.seq: e.record for e in dump(tmp_path)}
    assert isinstance(got[seq], Gap) and all(got[s] == recs[s - 1] for s in got if s != seq)
    reply0 = rep.table.get("conv0").message("reply0")
    assert reply0.status == "complete" and len(reply0.token_ids) == sum(
        len(r.token_ids) for r in recs if isinstance(r, TokensCommitted) and r.conv_id == "conv0") - 2


def test_journal_repair_salvages_every_valid_record_after_one_bad_record(tmp_path):
    """Regression: `journal repair` kept 10 of 63 conversations after
    one bad record instead of salvaging the valid records after it."""
    recs = []
    for k in range(63):
        recs += [ConversationCreated(f"c{k:02d}", f"t{k}", float(k)), MessageAccepted(f"c{k:02d}", "m", "user", "x" * 40)]
    where = write(tmp_path, recs, segment_bytes=4096)
    segs = sorted(tmp_path.glob("*.seg"))
    assert len(segs) >= 3
    seq, off = where[21]  # conversation c10's message, in the first segment
    flip(segs[0], off + 30)
    rep = cli_support.repair_cmd(tmp_path)
    assert rep["conversations"] == 63  # every conversation; c10 lost its one message
    assert rep["damage"][0]["n_lost"] == 1 and rep["damage"][0]["first_lost"] == seq
    assert any("(c10): message m" in line for line in rep["notices"])
    assert verify(tmp_path).ok and len(recover(tmp_path).table.live()) == 63
    assert recover(tmp_path).table.get("c10").messages == []


def test_a_lost_conversation_creation_is_named_by_the_records_after_it(tmp_path):
    recs = []
    for k in range(10):
        recs += [ConversationCreated(f"c{k}", f"t{k}", float(k)), MessageAccepted(f"c{k}", "m", "user", "x" * 40)]
    where = write(tmp_path, recs)
    seq, off = where[8]  # c4's creation
    data = bytearray((tmp_path / "0000000001.seg").read_bytes())
    data[off:off + 26] = bytes(26)  # its header zeroed: nothing of it can be read
    (tmp_path / "0000000001.seg").write_bytes(bytes(data))
    rep = recover(tmp_path)
    assert len(rep.table.live()) == 10 and rep.damage[0]["first_lost"] == seq
    assert any(a["conv_id"] == "c4" for a in rep.damage[0]["affected"])  # its message named it
    c4 = rep.table.get("c4")  # rebuilt from its message, and says what it lost
    assert c4.salvaged.startswith("its creation was lost") and [m.text for m in c4.messages] == ["x" * 40]


def test_a_bad_record_followed_by_valid_records_is_damage_even_without_a_receipt(tmp_path):
    RECEIPT_FILE, Gap, decode_receipt, encode_receipt, JournalScan = _new()
    recs = three_conversations(40)
    where = write(tmp_path, recs)
    for name in RECEIPT_FILES:
        (tmp_path / name).unlink()  # no acknowledged point known at all
    seq, off = where[20]
    flip(tmp_path / "0000000001.seg", off + 3)
    scan = JournalScan(tmp_path)
    assert len(list(scan.entries())) == 39 and scan.damage and scan.damage[0].why == "valid records follow it"
    rep = recover(tmp_path)
    assert rep.damage and rep.last_seq == 40 and rep.bytes_dropped == 0


def test_a_torn_tail_past_the_acknowledged_point_is_cut_and_the_same_bytes_before_it_are_damage(tmp_path):
    RECEIPT_FILE, Gap, decode_receipt, encode_receipt, JournalScan = _new()
    recs = three_conversations(30)
    where = write(tmp_path, recs)
    seg = tmp_path / "0000000001.seg"
    last_seq, last_off = where[-1]
    clean = seg.read_bytes()
    # the last record torn in half, never receipted: a crash's tail
    seg.write_bytes(clean[:last_off + 10])
    set_receipt(tmp_path, encode_receipt(1, last_off, last_seq - 1))
    rep = recover(tmp_path)
    assert rep.damage == [] and rep.bytes_dropped == 10 and rep.last_seq == last_seq - 1
    assert "torn tail" in rep.summary()
    # the same cut, but the receipt had covered it: damage; the seq is not reused
    seg.write_bytes(clean[:last_off + 10])
    set_receipt(tmp_path, encode_receipt(1, len(clean), last_seq))
    rep = recover(tmp_path)
    assert rep.damage and rep.damage[0]["first_lost"] == last_seq and rep.next_seq == last_seq + 1
    assert "at or before the acknowledged seq" in rep.damage[0]["why"]
    with Journal(tmp_path) as j:
        assert j.publish(MessageAccepted("conv0", "x", "user", "after"), 0) == last_seq + 1


def test_acknowledged_records_missing_from_the_end_are_reported_and_never_reused(tmp_path):
    recs = three_conversations(30)
    where = write(tmp_path, recs)
    seg = tmp_path / "0000000001.seg"
    seg.write_bytes(seg.read_bytes()[:where[25][1]])  # whole records gone, a clean end
    rep = recover(tmp_path)
    assert rep.damage[0]["first_lost"] == 26 and rep.damage[0]["last_lost"] == 30
    assert rep.next_seq == 31 and "a receipt covered seq 30" in rep.damage[0]["message"]


def test_damage_is_salvaged_once_and_remembered_by_verify(tmp_path):
    recs = three_conversations(30)
    where = write(tmp_path, recs)
    flip(tmp_path / "0000000001.seg", where[5][1] + 30)
    assert not verify(tmp_path).ok and verify(tmp_path).damage
    first = recover(tmp_path)
    assert len(first.damage) == 1
    v = verify(tmp_path)
    assert v.ok and v.gaps[0]["first_seq"] == 6 and v.gaps[0]["copy"] == first.damage[0]["copy"]
    assert recover(tmp_path).damage == [] and len(list(tmp_path.glob("*.damaged"))) == 1


def test_a_damaged_segment_header_is_rebuilt_from_its_records(tmp_path):
    recs = three_conversations(200)
    write(tmp_path, recs, segment_bytes=4096)
    segs = sorted(tmp_path.glob("*.seg"))
    flip(segs[1], 3)  # the magic of segment 2's header
    rep = recover(tmp_path, keep_records=True)
    assert rep.damage and rep.damage[0]["n_lost"] == 0 and "segment header" in rep.damage[0]["message"]
    assert [e.record for e in rep.records] == recs and verify(tmp_path).ok


def test_the_engine_reports_salvaged_damage_in_its_status(tmp_path):
    from aotx.engine.runtime.store import open_store

    recs = three_conversations(30)
    where = write(tmp_path, recs)
    flip(tmp_path / "0000000001.seg", where[12][1] + 30)
    store = open_store(tmp_path)
    try:
        assert store.notices and "journal damage" in store.notices[0] and "conv0" in store.notices[0]
        assert "DAMAGE" in store.recovery_note
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["zeros", "garbage"])
def test_a_damaged_sector_in_the_middle_loses_only_the_records_it_held(tmp_path, kind):
    RECEIPT_FILE, Gap, decode_receipt, encode_receipt, JournalScan = _new()
    recs = three_conversations(300)
    where = write(tmp_path, recs)
    seg = tmp_path / "0000000001.seg"
    data = bytearray(seg.read_bytes())
    start = (where[100][1] // 512 + 1) * 512
    data[start:start + 512] = bytes(512) if kind == "zeros" else bytes((i * 37 + 11) % 256 for i in range(512))
    seg.write_bytes(bytes(data))
    rep = recover(tmp_path, keep_records=True)
    lost = {s for d in rep.damage for s in range(d["first_lost"], d["last_lost"] + 1)}
    held = {s for s, off in where if start - 200 < off < start + 512}
    assert lost and lost <= held  # only records that overlapped the bad sector
    assert rep.last_seq == 300 and all(e.record == recs[e.seq - 1] for e in rep.records if not isinstance(e.record, Gap))
    assert verify(tmp_path).ok


def test_a_flipped_bit_anywhere_loses_at_most_the_records_it_touched(tmp_path):
    """Every 17th byte of a journal (segments, a streamed checkpoint, records after it),
    one bit flipped each time: recovery never raises, never returns a bad record, keeps
    the journal's full length, loses at most the few records the bit touched, and a
    second recovery has nothing left to do."""
    import shutil

    from aotx.engine.journal import compact

    RECEIPT_FILE, Gap, decode_receipt, encode_receipt, JournalScan = _new()
    orig = tmp_path / "orig"
    recs = three_conversations(120)
    write(orig, recs, segment_bytes=4096)
    compact(orig)
    extra = [MessageAccepted("conv1", f"x{i}", "user", "y" * (i % 50)) for i in range(30)]
    write(orig, extra, every=3, segment_bytes=4096)
    base = recover(orig)
    segs = sorted(orig.glob("*.seg"))
    total = sum(p.stat().st_size for p in segs)
    checked = 0
    for pos in range(0, total, 17):
        d = tmp_path / "j"
        if d.exists():
            shutil.rmtree(d)
        shutil.copytree(orig, d, ignore=shutil.ignore_patterns("LOCK"))
        q = pos
        for p in sorted(d.glob("*.seg")):
            if q < p.stat().st_size:
                flip(p, q, pos % 8)
                break
            q -= p.stat().st_size
        rep = recover(d, keep_records=True)
        lost = {s for e in rep.records if isinstance(e.record, Gap) for s in range(e.seq, e.record.last_seq + 1)}
        assert rep.last_seq == base.last_seq and len(lost) <= 3, (pos, rep.last_seq, lost)
        again = recover(d)
        assert again.damage == [] and again.bytes_dropped == 0 and verify(d).ok, pos
        checked += 1
    assert checked > 200


# ---- recovery by sequence numbers, not file names ---------------------------------------------

def nine_segments(d: Path) -> list:
    recs = []
    for k in range(6):
        recs += [ConversationCreated(f"c{k}", f"Chat {k}", float(k)),
                 MessageAccepted(f"c{k}", f"u{k}", "user", "question " * 20)]
    recs += three_conversations(300)
    write(d, recs, segment_bytes=4096)
    assert len(list(d.glob("*.seg"))) >= 6
    return recs


def test_a_flipped_bit_in_a_conversations_creation_keeps_all_its_later_records_reachable(tmp_path):
    """One flipped bit in the record that creates a conversation hid the whole
    conversation: every later record of it was dropped from the table."""
    recs = three_conversations(64)
    where = write(tmp_path, recs)
    flip(tmp_path / "0000000001.seg", where[0][1] + 40)  # conv0's ConversationCreated
    rep = recover(tmp_path)
    conv0 = rep.table.get("conv0")
    assert conv0 is not None and conv0.salvaged and len(conv0.messages) == 2
    assert conv0.message("reply0").token_ids and conv0.message("reply0").status == "complete"
    shown = cli_support.conversation_show_cmd("conv0", tmp_path)  # what `aotx conversations show` prints
    assert shown["salvaged"] and [m["msg_id"] for m in shown["messages"]] == ["user0", "reply0"]


def test_deleting_the_first_segment_keeps_every_conversation_of_the_later_ones(tmp_path):
    """Deleting segment 1 of a 9-segment journal kept 440 of 507 records but showed 0
    conversations (every creation was in segment 1)."""
    nine_segments(tmp_path)
    entries = list(dump(tmp_path))
    in_first = {e.record.conv_id for e in entries if e.segment == 1 and hasattr(e.record, "conv_id")}
    later = {e.record.conv_id for e in entries if e.segment > 1 and hasattr(e.record, "conv_id")}
    (tmp_path / "0000000001.seg").unlink()
    v = verify(tmp_path)
    assert not v.ok and "segment 1 is missing" in v.damage[0] and "records seq 1.." in v.damage[0]
    rep = recover(tmp_path)
    live = {c.conv_id: c for c in rep.table.live()}
    assert set(live) == later == {"conv0", "conv1", "conv2"}  # every conversation with a record left
    assert {k for k, c in live.items() if c.salvaged} == in_first & later == later  # each says what it lost
    assert "segment 1 was missing" in rep.notices()[0]


def test_swapped_segment_names_lose_no_record(tmp_path):
    """Swapping the names of segments 3 and 5 dropped 131 intact records, among them
    all of segment 4, which was not touched."""
    recs = nine_segments(tmp_path)
    s3, s5 = tmp_path / "0000000003.seg", tmp_path / "0000000005.seg"
    b3, b5 = s3.read_bytes(), s5.read_bytes()
    s3.write_bytes(b5)
    s5.write_bytes(b3)
    v = verify(tmp_path)
    assert not v.ok and v.n_records == len(recs) and any("is in file 0000000003.seg" in x for x in v.damage)
    rep = recover(tmp_path, keep_records=True)
    assert [e.record for e in rep.records] == recs and sum(d["n_lost"] for d in rep.damage) == 0
    assert s3.read_bytes() == b3 and s5.read_bytes() == b5  # renamed back
    assert verify(tmp_path).ok


def test_losing_receipt_with_the_last_segment_is_noticed(tmp_path):
    """Deleting RECEIPT together with the last segment lost its records with no notice."""
    recs = nine_segments(tmp_path)
    last = sorted(tmp_path.glob("*.seg"))[-1]
    first_lost = [e.seq for e in dump(tmp_path) if e.segment == int(last.name[:10])][0]
    (tmp_path / "RECEIPT").unlink()
    last.unlink()
    v = verify(tmp_path)
    assert not v.ok and f"records seq {first_lost}..{len(recs)} lost" in v.damage[0]
    rep = recover(tmp_path)
    assert rep.damage[0]["first_lost"] == first_lost and rep.damage[0]["last_lost"] == len(recs)
    assert rep.next_seq == len(recs) + 1  # the lost seqs are never handed out again


@pytest.mark.parametrize("size", [10, 0])
def test_a_destroyed_header_below_the_acknowledged_mark_is_damage_not_a_torn_tail(tmp_path, size):
    """A segment truncated to 10 or 0 bytes while RECEIPT acknowledged its records was
    reported as a torn tail ("a crash leaves this"), with no damage line."""
    recs = three_conversations(60)
    write(tmp_path, recs)
    seg = tmp_path / "0000000001.seg"
    seg.write_bytes(seg.read_bytes()[:size])
    v = verify(tmp_path)
    assert v.tail is None and v.damage and "records seq 1..60 lost" in " ".join(v.damage)
    rep = recover(tmp_path)
    assert rep.bytes_dropped == 0 and rep.damage and rep.next_seq == 61


def test_a_journal_from_before_the_second_receipt_copy_opens_and_gets_one(tmp_path):
    """Old journals have only RECEIPT: they open as before; the writer adds RECEIPT.2 and
    from then on the higher valid copy is the acknowledged mark."""
    from aotx.engine.journal.segment_files import read_acknowledged

    recs = three_conversations(30)
    write(tmp_path, recs)
    second = tmp_path / "RECEIPT.2"
    second.unlink()  # as an older AOTX left it
    rep = recover(tmp_path)
    assert rep.problem is None and rep.acknowledged_seq == 30 and len(rep.table.live()) == 3
    with Journal(tmp_path) as j:
        j.publish(MessageAccepted("conv0", "late", "user", "more"), 0)
    assert second.exists() and read_acknowledged(tmp_path)[2] == 31
    set_receipt(tmp_path, b"")  # both copies unreadable: no mark, and nothing is lost for it
    (tmp_path / "RECEIPT.2").write_bytes(_records.encode_receipt(1, 0, 31))
    assert read_acknowledged(tmp_path)[2] == 31 and verify(tmp_path).ok


def test_a_damage_notice_never_names_an_id_misread_from_the_damaged_bytes(tmp_path):
    """A bit flipped inside a token record's message id: the notice named the misread id
    ("m2989b8=5a9") beside the real one, a message that never existed."""
    d = tmp_path / "j"
    with Journal(d, segment_bytes=1 << 20, buffer_bytes=1 << 16) as j:
        for i, r in enumerate([ConversationCreated("c7", "Talk", 1.0), MessageAccepted("c7", "u1234567", "user", "hi"),
                               MessageAccepted("c7", "r7654321", "assistant"),
                               TokensCommitted("c7", "r7654321", 3, [5, 6], "one two"),
                               TokensCommitted("c7", "r7654321", 5, [7], " three"),
                               MessageFinished("c7", "r7654321", "stop", 3, 3)]):
            j.publish(r, i)
            j.flush()
    seg = d / "0000000001.seg"
    data = bytearray(seg.read_bytes())
    at = data.index(b"r7654321", data.index(b"one two"))  # the second token record's id
    data[at + 3] ^= 0x01
    seg.write_bytes(bytes(data))
    rep = recover(d)
    [notice] = rep.notices()
    misread = bytes(data[at:at + 8]).decode()
    assert misread not in notice and "“Talk” (c7)" in notice, notice
