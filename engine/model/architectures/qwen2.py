"""The qwen2 architecture (Qwen2, Qwen2.5, Qwen2.5-Coder): tensors and block.

Each block, pre-norm, grouped-query attention, as llama but with Q/K/V biases and
GPT-NeoX RoPE:
    h  = rmsnorm(x) * attn_norm
    q, k, v = Wq h + bq, Wk h + bk, Wv h + bv         (biases optional in the file)
    q, k = rope_neox(q), rope_neox(k)                  (pairs (j, j + dim/2))
    x  = x + Wo . attention(q, k, v)                   (scale 1/sqrt(head_dim))
    h  = rmsnorm(x) * ffn_norm
    x  = x + Wdown (silu(Wgate h) * Wup h)
    logits = Woutput . (rmsnorm(x) * output_norm) (+ output.bias)   (tied when absent)
Checked against llama.cpp (as vendored by llama-cpp-python 0.3.36): src/models/qwen2.cpp
(load_arch_tensors: create_tensor_qkv with optional biases, optional output bias;
graph: the order above, kq_scale 1/sqrt(n_embd_head), the n_embd_head == n_rot assert),
llama_model_rope_type (LLM_ARCH_QWEN2: LLAMA_ROPE_TYPE_NEOX). Qwen2's sliding-window keys
are not read by llama.cpp and are not here either.
"""

from __future__ import annotations

import math

from aotx.engine.backend.ops import ProgramBuilder, Value
from aotx.engine.model.architectures import common as C
from aotx.engine.model.config import ModelConfig
from aotx.engine.model.transformer import Weights



def check_config(cfg: ModelConfig, path: str) -> None:
    C.require_full_rope(cfg, path)


def tensors(cfg: ModelConfig) -> list:
    d, q_out = cfg.d_model, cfg.n_heads * cfg.head_dim
    out = C.embedding_tensors(cfg, output_bias=True)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        out += [C.vec(p + "attn_norm.weight", d)] + C.qkv_tensors(cfg, p)
        out += [C.mat(p + "attn_output.weight", q_out, d), C.vec(p + "ffn_norm.weight", d)]
        out += C.ffn_tensors(cfg, p)
    return out


def forward(b: ProgramBuilder, cfg: ModelConfig, w: Weights) -> Value:
    hd, eps = cfg.head_dim, cfg.norm_eps
    rope = C.rope_spec(cfg, "neox")
    x = b.embed(w["token_embd.weight"])
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        h = b.rms_norm(x, w[p + "attn_norm.weight"], eps, name=p + "attn_norm")
        q, k, v = C.build_qkv(b, cfg, w, p, h)
        q, k = b.rope(q, rope, hd, name=p + "q_rope"), b.rope(k, rope, hd, name=p + "k_rope")
        a = b.attention(q, k, v, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=hd,
                        scale=1.0 / math.sqrt(hd), name=p + "attn")
        x = b.add(x, b.linear(a, w[p + "attn_output.weight"], name=p + "attn_out"), name=p + "ffn_inp")
        if i == cfg.n_layers - 1:
            x = b.take_rows(x, name="out_rows")
        h = b.rms_norm(x, w[p + "ffn_norm.weight"], eps, name=p + "ffn_norm")
        x = b.add(x, C.build_ffn(b, w, p, h, "silu"), name=p + "l_out")
    return C.output_head(b, cfg, w, x)
