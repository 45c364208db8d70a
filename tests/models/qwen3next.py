"""A tiny ``qwen3next`` GGUF (Qwen3-Next): the tiny ``qwen35moe`` file (``qwen35moe.py``)
in Qwen3-Next's layout: beta and alpha from one ``ssm_ba`` matrix (per key head, 2 betas
then 2 alphas), value heads reading key heads grouped (h // 2), plain NEOX RoPE over 16 of
32 dims (no ``rope.dimension_sections``), pre-tokenizer ``qwen2``. Deterministic for any
seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import qwen35moe
from .common import Tokenizer


def write(path: str | Path, tokenizer: Tokenizer, *, seed: int = 37, **kw: Any) -> Path:
    """Write the tiny qwen3next file to ``path``; other arguments go to ``qwen35moe.write``."""
    kw = {"arch": "qwen3next", "fused_ba": True, "sections": None, "pre": "qwen2", **kw}
    return qwen35moe.write(path, tokenizer, seed=seed, **kw)
