"""A tiny ``gpt-oss`` GGUF: attention sinks, sliding-window layers alternating with global
ones, YaRN RoPE, QKV and output biases, and 8 biased MXFP4 experts, 3 per token, routed by
a softmax over the top-3 logits and gpt-oss's clamped SwiGLU.

Metadata as the converter's GptOssModel writes it: block_count (4: layers 0 and 2 slide),
context_length (131072), embedding_length, feed_forward_length, head_count,
head_count_kv, rope.freq_base (150000), layer_norm_rms_epsilon (1e-5), expert_count,
expert_used_count, key_length / value_length (32), rope.scaling.type yarn with factor 32
and original_context_length 4096, attention.sliding_window (16, shorter than the
reference prompts), expert_feed_forward_length. Tensors: attn_sinks (one logit per head,
std 1: they visibly move the attention), post_attention_norm (the pre-FFN norm),
attn_{q,k,v,output}.bias, ffn_gate_inp.weight/.bias, ffn_{gate,up,down}_exps.weight in
MXFP4 (E8M0 scales) with their per-expert biases. Untied output. The tokenizer is SmolLM2's
(gpt-oss's own o200k vocabulary is not in the repository), with gpt-oss's ChatML-free
metadata otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
from gguf import GGMLQuantizationType as T

from .common import Tokenizer, TinyWriter, std_vocab
from .experts import expert_bias, experts

#: router weights of std ROUTER_STD / sqrt(d): logits of std ~ROUTER_STD, so that near-ties between
#: experts (where two correct engines may route a row differently) are rare
ROUTER_STD = 4.0

TYPES = {"token_embd": T.Q8_0, "output": T.Q8_0, "attn_q": T.F16, "attn_k": T.F16, "attn_v": T.F16,
         "attn_output": T.F16, "ffn_gate_inp": T.F32, "ffn_gate_exps": T.MXFP4, "ffn_up_exps": T.MXFP4,
         "ffn_down_exps": T.MXFP4}


def write(path: str | Path, tokenizer: Tokenizer, *, seed: int = 43, n_layers: int = 4, d_model: int = 64,
          n_heads: int = 4, n_kv_heads: int = 2, head_dim: int = 32, ffn: int = 64, n_expert: int = 8,
          n_expert_used: int = 3, expert_ffn: int = 64, rope_base: float = 150000.0, sliding_window: int = 16,
          yarn: bool = True, context_length: int = 131072, norm_eps: float = 1e-5, sink_std: float = 1.0,
          sink_mean: float = 0.0, bias_std: float = 0.1, **defects: Any) -> Path:
    """Write the tiny gpt-oss file to ``path``; ``yarn=False`` leaves the RoPE scaling keys
    out; ``sink_mean`` -1e4 makes the sinks vanish; ``bias_std`` scales every bias (0: none,
    in effect); ``defects`` go to ``TinyWriter``."""
    tw = TinyWriter(path, "gpt-oss", seed=seed, name="tiny-gpt-oss", **defects)
    w = tw.w
    tw.decoder_hparams(n_layers=n_layers, context_length=context_length, d_model=d_model, ffn=ffn, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, rope_base=rope_base, norm_eps=norm_eps)
    if yarn:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_sliding_window(sliding_window)
    w.add_expert_feed_forward_length(expert_ffn)
    tw.tokenizer(tokenizer)

    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    tw.matrix("token_embd.weight", tokenizer.n_vocab, d_model, TYPES["token_embd"], std=std_vocab(d_model))
    for i in range(n_layers):
        p = f"blk.{i}."
        tw.vector(p + "attn_norm.weight", d_model)
        tw.matrix(p + "attn_q.weight", q, d_model, TYPES["attn_q"])
        tw.vector(p + "attn_q.bias", q, mean=0.0, std=bias_std)
        tw.matrix(p + "attn_k.weight", kv, d_model, TYPES["attn_k"])
        tw.vector(p + "attn_k.bias", kv, mean=0.0, std=bias_std)
        tw.matrix(p + "attn_v.weight", kv, d_model, TYPES["attn_v"])
        tw.vector(p + "attn_v.bias", kv, mean=0.0, std=bias_std)
        tw.matrix(p + "attn_output.weight", d_model, q, TYPES["attn_output"])
        tw.vector(p + "attn_output.bias", d_model, mean=0.0, std=bias_std)
        tw.vector(p + "attn_sinks.weight", n_heads, mean=sink_mean, std=sink_std)
        tw.vector(p + "post_attention_norm.weight", d_model)
        tw.matrix(p + "ffn_gate_inp.weight", n_expert, d_model, TYPES["ffn_gate_inp"], std=ROUTER_STD / d_model ** 0.5)
        tw.vector(p + "ffn_gate_inp.bias", n_expert, mean=0.0, std=3 * bias_std)
        experts(tw, p + "ffn_gate_exps.weight", n_expert, expert_ffn, d_model, TYPES["ffn_gate_exps"])
        expert_bias(tw, p + "ffn_gate_exps.bias", n_expert, expert_ffn, std=bias_std)
        experts(tw, p + "ffn_up_exps.weight", n_expert, expert_ffn, d_model, TYPES["ffn_up_exps"])
        expert_bias(tw, p + "ffn_up_exps.bias", n_expert, expert_ffn, std=bias_std)
        experts(tw, p + "ffn_down_exps.weight", n_expert, d_model, expert_ffn, TYPES["ffn_down_exps"])
        expert_bias(tw, p + "ffn_down_exps.bias", n_expert, d_model, std=bias_std)
    tw.vector("output_norm.weight", d_model, mean=3.0, std=0.3)
    tw.matrix("output.weight", tokenizer.n_vocab, d_model, TYPES["output"], std=std_vocab(d_model))
    return tw.write()
