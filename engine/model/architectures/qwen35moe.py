"""The qwen35moe architecture (Qwen3.5 / 3.6 mixture of experts, 35B-A3B .. 397B-A17B):
qwen35's layers (gated DeltaNet and gated full attention, ``qwen35.py``) with a routed
mixture of experts and an always-on shared expert in place of the dense FFN.

    h  = rmsnorm(x) * post_attention_norm                (after each layer's attention residual)
    x  = x + moe(h) + sigmoid(Wgate_shexp h) * Wdown_shexp (silu(Wgate_shexp' h) * Wup_shexp h)
moe: router logits l = ffn_gate_inp h (expert_count), p = softmax(l), the
expert_used_count largest kept and renormalised to sum 1, times expert_weights_scale when
set, each kept expert a SwiGLU FFN of width expert_feed_forward_length (default
feed_forward_length / expert_used_count); the shared expert's width
expert_shared_feed_forward_length (default feed_forward_length).

Checked against llama.cpp (as vendored by llama-cpp-python 0.3.36, 0c1e5709):
src/models/qwen35moe.cpp (tensors: ffn_gate_inp, ffn_{gate,up,down}_exps, the shared
expert and its (d -> 1) gate; build_layer_ffn: build_moe_ffn(LLM_FFN_SILU, norm_w true,
expert_weights_scale, LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX), the shared expert gated by
sigmoid). Fused ``ffn_gate_up_exps`` (a converter option) is not supported: such a file is
refused naming that tensor.
"""

from __future__ import annotations

from aotx.engine.backend.ops import ProgramBuilder, Value
from aotx.engine.model.architectures import common as C
from aotx.engine.model.architectures import hparams as K
from aotx.engine.model.architectures import moe_block as M
from aotx.engine.model.architectures import qwen35 as Q
from aotx.engine.model.config import ModelConfig
from aotx.engine.model.transformer import Weights

KNOWN_TENSORS_ONLY = True
ignored_tensor = Q.ignored_tensor


def expert_ffn_dim(cfg: ModelConfig) -> int:
    return cfg.expert_ffn_dim or cfg.ffn_dim // max(1, cfg.n_expert_used)


def shared_ffn_dim(cfg: ModelConfig) -> int:
    return cfg.shared_ffn_dim or cfg.ffn_dim


def check_config(cfg: ModelConfig, path: str) -> None:
    Q.check_config(cfg, path)
    M.require_experts(cfg, path)
    K.positive(cfg, path, "expert_feed_forward_length", expert_ffn_dim(cfg))
    K.positive(cfg, path, "expert_shared_feed_forward_length", shared_ffn_dim(cfg))


def tensors(cfg: ModelConfig) -> list:
    lin = Q.linear_hparams(cfg)
    out = C.embedding_tensors(cfg)
    for i in range(cfg.n_layers):
        out += Q.layer_tensors(cfg, lin, i) + _moe_ffn_tensors(cfg, f"blk.{i}.")
    return out


def forward(b: ProgramBuilder, cfg: ModelConfig, w: Weights) -> Value:
    scale = K.key(cfg, "model", "expert_weights_scale", 0.0, float)
    return Q.build(b, cfg, w, lambda b, cfg, w, p, h: M.build_moe(b, cfg, w, p, h, gating="softmax", norm_w=True,
                                                                  w_scale=scale))


def _moe_ffn_tensors(cfg: ModelConfig, p: str) -> list:
    return M.moe_tensors(cfg, p, expert_ffn_dim(cfg), shared_ff=shared_ffn_dim(cfg), shared_gate=True)


def mtp_tensors(cfg: ModelConfig) -> list:
    return Q.nextn_tensors(cfg, _moe_ffn_tensors)


def mtp_forward(b: ProgramBuilder, cfg: ModelConfig, w: Weights) -> Value:
    scale = K.key(cfg, "model", "expert_weights_scale", 0.0, float)
    return Q.build_mtp(b, cfg, w, lambda b, cfg, w, p, h: M.build_moe(b, cfg, w, p, h, gating="softmax", norm_w=True,
                                                                      w_scale=scale))
