"""The llama architecture (Llama 1/2/3.x, Mistral-style llama GGUFs, SmolLM2): tensors and block.

Each block (Touvron et al. 2023, "LLaMA"), pre-norm, grouped-query attention:
    h  = rmsnorm(x) * attn_norm
    q, k, v = Wq h (+bq), Wk h (+bk), Wv h (+bv)      (or one fused attn_qkv, split)
    q, k = rope_normal(q), rope_normal(k)              (adjacent pairs; Llama 3: rope_freqs factors)
    x  = x + Wo . attention(q, k, v) (+bo)             (scale 1/sqrt(head_dim))
    h  = rmsnorm(x) * ffn_norm
    x  = x + Wdown (silu(Wgate h) * Wup h)
    logits = Woutput . (rmsnorm(x) * output_norm)      (Woutput tied to token_embd when absent)
Checked against llama.cpp (as vendored by llama-cpp-python 0.3.36): src/models/llama.cpp
(order of ops, optional wo/ffn biases, rope factors, kq_scale), llama-model.cpp
create_tensor_qkv (fused or separate QKV) and load_hparams (n_rot must equal the head
dimension), llama_model_rope_type (LLM_ARCH_LLAMA: LLAMA_ROPE_TYPE_NORM). Q and K weights
arrive permuted for ggml's adjacent-pair RoPE by the converter. Llama 3.x "llama3" RoPE
scaling arrives as the ``rope_freqs`` tensor (convert_hf_to_gguf's LlamaModel
generate_extra_tensors); mixture-of-experts llama files (Mixtral) are refused as missing
``ffn_gate`` tensors.
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
    out = C.embedding_tensors(cfg) + C.rope_factor_tensors(cfg, longrope=cfg.rope_scaling == "longrope")
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        out += [C.vec(p + "attn_norm.weight", d)] + C.qkv_tensors(cfg, p)
        out += [C.mat(p + "attn_output.weight", q_out, d), C.vec(p + "attn_output.bias", d, True),
                C.vec(p + "ffn_norm.weight", d)]
        out += C.ffn_tensors(cfg, p, biases=True)
    return out


def forward(b: ProgramBuilder, cfg: ModelConfig, w: Weights) -> Value:
    hd, eps = cfg.head_dim, cfg.norm_eps
    rope = C.rope_spec(cfg, "normal", w)
    x = b.embed(w["token_embd.weight"])
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        h = b.rms_norm(x, w[p + "attn_norm.weight"], eps, name=p + "attn_norm")
        q, k, v = C.build_qkv(b, cfg, w, p, h)
        q, k = b.rope(q, rope, hd, name=p + "q_rope"), b.rope(k, rope, hd, name=p + "k_rope")
        a = b.attention(q, k, v, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=hd,
                        scale=1.0 / math.sqrt(hd), name=p + "attn")
        x = b.add(x, b.linear(a, w[p + "attn_output.weight"], w.get(p + "attn_output.bias"), name=p + "attn_out"),
                  name=p + "ffn_inp")
        if i == cfg.n_layers - 1:
            x = b.take_rows(x, name="out_rows")
        h = b.rms_norm(x, w[p + "ffn_norm.weight"], eps, name=p + "ffn_norm")
        x = b.add(x, C.build_ffn(b, w, p, h, "silu"), name=p + "l_out")
    return C.output_head(b, cfg, w, x)


def build(cfg: ModelConfig, gf, backend):
    """This architecture loaded onto ``backend`` (tools and tests build llama files directly)."""
    import sys

    from aotx.engine.model.transformer import build as build_model

    return build_model(cfg, gf, backend, sys.modules[__name__])
