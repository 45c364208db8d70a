"""Tokenizer built from GGUF metadata, matching llama.cpp token for token.

Owns: turning ``tokenizer.ggml.*`` metadata into a Hugging Face ``tokenizers``
model (BPE for ``tokenizer.ggml.model == "gpt2"``, SentencePiece-style BPE with
byte fallback for ``"llama"``), special-token handling, BOS/EOS flags, the
end-of-generation id set, detokenization and streaming detokenization
(``StreamDecoder``). Leaves to others: what llama.cpp's loader derives from the
vocabulary (token types, the pre-tokenizer table, special texts: ``token_rules.py``), the
chat template (``chat_template.py``) and when to stop generating (``termination.py``).

How it follows llama.cpp (``src/llama-vocab.cpp``):

* Special tokens are split out of the text *before* BPE, longest token text
  first (``tokenizer_st_partition``). CONTROL and UNKNOWN tokens are split out
  only with ``parse_special=True``; USER_DEFINED tokens always. Each remaining
  text fragment is BPE-encoded on its own.
* The pre-tokenizer regexes come from ``llm_tokenizer_bpe``'s table keyed by
  ``tokenizer.ggml.pre``; each regex splits the pieces the previous one left
  (a ``Sequence`` of ``Split(..., "isolated")``), then GPT-2 byte-to-unicode.
  For ``smollm`` this equals ``Digits(individual_digits=True)`` followed by
  GPT-2's ``ByteLevel`` regex.
* Detokenization follows ``token_to_piece``/``detokenize``: NORMAL tokens are
  byte-decoded, CONTROL/UNKNOWN tokens print their text only with
  ``skip_special=False``, USER_DEFINED print their text, UNUSED print nothing,
  and ``clean_spaces`` pre-tokenizers get llama.cpp's space clean-up passes.
* End of generation (``eog_ids``): EOS, EOT, EOM, the FIM pad/repo/sep tokens
  and every token whose text is in llama.cpp's list of EOG texts
  (``<|im_end|>``, ``<|endoftext|>``, ``<|eot_id|>``, ``<end_of_turn>``, ``</s>``,
  ...). On SmolLM2 that is {0 ``<|endoftext|>``, 2 ``<|im_end|>``, 4 ``<reponame>``};
  id 4 comes from the FIM-repo rule (``<reponame>`` is Granite's FIM_REP text).
* Token types after llama.cpp's loader (``_token_rules``): tokens found by those
  texts become CONTROL (Qwen2.5's NORMAL ``</s>``), and a file named like Phi-3
  gets RSTRIP on its special tokens (whitespace after them is dropped in parsing).
  Checked token for token against llama.cpp on Qwen2.5, Gemma 3, Llama 3.2 and a
  Phi-3-style SentencePiece vocabulary (tests/test_tokenizer_real.py).

Not done: WordPiece (``bert``), Unigram (``t5``), RWKV and PLaMo vocabularies
raise ``TokenizerError``; LSTRIP/RSTRIP attributes of other model families
(jina's ``<mask>``, ...); ``StreamDecoder`` does not apply ``clean_spaces``.
Building a large SentencePiece vocabulary (Gemma's 262,144 pieces) takes seconds:
its merges are derived in Python.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from aotx.engine.errors import TokenizerError
from aotx.engine.model.token_rules import (
    _C_SPACE, _SPECIAL_TYPES, PRE_TOKENIZERS, TokenType, _meta_id, _token_rules, _TokenRules, gpt2_unicode_to_byte,
)

# fragments this long are encoded with the GIL released (same ids; costs ~20 us more per call)
_GIL_FREE_CHARS = 4096


@lru_cache(maxsize=1)
def _gpt2_table() -> tuple[frozenset[str], dict[int, str]]:
    """GPT-2's byte chars, and a str.translate table taking each to the latin-1 char of its
    byte (so that ``.encode("latin-1")`` gives the bytes)."""
    u2b = gpt2_unicode_to_byte()
    return frozenset(u2b), {ord(c): chr(b) for c, b in u2b.items()}


class Tokenizer:
    """A GGUF tokenizer. Build it with ``Tokenizer.from_metadata(meta)``.

    Attributes: ``model`` ("gpt2", "gemma4" or "llama"), ``pre`` (``tokenizer.ggml.pre``),
    ``add_bos``/``add_eos`` (what ``encode(add_special=True)`` adds), ``bos_id``,
    ``eos_id``, ``eot_id``, ``eom_id``, ``eog_ids`` (frozenset), ``vocab_size``.
    Immutable after construction and safe to share between threads.
    """

    def __init__(self, *, model: str, pre: str, tokens: Sequence[str], token_types: Sequence[int],
                 hf: Any, add_bos: bool, add_eos: bool, add_space_prefix: bool, clean_spaces: bool,
                 bos_id: int | None, eos_id: int | None, eot_id: int | None, eom_id: int | None,
                 eog_ids: frozenset[int], lstrip: frozenset[int] = frozenset(),
                 rstrip: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.pre = pre
        self._tokens = tuple(tokens)
        self._types = tuple(token_types)
        self._hf = hf
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_space_prefix = add_space_prefix
        self.clean_spaces = clean_spaces
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eot_id = eot_id
        self.eom_id = eom_id
        self.eog_ids = eog_ids
        self._lstrip = lstrip
        self._rstrip = rstrip
        # Special-token partition order: longest text first (llama.cpp cache_special_tokens).
        special = [(t, i, TokenType(ty)) for i, (t, ty) in enumerate(zip(self._tokens, self._types))
                   if ty in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED) and t]
        special.sort(key=lambda x: -len(x[0].encode("utf-8")))
        self._special = tuple(special)
        self._pieces = tuple(self._piece_bytes(i) for i in range(len(self._tokens)))
        self._by_text: dict[str, int] = {}      # gemma4: runs of newlines that are tokens
        for i, t in enumerate(self._tokens):
            if model == "gemma4" and t and not t.strip("\n"):
                self._by_text.setdefault(t, i)

    # --- construction ---------------------------------------------------------------

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        """Build from GGUF metadata (key -> plain Python value).

        Reads ``tokenizer.ggml.{model,pre,tokens,token_type,merges,scores}``, the
        special-token ids and ``add_bos_token``/``add_eos_token``/``add_space_prefix``.
        Raises TokenizerError naming the key and value when something is missing,
        malformed or unsupported (for example an unknown ``tokenizer.ggml.pre``).
        """
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.model; the file carries no tokenizer")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, (list, tuple)) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise TokenizerError("GGUF metadata tokenizer.ggml.tokens is missing or not a list of strings")
        n = len(tokens)
        types = meta.get("tokenizer.ggml.token_type")
        if types is None:
            types = [int(TokenType.NORMAL)] * n
        if not isinstance(types, (list, tuple)) or len(types) != n:
            raise TokenizerError(f"GGUF metadata tokenizer.ggml.token_type has "
                                 f"{len(types) if isinstance(types, (list, tuple)) else types!r} entries; "
                                 f"expected one per token ({n})")
        bad = next((i for i, t in enumerate(types) if not isinstance(t, int) or not 0 <= t <= 6), None)
        if bad is not None:
            raise TokenizerError(f"GGUF metadata tokenizer.ggml.token_type[{bad}] is {types[bad]!r}; "
                                 f"expected 0..6")
        rules = _token_rules(meta, tokens, [int(t) for t in types])
        types = list(rules.types)
        if model == "gpt2":
            return cls._build_bpe(meta, list(tokens), types, rules)
        if model == "llama":
            return cls._build_spm(meta, list(tokens), types, rules)
        if model == "gemma4":
            return cls._build_raw_bpe(meta, list(tokens), types, rules)
        raise TokenizerError(f"tokenizer.ggml.model {model!r} is not supported "
                             f"(AOTX reads 'gpt2' BPE, 'gemma4' BPE and 'llama' SentencePiece vocabularies)")

    @classmethod
    def _build_raw_bpe(cls, meta: Mapping[str, Any], tokens: list[str], types: list[int],
                       rules: _TokenRules) -> "Tokenizer":
        """Gemma 4's BPE (``tokenizer.ggml.model == "gemma4"``, llama-vocab.cpp's
        LLAMA_VOCAB_PRE_TYPE_GEMMA4): spaces become ``▁``, the text splits into runs of
        non-newlines and runs of newlines (a newline run that is a token is that token),
        BPE merges run on raw UTF-8 characters, and a piece outside the vocabulary falls
        back to ``<0xXX>`` byte tokens; BOS is always added; pieces decode with ``▁`` as
        a space."""
        from tokenizers import Regex
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or ()]
        if any(len(m) != 2 or not all(m) for m in merges):
            raise TokenizerError("GGUF metadata tokenizer.ggml.merges holds an entry that is not 'left right'")
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        try:
            hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
        except Exception as e:  # noqa: BLE001
            raise TokenizerError(f"cannot build the gemma4 BPE tokenizer from the GGUF vocabulary ({e})") from None
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
        hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
        cls._register_added(hf, tokens, types)
        add_eos = meta.get("tokenizer.ggml.add_eos_token")
        return cls._finish(meta, rules, "gemma4", "gemma4", tokens, types, hf, add_bos=True,
                           add_eos=False if add_eos is None else bool(add_eos), add_space_prefix=False,
                           clean_spaces=True)

    @classmethod
    def _build_bpe(cls, meta: Mapping[str, Any], tokens: list[str], types: list[int],
                   rules: _TokenRules) -> "Tokenizer":
        from tokenizers import Regex
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        pre = meta.get("tokenizer.ggml.pre")
        pre = "default" if pre in (None, "") else str(pre)
        spec = PRE_TOKENIZERS.get(pre)
        if spec is None:
            raise TokenizerError(f"tokenizer.ggml.pre {pre!r} is not a pre-tokenizer AOTX knows "
                                 f"(known: {', '.join(sorted(PRE_TOKENIZERS))})")
        merges_raw = meta.get("tokenizer.ggml.merges")
        if not isinstance(merges_raw, (list, tuple)):
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.merges; a gpt2 BPE tokenizer needs them")
        merges = []
        for i, m in enumerate(merges_raw):
            parts = m.split(" ") if isinstance(m, str) else ()
            if len(parts) != 2 or not parts[0] or not parts[1]:
                raise TokenizerError(f"GGUF metadata tokenizer.ggml.merges[{i}] is {m!r}; expected 'left right'")
            merges.append((parts[0], parts[1]))
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            # Duplicate texts: llama.cpp's text->id map keeps the first; do the same.
            vocab = {}
            for i, t in enumerate(tokens):
                vocab.setdefault(t, i)
        try:
            hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=spec.ignore_merges))
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception on bad merges
            raise TokenizerError(f"cannot build the BPE tokenizer from the GGUF vocabulary ({e})") from None
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        hf.decoder = decoders.ByteLevel()
        cls._register_added(hf, tokens, types)
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        add_eos = meta.get("tokenizer.ggml.add_eos_token")
        return cls._finish(meta, rules, "gpt2", pre, tokens, types, hf,
                           add_bos=spec.add_bos if add_bos is None else bool(add_bos),
                           add_eos=False if add_eos is None else bool(add_eos),
                           add_space_prefix=False, clean_spaces=spec.clean_spaces)

    @classmethod
    def _build_spm(cls, meta: Mapping[str, Any], tokens: list[str], types: list[int],
                   rules: _TokenRules) -> "Tokenizer":
        """SentencePiece vocabularies (``tokenizer.ggml.model == "llama"``).

        llama.cpp's SPM tokenizer greedily merges the adjacent pair whose merged
        text is the highest-scoring vocabulary entry and falls back to ``<0xXX>``
        byte tokens. Here that is a BPE whose merges are every (left, right) split
        of a vocabulary entry, ranked by the entry's score, with byte fallback
        (the construction of transformers' GGUF ``LlamaConverter``). Spaces become
        ``▁``; a space is prefixed to a fragment at the start or after a special
        token when ``add_space_prefix`` (llama.cpp ``llama_vocab::impl::tokenize``).
        """
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models

        scores = meta.get("tokenizer.ggml.scores")
        if not isinstance(scores, (list, tuple)) or len(scores) != len(tokens):
            raise TokenizerError("GGUF metadata tokenizer.ggml.scores is missing or not one per token; "
                                 "a 'llama' SentencePiece tokenizer needs it")
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        normal = {t for t, ty in zip(tokens, types) if ty in (TokenType.NORMAL, TokenType.USER_DEFINED)}
        ranked = []
        for t in normal:
            if len(t) < 2:
                continue
            sc = float(scores[vocab[t]])
            for k in range(1, len(t)):
                a, b = t[:k], t[k:]
                if a in normal and b in normal:
                    ranked.append((-sc, vocab[t], a, b))
        ranked.sort()
        merges = [(a, b) for _, _, a, b in ranked]
        unk = _meta_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens))
        try:
            hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True,
                                        unk_token=tokens[unk] if unk is not None else None))
        except Exception as e:  # noqa: BLE001
            raise TokenizerError(f"cannot build the SentencePiece tokenizer from the GGUF vocabulary ({e})") \
                from None
        hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
        cls._register_added(hf, tokens, types)
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        add_eos = meta.get("tokenizer.ggml.add_eos_token")
        asp = meta.get("tokenizer.ggml.add_space_prefix")
        return cls._finish(meta, rules, "llama", str(meta.get("tokenizer.ggml.pre") or "default"), tokens, types,
                           hf,
                           add_bos=True if add_bos is None else bool(add_bos),
                           add_eos=False if add_eos is None else bool(add_eos),
                           add_space_prefix=True if asp is None else bool(asp), clean_spaces=False)

    @staticmethod
    def _register_added(hf: Any, tokens: list[str], types: list[int]) -> None:
        from tokenizers import AddedToken

        special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
                   if ty in _SPECIAL_TYPES and t]
        user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
                if ty == TokenType.USER_DEFINED and t]
        if special:
            hf.add_special_tokens(special)
        if user:
            hf.add_tokens(user)
        # Special-token text is never parsed by the HF model itself: ``Tokenizer``
        # splits special tokens out first (llama.cpp's partition), so HF only sees text.
        hf.encode_special_tokens = True

    @classmethod
    def _finish(cls, meta: Mapping[str, Any], rules: _TokenRules, model: str, pre: str, tokens: list[str],
                types: list[int], hf: Any, *, add_bos: bool, add_eos: bool, add_space_prefix: bool,
                clean_spaces: bool) -> "Tokenizer":
        n = len(tokens)
        bos = _meta_id(meta, "tokenizer.ggml.bos_token_id", n)
        eos = _meta_id(meta, "tokenizer.ggml.eos_token_id", n)
        if add_bos and bos is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is true but the metadata names no "
                                 "tokenizer.ggml.bos_token_id")
        if add_eos and eos is None:
            raise TokenizerError("tokenizer.ggml.add_eos_token is true but the metadata names no "
                                 "tokenizer.ggml.eos_token_id")
        return cls(model=model, pre=pre, tokens=tokens, token_types=types, hf=hf, add_bos=add_bos,
                   add_eos=add_eos, add_space_prefix=add_space_prefix, clean_spaces=clean_spaces,
                   bos_id=bos, eos_id=eos, eot_id=rules.eot, eom_id=rules.eom, eog_ids=rules.eog,
                   lstrip=rules.lstrip, rstrip=rules.rstrip)

    # --- vocabulary ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocabulary (the logits' width)."""
        return len(self._tokens)

    def token_to_piece(self, token_id: int) -> str:
        """The vocabulary entry's text as stored in the GGUF (GPT-2 byte-to-unicode
        form for BPE, e.g. ``"Ġthe"``; ``"▁the"`` for SentencePiece)."""
        return self._tokens[token_id]

    def token_type(self, token_id: int) -> TokenType:
        """The token's ``tokenizer.ggml.token_type``."""
        return TokenType(self._types[token_id])

    def is_special(self, token_id: int) -> bool:
        """True for CONTROL and UNKNOWN tokens (the ones ``skip_special`` hides)."""
        return self._types[token_id] in _SPECIAL_TYPES

    def token_bytes(self, token_id: int, *, skip_special: bool = False) -> bytes:
        """The bytes this token contributes to the output text (llama.cpp
        ``token_to_piece``): possibly an incomplete UTF-8 sequence."""
        if skip_special and self._types[token_id] in _SPECIAL_TYPES:
            return b""
        return self._pieces[token_id]

    @property
    def special_texts(self) -> tuple[str, ...]:
        """Texts of the CONTROL and UNKNOWN tokens (what ``parse_special`` turns into ids)."""
        return tuple(t for t, _, ty in self._special if ty in _SPECIAL_TYPES)

    def _piece_bytes(self, i: int) -> bytes:
        text, ty = self._tokens[i], self._types[i]
        if ty in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED):
            return text.encode("utf-8")
        if ty == TokenType.UNUSED:
            return b""
        if self.model in ("llama", "gemma4"):
            if ty == TokenType.BYTE and len(text) == 6 and text.startswith("<0x"):
                return bytes([int(text[3:5], 16)])
            return text.replace("▁", " ").encode("utf-8")
        keys, table = _gpt2_table()
        if keys.issuperset(text):           # every char a byte's (C loops; ~250k tokens at load)
            return text.translate(table).encode("latin-1")
        u2b = gpt2_unicode_to_byte()
        out = bytearray()
        for ch in text:
            b = u2b.get(ch)
            if b is None:
                out += ch.encode("utf-8")
            else:
                out.append(b)
        return bytes(out)

    # --- encode ----------------------------------------------------------------------

    def partition(self, text: str, *, parse_special: bool,
                  plain_spans: Sequence[tuple[int, int]] = ()) -> list[str | int]:
        """Split ``text`` into raw-text fragments (str) and special-token ids (int),
        as llama.cpp's ``tokenizer_st_partition``: for each special token, longest
        text first, every occurrence in a still-raw fragment becomes its id.
        CONTROL/UNKNOWN tokens are matched only with ``parse_special``; an
        occurrence that overlaps any ``plain_spans`` ``(start, end)`` character
        range is left as text (this is how chat content stays plain text)."""
        frags: list[tuple[int, int] | int] = [(0, len(text))] if text else []
        for tok_text, tok_id, ty in self._special:
            if not parse_special and ty in _SPECIAL_TYPES:
                continue
            if tok_text not in text:
                continue
            out: list[tuple[int, int] | int] = []
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    continue
                start, end = f
                pos = start
                while True:
                    m = text.find(tok_text, pos, end)
                    if m < 0:
                        break
                    m_end = m + len(tok_text)
                    if any(s < m_end and m < e for s, e in plain_spans):
                        pos = m + 1
                        continue
                    left = m
                    if tok_id in self._lstrip:
                        while left > start and text[left - 1] in _C_SPACE:
                            left -= 1
                    if left > start:
                        out.append((start, left))
                    out.append(tok_id)
                    start = pos = m_end
                    if tok_id in self._rstrip:
                        while start < end and text[start] in _C_SPACE:
                            start += 1
                        pos = start
                if start < end:
                    out.append((start, end))
            frags = out
        return [f if isinstance(f, int) else text[f[0]:f[1]] for f in frags]

    def encode(self, text: str, *, add_special: bool = False, parse_special: bool = False,
               plain_spans: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Token ids of ``text`` (llama.cpp ``llama_tokenize``).

        ``add_special``: add BOS/EOS as the metadata's add_bos/add_eos flags say.
        ``parse_special``: special-token text such as ``<|im_start|>`` becomes its
        single id; when False (the default, for user content) it is tokenized as
        plain text. ``plain_spans``: with ``parse_special``, character ranges where
        special-token text still stays plain text (see ``partition``).
        """
        ids: list[int] = []
        if add_special and self.add_bos:
            assert self.bos_id is not None
            ids.append(self.bos_id)
        prev_special = True
        for frag in self.partition(text, parse_special=parse_special, plain_spans=plain_spans):
            if isinstance(frag, int):
                ids.append(frag)
                prev_special = True
                continue
            if self.model == "llama":
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                frag = frag.replace(" ", "▁")
            elif self.model == "gemma4":
                ids.extend(self._encode_raw_bpe(frag.replace(" ", "▁")))
                prev_special = False
                continue
            if len(frag) < _GIL_FREE_CHARS:
                ids.extend(self._hf.encode(frag, add_special_tokens=False).ids)
            else:  # tokenizers releases the GIL in encode_batch (not in encode): the tick keeps running
                ids.extend(self._hf.encode_batch([frag], add_special_tokens=False)[0].ids)
            prev_special = False
        if add_special and self.add_eos:
            assert self.eos_id is not None
            ids.append(self.eos_id)
        return ids

    def _encode_raw_bpe(self, frag: str) -> list[int]:
        """Gemma 4: each run of newlines that is a token becomes that token (llama.cpp's
        newline-run lookup); the other runs go through the BPE."""
        out: list[int] = []
        for run in re.findall(r"[^\n]+|\n+", frag):
            tid = self._by_text.get(run) if run[0] == "\n" else None
            out.extend([tid] if tid is not None else self._hf.encode(run, add_special_tokens=False).ids)
        return out

    # --- decode ----------------------------------------------------------------------

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of ``ids`` (llama.cpp ``llama_detokenize``; ``skip_special`` is its
        ``special=False``: CONTROL/UNKNOWN tokens render as nothing). Invalid UTF-8
        becomes U+FFFD. SentencePiece drops the first token's leading space when
        ``add_space_prefix``; ``clean_spaces`` pre-tokenizers get llama.cpp's
        space clean-up (" ." -> ".", " 's" -> "'s", ...)."""
        ids = list(ids)
        if skip_special and self.add_bos and ids and ids[0] == self.bos_id:
            ids = ids[1:]
        if skip_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        chunks = [self.token_bytes(i, skip_special=skip_special) for i in ids]
        if self.add_space_prefix and chunks and chunks[0].startswith(b" "):
            chunks[0] = chunks[0][1:]
        text = b"".join(chunks).decode("utf-8", errors="replace")
        return _clean_spaces(text) if self.clean_spaces else text


def _clean_spaces(text: str) -> str:
    """llama.cpp ``detokenize``'s three clean-up passes for ``clean_spaces``
    vocabularies: drop the space before ``?!.,``; turn `` ' `` into ``'``; drop the
    space before ``'s``, ``'m``, ``'re``, ``'ve``."""
    if not text:
        return text
    out = [text[0]]
    for i in range(1, len(text)):
        if text[i - 1] == " " and text[i] in "?!.,":
            out.pop()
        out.append(text[i])
    t = "".join(out)
    out, i = [t[0]], 1
    while i < len(t):
        x = t[i]
        if x == "'" and i + 1 < len(t) and t[i - 1] == " " and t[i + 1] == " ":
            out.pop()
            out.append(x)
            i += 2
            continue
        out.append(x)
        i += 1
    t = "".join(out)
    out = [t[0]]
    for i in range(1, len(t)):
        x = t[i]
        if t[i - 1] == " " and x == "'" and i + 1 < len(t):
            x1 = t[i + 1]
            x2 = t[i + 2] if i + 2 < len(t) else ""
            if x1 in "sm" or (x1 + x2) in ("re", "ve"):
                out.pop()
        out.append(x)
    return "".join(out)


class StreamDecoder:
    """Token ids in, text deltas out, never splitting a UTF-8 character.

    ``feed(id)`` returns the text that is complete so far (possibly ""): bytes of
    a character that spans tokens are held back until it completes; bytes that
    can never form a character become U+FFFD. ``flush()`` returns what is left
    (an incomplete trailing character as U+FFFD). Concatenating every delta and
    the flush equals ``Tokenizer.decode(ids, skip_special=...)`` except for
    ``clean_spaces`` and the SentencePiece leading space, which streaming does
    not apply (llama.cpp's streaming ``token_to_piece`` does not either).
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Append one token; return the newly complete text."""
        return self._dec.decode(self._tok.token_bytes(token_id, skip_special=self._skip))

    def flush(self) -> str:
        """End of stream: return any held-back bytes (as U+FFFD) and reset."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out

