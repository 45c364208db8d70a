"""When generation stops, and what text is safe to show before it does.

Owns: the termination rules of one generation: end-of-generation token ids
(``Tokenizer.eog_ids``: EOS, EOT, EOM, ...), stop strings (even when one spans
several tokens), the token budget (``max_tokens``) and the context limit
(``n_ctx``). Leaves to others: producing tokens and their text deltas
(``tokenizer.StreamDecoder``), and sampling.

A stop string must never leak into the stream, even in part: text whose tail
could still be the start of a stop string is held back until the next delta
decides. On a match only the text before the stop string is emitted. Finish
reasons follow OpenAI/llama.cpp usage: ``"stop"`` (EOG token or stop string),
``"length"`` (``max_tokens`` generated), ``"context"`` (prompt + generated
tokens filled ``n_ctx``).
"""

from __future__ import annotations

from collections.abc import Iterable

FINISH_REASONS = ("stop", "length", "context")


class StopChecker:
    """Feed each generated token; get back the text to emit and, at the end, why.

    ``eog_ids``: token ids that end generation (their own text is never
    emitted). ``stop_strings``: texts that end generation (empty strings are
    ignored). ``max_tokens``: at most this many generated tokens (None: no
    limit). ``n_ctx``: context size in tokens; ``n_prompt``: tokens already in
    the context before the first generated one (None ``n_ctx``: no limit).
    Raises ValueError on a non-positive ``max_tokens`` or ``n_ctx``.
    """

    def __init__(self, eog_ids: Iterable[int], stop_strings: Iterable[str] = (), max_tokens: int | None = None,
                 n_ctx: int | None = None, *, n_prompt: int = 0) -> None:
        if max_tokens is not None and max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if n_ctx is not None and n_ctx <= 0:
            raise ValueError(f"n_ctx must be positive, got {n_ctx}")
        self.eog_ids = frozenset(eog_ids)
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.max_tokens = max_tokens
        self.n_ctx = n_ctx
        self.n_prompt = n_prompt
        # the reply goes on past the end of the context (a context policy cuts its prompt):
        # "context" then keeps held text back, as the reply is not over
        self.goes_on = False
        self.n_generated = 0
        self.finish_reason: str | None = None
        self.matched = ""  # the stop string that ended generation ("" for any other reason)
        self._held = ""
        # Every proper prefix of every stop string, to find the longest held tail.
        self._prefixes = frozenset(s[:k] for s in self.stop_strings for k in range(1, len(s)))
        self._max_hold = max((len(s) - 1 for s in self.stop_strings), default=0)

    def feed(self, token_id: int, text: str) -> tuple[str, str | None]:
        """One generated token and its text delta -> (text safe to emit now,
        finish reason or None). After a finish reason, feeding raises ValueError."""
        if self.finish_reason is not None:
            raise ValueError(f"generation already finished ({self.finish_reason})")
        self.n_generated += 1
        if token_id in self.eog_ids:
            return self._finish("stop", self._take_all())
        buf = self._held + text
        cut = self._first_stop(buf)
        if cut is not None:
            self._held = ""
            self.matched = next(s for s in self.stop_strings if buf.find(s) == cut)
            return self._finish("stop", buf[:cut])
        hold = self._hold_len(buf)
        emit, self._held = (buf[: len(buf) - hold], buf[len(buf) - hold:]) if hold else (buf, "")
        if self.max_tokens is not None and self.n_generated >= self.max_tokens:
            return self._finish("length", emit + self._take_all())
        if self.n_ctx is not None and self.n_prompt + self.n_generated >= self.n_ctx:
            return self._finish("context", emit if self.goes_on else emit + self._take_all())
        return emit, None

    def resume(self, n_prompt: int) -> None:
        """The reply goes on after a "context" finish, its prompt cut to ``n_prompt``
        tokens before the reply's own."""
        if self.finish_reason != "context":
            raise ValueError(f"only a reply that reached the end of the context resumes, not {self.finish_reason}")
        self.finish_reason = None
        self.n_prompt = n_prompt

    def flush(self) -> str:
        """Generation ended for another reason (cancelled, error): the held-back
        text, which turned out not to be a stop string."""
        return self._take_all()

    def _finish(self, reason: str, emit: str) -> tuple[str, str]:
        self.finish_reason = reason
        return emit, reason

    def _take_all(self) -> str:
        out, self._held = self._held, ""
        return out

    def _first_stop(self, buf: str) -> int | None:
        best = None
        for s in self.stop_strings:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best):
                best = i
        return best

    def _hold_len(self, buf: str) -> int:
        for k in range(min(self._max_hold, len(buf)), 0, -1):
            if buf[-k:] in self._prefixes:
                return k
        return 0
