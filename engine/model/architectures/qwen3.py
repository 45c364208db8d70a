"""The qwen3 architecture (Qwen3 dense models): tensors and block.

Each block, pre-norm, grouped-query attention with QK-norm and GPT-NeoX RoPE, no biases:
    h  = rmsnorm(x) * attn_norm
    q, k, v = Wq h, Wk h, Wv h                         (head_dim from attention.key_length)
    q  = rope_neox(rmsnorm_per_head(q) * attn_q_norm)
    k  = rope_neox(rmsnorm_per_head(k) * attn_k_norm)
    x  = x + Wo . attention(q, k, v)                   (scale 1/sqrt(head_dim))
    h  = rmsnorm(x) * ffn_norm
    x  = x + Wdown (silu(Wgate h) * Wup h)
    logits = Woutput . (rmsnorm(x) * output_norm)      (tied to token_embd when absent)
Checked against llama.cpp (as vendored by llama-cpp-python 0.3.36): src/models/qwen3.cpp
(tensors: q/k norms of n_embd_head_k, attn_output (n_head * head_dim -> n_embd); graph:
the q/k norm before RoPE, kq_scale 1/sqrt(n_embd_head), the n_embd_head == n_rot
assert), llama_model_rope_type (LLM_ARCH_QWEN3: LLAMA_ROPE_TYPE_NEOX). The fused-QKV form
of create_tensor_qkv is accepted as for every architecture there.
"""

from __future__ import annotations

import math

from aotx.engine.backend.ops import ProgramBuilder, Value
from aotx.engine.model.architectures import common as C
from aotx.engine.model.config import ModelConfig
from aotx.engine.model.transformer import Weights



def check_config(cfg: ModelConfig, path: str) -> None:
    C.require_full_rope(cfg, path)


def layer_tensors(cfg: ModelConfig, p: str) -> list:
    """Layer ``p``'s tensors before its FFN (qwen3moe shares them)."""
    d, hd, q_out = cfg.d_model, cfg.head_dim, cfg.n_heads * cfg.head_dim
    return ([C.vec(p + "attn_norm.weight", d)] + C.qkv_tensors(cfg, p)
            + [C.mat(p + "attn_output.weight", q_out, d), C.vec(p + "attn_q_norm.weight", hd),
               C.vec(p + "attn_k_norm.weight", hd), C.vec(p + "ffn_norm.weight", d)])


def tensors(cfg: ModelConfig) -> list:
    out = C.embedding_tensors(cfg)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        out += layer_tensors(cfg, p) + C.ffn_tensors(cfg, p)
    return out


def build(b: ProgramBuilder, cfg: ModelConfig, w: Weights, ffn) -> Value:
    """The qwen3 stack with ``ffn(b, cfg, w, p, h) -> Value`` as each layer's FFN (qwen3moe
    passes its mixture of experts)."""
    hd, eps = cfg.head_dim, cfg.norm_eps
    rope = C.rope_spec(cfg, "neox")
    x = b.embed(w["token_embd.weight"])
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        h = b.rms_norm(x, w[p + "attn_norm.weight"], eps, name=p + "attn_norm")
        q, k, v = C.build_qkv(b, cfg, w, p, h)
        q = b.head_rms_norm(q, w[p + "attn_q_norm.weight"], eps, hd, name=p + "q_norm")
        k = b.head_rms_norm(k, w[p + "attn_k_norm.weight"], eps, hd, name=p + "k_norm")
        q, k = b.rope(q, rope, hd, name=p + "q_rope"), b.rope(k, rope, hd, name=p + "k_rope")
        a = b.attention(q, k, v, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=hd,
                        scale=1.0 / math.sqrt(hd), name=p + "attn")
        x = b.add(x, b.linear(a, w[p + "attn_output.weight"], name=p + "attn_out"), name=p + "ffn_inp")
        if i == cfg.n_layers - 1:
            x = b.take_rows(x, name="out_rows")
        h = b.rms_norm(x, w[p + "ffn_norm.weight"], eps, name=p + "ffn_norm")
        x = b.add(x, ffn(b, cfg, w, p, h), name=p + "l_out")
    return C.output_head(b, cfg, w, x)


def forward(b: ProgramBuilder, cfg: ModelConfig, w: Weights) -> Value:
    return build(b, cfg, w, lambda b, cfg, w, p, h: C.build_ffn(b, w, p, h, "silu"))
