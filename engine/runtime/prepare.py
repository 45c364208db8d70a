"""The preparation stage: a message's prompt is made off the tick thread, within bounds.

Owns: the workers that run stage 3 of ``submit.py`` (the chat template over the
conversation, then tokenization) so that the tick never waits on one client's
input, and the bounds that keep each preparation finite:

* size first: a text that cannot fit the context whatever its tokenization is
  refused before any work (every token covers at most the vocabulary's longest
  piece, so ``len(text) / longest`` tokens is a floor); a 10 MB paste against a
  4,096-token context is answered at once instead of tokenized for a minute, and
  so is a prompt a chat template wrote that long (up to its 32 Mi characters);
* the chat template renders inside its ``RenderBudget`` (CPU time and size;
  ``model/template_sandbox.py``), in a worker process whose memory and CPU the
  operating system bounds (``model/template_worker.py``: ``isolate`` routes a
  model's template there): a hostile template is refused naming it, and what it
  built never grows the engine;
* tokenization of long fragments goes through ``tokenizers`` with the GIL
  released (``Tokenizer.encode``), so the tick thread keeps running.

Results come back to the engine thread as a ``Prepared`` event (``events.py``),
as finished media stages come back as ``MediaReady``: one mechanism, one inbox.
Leaves to others: what the stage computes (``submit.py``), admission
(``admission.py``), the template and the tokenizer (``engine/model``).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from aotx.engine.errors import AotxError, EngineError, ErrorCode
from aotx.engine.model.template_sandbox import DEFAULT_CPU_SECONDS, DEFAULT_MAX_CHARS, RenderBudget
from aotx.engine.model.template_worker import TemplateWorkers, shared_workers
from aotx.engine.model.tokenizer import Tokenizer
from aotx.engine.runtime.admission import Refusal
from aotx.engine.runtime.events import Inbox, Prepared

log = logging.getLogger("aotx.engine")

N_WORKERS = 2  # one slow preparation (a long paste) does not hold up everyone else's
RENDER_MIN_CHARS = 1 << 20  # a render may always build this much, whatever the context


class Preparer:
    """A few daemon worker threads running preparations, fairly.

    ``submit(sub, work)`` runs ``work() -> (text, prompt ids)`` on a worker and posts
    ``Prepared(sub, text, prompt)`` to ``inbox``, or ``Prepared(sub, error=e)`` when it
    raised (an ``AotxError`` as is; anything else becomes an internal error, logged).

    Order and fairness: one client's (one ``sub.sink``'s) preparations run one at a
    time in the order they came, so its messages are accepted in the order it sent
    them; clients take turns, so one sending slow work (a long paste, a template
    that runs to its budget) delays another's next message by at most one of its
    preparations, not by its whole queue. Workers start on first use and are
    daemons: a stuck C call can never keep the process from exiting. ``close()`` ends
    them (the engine's ``stop``): a stopped engine leaves no thread behind."""

    def __init__(self, inbox: Inbox, n_workers: int = N_WORKERS, templates: TemplateWorkers | None = None):
        self.inbox = inbox
        self.n_workers = n_workers
        self.templates = templates if templates is not None else shared_workers()
        self._cond = threading.Condition()
        self._pending: dict[int, deque] = {}  # id(sink) -> its preparations not yet started
        self._turns: deque[int] = deque()  # sinks with pending work and none running, in turn order
        self._running: set[int] = set()  # sinks one of whose preparations is running
        self._threads: list[threading.Thread] = []
        self._closed = False

    def isolate(self, template: Any) -> None:
        """Render ``template`` (a model's ``ChatTemplate``) in the template worker processes
        from now on, and start one worker now so the first message does not wait for it."""
        if hasattr(template, "workers"):
            template.workers = self.templates
            self.templates.warm()

    def submit(self, sub: Any, work: Callable[[], tuple[str, list[int]]]) -> None:
        key = id(sub.sink)
        with self._cond:
            self._closed = False
            if not self._threads:
                for i in range(self.n_workers):
                    t = threading.Thread(target=self._run, name=f"aotx-prepare-{i}", daemon=True)
                    t.start()
                    self._threads.append(t)
            q = self._pending.setdefault(key, deque())
            q.append((sub, work))
            if len(q) == 1 and key not in self._running:
                self._turns.append(key)
            self._cond.notify()

    def close(self, timeout_s: float = 1.0) -> None:
        """End the workers once they are idle; a preparation still running finishes
        first (waited for up to ``timeout_s``, then left to its daemon thread)."""
        with self._cond:
            self._closed = True
            threads, self._threads = self._threads, []
            self._cond.notify_all()
        for t in threads:
            t.join(timeout_s)

    def _take(self) -> tuple[int, Any, Callable[[], tuple[str, list[int]]]] | None:
        with self._cond:
            while not self._turns:
                if self._closed:
                    return None
                self._cond.wait()
            key = self._turns.popleft()
            q = self._pending[key]
            sub, work = q.popleft()
            if not q:
                del self._pending[key]
            self._running.add(key)
            return key, sub, work

    def _done(self, key: int) -> None:
        with self._cond:
            self._running.discard(key)
            if key in self._pending:  # its next one takes a turn at the back
                self._turns.append(key)
                self._cond.notify()

    def _run(self) -> None:
        while True:
            taken = self._take()
            if taken is None:
                return
            key, sub, work = taken
            try:
                text, prompt = work()
                ev = Prepared(sub, text, prompt)
            except AotxError as e:
                ev = Prepared(sub, error=e)
            except Exception as e:  # noqa: BLE001 - a bug must reach the client as an error, not kill the worker
                log.exception("preparing a message failed")
                ev = Prepared(sub, error=EngineError(f"internal error while preparing the prompt: {e}",
                                                     ErrorCode.INTERNAL))
            # posted before the client's next preparation may start: its messages stay in order
            self.inbox.put(ev)
            self._done(key)


def longest_piece(tokenizer: Tokenizer) -> int:
    """The most bytes one token of ``tokenizer`` stands for (special tokens included),
    at least 1 (one pass over the vocabulary: ~50 ms for 50k tokens; callers keep it)."""
    return max([1] + [len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size)])


def render_budget(longest: int, context_tokens: int) -> RenderBudget:
    """The budget of a chat template render whose prompt must fit ``context_tokens``: the
    default CPU time, and at most the characters a prompt that fits could hold (four
    times the floor's, for what a template builds on the way; at least 1 Mi, at most
    the sandbox's default). What a template writes past it stays in its worker: 30 M
    characters crossing to the engine for each refused message grew its RSS for good."""
    chars = min(DEFAULT_MAX_CHARS, max(RENDER_MIN_CHARS, 4 * longest * context_tokens))
    return RenderBudget(DEFAULT_CPU_SECONDS, chars)


def check_size(text: str, longest: int, context_tokens: int, what: str = "the message") -> None:
    """Refuse ``text`` when no tokenization of it can fit ``context_tokens`` (with one
    token of reply): every token covers at most ``longest`` bytes (``longest_piece``)
    and a character is at least one byte, so ``len(text) / longest`` tokens is a
    floor. ``what`` names the text ("the message", or the prompt a chat template
    made). Raises Refusal (too_long, context)."""
    floor = -(-len(text) // longest)
    if floor + 1 > context_tokens:
        raise Refusal(ErrorCode.TOO_LONG, "context",
                      f"{what} is {len(text):,} characters, at least {floor:,} tokens (this vocabulary's "
                      f"longest token is {longest} bytes); the context holds {context_tokens:,} tokens",
                      asked=floor + 1, free=context_tokens,
                      accepts=f"a prompt of at most {context_tokens - 1} tokens",
                      detail=f"{what} is too long for the context: at least {floor:,} tokens, the context "
                             f"holds {context_tokens:,}")
