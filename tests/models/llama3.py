"""A tiny Llama 3.x GGUF: architecture ``llama`` with the ``rope_freqs.weight`` tensor that
llama.cpp's converter writes for ``rope_scaling.rope_type = "llama3"`` (Llama 3.1/3.2/3.3).

Metadata as convert_hf_to_gguf.py's LlamaModel writes it for Llama 3.2: block_count,
context_length, embedding_length, feed_forward_length, head_count, head_count_kv,
rope.freq_base (500000), layer_norm_rms_epsilon, key_length/value_length (config head_dim),
file_type, vocab_size, rope.dimension_count. There are no rope-scaling keys: the llama3
scaling lives in the tensor (its per-frequency divisors, ``n_rot / 2`` float32), which
llama.cpp passes to ``ggml_rope_ext`` as freq_factors on every layer.

The factors follow the converter's formula (factor 8, low_freq_factor 1, high_freq_factor 4)
with ``original_max_position_embeddings`` 64 instead of Llama 3's 8192, so that they scale
frequencies whose rotations matter within a test prompt (with 8192 only dimensions that turn
by a few hundredths of a radian over 100 positions change, and a forward that ignored the
tensor would pass). The pre-tokenizer is Llama 3's ``llama-bpe`` over the source tokenizer's
vocabulary (SmolLM2's gpt2 BPE by default).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from .common import Tokenizer, TinyWriter, std_vocab

#: default tensor type per role
TYPES = {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "attn_k": T.Q4_0, "attn_v": T.Q4_0, "attn_output": T.Q4_1,
         "ffn_gate": T.Q5_1, "ffn_up": T.Q5_1, "ffn_down": T.Q6_K}


def llama3_rope_factors(head_dim: int, base: float, factor: float = 8.0, low_freq_factor: float = 1.0,
                        high_freq_factor: float = 4.0, original_context: int = 64) -> np.ndarray:
    """The ``rope_freqs.weight`` values (head_dim/2 float32), by the formula of the
    converter's LlamaModel.generate_extra_tensors (Meta's llama3 RoPE scaling)."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / float(f)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def write(path: str | Path, tokenizer: Tokenizer, *, seed: int = 31, n_layers: int = 2, d_model: int = 64,
          n_heads: int = 2, n_kv_heads: int = 1, head_dim: int = 32, ffn: int = 256,
          rope_base: float = 500000.0, rope_freqs: bool = True, original_context: int = 64,
          context_length: int = 131072, norm_eps: float = 1e-5, tied: bool = True, **defects: Any) -> Path:
    """Write the tiny Llama 3.x file to ``path``; ``defects`` go to ``TinyWriter``."""
    tw = TinyWriter(path, "llama", seed=seed, name="tiny-llama3", **defects)
    w = tw.w
    tw.decoder_hparams(n_layers=n_layers, context_length=context_length, d_model=d_model, ffn=ffn, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, rope_base=rope_base, norm_eps=norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(tokenizer.n_vocab)
    w.add_rope_dimension_count(head_dim)
    tw.tokenizer(tokenizer.replace({"tokenizer.ggml.pre": "llama-bpe"}))

    if rope_freqs:
        tw.tensor("rope_freqs.weight", llama3_rope_factors(head_dim, rope_base, original_context=original_context))
    tw.matrix("token_embd.weight", tokenizer.n_vocab, d_model, TYPES["token_embd"], std=std_vocab(d_model))
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    for i in range(n_layers):
        p = f"blk.{i}."
        tw.vector(p + "attn_norm.weight", d_model)
        tw.matrix(p + "attn_q.weight", q, d_model, TYPES["attn_q"])
        tw.matrix(p + "attn_k.weight", kv, d_model, TYPES["attn_k"])
        tw.matrix(p + "attn_v.weight", kv, d_model, TYPES["attn_v"])
        tw.matrix(p + "attn_output.weight", d_model, q, TYPES["attn_output"])
        tw.vector(p + "ffn_norm.weight", d_model)
        tw.matrix(p + "ffn_gate.weight", ffn, d_model, TYPES["ffn_gate"])
        tw.matrix(p + "ffn_up.weight", ffn, d_model, TYPES["ffn_up"])
        tw.matrix(p + "ffn_down.weight", d_model, ffn, TYPES["ffn_down"])
    tw.vector("output_norm.weight", d_model, mean=3.0, std=0.3)
    if not tied:
        tw.matrix("output.weight", tokenizer.n_vocab, d_model, T.Q8_0, std=std_vocab(d_model))
    return tw.write()
