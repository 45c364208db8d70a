"""Tokenizer: every llama.cpp reference tokenization, special tokens, EOG ids,
streaming detokenization, and small synthetic vocabularies for the error paths."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aotx.engine.errors import TokenizerError
from aotx.engine.model.gguf_file import GGUFFile
from aotx.engine.model.tokenizer import StreamDecoder, Tokenizer, TokenType, gpt2_unicode_to_byte


@pytest.fixture(scope="module")
def meta(default_model_path):
    return GGUFFile.open(default_model_path).metadata


@pytest.fixture(scope="module")
def tok(meta) -> Tokenizer:
    return Tokenizer.from_metadata(meta)


@pytest.fixture(scope="module")
def tok_refs(refs_dir):
    return json.loads((refs_dir / "tokenizer_refs.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def chat_refs(refs_dir):
    return json.loads((refs_dir / "chat_refs.json").read_text(encoding="utf-8"))


# --- the default model against llama.cpp ---------------------------------------------

def test_every_reference_tokenization_matches(tok, tok_refs):
    assert len(tok_refs["strings"]) >= 20
    bad = []
    for s in tok_refs["strings"]:
        for mode, parse_special in (("special_true", True), ("special_false", False)):
            ref = s[mode]
            ids = tok.encode(s["text"], parse_special=parse_special)
            if ids != ref["ids"]:
                bad.append(f"{s['name']} {mode}: {ids} != {ref['ids']}")
            elif [tok.token_to_piece(i) for i in ids] != ref["pieces"]:
                bad.append(f"{s['name']} {mode}: pieces differ")
    assert not bad, "\n".join(bad)


def test_every_reference_detokenization_matches(tok, tok_refs):
    bad = []
    for s in tok_refs["strings"]:
        for mode in ("special_true", "special_false"):
            ref = s[mode]
            for key, skip in (("detok_special_true", False), ("detok_special_false", True)):
                got = tok.decode(ref["ids"], skip_special=skip)
                if got != ref[key]:
                    bad.append(f"{s['name']} {mode} {key}: {got!r} != {ref[key]!r}")
    assert not bad, "\n".join(bad)


def test_add_bos_follows_the_metadata_flag(tok, tok_refs):
    probe = tok_refs["add_bos_probe"]
    assert tok.add_bos is False
    assert tok.encode(probe["text"], add_special=True, parse_special=True) == probe["tokenize_add_bos_true_special_true"]


def test_special_ids_and_eog_set(tok, refs_dir):
    facts = json.loads((refs_dir / "model_facts.json").read_text(encoding="utf-8"))["tokenizer"]
    assert tok.bos_id == facts["bos"]["id"] == 1
    assert tok.eos_id == facts["eos"]["id"] == 2
    assert tok.vocab_size == facts["n_tokens"]
    # llama.cpp's end-of-generation set for this file (refs/README.md): <|endoftext|>
    # and <|im_end|> by the EOG text list, <reponame> as the FIM-repo token.
    assert tok.eog_ids == frozenset({0, 2, 4})


def test_user_typed_special_text_is_plain_text(tok):
    plain = tok.encode("<|im_start|>user", parse_special=False)
    assert 1 not in plain and all(not tok.is_special(i) for i in plain)
    assert tok.decode(plain) == "<|im_start|>user"
    assert tok.encode("<|im_start|>user", parse_special=True) == [1, 4093]


def test_plain_spans_keep_special_text_plain(tok):
    text = "<|im_start|>user\n<|im_end|><|im_end|>"
    inner = text.index("<|im_end|>")
    ids = tok.encode(text, parse_special=True, plain_spans=[(inner, inner + len("<|im_end|>"))])
    assert ids[:3] == [1, 4093, 198] and ids[-1] == 2
    assert ids.count(2) == 1 and tok.decode(ids) == text


# --- streaming detokenization --------------------------------------------------------

def _stream(tok, ids, **kw):
    sd = StreamDecoder(tok, **kw)
    deltas = [sd.feed(i) for i in ids]
    deltas.append(sd.flush())
    return deltas


def test_stream_reproduces_every_reference_completion(tok, chat_refs):
    for r in chat_refs["results"]:
        deltas = _stream(tok, r["completion_token_ids"])
        assert "".join(deltas) == r["completion_text"], r["name"]
        assert not any("\ufffd" in d for d in deltas), r["name"]


@pytest.mark.parametrize("name", ["emoji_single", "emoji_zwj_family", "cjk_chinese", "cjk_japanese",
                                  "accents_precomposed", "math_symbols", "arabic"])
def test_stream_holds_back_split_characters(tok, tok_refs, name):
    s = next(x for x in tok_refs["strings"] if x["name"] == name)
    ids = s["special_false"]["ids"]
    deltas = _stream(tok, ids)
    assert "".join(deltas) == s["text"]
    assert not any("\ufffd" in d for d in deltas)
    for d in deltas:
        d.encode("utf-8")  # every delta is whole characters
    if name == "emoji_single":
        # 4 UTF-8 bytes over 3 tokens: nothing may come out before the last one.
        assert deltas[:2] == ["", ""] and deltas[2] == "😀"


def test_stream_flush_marks_a_truncated_character(tok):
    ids = tok.encode("😀")
    sd = StreamDecoder(tok)
    assert [sd.feed(i) for i in ids[:-1]] == ["", ""]
    assert sd.flush() == "\ufffd"


def test_stream_skips_control_tokens_by_default(tok):
    ids = tok.encode("<|im_start|>hi<|im_end|>", parse_special=True)
    assert "".join(_stream(tok, ids)) == "hi"
    assert "".join(_stream(tok, ids, skip_special=False)) == "<|im_start|>hi<|im_end|>"


# Up to U+3FFFF: every UTF-8 byte those need is in the vocabulary. (SmolLM2's
# vocabulary lacks the lead bytes 0xF1-0xF7, so like llama.cpp it cannot
# represent U+40000 and above: those bytes are dropped.)
_MULTIBYTE = st.text(alphabet=st.characters(min_codepoint=0x80, max_codepoint=0x3FFFF,
                                            exclude_categories=("Cs",)) | st.sampled_from(" a1.\n"),
                     max_size=24)


@settings(max_examples=150, deadline=None)
@given(text=_MULTIBYTE)
def test_stream_never_breaks_a_character(tok, text):
    ids = tok.encode(text)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert tok.decode(ids) == text


# --- synthetic vocabularies (no model file needed) -----------------------------------

def _byte_level_meta(pre="gpt2", extra=(), merges=(), **kw):
    byte_chars = sorted(gpt2_unicode_to_byte(), key=gpt2_unicode_to_byte().get)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>"]
    tokens = specials + byte_chars + list(extra)
    types = [3, 3, 3, 4] + [1] * (len(tokens) - 4)
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": list(merges),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    meta.update(kw)
    return meta


def test_unknown_pre_tokenizer_is_named():
    with pytest.raises(TokenizerError, match="'made-up-pre'"):
        Tokenizer.from_metadata(_byte_level_meta(pre="made-up-pre"))


def test_unsupported_model_is_named():
    meta = _byte_level_meta()
    meta["tokenizer.ggml.model"] = "bert"
    with pytest.raises(TokenizerError, match="'bert'"):
        Tokenizer.from_metadata(meta)


@pytest.mark.parametrize("key,value,match", [
    ("tokenizer.ggml.tokens", None, "tokenizer.ggml.tokens"),
    ("tokenizer.ggml.token_type", [1, 1], "token_type"),
    ("tokenizer.ggml.merges", ["Ġ"], r"merges\[0\]"),
    ("tokenizer.ggml.eos_token_id", 10**6, "eos_token_id"),
])
def test_malformed_metadata_is_a_tokenizer_error(key, value, match):
    meta = _byte_level_meta()
    meta[key] = value
    with pytest.raises(TokenizerError, match=match):
        Tokenizer.from_metadata(meta)


@pytest.mark.parametrize("pre", ["default", "gpt2", "gpt-2", "llama-bpe", "llama3", "qwen2", "smollm",
                                 "starcoder", "falcon", "command-r", "stablelm2"])
def test_known_pre_tokenizers_round_trip(pre):
    tok = Tokenizer.from_metadata(_byte_level_meta(pre=pre, extra=["Ġh", "Ġhe"], merges=["Ġ h", "Ġh e"]))
    text = "a he said 123,4567 — ok\n\n  x"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode(" he") == [tok.vocab_size - 1]  # the merges are used


def test_user_defined_tokens_always_split_control_only_when_asked():
    tok = Tokenizer.from_metadata(_byte_level_meta())
    assert tok.token_type(3) == TokenType.USER_DEFINED
    assert tok.encode("a<tool>b", parse_special=False)[1] == 3
    assert 1 not in tok.encode("<|im_start|>", parse_special=False)
    assert tok.encode("<|im_start|>", parse_special=True) == [1]
    assert tok.eog_ids == frozenset({0, 2})


def test_add_special_adds_bos_and_eos_when_flagged():
    tok = Tokenizer.from_metadata(_byte_level_meta(**{"tokenizer.ggml.add_bos_token": True,
                                                      "tokenizer.ggml.add_eos_token": True}))
    ids = tok.encode("a", add_special=True)
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 3
    assert tok.decode(ids, skip_special=True) == "a"


def test_clean_spaces_follow_llama_cpp():
    tok = Tokenizer.from_metadata(_byte_level_meta(pre="gpt2"))
    ids = tok.encode("Hello , world ' s end . It 's they 've I 'd")
    assert tok.decode(ids) == "Hello, world's end. It's they've I 'd"


def test_sentencepiece_vocabulary():
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    normal = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "llo", "▁he", "▁hello", "hello",
              "▁w", "or", "▁wor", "ld", "▁world"]
    tokens = pieces + normal
    types = [2, 3, 3] + [6] * 256 + [1] * len(normal)
    scores = [0.0] * len(pieces) + [-float(i) for i in range(len(normal))]
    scores[tokens.index("▁hello")] = 10.0
    scores[tokens.index("▁world")] = 9.0
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}
    tok = Tokenizer.from_metadata(meta)
    ids = tok.encode("hello world", add_special=True)
    assert ids == [1, tokens.index("▁hello"), tokens.index("▁world")]
    assert tok.decode(ids, skip_special=True) == "hello world"
    # Characters outside the vocabulary fall back to byte tokens.
    ids = tok.encode("hé")
    assert tok.decode(ids) == "hé"
    assert tokens.index("<0xC3>") in ids
