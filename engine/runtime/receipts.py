"""Receipts, one way: the journal's drain -> each client's ``Durable`` -> the engine thread.

Owns: the durable watch (which client waits for which sequence number, and what
the record completes: the user's message, a reply's tokens, its finish). The
store gives ``Receipts.deliver`` to the ``Journal`` when it opens it, so the drain
thread hands every receipt here right after its fsync; ``deliver`` sends each
covered client its ``Durable`` at once (sinks are thread-safe: a long tick never
delays a receipt) and posts ``ReceiptArrived`` to the engine's inbox, where the
engine marks messages durable and lets waiting requests run. Nothing is assigned
after the fact: the receipt flows journal -> receipts -> inbox.
"""

from __future__ import annotations

import enum
import threading

from aotx.engine import protocol as P
from aotx.engine.runtime.events import Inbox, ReceiptArrived
from aotx.engine.runtime.requests import Request


class Covers(enum.Enum):
    """What a watched record completes for its client."""

    ACCEPTED = "accepted"  # the user's message (and the reply's start)
    TOKENS = "tokens"      # a tick's tokens of the reply
    FINAL = "final"        # the reply's finish


class Receipts:
    """The durable watch of one engine. ``inbox``: the engine's (``events.Inbox``)."""

    def __init__(self, inbox: Inbox):
        self.inbox = inbox
        self._lock = threading.Lock()
        self._watch: list[tuple[int, Request, Covers]] = []

    def watch(self, seq: int, r: Request, covers: Covers) -> None:
        """Tell ``r``'s client when record ``seq`` is durable."""
        with self._lock:
            self._watch.append((seq, r, covers))

    def deliver(self, rc) -> None:
        """On the journal's drain thread (its ``on_receipt``), right after the fsync."""
        with self._lock:
            covered = [w for w in self._watch if w[0] <= rc.last_seq]
            self._watch = [w for w in self._watch if w[0] > rc.last_seq]
        receipt = P.Receipt(segment=rc.segment, offset=rc.offset, last_seq=rc.last_seq)
        sent: set[int] = set()
        # a reply whose finish is in this receipt gets that one event (with its msg_id), not
        # a tokens event before it: a client stops at the first event covering its reply's
        # last record, and missed the msg_id (seen after a cancel, whose tokens and finish
        # share one fsync)
        finals = {id(r) for _, r, covers in covered if covers is Covers.FINAL}
        accepted = []
        for _, r, covers in covered:
            if covers is Covers.ACCEPTED:
                r.sink.send(P.Durable(id=r.rid, receipt=receipt, msg_id=r.msg_id, choice=r.choice))
                accepted.append(r)
            elif covers is Covers.FINAL:
                r.sink.send(P.Durable(id=r.rid, receipt=receipt, msg_id=r.reply_id, choice=r.choice))
            elif id(r) not in sent and id(r) not in finals:
                r.sink.send(P.Durable(id=r.rid, receipt=receipt, choice=r.choice))
            sent.add(id(r))
        self.inbox.put(ReceiptArrived(rc, tuple(accepted)))
