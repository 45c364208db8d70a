"""The gemma3 architecture (Gemma 3 text models, 270M .. 27B): tensors and block.

    x  = embed(tokens) * sqrt(d_model)                (image embeddings enter unscaled)
Each block, grouped-query attention with QK-norm, norms before and after each sublayer,
sliding-window layers interleaved with global ones:
    h  = rmsnorm(x) * attn_norm
    q  = rope_neox(rmsnorm_per_head(Wq h) * attn_q_norm, base_l)
    k  = rope_neox(rmsnorm_per_head(Wk h) * attn_k_norm, base_l)
    v  = Wv h
    a  = attention(q, k, v, scale = f_attention_scale, window_l)
    x  = x + rmsnorm(Wo a) * post_attention_norm
    h  = rmsnorm(x) * ffn_norm
    x  = x + rmsnorm(Wdown (gelu_tanh(Wgate h) * Wup h)) * post_ffw_norm
    logits = Woutput . (rmsnorm(x) * output_norm)     (tied to token_embd; soft-capped
                                                       when final_logit_softcapping is set)
Layer l slides (window_l = attention.sliding_window, base_l = rope.freq_base_swa, default
10000, no frequency scaling) when l % 6 < 5, or as attention.sliding_window_pattern says;
the other layers are global (window 0, base_l = rope.freq_base). A file without
attention.sliding_window has global layers only (llama.cpp reads a window of 0 that way;
here 0 is refused as a defect: the converter omits the key instead). f_attention_scale =
1/sqrt(head_dim), or 1/sqrt(d_model / n_heads) for the 27B (62 layers), from the Gemma
reference config.
The norms' weights arrive with Gemma's "1 + w" already added by the converter
(convert_hf_to_gguf Gemma3Model.norm_shift), so they are used as they are.

Checked against llama.cpp (as vendored by llama-cpp-python 0.3.36): src/models/gemma3.cpp
(load_arch_hparams: sliding window, load_swa_pattern(6), rope.freq_base_swa,
final_logit_softcapping, f_attention_scale; tensors; graph: the order above, Q scaled by
f_attention_scale and kq_scale 1, LLM_FFN_GELU with LLM_FFN_PAR), llama-model.cpp
get_rope_freq_base / get_rope_freq_scale (sliding layers), llama-hparams
set_swa_pattern and is_masked_swa (LLAMA_SWA_TYPE_STANDARD: position t is hidden from
position p when p - t >= window), llama_model_rope_type (GEMMA3: NEOX). ggml's CPU GELU
reads a float16 table; this is the exact tanh form, which differs by float16 rounding.
"""

from __future__ import annotations

import math

from aotx.engine.backend.ops import ProgramBuilder, RopeSpec, Value
from aotx.engine.model.architectures import common as C
from aotx.engine.model.config import ModelConfig
from aotx.engine.model.transformer import Weights

SWA_PATTERN = 6     # every 6th layer is global (llama.cpp: load_swa_pattern(ml, 6))


def check_config(cfg: ModelConfig, path: str) -> None:
    if cfg.sliding_window is not None:
        cfg.check_sliding_window(path)


def attention_scale(cfg: ModelConfig) -> float:
    """llama.cpp's f_attention_scale for Gemma 3 (gemma_pytorch config.py query_pre_attn_scalar)."""
    if cfg.n_layers == 62:                     # LLM_TYPE_27B
        return 1.0 / math.sqrt(cfg.d_model / cfg.n_heads)
    return 1.0 / math.sqrt(cfg.head_dim)


def tensors(cfg: ModelConfig) -> list:
    d, hd, q_out = cfg.d_model, cfg.head_dim, cfg.n_heads * cfg.head_dim
    out = C.embedding_tensors(cfg)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        out += [C.vec(p + "attn_norm.weight", d)] + C.qkv_tensors(cfg, p)
        out += [C.mat(p + "attn_output.weight", q_out, d), C.vec(p + "post_attention_norm.weight", d),
                C.vec(p + "attn_q_norm.weight", hd), C.vec(p + "attn_k_norm.weight", hd),
                C.vec(p + "ffn_norm.weight", d), C.vec(p + "post_ffw_norm.weight", d)]
        out += C.ffn_tensors(cfg, p)
    return out


def forward(b: ProgramBuilder, cfg: ModelConfig, w: Weights) -> Value:
    hd, eps = cfg.head_dim, cfg.norm_eps
    rope_global = C.rope_spec(cfg, "neox", factors=False)
    rope_local = RopeSpec(mode="neox", dim=cfg.rope_dim, base=cfg.rope_base_swa, freq_scale=1.0,
                          attn_factor=cfg.rope_attn_factor)
    scale = attention_scale(cfg)
    swa = cfg.swa_layers(SWA_PATTERN) if cfg.sliding_window is not None else (False,) * cfg.n_layers
    x = b.embed(w["token_embd.weight"], scale=float(math.sqrt(cfg.d_model)))
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        rope = rope_local if swa[i] else rope_global
        h = b.rms_norm(x, w[p + "attn_norm.weight"], eps, name=p + "attn_norm")
        q, k, v = C.build_qkv(b, cfg, w, p, h)
        q = b.head_rms_norm(q, w[p + "attn_q_norm.weight"], eps, hd, name=p + "q_norm")
        k = b.head_rms_norm(k, w[p + "attn_k_norm.weight"], eps, hd, name=p + "k_norm")
        q, k = b.rope(q, rope, hd, name=p + "q_rope"), b.rope(k, rope, hd, name=p + "k_rope")
        a = b.attention(q, k, v, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=hd, scale=scale,
                        window=cfg.sliding_window if swa[i] else 0, name=p + "attn")
        o = b.rms_norm(b.linear(a, w[p + "attn_output.weight"], name=p + "attn_out"),
                       w[p + "post_attention_norm.weight"], eps, name=p + "attn_post_norm")
        x = b.add(o, x, name=p + "sa_out")
        if i == cfg.n_layers - 1:
            x = b.take_rows(x, name="out_rows")
        h = b.rms_norm(x, w[p + "ffn_norm.weight"], eps, name=p + "ffn_norm")
        f = b.rms_norm(C.build_ffn(b, w, p, h, "gelu_tanh"), w[p + "post_ffw_norm.weight"], eps,
                       name=p + "ffn_post_norm")
        x = b.add(f, x, name=p + "l_out")
    return C.output_head(b, cfg, w, x)
