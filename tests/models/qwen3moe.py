"""A tiny ``qwen3moe`` GGUF: qwen3's attention (QK-norm per head, NEOX RoPE, head_dim 32
unequal to d_model / n_heads = 16) and 8 routed experts, 2 per token, renormalised.

Metadata as the converter's Qwen3MoeModel (Qwen2MoeModel.set_gguf_parameters) writes it:
block_count, context_length (40960), embedding_length, feed_forward_length (the dense
intermediate size, unused by the experts), head_count, head_count_kv, rope.freq_base (1e6),
layer_norm_rms_epsilon (1e-6), expert_count, expert_used_count, key_length, value_length,
expert_feed_forward_length (``expert_ffn``). Tensors: the router ``ffn_gate_inp`` (E x d)
and the stacks ``ffn_{gate,up,down}_exps`` (numpy (E, out, in)). Untied output. Types: the
experts' gate/up Q8_0 and Q5_0 (input width 64: 32-blocks), down Q6_K (input width 256:
a K-quant super-block), the router F32 as the converter keeps it. Pre-tokenizer ``qwen2``.
Four layers, so that the routing of every token passes through several expert choices.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType as T

from .common import Tokenizer, TinyWriter, std_vocab
from .experts import experts

#: router weights of std ROUTER_STD / sqrt(d): logits of std ~ROUTER_STD, so that near-ties between
#: experts (where two correct engines may route a row differently) are rare
ROUTER_STD = 4.0

TYPES = {"token_embd": T.Q8_0, "output": T.Q8_0, "attn_q": T.F16, "attn_k": T.F16, "attn_v": T.F16,
         "attn_output": T.Q8_0, "ffn_gate_inp": T.F32, "ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q5_0,
         "ffn_down_exps": T.Q6_K}


def write(path: str | Path, tokenizer: Tokenizer, *, seed: int = 41, n_layers: int = 4, d_model: int = 64,
          n_heads: int = 4, n_kv_heads: int = 2, head_dim: int = 32, ffn: int = 512, n_expert: int = 8,
          n_expert_used: int = 2, expert_ffn: int = 256, rope_base: float = 1000000.0,
          context_length: int = 40960, norm_eps: float = 1e-6, **defects: Any) -> Path:
    """Write the tiny qwen3moe file to ``path``; ``defects`` go to ``TinyWriter``."""
    tw = TinyWriter(path, "qwen3moe", seed=seed, name="tiny-qwen3moe", **defects)
    w = tw.w
    tw.decoder_hparams(n_layers=n_layers, context_length=context_length, d_model=d_model, ffn=ffn, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, rope_base=rope_base, norm_eps=norm_eps)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_expert_feed_forward_length(expert_ffn)
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
        tw.matrix(p + "ffn_gate_inp.weight", n_expert, d_model, TYPES["ffn_gate_inp"], std=ROUTER_STD / d_model ** 0.5)
        experts(tw, p + "ffn_gate_exps.weight", n_expert, expert_ffn, d_model, TYPES["ffn_gate_exps"])
        experts(tw, p + "ffn_up_exps.weight", n_expert, expert_ffn, d_model, TYPES["ffn_up_exps"])
        experts(tw, p + "ffn_down_exps.weight", n_expert, d_model, expert_ffn, TYPES["ffn_down_exps"])
    tw.vector("output_norm.weight", d_model, mean=3.0, std=0.3)
    tw.matrix("output.weight", tokenizer.n_vocab, d_model, TYPES["output"], std=std_vocab(d_model))
    return tw.write()
