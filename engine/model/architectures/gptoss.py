"""The gpt-oss architecture (OpenAI gpt-oss-20b / -120b): attention sinks, alternating
sliding-window layers, YaRN RoPE, biased MXFP4 experts with gpt-oss's own routing.

Each block, pre-norm:
    h  = rmsnorm(x) * attn_norm
    q, k, v = Wq h + bq, Wk h + bk, Wv h + bv          (head_dim = rope.dimension_count)
    q, k = rope_neox(q), rope_neox(k)                   (YaRN when rope.scaling.type = yarn)
    x  = x + Wo . attention(q, k, v; sinks, window_l) + bo   (scale 1/sqrt(head_dim))
    h  = rmsnorm(x) * post_attention_norm              (the pre-FFN norm, named so)
    x  = x + moe(h)
    logits = Woutput . (rmsnorm(x) * output_norm)      (output.weight required)
attention: head h's softmax denominator also holds exp(attn_sinks[h] - max) (a learned
logit with no value). Layer l slides (window attention.sliding_window) when l % 2 == 0,
or as attention.sliding_window_pattern says (llama.cpp load_swa_pattern(ml, 2)); every
layer uses rope.freq_base, or rope.freq_base_swa on the sliding ones when the file has it.
moe: l = ffn_gate_inp h + b; the expert_used_count largest LOGITS kept and softmaxed over
those k (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT, no renormalisation); each expert
y = Wdown (swiglu_oai(Wgate h + bg, Wup h + bu)) + bd with swiglu_oai(g, u) =
min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1) (ggml_swiglu_oai, alpha
1.702, limit 7); expert width expert_feed_forward_length.
Checked against llama.cpp (as vendored by llama-cpp-python 0.3.36): src/models/openai-moe.cpp
(load_arch_hparams: attention.sliding_window required, expert_feed_forward_length,
load_swa_pattern(ml, 2), rope_freq_base_train_swa defaulting to rope_freq_base_train;
tensors: attn_sinks {n_head}, attn_output.bias, ffn_gate_inp.bias, the three expert biases,
post_attention_norm; graph: build_attn(..., attn_sinks, kq_scale 1/sqrt(n_rot)),
build_moe_ffn(..., LLM_FFN_SWIGLU_OAI_MOE, norm_w false, SOFTMAX_WEIGHT)), llama-graph.cpp
build_moe_ffn, ggml-cpu ops.cpp ggml_compute_forward_swiglu_oai_f32 and the soft_max sink
correction, llama-context.cpp's YaRN constants, llama_model_rope_type (OPENAI_MOE: NEOX).
"""

from __future__ import annotations

import dataclasses
import math

from aotx.engine.backend.ops import ProgramBuilder, Value
from aotx.engine.errors import ModelError
from aotx.engine.model.architectures import common as C
from aotx.engine.model.architectures import moe_block as M
from aotx.engine.model.config import ModelConfig
from aotx.engine.model.transformer import Tensor, Weights

SWA_PATTERN = 2     # llama.cpp: load_swa_pattern(ml, 2): even layers slide


def check_config(cfg: ModelConfig, path: str) -> None:
    C.require_full_rope(cfg, path)
    M.require_experts(cfg, path)
    if cfg.sliding_window is None:
        raise ModelError(f"{path}: metadata key '{cfg.arch}.attention.sliding_window' is missing")
    cfg.check_sliding_window(path)
    if cfg.expert_ffn_dim <= 0:
        raise ModelError(f"{path}: metadata key '{cfg.arch}.expert_feed_forward_length' is missing")


def tensors(cfg: ModelConfig) -> list:
    d, q_out = cfg.d_model, cfg.n_heads * cfg.head_dim
    out = [C.mat("token_embd.weight", d, cfg.vocab_size), C.vec("output_norm.weight", d),
           C.mat("output.weight", d, cfg.vocab_size)]
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        out += [C.vec(p + "attn_norm.weight", d), C.vec(p + "post_attention_norm.weight", d)]
        out += C.qkv_tensors(cfg, p)
        out += [C.mat(p + "attn_output.weight", q_out, d), C.vec(p + "attn_output.bias", d),
                Tensor(p + "attn_sinks.weight", (cfg.n_heads,), "vector")]
        out += M.moe_tensors(cfg, p, cfg.expert_ffn_dim, biases=True)
    return out


def forward(b: ProgramBuilder, cfg: ModelConfig, w: Weights) -> Value:
    hd, eps = cfg.head_dim, cfg.norm_eps
    rope = C.rope_spec(cfg, "neox")
    rope_swa = dataclasses.replace(rope, base=cfg.rope_base_swa) if cfg.rope_base_swa_set else rope
    swa = cfg.swa_layers(SWA_PATTERN)
    x = b.embed(w["token_embd.weight"])
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        r = rope_swa if swa[i] else rope
        h = b.rms_norm(x, w[p + "attn_norm.weight"], eps, name=p + "attn_norm")
        q, k, v = C.build_qkv(b, cfg, w, p, h)
        q, k = b.rope(q, r, hd, name=p + "q_rope"), b.rope(k, r, hd, name=p + "k_rope")
        a = b.attention(q, k, v, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=hd,
                        scale=1.0 / math.sqrt(hd), window=cfg.sliding_window if swa[i] else 0,
                        sinks=w[p + "attn_sinks.weight"], name=p + "attn")
        x = b.add(x, b.linear(a, w[p + "attn_output.weight"], w[p + "attn_output.bias"], name=p + "attn_out"),
                  name=p + "ffn_inp")
        if i == cfg.n_layers - 1:
            x = b.take_rows(x, name="out_rows")
        h = b.rms_norm(x, w[p + "post_attention_norm.weight"], eps, name=p + "attn_post_norm")
        x = b.add(x, M.build_moe(b, cfg, w, p, h, gating="softmax_weight", norm_w=False, act="swiglu_oai"),
                  name=p + "l_out")
    return C.output_head(b, cfg, w, x)
