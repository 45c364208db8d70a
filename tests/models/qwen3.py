"""A tiny ``qwen3`` GGUF: no QKV bias, RMS QK-norm (``blk.N.attn_q_norm`` /
``attn_k_norm``, one weight of ``head_dim`` per layer, applied per head before RoPE), NEOX
RoPE, and ``head_dim`` (32) unequal to ``d_model / n_heads`` (16), as in Qwen3 where the
config's head_dim is written as key_length/value_length.

Metadata as the converter's Qwen3Model writes it: block_count, context_length (40960),
embedding_length, feed_forward_length, head_count, head_count_kv, rope.freq_base (1e6),
layer_norm_rms_epsilon (1e-6), key_length, value_length, file_type. An untied
``output.weight`` (Qwen3 8B and up; the small ones tie). Pre-tokenizer ``qwen2``. The
QK-norm weights have mean 1 and std 0.3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType as T

from .common import Tokenizer, TinyWriter, std_vocab

TYPES = {"token_embd": T.Q5_0, "output": T.Q8_0, "attn_q": T.F16, "attn_k": T.F16, "attn_v": T.F16,
         "attn_output": T.BF16, "ffn_gate": T.Q5_0, "ffn_up": T.Q5_0, "ffn_down": T.Q4_K}


def write(path: str | Path, tokenizer: Tokenizer, *, seed: int = 33, n_layers: int = 2, d_model: int = 64,
          n_heads: int = 4, n_kv_heads: int = 2, head_dim: int = 32, ffn: int = 256,
          rope_base: float = 1000000.0, context_length: int = 40960, norm_eps: float = 1e-6,
          tied: bool = False, **defects: Any) -> Path:
    """Write the tiny qwen3 file to ``path``; ``defects`` go to ``TinyWriter``."""
    tw = TinyWriter(path, "qwen3", seed=seed, name="tiny-qwen3", **defects)
    w = tw.w
    tw.decoder_hparams(n_layers=n_layers, context_length=context_length, d_model=d_model, ffn=ffn, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, rope_base=rope_base, norm_eps=norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    tw.tokenizer(tokenizer.replace({"tokenizer.ggml.pre": "qwen2"}))

    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    tw.matrix("token_embd.weight", tokenizer.n_vocab, d_model, TYPES["token_embd"], std=std_vocab(d_model))
    for i in range(n_layers):
        p = f"blk.{i}."
        tw.vector(p + "attn_norm.weight", d_model)
        tw.matrix(p + "attn_q.weight", q, d_model, TYPES["attn_q"])
        tw.matrix(p + "attn_k.weight", kv, d_model, TYPES["attn_k"])
        tw.matrix(p + "attn_v.weight", kv, d_model, TYPES["attn_v"])
        tw.vector(p + "attn_q_norm.weight", head_dim, std=0.3)
        tw.vector(p + "attn_k_norm.weight", head_dim, std=0.3)
        tw.matrix(p + "attn_output.weight", d_model, q, TYPES["attn_output"])
        tw.vector(p + "ffn_norm.weight", d_model)
        tw.matrix(p + "ffn_gate.weight", ffn, d_model, TYPES["ffn_gate"])
        tw.matrix(p + "ffn_up.weight", ffn, d_model, TYPES["ffn_up"])
        tw.matrix(p + "ffn_down.weight", d_model, ffn, TYPES["ffn_down"])
    tw.vector("output_norm.weight", d_model, mean=3.0, std=0.3)
    if not tied:
        tw.matrix("output.weight", tokenizer.n_vocab, d_model, TYPES["output"], std=std_vocab(d_model))
    return tw.write()
