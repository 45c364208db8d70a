"""A tiny ``lfm2`` GGUF (Liquid's LFM2 dense): gated short-convolution layers beside
grouped-query attention layers.

Shape: 4 layers, conv, conv, attention, conv (``attention.head_count_kv`` [0, 0, 2, 0], as
conversion/lfm2.py writes it: 0 for a "conv" layer), d_model 64, FFN 256 (SwiGLU).
Short convolution: ``shortconv.in_proj`` 64 -> 3 x 64 (b, c, x), a depthwise kernel of
``shortconv.l_cache`` 3 taps (F32, entries of std 0.5, so the two earlier positions carried
in the conv state weigh as much as the current one), ``shortconv.out_proj`` 64 -> 64.
Attention: 4 query heads of 16, 2 KV heads, QK-norm, NEOX RoPE over the whole head at base
1e6, sliding window 8 (``attention.sliding_window``: real LFM2 files have none; the tiny
file slides so that the references check the window too; ``window=0`` writes no key).
The final norm is ``token_embd_norm`` (llama.cpp's LLM_TENSOR_OUTPUT_NORM_LFM2), weights
~3; output tied to token_embd (``tied=False`` writes ``output``).

``memory=False`` zeroes the kernel's two earlier taps (the same random draws otherwise):
the convolution then forgets every earlier token, the references' sensitivity check.

Pre-tokenizer ``lfm2`` (llama.cpp: the llama3 regex); the vocabulary is the given
tokenizer's. Deterministic: ``write(path, tokenizer, seed=...)`` gives the same bytes for
the same arguments; any seed gives a file llama.cpp loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from .common import TinyWriter, Tokenizer, std_vocab

TYPES = {"token_embd": T.Q8_0, "output": T.Q8_0, "attn_q": T.F16, "attn_k": T.F16, "attn_v": T.Q8_0,
         "attn_output": T.BF16, "shortconv.in_proj": T.Q8_0, "shortconv.out_proj": T.Q5_0, "ffn_gate": T.Q5_0,
         "ffn_up": T.Q5_0, "ffn_down": T.Q4_K}


def write(path: str | Path, tokenizer: Tokenizer, *, seed: int = 2, layers: str = "CCAC", d_model: int = 64,
          n_heads: int = 4, n_kv_heads: int = 2, ffn: int = 256, l_cache: int = 3, window: int = 8,
          memory: bool = True, context_length: int = 128000, pre: str = "lfm2", tied: bool = True,
          **defects: Any) -> Path:
    """Write the tiny lfm2 file to ``path``; ``layers`` one letter per layer (C: short
    convolution, A: attention); ``defects`` go to ``TinyWriter``."""
    tw = TinyWriter(path, "lfm2", seed=seed, name="tiny-lfm2", **defects)
    w = tw.w
    head_dim = d_model // n_heads
    tw.decoder_hparams(n_layers=len(layers), context_length=context_length, d_model=d_model, ffn=ffn,
                       n_heads=n_heads, n_kv_heads=[n_kv_heads if c == "A" else 0 for c in layers],
                       rope_base=1000000.0, norm_eps=1e-5)
    w.add_vocab_size(tokenizer.n_vocab)
    w.add_shortconv_l_cache(l_cache)
    if window:
        w.add_sliding_window(window)
    tw.tokenizer(tokenizer.replace({"tokenizer.ggml.pre": pre}))
    tw.matrix("token_embd.weight", tokenizer.n_vocab, d_model, TYPES["token_embd"], std=std_vocab(d_model))
    for i, kind in enumerate(layers):
        p = f"blk.{i}."
        tw.vector(p + "attn_norm.weight", d_model)
        if kind == "C":
            tw.matrix(p + "shortconv.in_proj.weight", 3 * d_model, d_model, TYPES["shortconv.in_proj"])
            kernel = (0.5 * tw.rng.standard_normal((d_model, l_cache))).astype(np.float32)
            if not memory:
                kernel[:, :-1] = 0.0
            tw.tensor(p + "shortconv.conv.weight", kernel)
            tw.matrix(p + "shortconv.out_proj.weight", d_model, d_model, TYPES["shortconv.out_proj"])
        else:
            kv = n_kv_heads * head_dim
            tw.matrix(p + "attn_q.weight", d_model, d_model, TYPES["attn_q"])
            tw.matrix(p + "attn_k.weight", kv, d_model, TYPES["attn_k"])
            tw.matrix(p + "attn_v.weight", kv, d_model, TYPES["attn_v"])
            tw.vector(p + "attn_q_norm.weight", head_dim, std=0.3)
            tw.vector(p + "attn_k_norm.weight", head_dim, std=0.3)
            tw.matrix(p + "attn_output.weight", d_model, d_model, TYPES["attn_output"])
        tw.vector(p + "ffn_norm.weight", d_model)
        tw.matrix(p + "ffn_gate.weight", ffn, d_model, TYPES["ffn_gate"])
        tw.matrix(p + "ffn_up.weight", ffn, d_model, TYPES["ffn_up"])
        tw.matrix(p + "ffn_down.weight", d_model, ffn, TYPES["ffn_down"])
    tw.vector("token_embd_norm.weight", d_model, mean=3.0, std=0.3)
    if not tied:
        tw.matrix("output.weight", tokenizer.n_vocab, d_model, TYPES["output"], std=std_vocab(d_model))
    return tw.write()
