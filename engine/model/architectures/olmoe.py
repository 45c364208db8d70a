"""The olmoe architecture (AllenAI OLMoE-1B-7B): full-width QK-norm, 64 routed experts, top-8.

Each block, pre-norm, multi-head attention (head_count_kv = head_count) with a QK-norm
over the WHOLE q and k rows (not per head), GPT-NeoX RoPE, no biases:
    h  = rmsnorm(x) * attn_norm
    q  = rope_neox(rmsnorm(Wq h) * attn_q_norm)          (norm over all n_embd values)
    k  = rope_neox(rmsnorm(Wk h) * attn_k_norm);  v = Wv h
    x  = x + Wo . attention(q, k, v)                    (scale 1/sqrt(head_dim))
    h  = rmsnorm(x) * ffn_norm
    x  = x + moe(h)
    logits = Woutput . (rmsnorm(x) * output_norm)       (output.weight required)
moe: p = softmax(ffn_gate_inp h), the expert_used_count largest p kept WITHOUT
renormalising (norm_w false), each a SwiGLU expert of width feed_forward_length.
Checked against llama.cpp (as vendored by llama-cpp-python 0.3.36): src/models/olmoe.cpp
(tensors: attn_q_norm and attn_k_norm {n_embd}, wq {n_embd, n_embd}, output required;
experts {n_embd, n_ff, n_expert}; graph: build_norm(Qcur) / build_norm(Kcur) before the
reshape to heads, build_moe_ffn(..., LLM_FFN_SILU, norm_w = false,
LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX)), llama_model_rope_type (OLMOE: NEOX).
"""

from __future__ import annotations

import math

from aotx.engine.backend.ops import ProgramBuilder, Value
from aotx.engine.errors import ModelError
from aotx.engine.model.architectures import common as C
from aotx.engine.model.architectures import moe_block as M
from aotx.engine.model.config import ModelConfig
from aotx.engine.model.transformer import Weights


def check_config(cfg: ModelConfig, path: str) -> None:
    C.require_full_rope(cfg, path)
    M.require_experts(cfg, path)
    if cfg.n_heads * cfg.head_dim != cfg.d_model or cfg.n_kv_heads != cfg.n_heads:
        raise ModelError(f"{path}: olmoe normalises whole q and k rows of width {cfg.arch}.embedding_length "
                         f"{cfg.d_model}: it needs head_count x key_length = embedding_length and head_count_kv = "
                         f"head_count (the file has {cfg.n_heads} x {cfg.head_dim}, {cfg.n_kv_heads} KV heads)")


def tensors(cfg: ModelConfig) -> list:
    d = cfg.d_model
    out = [C.mat("token_embd.weight", d, cfg.vocab_size), C.vec("output_norm.weight", d),
           C.mat("output.weight", d, cfg.vocab_size)]
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        out += [C.vec(p + "attn_norm.weight", d)] + C.qkv_tensors(cfg, p)
        out += [C.mat(p + "attn_output.weight", d, d), C.vec(p + "attn_q_norm.weight", d),
                C.vec(p + "attn_k_norm.weight", d), C.vec(p + "ffn_norm.weight", d)]
        out += M.moe_tensors(cfg, p, cfg.ffn_dim)
    return out


def forward(b: ProgramBuilder, cfg: ModelConfig, w: Weights) -> Value:
    hd, eps = cfg.head_dim, cfg.norm_eps
    rope = C.rope_spec(cfg, "neox")
    x = b.embed(w["token_embd.weight"])
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        h = b.rms_norm(x, w[p + "attn_norm.weight"], eps, name=p + "attn_norm")
        q, k, v = C.build_qkv(b, cfg, w, p, h)
        q = b.rms_norm(q, w[p + "attn_q_norm.weight"], eps, name=p + "q_norm")
        k = b.rms_norm(k, w[p + "attn_k_norm.weight"], eps, name=p + "k_norm")
        q, k = b.rope(q, rope, hd, name=p + "q_rope"), b.rope(k, rope, hd, name=p + "k_rope")
        a = b.attention(q, k, v, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=hd,
                        scale=1.0 / math.sqrt(hd), name=p + "attn")
        x = b.add(x, b.linear(a, w[p + "attn_output.weight"], name=p + "attn_out"), name=p + "ffn_inp")
        if i == cfg.n_layers - 1:
            x = b.take_rows(x, name="out_rows")
        h = b.rms_norm(x, w[p + "ffn_norm.weight"], eps, name=p + "ffn_norm")
        x = b.add(x, M.build_moe(b, cfg, w, p, h, gating="softmax", norm_w=False), name=p + "l_out")
    return C.output_head(b, cfg, w, x)
