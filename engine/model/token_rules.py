"""What llama.cpp's vocabulary loader knows beyond the GGUF metadata: token types, pre-tokenizers, special texts.

Owns: ``TokenType`` (``tokenizer.ggml.token_type``), the pre-tokenizer table keyed by
``tokenizer.ggml.pre`` (``PRE_TOKENIZERS``, llama-vocab.cpp's ``llm_tokenizer_bpe``
regexes and flags), the token texts llama.cpp recognises (EOT, EOM, FIM, the
end-of-generation texts), GPT-2's byte map (``gpt2_unicode_to_byte``), and
``_token_rules``: the types, EOT/EOM ids, EOG set and LSTRIP/RSTRIP tokens llama.cpp's
loader derives from them (llama-vocab.cpp ``impl::load``, in its order).
Leaves to others: building and running the tokenizer (``tokenizer.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache
from typing import Any

from aotx.engine.errors import TokenizerError


class TokenType(IntEnum):
    """``tokenizer.ggml.token_type`` values (llama.cpp ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# --- pre-tokenizers: llama-vocab.cpp ``llm_tokenizer_bpe`` regex table -------------

_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
              r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
             r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5: letters take their combining marks (\p{M}) with them
_QWEN35_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
              r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizerSpec:
    """One row of the pre-tokenizer table: regexes applied in order, and the
    flags llama.cpp sets with them (``ignore_merges``, default ``add_bos``,
    ``clean_spaces``)."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False
    clean_spaces: bool = True


_LLAMA3 = PreTokenizerSpec((_LLAMA3_RE,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizerSpec((_QWEN2_RE,), clean_spaces=False)
_GPT2 = PreTokenizerSpec((_GPT2_RE,))
_STARCODER = PreTokenizerSpec((r"\p{N}", _GPT2_RE))

# ``tokenizer.ggml.pre`` value -> spec (names as llama-vocab.cpp spells them).
PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "default": PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]")),
    "gpt-2": _GPT2, "gpt2": _GPT2, "phi-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2, "jais": _GPT2,
    "exaone4": _GPT2,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3,
    "pixtral": _LLAMA3, "dbrx": _LLAMA3, "smaug-bpe": _LLAMA3, "lfm2": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2,
    "qwen35": PreTokenizerSpec((_QWEN35_RE,), clean_spaces=False),
    "stablelm2": PreTokenizerSpec((_QWEN2_RE,)),
    "smollm": PreTokenizerSpec((r"\p{N}", _GPT2_RE), clean_spaces=False),
    "starcoder": _STARCODER, "refact": _STARCODER, "codeshell": _STARCODER, "exaone": _STARCODER,
    "minerva-7b": _STARCODER,
    "command-r": PreTokenizerSpec((r"\p{N}", _GPT2_RE), clean_spaces=False),
    "falcon": PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_RE, r"[0-9][0-9][0-9]")),
}

# --- token texts llama-vocab.cpp recognises (``impl::load``, llama.cpp 0c1e5709) -------

_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PRE_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                  "<|code_prefix|>", "<|prefix|>")
_FIM_SUF_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                  "<|code_suffix|>", "<|suffix|>")
_FIM_MID_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                  "<|code_middle|>", "<|middle|>")
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
_EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                        "<｜end▁of▁sentence｜>", "[e~["})

_SPECIAL_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN)
_C_SPACE = " \t\n\v\f\r"  # C isspace(), what llama.cpp's LSTRIP/RSTRIP skip


@lru_cache(maxsize=1)
def gpt2_unicode_to_byte() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-unicode map, inverted (char -> byte).
    Source: openai/gpt-2 ``encoder.py`` ``bytes_to_unicode`` (also llama.cpp unicode.cpp)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _meta_id(meta: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    v = meta.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise TokenizerError(f"GGUF metadata {key} is {v!r}; expected a token id")
    if v < 0:  # some converters write -1 for "none"
        return None
    if v >= n_vocab:
        raise TokenizerError(f"GGUF metadata {key} is {v}, past the end of the vocabulary ({n_vocab} tokens)")
    return v


def _find_text(text_to_id: Mapping[str, int], texts: Iterable[str]) -> int | None:
    """First token (in ``texts`` order) whose text is in the vocabulary."""
    for t in texts:
        if t in text_to_id:
            return text_to_id[t]
    return None


@dataclass(frozen=True)
class _TokenRules:
    """What llama.cpp's vocabulary loader derives from token texts and the model name on
    top of the metadata: ``types`` after its overrides, the EOT/EOM ids, the EOG set, and
    the tokens whose partition strips whitespace to their left/right (LSTRIP/RSTRIP)."""

    types: tuple[int, ...]
    eot: int | None
    eom: int | None
    eog: frozenset[int]
    lstrip: frozenset[int]
    rstrip: frozenset[int]


def _token_rules(meta: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int]) -> _TokenRules:
    """llama-vocab.cpp ``impl::load`` after the vocabulary is read, in its order:

    1. EOT, EOM and the FIM tokens are found by text when the metadata names none; a
       found token that is not CONTROL becomes CONTROL.
    2. The EOG set: the FIM pad/repo/sep tokens, every token whose text is in llama.cpp's
       list of end-of-generation texts (made CONTROL if it is not: Qwen2.5's NORMAL
       ``</s>`` turns CONTROL, so ``</s>`` in special-parsed text is one token), EOS,
       EOT, EOM. Then two repairs: ``<|end|>`` leaves the set (and becomes USER_DEFINED)
       when ``<|return|>`` + ``<|call|>`` (gpt-oss) or ``<|calls|>`` + ``<|flush|>`` are
       there; ``</s>`` leaves it (NORMAL) beside ``<|tool_response>`` or
       ``<|plamo:eos|>``.
    3. A file whose lower-cased ``general.name`` contains "phi-3" or "phi3" gets Phi-3's
       attributes: RSTRIP on every special token and on ``</s>``, none on ``<unk>``,
       ``<s>``, ``<|endoftext|>`` (whitespace after such a token is dropped in parsing).
    """
    n = len(tokens)
    ty = list(types)
    text_to_id: dict[str, int] = {}
    for i, t in enumerate(tokens):
        text_to_id.setdefault(t, i)

    def found(key: str, texts: Sequence[str]) -> int | None:
        tid = _meta_id(meta, f"tokenizer.ggml.{key}_token_id", n)
        if tid is not None:
            return tid
        tid = _find_text(text_to_id, texts)
        if tid is not None and ty[tid] != TokenType.CONTROL:
            ty[tid] = int(TokenType.CONTROL)
        return tid

    eot = found("eot", _EOT_TEXTS)
    eom = found("eom", _EOM_TEXTS)
    for key, texts in (("fim_pre", _FIM_PRE_TEXTS), ("fim_suf", _FIM_SUF_TEXTS), ("fim_mid", _FIM_MID_TEXTS)):
        found(key, texts)
    eog: set[int] = set()
    for key, texts in (("fim_pad", _FIM_PAD_TEXTS), ("fim_rep", _FIM_REP_TEXTS), ("fim_sep", _FIM_SEP_TEXTS)):
        fid = found(key, texts)
        if fid is not None:
            eog.add(fid)
    for t, i in text_to_id.items():
        if t in _EOG_TEXTS:
            eog.add(i)
            if ty[i] != TokenType.CONTROL:
                ty[i] = int(TokenType.CONTROL)
    eos = _meta_id(meta, "tokenizer.ggml.eos_token_id", n)
    eog.update(i for i in (eos, eot, eom) if i is not None)
    eog_texts = {tokens[i]: i for i in eog}
    end = eog_texts.get("<|end|>")
    if end is not None and ((("<|return|>" in eog_texts) and ("<|call|>" in eog_texts or "<|calls|>" in eog_texts))
                            or (("<|call|>" in eog_texts or "<|calls|>" in eog_texts) and "<|flush|>" in eog_texts)):
        eog.discard(end)
        ty[end] = int(TokenType.USER_DEFINED)
    s_end = eog_texts.get("</s>")
    if s_end is not None and ("<|tool_response>" in eog_texts or "<|plamo:eos|>" in eog_texts):
        eog.discard(s_end)
        ty[s_end] = int(TokenType.NORMAL)
    rstrip: set[int] = set()
    name = str(meta.get("general.name") or "").lower()
    if "phi-3" in name or "phi3" in name:
        rstrip = {i for i, t in enumerate(ty) if t in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED)}
        if "</s>" in text_to_id:
            rstrip.add(text_to_id["</s>"])
        for t in ("<unk>", "<s>", "<|endoftext|>"):
            rstrip.discard(text_to_id.get(t, -1))
    return _TokenRules(tuple(ty), eot, eom, frozenset(eog), frozenset(), frozenset(rstrip))
