"""``EventSink``: what an in-process ``Engine`` sends to one client, recorded.

The engine calls ``sink.send(message)`` from its tick thread; tests post an operation
with ``engine.post(op, sink)`` and wait for the operation's last event. Shared by every
test that drives an Engine without a socket (it was copied into six test files).
"""

from __future__ import annotations

import threading

from aotx.engine import protocol as P

#: The events that end an operation: a reply finished, an error, or the answer of a
#: conversation operation (create, fork, cancel, delete ...).
FINAL = (P.Committed, P.Error, P.ConversationInfo, P.Ok)


class EventSink:
    """Records every event in ``events``; ``done`` is set by each final event."""

    def __init__(self) -> None:
        self.events: list = []
        self.done = threading.Event()

    def send(self, m) -> None:
        self.events.append(m)
        if isinstance(m, FINAL):
            self.done.set()

    def wait(self, timeout: float = 120):
        """Wait for the next final event and return it (the latest one seen)."""
        assert self.done.wait(timeout), self.events
        self.done.clear()
        return next(e for e in reversed(self.events) if isinstance(e, FINAL))

    def one(self, cls):
        """The single event of type ``cls`` (fails when there are none or several)."""
        found = [e for e in self.events if isinstance(e, cls)]
        assert len(found) == 1, self.events
        return found[0]

    def all(self, cls) -> list:
        return [e for e in self.events if isinstance(e, cls)]
