"""A tiny ``gemma3`` GGUF: Gemma 3's block in six layers, enough for llama.cpp's fixed
sliding-window pattern (layers 0-4 local, layer 5 global: ``il % 6 < 5``).

What it exercises: RMSNorm weights stored as converted (the converter adds Gemma's 1 to
every ``*norm.weight``; llama.cpp multiplies by the stored value as is), QK-norm per head,
post-attention and post-FFN norms (``post_attention_norm``, ``post_ffw_norm``), GELU-tanh
gated FFN, the token embedding scaled by sqrt(d_model), queries scaled by 1/sqrt(head_dim)
(llama.cpp's f_attention_scale for every Gemma 3 but the 27B), head_dim (32) unequal to
d_model / n_heads (16), a sliding window (16 tokens) shorter than the reference prompts,
and two RoPE bases: ``rope.freq_base`` (1e6) on the global layer and, on the local ones,
llama.cpp's default 10000 (the key ``rope.freq_base_swa`` is absent, as in the
Gemma 3 270M file from PyPI, unless ``rope_base_swa`` is given). NEOX RoPE. Tied output.

Metadata as the converter's Gemma3Model writes it (and the real file has): context_length,
embedding_length, block_count, feed_forward_length, head_count, layer_norm_rms_epsilon,
key_length, value_length, rope.freq_base, sliding_window, head_count_kv. The norms' stored
weights have mean 1 and std 0.3, so a forward that added 1 again would miss the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType as T

from .common import Tokenizer, TinyWriter, std_vocab

TYPES = {"token_embd": T.Q8_0, "attn_q": T.F32, "attn_k": T.F32, "attn_v": T.F32, "attn_output": T.F32,
         "ffn_gate": T.Q8_0, "ffn_up": T.Q8_0, "ffn_down": T.Q3_K}


def write(path: str | Path, tokenizer: Tokenizer, *, seed: int = 34, n_layers: int = 6, d_model: int = 64,
          n_heads: int = 4, n_kv_heads: int = 1, head_dim: int = 32, ffn: int = 256,
          rope_base: float = 1000000.0, rope_base_swa: float | None = None, sliding_window: int | None = 16,
          context_length: int = 32768, norm_eps: float = 1e-6, **defects: Any) -> Path:
    """Write the tiny gemma3 file to ``path``; ``sliding_window=None`` leaves the key out
    (every layer global); ``defects`` go to ``TinyWriter``."""
    tw = TinyWriter(path, "gemma3", seed=seed, name="tiny-gemma3", **defects)
    w = tw.w
    w.add_context_length(context_length)
    w.add_embedding_length(d_model)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_layer_norm_rms_eps(norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_base)
    if rope_base_swa is not None:
        w.add_rope_freq_base_swa(rope_base_swa)
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    w.add_head_count_kv(n_kv_heads)
    tw.tokenizer(tokenizer)

    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    tw.matrix("token_embd.weight", tokenizer.n_vocab, d_model, TYPES["token_embd"], std=std_vocab(d_model))
    for i in range(n_layers):
        p = f"blk.{i}."
        tw.vector(p + "attn_norm.weight", d_model, std=0.3)
        tw.matrix(p + "attn_q.weight", q, d_model, TYPES["attn_q"])
        tw.matrix(p + "attn_k.weight", kv, d_model, TYPES["attn_k"])
        tw.matrix(p + "attn_v.weight", kv, d_model, TYPES["attn_v"])
        tw.vector(p + "attn_q_norm.weight", head_dim, std=0.3)
        tw.vector(p + "attn_k_norm.weight", head_dim, std=0.3)
        tw.matrix(p + "attn_output.weight", d_model, q, TYPES["attn_output"])
        tw.vector(p + "post_attention_norm.weight", d_model, std=0.3)
        tw.vector(p + "ffn_norm.weight", d_model, std=0.3)
        tw.matrix(p + "ffn_gate.weight", ffn, d_model, TYPES["ffn_gate"])
        tw.matrix(p + "ffn_up.weight", ffn, d_model, TYPES["ffn_up"])
        tw.matrix(p + "ffn_down.weight", d_model, ffn, TYPES["ffn_down"])
        tw.vector(p + "post_ffw_norm.weight", d_model, std=0.3)
    tw.vector("output_norm.weight", d_model, mean=3.0, std=0.3)
    return tw.write()
