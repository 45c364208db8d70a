"""Every record that damage did not destroy stays reachable: a matrix over small journals.

Two small journals hold every record type (conversations created, renamed, updated,
truncated, deleted; messages accepted, tokens, finishes; a capsule record; a Gap an
earlier salvage wrote; a streamed checkpoint's Checkpoint, parts and end) across
several segments. Each case damages one copy of them: a single bit flipped in each
record's header, payload and checksum, each record zeroed, each segment truncated
inside each record, each segment deleted, duplicated, renamed and swapped with
another, its header destroyed, the ``RECEIPT`` file lost (alone, or with the last
segment). Then recovery runs as the engine's start does, and for each case:

* every record not physically destroyed is reachable in the table that
  ``aotx conversations show`` reads (``reading.read_table``): a conversation whose
  creation was destroyed is there, rebuilt and marked salvaged; each message, its
  tokens, its finish, each rename, update, truncation, capsule and deletion shows;
* every destroyed record is named as lost in the report (no silent cut), unless all
  copies of the acknowledged mark were lost with it (the one loss nothing can notice);
* a second start finds nothing to do and ``verify`` reads clean.

The number of cases is printed; the whole file runs in seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest

from aotx.engine.fileio import FileIO
from aotx.engine.journal import (
    CapsuleStored, ConversationCreated, ConversationDeleted, ConversationRenamed, ConversationTable,
    ConversationTruncated, ConversationUpdated, Journal, MessageAccepted, MessageFinished, TokensCommitted, dump,
    recover, verify,
)
from aotx.engine.journal.conversations import Message
from aotx.engine.journal.reading import read_table
from aotx.engine.journal.records import (
    RECEIPT_FILE, RECORD_TYPES, Checkpoint, CheckpointEnd, CheckpointPart, Gap,
)
from aotx.engine.journal.segment_files import segment_name


# ---- the journals ------------------------------------------------------------------------

def _history(prefix: str) -> list:
    """Three conversations touching every non-checkpoint record type (about 6 KiB)."""
    a, b, c = f"{prefix}a", f"{prefix}b", f"{prefix}c"
    pad = " and some more words" * 12
    recs: list = [
        ConversationCreated(a, "Alpha", 1.0, system_prompt="Be brief.", sampling={"temperature": 0.5}),
        MessageAccepted(a, "ua1", "user", "first question" + pad, created_at=2.0),
        MessageAccepted(a, "ra1", "assistant", created_at=2.0),
        TokensCommitted(a, "ra1", 10, [11, 12], "one two"),
        TokensCommitted(a, "ra1", 12, [13, 14], " three four"),
        TokensCommitted(a, "ra1", 14, [15], " five"),
        MessageFinished(a, "ra1", "stop", 10, 5),
        ConversationCreated(b, "Beta", 3.0),
        MessageAccepted(b, "ub1", "user", "keep me" + pad, created_at=4.0),
        MessageAccepted(b, "ub2", "user", "drop me", created_at=4.0),
        ConversationTruncated(b, "ub2"),
        ConversationRenamed(a, "Alpha renamed"),
        ConversationUpdated(a, "Be exact.", {"top_k": 7}),
        CapsuleStored(a, "/caps/a.caps", "fp", 15),
        ConversationCreated(c, "Gamma", 5.0),
        MessageAccepted(c, "uc1", "user", "soon gone"),
        ConversationDeleted(c),
        MessageAccepted(b, "ub3", "user", "after the truncation " * 30, created_at=6.0),
        MessageAccepted(b, "rb3", "assistant", created_at=6.0),
    ]
    for t in range(4):
        recs.append(TokensCommitted(b, "rb3", 30 + 2 * t, [100 + t, 200 + t], f" w{t}" * 40))
    recs.append(MessageFinished(b, "rb3", "length", 30, 8))
    return recs


def _write(d: Path, recs: list, every: int = 2) -> None:
    with Journal(d, segment_bytes=4096, buffer_bytes=1 << 16) as j:
        for i, r in enumerate(recs):
            j.publish(r, 1 + i // every)
            if i % every == every - 1:
                j.flush()


def journal_with_a_gap(d: Path) -> None:
    """Several segments without a checkpoint, and a Gap an earlier salvage wrote."""
    recs = _history("g")
    _write(d, recs[:12])
    seg = sorted(d.glob("*.seg"))[0]
    e = [x for x in dump(d) if x.seq == 4][0]  # a token record, damaged and salvaged once
    data = bytearray(seg.read_bytes())
    data[e.offset + 30] ^= 0x04
    seg.write_bytes(bytes(data))
    assert recover(d).damage
    _write(d, recs[12:] + _history("h") + _history("i"))


def journal_with_a_checkpoint(d: Path) -> None:
    """A streamed online checkpoint in several parts, with live records after it."""
    recs = _history("k")
    table = ConversationTable()
    with Journal(d, segment_bytes=4096, buffer_bytes=1 << 16, part_bytes=200) as j:
        for i, r in enumerate(recs):
            table.apply(r, j.publish(r, i), i)
            j.flush()
        j.checkpoint(table, 100)
        for i, r in enumerate(_history("l") + _history("m")):
            j.publish(r, 200 + i)
            if i % 3 == 2:
                j.flush()


@dataclass
class Written:
    """A journal as written: its files, and every record by seq with where it lies."""

    files: dict[str, bytes]
    records: dict[int, object]
    where: dict[int, tuple[int, int, int]]  # seq -> (segment, offset, end)
    segments: list[int] = field(default_factory=list)


def _load(d: Path) -> Written:
    files = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file() and p.name != "LOCK"}
    entries = list(dump(d))
    w = Written(files, {e.seq: e.record for e in entries}, {e.seq: (e.segment, e.offset, e.end) for e in entries})
    w.segments = sorted({e.segment for e in entries})
    return w


@pytest.fixture(scope="module")
def journals(tmp_path_factory) -> dict[str, Written]:
    out = {}
    for name, make in (("gap", journal_with_a_gap), ("checkpoint", journal_with_a_checkpoint)):
        d = tmp_path_factory.mktemp(name)
        make(d)
        assert verify(d).ok
        out[name] = _load(d)
    types = {type(r) for w in out.values() for r in w.records.values()}
    assert types == set(RECORD_TYPES.values()), set(RECORD_TYPES.values()) - types  # every record type
    assert all(len(w.segments) >= 3 for w in out.values())
    return out


# ---- the damage ----------------------------------------------------------------------------

@dataclass
class Case:
    name: str
    files: dict[str, bytes]  # the damaged directory
    destroyed: set[int]  # seqs whose bytes no longer hold a valid record
    noticeable: bool = True  # some copy of the acknowledged mark survives, or nothing was destroyed


def _seg(w: Written, number: int) -> bytes:
    return w.files[segment_name(number)]


def _in_segment(w: Written, number: int, start: int = 0, end: int | None = None) -> set[int]:
    """Seqs of records of segment ``number`` whose frames overlap bytes [start, end)."""
    return {s for s, (g, o, e) in w.where.items() if g == number and e > start and (end is None or o < end)}


def _with(w: Written, **changes: bytes | None) -> dict[str, bytes]:
    files = dict(w.files)
    for name, data in changes.items():
        if data is None:
            files.pop(name, None)
        else:
            files[name] = data
    return files


def record_cases(w: Written):
    """Per record: a bit flipped in its header (type, seq, length), payload and CRC;
    its bytes zeroed; its segment truncated inside it."""
    for seq, (g, off, end) in sorted(w.where.items()):
        name = segment_name(g)
        data = _seg(w, g)
        kind = type(w.records[seq]).__name__
        for where, pos in (("type", off), ("length", off + 18), ("payload", (off + 22 + end - 4) // 2),
                           ("crc", end - 1)):
            b = bytearray(data)
            b[pos] ^= 1 << (pos % 8)
            yield Case(f"seq {seq} {kind}: bit in its {where}", _with(w, **{name: bytes(b)}), {seq})
        b = bytearray(data)
        b[off:end] = bytes(end - off)
        yield Case(f"seq {seq} {kind}: zeroed", _with(w, **{name: bytes(b)}), {seq})
        cut = (off + end) // 2
        yield Case(f"seq {seq} {kind}: segment {g} truncated inside it", _with(w, **{name: data[:cut]}),
                   _in_segment(w, g, cut))


def segment_cases(w: Written):
    """Per segment: deleted, duplicated (under the next free number, and the last one's
    copy), renamed to a free number, swapped with the next and the one after, its
    header's bits flipped, its header truncated to 10 and to 0 bytes."""
    segs = w.segments
    free = segment_name(segs[-1] + 1)
    for i, g in enumerate(segs):
        name, data = segment_name(g), _seg(w, g)
        everything = _in_segment(w, g)
        yield Case(f"segment {g} deleted", _with(w, **{name: None}), everything)
        yield Case(f"segment {g} duplicated as {free}", _with(w, **{free: data}), set())
        yield Case(f"segment {g} renamed to {free}", _with(w, **{name: None, free: data}), set())
        for j in (i + 1, i + 2):
            if j < len(segs):
                other = segment_name(segs[j])
                yield Case(f"segments {g} and {segs[j]} swapped", _with(w, **{name: w.files[other], other: data}),
                           set())
        for pos in (0, 9, 12, 20, 29):
            b = bytearray(data)
            b[pos] ^= 0x20
            yield Case(f"segment {g} header byte {pos} flipped", _with(w, **{name: bytes(b)}), set())
        for size in (10, 0):
            yield Case(f"segment {g} truncated to {size} bytes", _with(w, **{name: data[:size]}), everything)


def receipt_cases(w: Written):
    last = segment_name(w.segments[-1])
    tail = _in_segment(w, w.segments[-1])
    yield Case("RECEIPT lost", _with(w, RECEIPT=None), set())
    yield Case("RECEIPT corrupted", _with(w, RECEIPT=bytes(40)), set())
    yield Case("RECEIPT lost with the last segment", _with(w, **{RECEIPT_FILE: None, last: None}), tail)
    yield Case("RECEIPT lost with the last segment's header", _with(w, **{RECEIPT_FILE: None,
                                                                          last: _seg(w, w.segments[-1])[:10]}), tail)
    # both copies and the last segment: nothing left on disk says those records existed
    yield Case("both receipt copies lost with the last segment",
               _with(w, **{RECEIPT_FILE: None, RECEIPT_FILE + ".2": None, last: None}), tail, noticeable=False)


# ---- what must be reachable ------------------------------------------------------------------

def _later(recs: dict[int, object], seq: int, cls, conv_id: str) -> bool:
    return any(isinstance(r, cls) and r.conv_id == conv_id and s > seq for s, r in recs.items())


def assert_reachable(table: ConversationTable, survivors: dict[int, object]) -> None:
    """Every surviving record's effect shows in ``table`` (later survivors may override
    an earlier one: a rename, an update, a truncation, a deletion)."""
    deleted = {r.conv_id for r in survivors.values() if isinstance(r, ConversationDeleted)}
    truncated = {(r.conv_id, r.msg_id) for r in survivors.values() if isinstance(r, ConversationTruncated)}
    parts: dict[tuple[str, str], Message] = {}
    for seq, r in survivors.items():
        if isinstance(r, CheckpointPart):
            for raw in r.messages:
                m = msgspec.msgpack.decode(raw, type=Message)
                parts[(r.conv_id, m.msg_id)] = m
    for seq, r in sorted(survivors.items()):
        what = f"seq {seq} {type(r).__name__}"
        if isinstance(r, (Checkpoint, CheckpointEnd)):
            continue
        if isinstance(r, Gap):
            assert any(g.first_seq == seq for g in table.gaps), what
            continue
        conv_id = r.conv_id
        c = table.get(conv_id)
        if conv_id in deleted:
            assert c is None, f"{what}: a deleted conversation shows"
            continue
        assert c is not None, f"{what}: conversation {conv_id} is not reachable"
        msg_id = getattr(r, "msg_id", None)
        if isinstance(r, ConversationCreated):
            if not _later(survivors, seq, ConversationRenamed, conv_id):
                assert c.title == r.title, what
            if not _later(survivors, seq, ConversationUpdated, conv_id):
                assert c.system_prompt == r.system_prompt, what
        elif isinstance(r, ConversationRenamed):
            if not _later(survivors, seq, ConversationRenamed, conv_id):
                assert c.title == r.title, what
        elif isinstance(r, ConversationUpdated):
            if not _later(survivors, seq, ConversationUpdated, conv_id):
                assert (c.system_prompt, c.sampling) == (r.system_prompt, r.sampling), what
        elif isinstance(r, ConversationTruncated):
            assert c.message(r.msg_id) is None, what
        elif isinstance(r, CapsuleStored):
            if not _later(survivors, seq, CapsuleStored, conv_id) and not _later(survivors, seq, ConversationTruncated,
                                                                                 conv_id):
                assert c.capsule is not None and c.capsule.path == r.path, what
        elif isinstance(r, CheckpointPart):
            for (cid, mid), pm in parts.items():
                if cid == conv_id and (cid, mid) not in truncated:
                    m = c.message(mid)
                    assert m is not None and m.role == pm.role, f"{what}: message {mid}"
                    assert m.token_ids[:len(pm.token_ids)] == pm.token_ids or m.role != "assistant", what
                    if pm.role != "assistant":
                        assert m.text == pm.text, what
        elif (conv_id, msg_id) in truncated:
            assert c.message(msg_id) is None, what
        else:
            m = c.message(msg_id)
            assert m is not None, f"{what}: message {msg_id} is not reachable"
            if isinstance(r, MessageAccepted):
                if r.role != "assistant":
                    assert (m.role, m.text) == (r.role, r.text), what
            elif isinstance(r, TokensCommitted):
                ids = m.token_ids
                assert any(ids[i:i + len(r.token_ids)] == r.token_ids for i in range(len(ids))), what
                assert r.text in m.text, what
            elif isinstance(r, MessageFinished):
                assert m.finish_reason == r.reason, what
        if not any(isinstance(x, ConversationCreated) and x.conv_id == conv_id for x in survivors.values()) and \
                not any(isinstance(x, CheckpointPart) and x.conv_id == conv_id and len(bytes(x.conversation))
                        for x in survivors.values()):
            assert c.salvaged, f"{what}: conversation {conv_id} lost its creation and does not say so"


class NoSync(FileIO):
    """The real file system without fsync: power loss is the crash-state tests' part;
    here it would only cost time."""

    def fsync(self, fd: int) -> None:
        pass

    def fdatasync(self, fd: int) -> None:
        pass

    def fsync_dir(self, path) -> None:
        pass


NO_SYNC = NoSync()


def check_case(d: Path, w: Written, case: Case) -> None:
    d.mkdir()
    for name, data in case.files.items():
        (d / name).write_bytes(data)
    rep = recover(d, fs=NO_SYNC)  # what the engine's start runs (Journal opens it so)
    table, problem = read_table(d)  # what `aotx conversations show` reads
    survivors = {s: r for s, r in w.records.items() if s not in case.destroyed}
    assert_reachable(table, survivors)
    lost = {s for dm in rep.damage for s in range(dm["first_lost"], dm["last_lost"] + 1)}
    if case.noticeable:
        assert case.destroyed <= lost, f"destroyed {sorted(case.destroyed - lost)} without a word"
        if case.destroyed or case.name.split(" ")[0] == "segments" or "renamed" in case.name \
                or "duplicated" in case.name or "header byte" in case.name:
            assert rep.damage and "DAMAGE" in rep.summary() and "\n" not in rep.summary(), rep.summary()
    again = recover(d, fs=NO_SYNC)  # a second start: nothing left to do, and it reads clean
    assert problem is None and again.problem is None and again.damage == [] and again.bytes_dropped == 0


def test_every_record_not_destroyed_stays_reachable_after_any_single_damage(journals, tmp_path, capsys):
    t0 = time.monotonic()
    counts: dict[str, int] = {}
    k = 0
    for jname, w in journals.items():
        for gen in (record_cases, segment_cases, receipt_cases):
            for case in gen(w):
                k += 1
                try:
                    check_case(tmp_path / f"j{k}", w, case)
                except AssertionError as e:
                    raise AssertionError(f"{jname} journal, {case.name}: {e}") from None
                counts[gen.__name__] = counts.get(gen.__name__, 0) + 1
    n = sum(counts.values())
    with capsys.disabled():
        print(f"\n[damage matrix] {n} cases ({counts}) over {sum(len(w.records) for w in journals.values())} "
              f"records of every type, in {time.monotonic() - t0:.1f} s")
    assert n > 400
