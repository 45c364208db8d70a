"""Crash states, exhaustively: every prefix of a small recorded run, and salvage's renames.

Builds on ``test_crash_states.py`` (its recording file layer, its model of what a
power loss leaves, its checks): a small writer run (two rotations, both receipt
copies) small enough that every state after every prefix of its writes and fsyncs is
recovered, none skipped for time; and the salvage of swapped, repeated and missing
segments (renames, a move aside, a recreated segment), through every state a power
loss can leave between those steps.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from aotx.engine.journal import (
    ConversationCreated, Journal, MessageAccepted, MessageFinished, TokensCommitted, recover,
)
from tests.test_crash_states import Budget, RecordingIO, _run_states, check_journal_state, snapshot


def _small_writer_run(d: Path):
    """A few ticks across two segment rotations: every write, fsync, create and receipt
    (both receipt copies) of the writer, small enough to replay every prefix of."""
    d.mkdir(parents=True, exist_ok=True)
    initial, ids = snapshot(d)
    fs = RecordingIO(d, ids)
    published: dict[int, object] = {}
    j = Journal(d, segment_bytes=4096, buffer_bytes=16384, fs=fs, on_receipt=lambda r: fs.mark("receipt", r.last_seq))

    def pub(rec, tick):
        published[j.publish(rec, tick)] = rec

    pub(ConversationCreated("c", "chat", 1.0), 0)
    pub(MessageAccepted("c", "u", "user", "hi " * 200), 0)
    pub(MessageAccepted("c", "r", "assistant"), 0)
    j.flush()
    j.wait_durable(j.last_seq, 10)
    for t in range(1, 13):
        pub(TokensCommitted("c", "r", 2 * t, [t, t], f"<{t}>" * (150 + 20 * t)), t)
        j.flush()
        j.wait_durable(j.last_seq, 10)
    pub(MessageFinished("c", "r", "stop", 3, 24), 13)
    j.close()
    return fs, published, initial, ids


def test_every_prefix_of_a_small_writer_run_recovers_every_receipted_record(tmp_path, capsys):
    """ALICE-style: the state after every prefix of the recorded operations (and, at each,
    every torn or dropped write since the last fsync), none skipped for time."""
    t0 = time.monotonic()
    fs, published, initial, ids = _small_writer_run(tmp_path / "journal")
    assert sum(1 for op in fs.ops if op[0] == "create" and op[1].endswith(".seg")) >= 3
    assert {op[1] for op in fs.ops if op[0] == "create"} >= {"RECEIPT", "RECEIPT.2"}
    budget = Budget(60)
    n = _run_states(tmp_path, initial, ids, fs.ops,
                    lambda d, receipted, i: check_journal_state(d, receipted, published, again=False), budget)
    assert not budget.spent()  # every state was checked, none left out for time
    with capsys.disabled():
        print(f"\n[crash states] every prefix of a small writer run: all {n} distinct states of "
              f"{sum(op[0] != 'receipt' for op in fs.ops)} operations in {time.monotonic() - t0:.1f} s")


def test_power_loss_while_salvage_renames_moves_aside_and_recreates_segments(tmp_path, capsys):
    """Recovery of swapped, repeated and missing segments renames files, moves a repeat
    aside and creates a missing segment: every state a power loss leaves on the way
    still recovers every record but the deleted segment's."""
    t0 = time.monotonic()
    fs0, published, _, _ = _small_writer_run(tmp_path / "journal")
    work = tmp_path / "salvage"
    shutil.copytree(tmp_path / "journal", work, ignore=shutil.ignore_patterns("LOCK"))
    segs = sorted(work.glob("*.seg"))
    assert len(segs) >= 4
    a, b = segs[1].read_bytes(), segs[2].read_bytes()
    segs[1].write_bytes(b)  # segments 2 and 3 swapped
    segs[2].write_bytes(a)
    (work / "0000000009.seg").write_bytes(segs[0].read_bytes())  # segment 1 repeated
    gone = segs[3]  # untouched by the swap: its name is its number
    lost_seqs = {e.seq for e in _entries_of(tmp_path / "journal", int(gone.name[:10]))}
    gone.unlink()  # a segment deleted
    initial, ids = snapshot(work)
    fs = RecordingIO(work, ids)
    rep = recover(work, fs=fs)
    kinds = {d["kind"] for d in rep.damage}
    assert {"misplaced", "duplicate", "gap"} <= kinds and {op[0] for op in fs.ops} >= {"rename", "create"}
    last = max(published)
    n = _run_states(tmp_path / "s", initial, ids, fs.ops,
                    lambda d, receipted, i: check_journal_state(d, last, published, lambda s: s in lost_seqs),
                    Budget(30))
    with capsys.disabled():
        print(f"\n[crash states] salvage of swapped, repeated and missing segments: {n} states from {len(fs.ops)} "
              f"operations in {time.monotonic() - t0:.1f} s")
    assert n > sum(op[0] in ("rename", "create") for op in fs.ops)  # a state after each of them, at least


def _entries_of(d: Path, segment: int):
    from aotx.engine.journal import dump

    return [e for e in dump(d) if e.segment == segment]


def test_power_loss_while_salvage_renames_segments_whose_headers_are_destroyed(tmp_path, capsys):
    """A destroyed header on a swapped segment (and both of a swap destroyed): salvage
    renames them back through a free number and rewrites their headers; every state a
    power loss leaves between those steps recovers every record."""
    from aotx.engine.journal.records import HEADER_BYTES

    t0 = time.monotonic()
    _, published, _, _ = _small_writer_run(tmp_path / "journal")
    last = max(published)
    n = 0
    for k, headers in enumerate(([1], [0, 1])):
        work = tmp_path / f"w{k}"
        shutil.copytree(tmp_path / "journal", work, ignore=shutil.ignore_patterns("LOCK"))
        segs = sorted(work.glob("*.seg"))
        for i in headers:
            b = bytearray(segs[i].read_bytes())
            b[HEADER_BYTES - 1 - i] ^= 0x10
            segs[i].write_bytes(bytes(b))
        a, b = segs[headers[0]].read_bytes(), segs[headers[0] + 1].read_bytes()
        segs[headers[0]].write_bytes(b)
        segs[headers[0] + 1].write_bytes(a)
        initial, ids = snapshot(work)
        fs = RecordingIO(work, ids)
        recover(work, fs=fs)
        assert sum(op[0] == "rename" for op in fs.ops) >= 2
        n += _run_states(tmp_path / f"s{k}", initial, ids, fs.ops,
                         lambda d, receipted, i: check_journal_state(d, last, published), Budget(20))
    with capsys.disabled():
        print(f"\n[crash states] salvage of swapped segments without headers: {n} states in "
              f"{time.monotonic() - t0:.1f} s")
    assert n >= 50
