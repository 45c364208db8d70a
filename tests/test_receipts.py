"""engine/runtime/receipts.py: which durable events a client gets for one receipt.

Regression: after a cancelled `aotx run --json`, the stream ended with a
`durable` event without the reply's msg_id. The reply's last tokens and its finish were
made durable by one fsync; the receipt sent a plain tokens event and then the reply's
final one, and the client (which stops at the first event covering the reply's last
record) never read the second.
"""

from __future__ import annotations

from types import SimpleNamespace

from aotx.engine import protocol as P
from aotx.engine.runtime.receipts import Covers, Receipts


class _Sink:
    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


class _Inbox:
    def __init__(self):
        self.items = []

    def put(self, item):
        self.items.append(item)


def _request(rid: int) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, msg_id=f"u{rid}", reply_id=f"m{rid}", choice=0, sink=_Sink())


def _durables(r) -> list[P.Durable]:
    return [m for m in r.sink.sent if isinstance(m, P.Durable)]


def test_a_receipt_covering_tokens_and_the_finish_sends_one_event_with_the_reply_id():
    rec = Receipts(_Inbox())
    r = _request(7)
    rec.watch(10, r, Covers.TOKENS)
    rec.watch(11, r, Covers.TOKENS)
    rec.watch(12, r, Covers.FINAL)
    rec.deliver(SimpleNamespace(segment=1, offset=400, last_seq=12))
    got = _durables(r)
    assert [(d.msg_id, d.receipt.last_seq) for d in got] == [("m7", 12)]


def test_tokens_before_the_finish_still_get_their_own_receipt():
    rec = Receipts(_Inbox())
    r, other = _request(7), _request(8)
    rec.watch(3, r, Covers.ACCEPTED)
    rec.watch(10, r, Covers.TOKENS)
    rec.watch(11, other, Covers.TOKENS)
    rec.deliver(SimpleNamespace(segment=1, offset=100, last_seq=10))
    assert [(d.msg_id, d.receipt.last_seq) for d in _durables(r)] == [("u7", 10)]
    assert _durables(other) == []
    rec.watch(12, r, Covers.FINAL)
    rec.deliver(SimpleNamespace(segment=1, offset=200, last_seq=12))
    assert [(d.msg_id, d.receipt.last_seq) for d in _durables(r)] == [("u7", 10), ("m7", 12)]
    assert [(d.msg_id, d.receipt.last_seq) for d in _durables(other)] == [("", 12)]
