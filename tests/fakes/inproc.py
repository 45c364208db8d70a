"""An Engine in this process and one client of it, for tests of the engine's operations.

``make_engine(lm, home, ...)`` starts an Engine on the default model's ``LoadedModel``
with its journal and models folder under ``home`` (AOTX_HOME); ``Client(engine)``
posts operations with fresh ids to one ``Sink`` and waits for their answers
(``answer``: an operation's final reply or Error, ``reply``: a message's Committed).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from aotx.engine import protocol as P
from aotx.engine.runtime.admission import Budget
from aotx.engine.runtime.catalog import Catalog
from aotx.engine.runtime.engine import Engine
from aotx.engine.runtime.store import open_store


class Sink:
    """Every event of one client; ``until(pred)`` waits for one that matches."""

    def __init__(self) -> None:
        self.events: list = []
        self.times: list[float] = []  # time.monotonic() of each event
        self._cv = threading.Condition()

    def send(self, m) -> None:
        with self._cv:
            self.events.append(m)
            self.times.append(time.monotonic())
            self._cv.notify_all()

    def until(self, pred, timeout: float = 180):
        end = time.monotonic() + timeout
        with self._cv:
            while True:
                for e in self.events:
                    if pred(e):
                        return e
                left = end - time.monotonic()
                assert left > 0, f"timed out; events: {self.events}"
                self._cv.wait(left)

    def of(self, cls, rid: int | None = None) -> list:
        return [e for e in self.events if isinstance(e, cls) and (rid is None or e.id == rid)]


def answer(sink: Sink, rid: int, cls=None):
    """The final answer to operation ``rid`` (an Error, or one of ``cls``)."""
    return sink.until(lambda e: getattr(e, "id", None) == rid and (isinstance(e, P.Error) or
                                                                  (cls is not None and isinstance(e, cls))))


def reply(sink: Sink, rid: int):
    return answer(sink, rid, P.Committed)


def make_engine(lm, home: Path, *, journal: str = "journal", budget: Budget | None = None, slots: int = 2,
                context: int = 256, **kw) -> Engine:
    store = open_store(home / journal)
    eng = Engine(lm, store, n_slots=slots, n_ctx=context, prefill_chunk=64, budget=budget, device="cpu",
                 catalog=Catalog(home / "models"), **kw)
    eng.start()
    return eng


def stop(eng: Engine) -> None:
    eng.stop()
    eng.store.close()


class Client:
    """Operations on an in-process engine, one sink, fresh ids."""

    def __init__(self, eng: Engine):
        self.eng = eng
        self.sink = Sink()
        self._id = 0

    def post(self, make) -> int:
        self._id += 1
        self.eng.post(make(self._id), self.sink)
        return self._id

    def create(self, model: str = "", **kw) -> P.ConversationView:
        rid = self.post(lambda i: P.CreateConversation(id=i, title="t", model=model, **kw))
        ans = answer(self.sink, rid, P.ConversationInfo)
        assert isinstance(ans, P.ConversationInfo), ans
        return ans.conversation

    def submit(self, conv_id: str, text: str, model: str = "", raw: bool = True, n: int = 6) -> int:
        sp = P.SamplingParams(temperature=0.0, max_tokens=n)
        return self.post(lambda i: P.SubmitMessage(id=i, conv_id=conv_id, text=text, sampling=sp, raw=raw,
                                                   model=model))

    def run(self, conv_id: str, text: str, **kw):
        rid = self.submit(conv_id, text, **kw)
        end = reply(self.sink, rid)
        return rid, end

    def tokens(self, rid: int) -> list[int]:
        return [e.token_id for e in self.sink.of(P.Token, rid)]

    def call(self, op_cls, cls, **fields):
        rid = self.post(lambda i: op_cls(id=i, **fields))
        return answer(self.sink, rid, cls)
