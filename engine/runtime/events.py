"""What arrives on the engine thread: the engine's inbox and its typed events.

Every event is a small frozen dataclass and the engine dispatches on its type
(``Engine._handlers``): a client's operation (``ClientOp``), a receipt from the
journal's drain (``ReceiptArrived``), a submission whose media stage finished
off the tick thread (``MediaReady``), a submission whose prompt was prepared off
the tick thread (``Prepared``: the chat template rendered and the text
tokenized, or the reason it could not be), a capsule file made durable
(``CapsuleWritten``), a client gone (``Disconnected``), and ``Wake`` (stop, or
just look again). Any thread may ``put``; only the engine thread ``get``s.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any, Union

from aotx.engine import protocol as P
from aotx.engine.errors import AotxError
from aotx.engine.journal.conversations import Receipt
from aotx.engine.runtime.requests import Request, Sink


@dataclass(frozen=True)
class ClientOp:
    op: P.Operation
    sink: Sink


@dataclass(frozen=True)
class ReceiptArrived:
    receipt: Receipt
    accepted: tuple[Request, ...]  # requests whose user message the receipt made durable


@dataclass(frozen=True)
class MediaReady:
    # a submit.Submission (not imported: submit posts these events), its attachments turned
    # into text or its pictures re-encoded
    submission: Any


@dataclass(frozen=True)
class Prepared:
    submission: Any  # a submit.Submission (not imported: submit posts these events)
    text: str = ""  # the user's turn as the prompt holds it (pictures that did not fit left out)
    prompt: list[int] | tuple = ()  # token ids
    error: AotxError | None = None  # raised while preparing (the template refused, too long)


@dataclass(frozen=True)
class CapsuleWritten:
    conv_id: str
    path: str
    n_tokens: int
    fingerprint: str = ""  # the model whose state it holds


@dataclass(frozen=True)
class RemoteEvent:
    """Something arrived from a remote model's stream (``remote.py``): look at it."""

    model: str


@dataclass(frozen=True)
class Disconnected:
    sink: Sink


@dataclass(frozen=True)
class Wake:
    pass


Event = Union[ClientOp, ReceiptArrived, MediaReady, Prepared, CapsuleWritten, RemoteEvent, Disconnected, Wake]


class Inbox:
    """The engine thread's queue of ``Event``s (thread-safe, unbounded)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, event: Event) -> None:
        self._q.put(event)

    def get(self, timeout: float | None = None) -> Event | None:
        """The next event, waiting up to ``timeout`` seconds (None or 0: not at all); None if none came."""
        try:
            return self._q.get(timeout=timeout) if timeout else self._q.get_nowait()
        except queue.Empty:
            return None
