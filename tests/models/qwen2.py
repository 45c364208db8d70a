"""A tiny ``qwen2`` GGUF (Qwen2 / Qwen2.5): a llama-style block whose Q, K and V
projections carry biases (``blk.N.attn_{q,k,v}.bias``, float32), NEOX RoPE.

Metadata as in the Qwen2.5-Coder-0.5B-Instruct file from PyPI (the converter's Qwen2Model):
block_count, context_length, embedding_length, feed_forward_length, head_count,
head_count_kv, rope.freq_base (1e6), layer_norm_rms_epsilon (1e-6), file_type; no
rope.dimension_count or key_length (head_dim = d_model / n_heads). The output is tied to
the embedding (no ``output.weight``), as in Qwen2.5 0.5B. Pre-tokenizer ``qwen2`` over the
source tokenizer's vocabulary. Biases have std 0.5, large enough that a forward that
dropped them would miss the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType as T

from .common import Tokenizer, TinyWriter, std_vocab

TYPES = {"token_embd": T.Q4_0, "attn_q": T.Q8_0, "attn_k": T.Q8_0, "attn_v": T.Q8_0, "attn_output": T.Q5_0,
         "ffn_gate": T.Q8_0, "ffn_up": T.Q8_0, "ffn_down": T.Q5_K}


def write(path: str | Path, tokenizer: Tokenizer, *, seed: int = 32, n_layers: int = 2, d_model: int = 64,
          n_heads: int = 4, n_kv_heads: int = 2, ffn: int = 256, rope_base: float = 1000000.0,
          context_length: int = 32768, norm_eps: float = 1e-6, bias_std: float = 0.5, tied: bool = True,
          **defects: Any) -> Path:
    """Write the tiny qwen2 file to ``path``; ``defects`` go to ``TinyWriter``."""
    tw = TinyWriter(path, "qwen2", seed=seed, name="tiny-qwen2", **defects)
    tw.decoder_hparams(n_layers=n_layers, context_length=context_length, d_model=d_model, ffn=ffn, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, rope_base=rope_base, norm_eps=norm_eps)
    tw.tokenizer(tokenizer.replace({"tokenizer.ggml.pre": "qwen2"}))

    head_dim = d_model // n_heads
    kv = n_kv_heads * head_dim
    tw.matrix("token_embd.weight", tokenizer.n_vocab, d_model, TYPES["token_embd"], std=std_vocab(d_model))
    for i in range(n_layers):
        p = f"blk.{i}."
        tw.vector(p + "attn_norm.weight", d_model)
        tw.matrix(p + "attn_q.weight", d_model, d_model, TYPES["attn_q"])
        tw.vector(p + "attn_q.bias", d_model, mean=0.0, std=bias_std)
        tw.matrix(p + "attn_k.weight", kv, d_model, TYPES["attn_k"])
        tw.vector(p + "attn_k.bias", kv, mean=0.0, std=bias_std)
        tw.matrix(p + "attn_v.weight", kv, d_model, TYPES["attn_v"])
        tw.vector(p + "attn_v.bias", kv, mean=0.0, std=bias_std)
        tw.matrix(p + "attn_output.weight", d_model, d_model, TYPES["attn_output"])
        tw.vector(p + "ffn_norm.weight", d_model)
        tw.matrix(p + "ffn_gate.weight", ffn, d_model, TYPES["ffn_gate"])
        tw.matrix(p + "ffn_up.weight", ffn, d_model, TYPES["ffn_up"])
        tw.matrix(p + "ffn_down.weight", d_model, ffn, TYPES["ffn_down"])
    tw.vector("output_norm.weight", d_model, mean=3.0, std=0.3)
    if not tied:
        tw.matrix("output.weight", tokenizer.n_vocab, d_model, T.Q8_0, std=std_vocab(d_model))
    return tw.write()
