"""A tiny ``phi3`` GGUF (Phi-3 / Phi-3.5 mini): fused ``attn_qkv`` (Q, K, V rows
concatenated in that order) and fused ``ffn_up`` holding gate then up (2 * n_ff rows:
llama.cpp's SWIGLU splits it in halves, silu(first) * second), NEOX RoPE, an untied
``output.weight``, d_model 256 so that every matrix can hold a 256-element K-type block.

Metadata as the converter's Phi3MiniModel writes it: context_length,
rope.scaling.original_context_length, embedding_length, feed_forward_length, block_count,
head_count, head_count_kv, layer_norm_rms_epsilon (1e-5), rope.dimension_count,
rope.freq_base (10000), file_type, sliding_window (2047, as Phi-3-mini-4k's config; llama.cpp
reads it and then disables Phi-3's sliding window, so it has no effect).

``longrope=True`` writes the 128k variant (Phi-3-mini-128k, Phi-3.5-mini): context_length
131072 over an original 4096, ``rope_factors_long.weight`` / ``rope_factors_short.weight``
(n_rot/2 float32 each; llama.cpp uses the short ones while the context it runs with is at
most the original length, the long ones above it) and ``rope.scaling.attn_factor``
(sqrt(1 + ln(32) / ln(4096)), the converter's formula), which llama.cpp multiplies into
RoPE's cos/sin (so both q and k are scaled by it).

``general.name`` is written the converter's way ("Tiny Phi 3 Mini 4k"): llama.cpp's vocabulary
loader gives a file whose lower-cased name contains "phi-3" or "phi3" Phi-3's special-token
attributes (RSTRIP on every special token, which needs ``<s>``, ``</s>`` and ``<unk>`` in the
vocabulary; SmolLM2's has none of them).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from .common import Tokenizer, TinyWriter, std_vocab

TYPES = {"token_embd": T.Q4_K, "output": T.Q6_K, "attn_qkv": T.Q5_K, "attn_output": T.Q4_K,
         "ffn_up": T.Q6_K, "ffn_down": T.Q2_K}


def write(path: str | Path, tokenizer: Tokenizer, *, seed: int = 35, n_layers: int = 2, d_model: int = 256,
          n_heads: int = 4, n_kv_heads: int = 4, ffn: int = 256, rope_base: float = 10000.0,
          context_length: int = 4096, original_context: int = 4096, sliding_window: int = 2047,
          norm_eps: float = 1e-5, longrope: bool = False, chat_template: str | None = None,
          **defects: Any) -> Path:
    """Write the tiny phi3 file to ``path``; ``chat_template`` replaces the source
    tokenizer's template; ``defects`` go to ``TinyWriter``."""
    if longrope:
        context_length = 131072
    head_dim = d_model // n_heads
    tw = TinyWriter(path, "phi3", seed=seed, name="Tiny Phi 3 Mini 128k" if longrope else "Tiny Phi 3 Mini 4k", **defects)
    w = tw.w
    w.add_context_length(context_length)
    w.add_rope_scaling_orig_ctx_len(original_context)
    w.add_embedding_length(d_model)
    w.add_feed_forward_length(ffn)
    w.add_block_count(n_layers)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_layer_norm_rms_eps(norm_eps)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope_base)
    w.add_sliding_window(sliding_window)
    if longrope:
        scale = context_length / original_context
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original_context)))
    tw.tokenizer(tokenizer if chat_template is None else tokenizer.replace({"tokenizer.chat_template": chat_template}))

    if longrope:
        # factors in the ranges of Phi-3-mini-128k's config: short ~1-3, long ~1-60
        n = head_dim // 2
        tw.tensor("rope_factors_long.weight", np.geomspace(1.0, 60.0, n).astype(np.float32))
        short = 1.0 + 2.0 * np.random.default_rng(seed + 1000).random(n)  # own stream: weights stay as in phi3
        tw.tensor("rope_factors_short.weight", short.astype(np.float32))
    kv = n_kv_heads * head_dim
    tw.matrix("token_embd.weight", tokenizer.n_vocab, d_model, TYPES["token_embd"], std=std_vocab(d_model))
    for i in range(n_layers):
        p = f"blk.{i}."
        tw.vector(p + "attn_norm.weight", d_model)
        tw.matrix(p + "attn_qkv.weight", d_model + 2 * kv, d_model, TYPES["attn_qkv"])
        tw.matrix(p + "attn_output.weight", d_model, d_model, TYPES["attn_output"])
        tw.vector(p + "ffn_norm.weight", d_model)
        tw.matrix(p + "ffn_up.weight", 2 * ffn, d_model, TYPES["ffn_up"])
        tw.matrix(p + "ffn_down.weight", d_model, ffn, TYPES["ffn_down"])
    tw.vector("output_norm.weight", d_model, mean=3.0, std=0.3)
    tw.matrix("output.weight", tokenizer.n_vocab, d_model, TYPES["output"], std=std_vocab(d_model))
    return tw.write()
