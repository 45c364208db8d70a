"""A tiny ``llama`` GGUF whose matrices are the block types beside today's thirteen:
IQ4_NL (32-element blocks, a non-linear 16-value codebook), IQ4_XS (256-element
super-blocks with 6-bit sub-block scales over the same codebook) and MXFP4 (ggml type 39:
32 FP4 E2M1 values under one E8M0 exponent). d_model 256 so that IQ4_XS fits every matrix.
Otherwise a plain llama block (Llama 2 style: no rope_freqs, base 10000), untied output.

It exists so that the new tensor types have llama.cpp references independent of any new
architecture: a forward that runs the llama file but not these types fails here only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType as T

from .common import Tokenizer, TinyWriter, std_vocab

TYPES = {"token_embd": T.Q8_0, "output": T.IQ4_XS, "attn_q": T.IQ4_NL, "attn_k": T.IQ4_XS, "attn_v": T.MXFP4,
         "attn_output": T.IQ4_XS, "ffn_gate": T.IQ4_NL, "ffn_up": T.MXFP4, "ffn_down": T.IQ4_XS}


def write(path: str | Path, tokenizer: Tokenizer, *, seed: int = 36, n_layers: int = 2, d_model: int = 256,
          n_heads: int = 4, n_kv_heads: int = 2, ffn: int = 256, rope_base: float = 10000.0,
          context_length: int = 4096, norm_eps: float = 1e-5, **defects: Any) -> Path:
    """Write the tiny IQ4_NL / IQ4_XS / MXFP4 llama file to ``path``."""
    head_dim = d_model // n_heads
    tw = TinyWriter(path, "llama", seed=seed, name="tiny-llama-iquants", **defects)
    w = tw.w
    tw.decoder_hparams(n_layers=n_layers, context_length=context_length, d_model=d_model, ffn=ffn, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, rope_base=rope_base, norm_eps=norm_eps)
    w.add_vocab_size(tokenizer.n_vocab)
    w.add_rope_dimension_count(head_dim)
    tw.tokenizer(tokenizer)

    kv = n_kv_heads * head_dim
    tw.matrix("token_embd.weight", tokenizer.n_vocab, d_model, TYPES["token_embd"], std=std_vocab(d_model))
    for i in range(n_layers):
        p = f"blk.{i}."
        tw.vector(p + "attn_norm.weight", d_model)
        tw.matrix(p + "attn_q.weight", d_model, d_model, TYPES["attn_q"])
        tw.matrix(p + "attn_k.weight", kv, d_model, TYPES["attn_k"])
        tw.matrix(p + "attn_v.weight", kv, d_model, TYPES["attn_v"])
        tw.matrix(p + "attn_output.weight", d_model, d_model, TYPES["attn_output"])
        tw.vector(p + "ffn_norm.weight", d_model)
        tw.matrix(p + "ffn_gate.weight", ffn, d_model, TYPES["ffn_gate"])
        tw.matrix(p + "ffn_up.weight", ffn, d_model, TYPES["ffn_up"])
        tw.matrix(p + "ffn_down.weight", d_model, ffn, TYPES["ffn_down"])
    tw.vector("output_norm.weight", d_model, mean=3.0, std=0.3)
    tw.matrix("output.weight", tokenizer.n_vocab, d_model, TYPES["output"], std=std_vocab(d_model))
    return tw.write()
