"""A full disk: the journal does not fail for good
on ENOSPC; it reports a degraded state naming the disk and how much it needs, the
engine holds new work with a notice saying so (and ``aotx status``, the gateway's
health and the TUI's status line show it), and everything resumes by itself when
space returns. Nothing durable is lost.

The disk fills by a patched ``os.writev`` that fails on the journal's segment files
while ``full`` is set (after writing part of the block, as a filling disk does): the
same on the tree before this fix, where the first ENOSPC failed the journal for good.
"""

from __future__ import annotations

import asyncio
import errno
import os
import time

import pytest

from aotx.engine.journal import ConversationCreated, Journal, MessageAccepted, TokensCommitted, dump, verify


class Disk:
    full = False
    failures = 0


@pytest.fixture
def disk(monkeypatch):
    """Patch ``os.writev`` so that, while ``disk.full``, writes to ``*.seg`` files put half
    their bytes down and then fail with ENOSPC."""
    d = Disk()
    real = os.writev

    def writev(fd, buffers):
        if d.full:
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                target = ""
            if target.endswith(".seg"):
                data = b"".join(bytes(b) for b in buffers)
                if len(data) > 1:
                    real(fd, [data[:len(data) // 2]])
                d.failures += 1
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, buffers)

    monkeypatch.setattr(os, "writev", writev)
    return d


def wait_for(pred, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_the_journal_waits_out_a_full_disk_and_loses_nothing(tmp_path, disk):
    """Regression: a full disk failed the journal for good: every later message failed with
    [Errno 28], even after the space came back."""
    receipts = []
    j = Journal(tmp_path, on_receipt=receipts.append)
    try:
        j.publish(ConversationCreated("c", "t"), 0)
        j.publish(MessageAccepted("c", "r", "assistant"), 0)
        assert j.wait_durable(2, 5)
        disk.full = True
        seqs = [j.publish(TokensCommitted("c", "r", i, [i], f"<{i}>"), i) for i in range(20)]
        j.flush()
        wait_for(lambda: j.degraded, what="the degraded state")
        assert disk.failures >= 1 and j.failed is None
        line = j.degraded
        assert str(tmp_path) in line and "bytes" in line and "free" in line and "held" in line
        assert not j.reserve(100) and j.free_bytes == 0 and j.stats()["degraded"] == line
        assert not j.wait_durable(seqs[-1], 0.3)  # still waiting, not failed
        assert j.durable_seq == 2
        disk.full = False  # space returns
        assert j.wait_durable(seqs[-1], 10)
        assert j.degraded == "" and j.reserve(100)
        assert receipts[-1].last_seq == seqs[-1]
    finally:
        j.close()
    got = list(dump(tmp_path))
    assert [e.seq for e in got] == list(range(1, 23)) and verify(tmp_path).ok  # the half writes were cut back
    assert [e.record.start_pos for e in got[2:]] == list(range(20))


def test_closing_while_the_disk_stays_full_fails_with_a_line_that_says_so(tmp_path, disk):
    from aotx.engine.errors import JournalError

    j = Journal(tmp_path)
    j.publish(ConversationCreated("c", "t"), 0)
    assert j.wait_durable(1, 5)
    disk.full = True
    j.publish(ConversationCreated("d", "t"), 0)
    j.flush()
    wait_for(lambda: j.degraded, what="the degraded state")
    with pytest.raises(JournalError, match="disk still full"):
        j.close(timeout=10)
    disk.full = False
    assert [e.seq for e in dump(tmp_path)] == [1]  # the receipted record is there, the other never was


# ---- the engine ------------------------------------------------------------------------

async def _wait_status(client, pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        st = await client.status()
        if pred(st):
            return st
        assert time.monotonic() < deadline, f"status never matched: degraded={st.degraded!r}"
        await asyncio.sleep(0.05)


async def test_the_engine_holds_new_work_while_the_disk_is_full_and_resumes_by_itself(engine_server, disk):
    """Regression: `aotx status` said `ready: yes` while every message failed with
    [Errno 28]. Now: degraded in the status and the TUI's status line, a held notice
    naming the disk, then the held work runs once space returns, every receipt arrives."""
    from aotx.app.widgets.status_bar import StatusBar
    from aotx.engine import protocol as P

    h = engine_server(slots=2, context=256)
    client = await h.connect()
    sp = P.SamplingParams(temperature=0.0, max_tokens=4)
    ev1: list = []
    ev2: list = []
    try:
        conv = await client.create_conversation("disk")
        other = await client.create_conversation("other")
        disk.full = True
        first = asyncio.create_task(_collect(client.submit(conv.conv_id, "one", sampling=sp, raw=True), ev1))
        st = await _wait_status(client, lambda s: s.degraded)
        assert st.ready and "disk full" in st.degraded and str(h.store.journal.directory) in st.degraded
        bar = StatusBar()
        bar.set_status(st)
        assert "DEGRADED" in bar.line() and "disk full" in bar.line()  # the TUI's status line
        assert not any(isinstance(e, P.Durable) for e in ev1)  # accepted, not yet durable: not started
        second = asyncio.create_task(_collect(client.submit(other.conv_id, "two", sampling=sp, raw=True), ev2))
        deadline = time.monotonic() + 20
        while not any(isinstance(e, P.Notice) and e.kind == "held" for e in ev2):
            assert time.monotonic() < deadline, ev2
            await asyncio.sleep(0.02)
        disk.full = False  # space returns: everything proceeds by itself
        await asyncio.wait_for(first, 120)
        await asyncio.wait_for(second, 120)
        st = await _wait_status(client, lambda s: not s.degraded)
        assert st.ready and st.degraded == ""
    finally:
        await client.close()
    for evs in (ev1, ev2):
        assert any(isinstance(e, P.Committed) for e in evs), evs
        assert isinstance(evs[-1], P.Durable)
    [held] = [e for e in ev2 if isinstance(e, P.Notice) and e.kind == "held"]
    assert held.resource == "disk" and "disk full" in held.message and "held" in held.message
    assert disk.failures >= 1
    assert verify(h.store.journal.directory).ok


async def _collect(agen, out: list) -> list:
    async for ev in agen:
        out.append(ev)
    return out


def test_the_gateway_health_says_degraded():
    """The gateway's /health answers 503 with the degraded line while the disk is full."""
    import json

    from aotx.engine.gateway import server as G
    from aotx.engine import protocol as P

    class Link:
        async def get(self):
            return self

        async def status(self):
            return P.StatusReply(id=0, model="m", device="cpu", ready=True, budget_bytes=0, used_bytes=0, budget=[],
                                 slots=[], n_ctx=512, degraded="disk full: the journal in /x needs 1 KiB")

    class Gw:
        link = Link()
        inflight = type("I", (), {"total": 0})()
        cfg = G.GatewayConfig()

    r = asyncio.run(G.Gateway.health(Gw(), None))
    body = json.loads(r.body)
    assert r.status_code == 503 and body["status"] == "degraded" and "disk full" in body["degraded"]
