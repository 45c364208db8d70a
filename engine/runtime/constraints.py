"""Constrained decoding: the grammar state of a slot and the token mask of each step.

Owns: compiling a ``protocol.Constraint`` (a JSON schema, a Lark or GBNF grammar, a
regex) with llguidance (the library llama.cpp uses: an Earley parser over a lexer,
masks computed against a token trie; github.com/guidance-ai/llguidance) for one
model's vocabulary, and the per-request ``GrammarState``: the matcher, the tokens it
consumed, the mask of the next step as a bitmask (``(ceil(vocab / 32),) int32``, bit
``i`` set when token ``i`` is allowed), the masks of a speculative verify window, and
the state as data for a capsule (``snapshot`` / ``GrammarState.restore``: the grammar
and the consumed ids; a restore replays them, so a fork or a restored capsule
continues the same constraint exactly).

Every end-of-generation id of the vocabulary is llguidance's EOS: a grammar that is
satisfied allows them (and only them once it cannot grow), so a reply ends where the
grammar does. Leaves applying a mask to logits to ``sampling.py`` (host) and the
CUDA sampling kernel (``backend/cuda/sampling.py``), and choosing rows to the executor.

Limits: a grammar compiles in llguidance's default resource limits (a schema or a
grammar past them is refused with the library's message); masks are computed on the
engine thread, one per constrained row per tick (about 0.1-1 ms each for JSON
schemas on a 150k vocabulary; ``tests/tools/bench_constraints.py`` measures it).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from aotx.engine.errors import RequestError
from aotx.engine.model.tokenizer import Tokenizer

#: llguidance's JSON compile options for every JSON schema: no free whitespace between
#: tokens (a small model given free whitespace can loop on newlines), OpenAI's
#: separators (``{"a": 1, "b": 2}``), the way models write JSON in their training data.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(RequestError):
    """A grammar or schema llguidance cannot compile; the message starts with the
    client's name for the field."""


def _llg():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401 (fill_next_token_bitmask)
    except ImportError as e:  # a dependency of the package: only a broken install lacks it
        raise RequestError(f"constrained decoding needs llguidance ({e.name} is missing): "
                           "pip install llguidance") from None
    return llguidance


class _Vocabulary:
    """What llguidance's ``TokenizerWrapper`` reads from a tokenizer: every token's
    bytes, the special ids, and an encoder for the text a grammar forces."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        toks, special = [], []
        for i in range(tokenizer.vocab_size):
            toks.append(tokenizer.token_bytes(i))
            if tokenizer.is_special(i) or not toks[-1]:
                special.append(i)  # CONTROL/UNKNOWN (and empty, UNUSED) ids never match grammar text
        self.tokens = toks
        self.special_token_ids = special

    def __call__(self, s: str | bytes) -> list[int]:
        if isinstance(s, bytes):
            s = s.decode("utf-8", errors="replace")
        return self._tok.encode(s)


class Compiler:
    """Compiles constraints for one model's tokenizer. The llguidance tokenizer (a
    token trie over the vocabulary, ~1-3 s for 150k tokens) is built on first use and
    kept; ``compile`` is safe from any thread."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.vocab = int(tokenizer.vocab_size)
        self.words = (self.vocab + 31) // 32
        self.eog = sorted(int(i) for i in tokenizer.eog_ids)
        self._lltok = None
        self._lock = threading.Lock()

    @property
    def lltokenizer(self):
        with self._lock:
            if self._lltok is None:
                llg = _llg()
                eos = self.eog or ([self.tokenizer.eos_id] if self.tokenizer.eos_id is not None else [])
                self._lltok = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(self.tokenizer)), n_vocab=self.vocab,
                                              eos_token=eos)
            return self._lltok

    def grammar_text(self, kind: str, grammar: str, field: str = "") -> str:
        """llguidance's grammar for a constraint of ``kind`` (``protocol.CONSTRAINT_KINDS``).
        Raises GrammarError naming ``field`` for a schema that is not JSON."""
        llg = _llg()
        where = field or "constraint"
        if kind == "json_schema":
            try:
                schema = json.loads(grammar)
            except ValueError as e:
                raise GrammarError(f"{where}: the schema is not JSON ({e})") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError(f"{where}: a JSON schema is an object, got {type(schema).__name__}")
            try:
                return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except (ValueError, TypeError) as e:
                raise GrammarError(f"{where}: {e}") from None
        if kind == "lark":
            return llg.LLMatcher.grammar_from_lark(grammar)
        if kind == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                return llg.LLMatcher.grammar_from_lark(gbnf_to_lark(grammar))
            except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions on bad GBNF
                raise GrammarError(f"{where}: not a GBNF grammar llguidance reads: {e}") from None
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(grammar)
        raise GrammarError(f"{where}: unknown grammar kind {kind!r}")

    def compile(self, kind: str, grammar: str, field: str = "") -> "GrammarState":
        """A fresh ``GrammarState``. Raises GrammarError (the field, then llguidance's
        message) when the grammar does not compile for this vocabulary."""
        text = self.grammar_text(kind, grammar, field)
        return self.from_text(text, field)

    def from_text(self, text: str, field: str = "") -> "GrammarState":
        llg = _llg()
        m = llg.LLMatcher(self.lltokenizer, text, log_level=0)
        if m.is_error():
            raise GrammarError(f"{field or 'constraint'}: {m.get_error()}")
        g = GrammarState(self, text, m, field)
        g.mask()  # the first step's mask (kept for it): the matcher knows its dead ends once it has one
        if m.is_stopped() and not m.is_accepting():
            # stopped before its first token and not accepting the empty text: the grammar's
            # language is empty (a schema that only refers to itself, {"$ref": "#"}), and the
            # reply would be "" where a value was promised
            raise GrammarError(f"{field or 'constraint'}: the grammar admits no text at all (a schema or rule that "
                               "only refers to itself, such as {\"$ref\": \"#\"}, has no value); give it a case "
                               "that ends")
        return g


class GrammarState:
    """The grammar state of one reply (one slot's constraint). ``consumed``: the ids the
    matcher took, in order. ``mask()`` is the bitmask of the next step (cached until
    the next ``consume``)."""

    def __init__(self, compiler: Compiler, text: str, matcher: Any, field: str = ""):
        self.compiler = compiler
        self.text = text
        self.matcher = matcher
        self.field = field
        self.consumed: list[int] = []
        self._mask: np.ndarray | None = None
        self.error = ""

    # ---- masks ------------------------------------------------------------------------

    def _fill(self, out: np.ndarray) -> None:
        self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def mask(self) -> np.ndarray:
        """(words,) int32 bitmask of the ids allowed next (read-only: shared until the
        next ``consume``)."""
        if self._mask is None:
            m = np.empty(self.compiler.words, np.int32)
            self._fill(m)
            m.setflags(write=False)
            self._mask = m
        return self._mask

    def window_masks(self, drafts: list[int]) -> np.ndarray:
        """(1 + len(drafts), words) int32: the mask of each row of a verify window, row
        ``i`` after ``drafts[:i]``. Drafts are consumed tentatively and rolled back; past
        the first draft the grammar forbids, rows repeat that row's mask (the forbidden
        draft is rejected there, so later rows are never used)."""
        out = np.empty((1 + len(drafts), self.compiler.words), np.int32)
        out[0] = self.mask()
        # never consume a draft the grammar refuses: that would leave the matcher in its
        # error state for good (llguidance's matchers do not leave it)
        n_ok = self.matcher.validate_tokens([int(d) for d in drafts]) if drafts else 0
        for i in range(n_ok):
            if not self.matcher.consume_token(int(drafts[i])):
                raise RuntimeError(f"grammar state lost on a validated draft: {self.matcher.get_error()}")
            self._fill(out[i + 1])
        if n_ok:
            self.matcher.rollback(n_ok)
        out[n_ok + 1:] = out[n_ok]
        return out

    def allows(self, token: int) -> bool:
        m = self.mask()
        return bool((int(m[token >> 5]) >> (token & 31)) & 1)

    # ---- steps ------------------------------------------------------------------------

    def consume(self, tokens: list[int]) -> bool:
        """Advance past ``tokens`` (the ones the sampler produced). False (and ``error``
        set) when the grammar refuses one: then the reply must end."""
        for t in tokens:
            if self.matcher.is_stopped() and int(t) in self.compiler.eog:
                self.consumed.append(int(t))  # the end of the reply after the grammar's end
                continue
            if not self.matcher.consume_token(int(t)):
                self.error = self.matcher.get_error() or f"token {t} is not allowed here"
                self._mask = None
                return False
            self.consumed.append(int(t))
        self._mask = None
        return True

    @property
    def done(self) -> bool:
        """The grammar cannot take anything more but the end of the reply."""
        return bool(self.matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self.matcher.is_accepting())

    # ---- forks and capsules -------------------------------------------------------------

    def fork(self) -> "GrammarState":
        """An independent copy at the same point (n choices forked after the prompt)."""
        g = GrammarState(self.compiler, self.text, self.matcher.deep_copy(), self.field)
        g.consumed = list(self.consumed)
        g._mask = self._mask
        return g

    def snapshot(self) -> dict[str, Any]:
        """The state as data (a capsule's ``grammar`` header field)."""
        return {"grammar": self.text, "consumed": list(self.consumed), "field": self.field}

    @classmethod
    def restore(cls, compiler: Compiler, state: dict[str, Any]) -> "GrammarState":
        """The state ``snapshot`` saved: the grammar compiled again, its tokens replayed.
        Raises GrammarError when they no longer fit (another vocabulary)."""
        g = compiler.from_text(str(state["grammar"]), str(state.get("field", "")))
        if not g.consume([int(t) for t in state.get("consumed", [])]):
            raise GrammarError(f"the capsule's grammar state does not replay: {g.error}")
        return g


def mask_bits(mask: np.ndarray, vocab: int) -> np.ndarray:
    """(vocab,) bool: which ids a (words,) int32 bitmask allows (bit i of word i // 32)."""
    return np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), bitorder="little")[:vocab].astype(bool)
