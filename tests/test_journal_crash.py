"""Crash tests: kill -9 a writer at random moments, many times, and check that
every seq covered by a receipt the writer reported is recovered, in order, with
its exact content; that nothing torn is read back; and that the next writer
continues after it. Bounded: ~10 kills, each after at most 0.4 s of writing."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time

from aotx.engine.journal import TokensCommitted, compact, recover, verify
from aotx.engine.journal.records import CHECKPOINT_RECORDS

CHILD = r"""
import os, sys, time
from aotx.engine.journal import ConversationCreated, Journal, MessageAccepted, TokensCommitted
out = sys.stdout.fileno()
def on_receipt(r):
    os.write(out, b"%d\n" % r.last_seq)
j = Journal(sys.argv[1], segment_bytes=32 << 10, buffer_bytes=64 << 10, on_receipt=on_receipt)
os.write(out, b"start %d\n" % j.recovery.next_seq)
if j.recovery.next_seq == 1:
    for k in range(8):
        j.publish(ConversationCreated("c%d" % k, "t"), 0)
        j.publish(MessageAccepted("c%d" % k, "m", "assistant"), 0)
tick = 0
while True:  # 8 concurrent "replies", one token each per tick
    tick += 1
    for k in range(8):
        if not j.reserve(96):
            time.sleep(0.0005)  # held: the disk is behind
            continue
        s = j.last_seq + 1
        assert j.publish(TokensCommitted("c%d" % k, "m", s, [s], str(s) + ","), tick) == s
    j.flush()
"""


def _run_and_kill(directory, rng) -> tuple[int, int]:
    """Start a writer, let it run a random time, SIGKILL it. Returns (start seq,
    highest last_seq of a receipt it reported)."""
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(directory)], stdout=subprocess.PIPE)
    buf = b""
    start = None
    received = 0
    deadline = time.monotonic() + 30
    kill_at = None
    try:
        while True:
            now = time.monotonic()
            assert now < deadline, "writer did not start"
            if kill_at is not None and now >= kill_at:
                os.kill(p.pid, signal.SIGKILL)
                break
            r, _, _ = select.select([p.stdout], [], [], 0.01)
            if r:
                chunk = os.read(p.stdout.fileno(), 65536)
                assert chunk, f"writer exited early with {p.poll()}"
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.startswith(b"start "):
                        start = int(line.split()[1])
                        kill_at = time.monotonic() + rng.uniform(0.02, 0.4)
                    else:
                        received = max(received, int(line))
        p.wait(10)
        rest = p.stdout.read()  # receipts already in the pipe were received too
        for line in (buf + rest).split(b"\n"):
            if line.strip():
                received = max(received, int(line))
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
    assert start is not None
    return start, received


SETUP = 16  # seqs of the 8 ConversationCreated + 8 MessageAccepted records


def test_kill_9_at_random_moments_loses_nothing_a_receipt_covered(tmp_path):
    rng = random.Random(4)
    d = tmp_path / "journal"
    durable = 0  # highest seq any writer reported durable
    next_seq = 1  # where the next writer must continue
    checkpoint_seq = None
    for round_ in range(10):
        start, received = _run_and_kill(d, rng)
        assert start == next_seq  # the writer continued right after what was recovered
        assert received >= start, "no receipt within the run"
        durable = max(durable, received)
        rep = recover(d, keep_records=True)
        assert rep.last_seq >= durable, (rep.last_seq, durable, rep.problem)
        # the records: contiguous seqs, exact content, nothing torn
        entries = rep.records
        if isinstance(entries[0].record, CHECKPOINT_RECORDS):
            assert entries[0].seq == checkpoint_seq[0]
            assert [e.seq for e in entries if isinstance(e.record, CHECKPOINT_RECORDS)] == list(
                range(checkpoint_seq[0], checkpoint_seq[1] + 1))
            entries = [e for e in entries if not isinstance(e.record, CHECKPOINT_RECORDS)]
        first = checkpoint_seq[1] + 1 if checkpoint_seq else 1
        assert [e.seq for e in entries] == list(range(first, rep.last_seq + 1))
        for e in entries:
            if e.seq > SETUP:
                r = e.record
                assert isinstance(r, TokensCommitted)
                assert (r.start_pos, r.token_ids, r.text) == (e.seq, [e.seq], f"{e.seq},")
        # the conversations: every token seq once, in order, text matching
        tokens = []
        for c in rep.table.live():
            m = c.messages[0]
            assert m.token_ids == sorted(m.token_ids) and m.status == "interrupted"
            assert m.text == "".join(f"{t}," for t in m.token_ids)
            tokens += m.token_ids
        expected = set(range(SETUP + 1, rep.last_seq + 1)) - (
            set(range(checkpoint_seq[0], checkpoint_seq[1] + 1)) if checkpoint_seq else set())
        assert len(tokens) == len(expected) and set(tokens) == expected
        assert verify(d).ok
        next_seq = rep.last_seq + 1
        if round_ == 5:  # compaction between crashes: writers continue after the checkpoint
            cr = compact(d)
            assert cr.covers_seq == rep.last_seq and len(list(d.glob("*.seg"))) == 1
            assert cr.parts == 8  # one CheckpointPart per conversation
            checkpoint_seq = (next_seq, cr.end_seq)
            next_seq = cr.end_seq + 1
    assert durable > 1000
