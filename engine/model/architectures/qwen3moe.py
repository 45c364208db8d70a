"""The qwen3moe architecture (Qwen3-30B-A3B, Qwen3-235B-A22B): qwen3's attention, routed experts.

Each block, pre-norm, grouped-query attention with QK-norm and GPT-NeoX RoPE, no biases,
and a mixture of E experts in place of the dense FFN:
    h  = rmsnorm(x) * attn_norm
    q, k, v = Wq h, Wk h, Wv h                          (head_dim from attention.key_length)
    q  = rope_neox(rmsnorm_per_head(q) * attn_q_norm);  k likewise with attn_k_norm
    x  = x + Wo . attention(q, k, v)                    (scale 1/sqrt(head_dim))
    h  = rmsnorm(x) * ffn_norm
    x  = x + moe(h)                                     (below)
    logits = Woutput . (rmsnorm(x) * output_norm)       (tied to token_embd when absent)
moe: router logits l = ffn_gate_inp h (expert_count of them), p = softmax(l), the
expert_used_count largest p kept and renormalised to sum 1 (norm_w), each kept expert a
SwiGLU FFN of width expert_feed_forward_length (default feed_forward_length /
expert_used_count), the outputs summed with those weights. No shared expert.
Checked against llama.cpp (as vendored by llama-cpp-python 0.3.36): src/models/qwen3moe.cpp
(tensors: ffn_gate_inp {n_embd, n_expert}, ffn_{gate,up}_exps {n_embd, n_ff_exp, n_expert},
ffn_down_exps {n_ff_exp, n_embd, n_expert}, n_ff_exp = n_ff_exp() or n_ff / n_expert_used;
graph: build_moe_ffn(..., LLM_FFN_SILU, norm_w = true, expert_weights_scale (0: none),
LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX)), llama-graph.cpp build_moe_ffn, and
llama_model_rope_type (QWEN3MOE: NEOX).
"""

from __future__ import annotations

from aotx.engine.backend.ops import ProgramBuilder, Value
from aotx.engine.model.architectures import common as C
from aotx.engine.model.architectures import moe_block as M
from aotx.engine.model.architectures import qwen3 as Q3
from aotx.engine.model.config import ModelConfig
from aotx.engine.model.transformer import Weights


def expert_ffn_dim(cfg: ModelConfig) -> int:
    return cfg.expert_ffn_dim or cfg.ffn_dim // max(1, cfg.n_expert_used)


def check_config(cfg: ModelConfig, path: str) -> None:
    C.require_full_rope(cfg, path)
    M.require_experts(cfg, path)


def tensors(cfg: ModelConfig) -> list:
    out = C.embedding_tensors(cfg)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        out += Q3.layer_tensors(cfg, p) + M.moe_tensors(cfg, p, expert_ffn_dim(cfg))
    return out


def forward(b: ProgramBuilder, cfg: ModelConfig, w: Weights) -> Value:
    return Q3.build(b, cfg, w, lambda b, cfg, w, p, h: M.build_moe(b, cfg, w, p, h, gating="softmax", norm_w=True))
