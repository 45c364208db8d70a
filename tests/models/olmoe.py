"""A tiny ``olmoe`` GGUF: OLMoE's block (QK-norm over the whole q and k rows, not per head;
multi-head attention, head_count_kv = head_count), NEOX RoPE, and 8 routed experts, 3 per
token, NOT renormalised (llama.cpp's olmoe graph: norm_w false).

Metadata as the converter's OlmoeModel writes it: block_count, context_length (4096),
embedding_length, feed_forward_length (the experts' width: OLMoE has no separate
expert_feed_forward_length), head_count, head_count_kv, rope.freq_base (10000),
layer_norm_rms_epsilon (1e-5), expert_count, expert_used_count. Tensors: attn_q_norm and
attn_k_norm of width d_model, the router ``ffn_gate_inp`` and ``ffn_{gate,up,down}_exps``;
output.weight (required by llama.cpp's olmoe). Types: experts' gate/up Q4_1, down Q4_0,
router F16. Pre-tokenizer ``olmo`` would be OLMoE's; the file keeps SmolLM2's own
(``smollm``) so the tokenizer stays the default model's. Three layers.
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

TYPES = {"token_embd": T.Q4_1, "output": T.Q8_0, "attn_q": T.Q8_0, "attn_k": T.Q8_0, "attn_v": T.Q8_0,
         "attn_output": T.F16, "ffn_gate_inp": T.F16, "ffn_gate_exps": T.Q4_1, "ffn_up_exps": T.Q4_1,
         "ffn_down_exps": T.Q4_0}


def write(path: str | Path, tokenizer: Tokenizer, *, seed: int = 42, n_layers: int = 3, d_model: int = 64,
          n_heads: int = 4, ffn: int = 128, n_expert: int = 8, n_expert_used: int = 3, rope_base: float = 10000.0,
          context_length: int = 4096, norm_eps: float = 1e-5, **defects: Any) -> Path:
    """Write the tiny olmoe file to ``path``; ``defects`` go to ``TinyWriter``."""
    tw = TinyWriter(path, "olmoe", seed=seed, name="tiny-olmoe", **defects)
    w = tw.w
    tw.decoder_hparams(n_layers=n_layers, context_length=context_length, d_model=d_model, ffn=ffn, n_heads=n_heads,
                       n_kv_heads=n_heads, rope_base=rope_base, norm_eps=norm_eps)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    tw.tokenizer(tokenizer)

    tw.matrix("token_embd.weight", tokenizer.n_vocab, d_model, TYPES["token_embd"], std=std_vocab(d_model))
    for i in range(n_layers):
        p = f"blk.{i}."
        tw.vector(p + "attn_norm.weight", d_model)
        tw.matrix(p + "attn_q.weight", d_model, d_model, TYPES["attn_q"])
        tw.matrix(p + "attn_k.weight", d_model, d_model, TYPES["attn_k"])
        tw.matrix(p + "attn_v.weight", d_model, d_model, TYPES["attn_v"])
        tw.vector(p + "attn_q_norm.weight", d_model, std=0.3)
        tw.vector(p + "attn_k_norm.weight", d_model, std=0.3)
        tw.matrix(p + "attn_output.weight", d_model, d_model, TYPES["attn_output"])
        tw.vector(p + "ffn_norm.weight", d_model)
        tw.matrix(p + "ffn_gate_inp.weight", n_expert, d_model, TYPES["ffn_gate_inp"], std=ROUTER_STD / d_model ** 0.5)
        experts(tw, p + "ffn_gate_exps.weight", n_expert, ffn, d_model, TYPES["ffn_gate_exps"])
        experts(tw, p + "ffn_up_exps.weight", n_expert, ffn, d_model, TYPES["ffn_up_exps"])
        experts(tw, p + "ffn_down_exps.weight", n_expert, d_model, ffn, TYPES["ffn_down_exps"])
    tw.vector("output_norm.weight", d_model, mean=3.0, std=0.3)
    tw.matrix("output.weight", tokenizer.n_vocab, d_model, TYPES["output"], std=std_vocab(d_model))
    return tw.write()
