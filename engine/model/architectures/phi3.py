"""The phi3 architecture (Phi-3, Phi-3.5 mini/medium, Phi-4 mini): tensors and block.

Each block, pre-norm, with fused projections and GPT-NeoX RoPE:
    h  = rmsnorm(x) * attn_norm
    q, k, v = split(Wqkv h)                            (or separate attn_q/k/v)
    q, k = rope_neox(q), rope_neox(k)                  (long-rope factors, attention factor)
    x  = x + Wo . attention(q, k, v)                   (scale 1/sqrt(head_dim))
    h  = rmsnorm(x) * ffn_norm
    g, u = split(Wup h)                                (ffn_up holds gate then up: 2 * n_ff)
    x  = x + Wdown (silu(g) * u)
    logits = Woutput . (rmsnorm(x) * output_norm)      (tied to token_embd when absent)
RoPE factors (llama.cpp get_rope_factors): ``rope_factors_long`` for a KV cache whose
context exceeds rope.scaling.original_context_length, ``rope_factors_short`` otherwise,
none when the file has neither; cos and sin are multiplied by rope.scaling.attn_factor
(convert_hf_to_gguf: sqrt(1 + ln(scale) / ln(original context)) for long-rope files).
Phi-3's sliding window is disabled, as llama.cpp disables it (its load_arch_hparams).

Checked against llama.cpp (as vendored by llama-cpp-python 0.3.36): src/models/phi3.cpp
(tensors: create_tensor_qkv with q of n_embd, ffn_up of 2 * n_ff, rope_long/short;
graph: Q scaled by 1/sqrt(n_embd_head) with kq_scale 1, build_ffn LLM_FFN_SWIGLU with
LLM_FFN_SEQ on the fused up, i.e. silu of the first half times the second half),
llama_model_rope_type (PHI3: NEOX), llama-context.cpp (attn_factor = rope_attn_factor
when not YaRN).
"""

from __future__ import annotations

import math

from aotx.engine.backend.ops import ProgramBuilder, Value
from aotx.engine.model.architectures import common as C
from aotx.engine.model.config import ModelConfig
from aotx.engine.model.transformer import Weights



def tensors(cfg: ModelConfig) -> list:
    d, f = cfg.d_model, cfg.ffn_dim
    out = C.embedding_tensors(cfg) + C.rope_factor_tensors(cfg, longrope=True)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        out += [C.vec(p + "attn_norm.weight", d)] + C.qkv_tensors(cfg, p, q_out=d)
        out += [C.mat(p + "attn_output.weight", d, d), C.vec(p + "ffn_norm.weight", d),
                C.mat(p + "ffn_up.weight", d, 2 * f), C.mat(p + "ffn_down.weight", f, d)]
    return out


def check_config(cfg: ModelConfig, path: str) -> None:
    from aotx.engine.errors import ModelError

    if cfg.n_heads * cfg.head_dim != cfg.d_model:
        raise ModelError(f"{path}: phi3 needs head_count x key_length = embedding_length, got "
                         f"{cfg.n_heads} x {cfg.head_dim} for {cfg.d_model}")


def forward(b: ProgramBuilder, cfg: ModelConfig, w: Weights) -> Value:
    hd, eps, f = cfg.head_dim, cfg.norm_eps, cfg.ffn_dim
    rope = C.rope_spec(cfg, "neox", w)
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
        g, u = b.split(b.linear(h, w[p + "ffn_up.weight"], name=p + "gate_up"), (f, f), names=(p + "gate", p + "up"))
        x = b.add(x, b.linear(b.glu(g, u, "silu", name=p + "glu"), w[p + "ffn_down.weight"], name=p + "ffn_out"),
                  name=p + "l_out")
    return C.output_head(b, cfg, w, x)
