"""The qwen35 architecture (Qwen3.5 / Qwen3.6 dense, 0.8B .. 27B): gated DeltaNet layers
interleaved with gated full-attention layers.

    x = embed(tokens)
Each block, pre-norm; three of every four layers (``attention.recurrent_layers``, else
every layer but each ``full_attention_interval``-th, default 4) are linear attention:
    h = rmsnorm(x) * attn_norm
    qkv = Wqkv h;  z = Wgate h;  beta = Wbeta h;  alpha = Walpha h
    q, k, v = split(silu(short_conv(qkv, ssm_conv1d)))         (the conv carries its state)
    o = delta_rule(l2norm(q), l2norm(k), v, alpha, beta; a = ssm_a, dt_bias = ssm_dt.bias)
    a = Wssm_out (rmsnorm_per_head(o) * ssm_norm * silu(z))
the others full attention with a gated output:
    q|gate = Wq h (per head: head_dim query values, then head_dim gate values);  k, v = Wk h, Wv h
    q = rope_imrope(rmsnorm_per_head(q) * attn_q_norm);  k likewise with attn_k_norm
    a = Wo (attention(q, k, v) * sigmoid(gate))                  (scale 1/sqrt(head_dim))
then, in every layer:
    x = x + a;  x = x + Wdown (silu(Wgate rmsnorm(x) * post_attention_norm) * Wup ...)
    logits = Woutput . (rmsnorm(x) * output_norm)                 (tied when absent)
RoPE: interleaved M-RoPE (LLAMA_ROPE_TYPE_IMROPE) over the first rope.dimension_count
dimensions of each head; a text token's position is (p, p, p, 0) across the four
rope.dimension_sections, so pair j turns at p unless its sector falls in the fourth
section (then at 0: no rotation). Here that is a NEOX RoPE whose frequency factor is
infinite for such pairs.
The ``nextn_predict_layers`` blocks after the main stack are the multi-token-prediction
head (``mtp_forward``, traced by ``TransformerModel.load_mtp``; runtime/mtp.py drafts with
it); the main forward does not run them, but keeps every row's final-normed hidden state
for it.

Checked against llama.cpp (as vendored by llama-cpp-python 0.3.36, 0c1e5709):
src/models/qwen35.cpp (load_arch_hparams: ssm.* keys, recurrent layers from
attention.recurrent_layers or full_attention_interval; tensors; graph: build_layer_attn,
build_layer_attn_linear, build_norm_gated, the post-attention norm before the FFN),
delta-net-base.cpp (build_conv_state, build_delta_net*), models.h build_gdn_l2_norm,
ggml-cpu ops.cpp (ssm_conv, gated_delta_net, rope_multi's imrope sectors), llama-graph.cpp
llm_graph_input_pos (text positions (p, p, p, 0)), conversion/qwen.py (A_log stored as
-exp(A_log); V heads reordered to ggml's tiled broadcast: value head h reads key head
h % n_k_heads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aotx.engine.backend.ops import ProgramBuilder, RopeSpec, Value
from aotx.engine.errors import ModelError
from aotx.engine.model.architectures import common as C
from aotx.engine.model.architectures import hparams as K
from aotx.engine.model.config import ModelConfig
from aotx.engine.model.transformer import Tensor, Weights

#: every tensor of the file must be one this module declares (or a nextn block's)
KNOWN_TENSORS_ONLY = True


@dataclass(frozen=True)
class Linear:
    """The gated DeltaNet hyperparameters: ``conv`` kernel width, ``n_k`` key heads and
    ``n_v`` value heads of ``head_dim`` each, ``recurrent`` one bool per layer of the main
    stack, ``sections`` the four M-RoPE sections (None: plain NEOX RoPE); Qwen3-Next's
    layout: ``fused_ba`` (beta and alpha from one ``ssm_ba`` matrix, per key head
    [beta x r, alpha x r]) and ``key_heads`` "grouped" (value head h reads key head h // r,
    r = n_v / n_k; Qwen3.5's converter reorders to "tiled": h % n_k)."""

    conv: int
    n_k: int
    n_v: int
    head_dim: int
    recurrent: tuple[bool, ...]
    sections: tuple[int, ...] | None
    fused_ba: bool = False
    key_heads: str = "tiled"

    @property
    def key_dim(self) -> int:
        return self.n_k * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v * self.head_dim


def linear_hparams(cfg: ModelConfig, path: str = "model") -> Linear:
    """Read and check the keys of the linear-attention layers. Raises ModelError naming
    the key."""
    conv = K.key(cfg, path, "ssm.conv_kernel")
    inner = K.key(cfg, path, "ssm.inner_size")
    state = K.key(cfg, path, "ssm.state_size")
    n_v = K.key(cfg, path, "ssm.time_step_rank")
    n_k = K.key(cfg, path, "ssm.group_count")
    for name, val in (("ssm.conv_kernel", conv - 1), ("ssm.inner_size", inner), ("ssm.state_size", state),
                      ("ssm.time_step_rank", n_v), ("ssm.group_count", n_k)):
        K.positive(cfg, path, name, val)
    if n_v % n_k:
        raise ModelError(f"{path}: {cfg.arch}.ssm.time_step_rank {n_v} (value heads) is not a multiple of "
                         f"{cfg.arch}.ssm.group_count {n_k} (key heads)")
    if inner != n_v * state:
        raise ModelError(f"{path}: {cfg.arch}.ssm.inner_size {inner} is not ssm.time_step_rank x ssm.state_size "
                         f"({n_v} x {state}); the delta rule needs key and value heads of one size")
    n_all = cfg.n_layers + cfg.nextn_layers
    rec = K.array(cfg, path, "attention.recurrent_layers", n_all, bool)
    if rec is None:
        every = K.key(cfg, path, "full_attention_interval", 4)
        K.positive(cfg, path, "full_attention_interval", every)
        rec = tuple((i + 1) % every != 0 for i in range(cfg.n_layers))
    rec = tuple(rec[:cfg.n_layers])
    if all(rec):
        raise ModelError(f"{path}: {cfg.arch} has no full-attention layer (attention.recurrent_layers / "
                         f"full_attention_interval)")
    if cfg.arch == "qwen3next":     # plain NEOX RoPE, the Qwen3-Next projections' layout
        return Linear(conv, n_k, n_v, state, rec, None, fused_ba=True, key_heads="grouped")
    sections = K.array(cfg, path, "rope.dimension_sections", 4)
    if sections is None:
        raise ModelError(f"{path}: metadata key '{cfg.arch}.rope.dimension_sections' is missing")
    if min(sections) < 0 or sum(sections[:3]) <= 0:
        raise ModelError(f"{path}: {cfg.arch}.rope.dimension_sections {list(sections)} must be non-negative with "
                         f"a positive text section")
    return Linear(conv, n_k, n_v, state, rec, tuple(sections))


def imrope_spec(cfg: ModelConfig, sections: tuple[int, ...] | None) -> RopeSpec:
    """Interleaved M-RoPE for text positions (p, p, p, 0) as a NEOX spec: pair j's sector
    is j % sum(sections); sectors 3i, 3i+1, 3i+2 below 3 x sections[0], [1], [2] turn at
    p, the rest (the fourth section) at 0 (frequency factor inf: angle 0). No sections:
    plain NEOX RoPE (Qwen3-Next)."""
    if sections is None:
        return C.rope_spec(cfg, "neox", factors=False)
    total = sum(sections)
    ff = []
    for j in range(cfg.rope_dim // 2):
        s = j % total
        text = ((s % 3 == 0 and s < 3 * sections[0]) or (s % 3 == 1 and s < 3 * sections[1])
                or (s % 3 == 2 and s < 3 * sections[2]))
        ff.append(1.0 if text else math.inf)
    spec = C.rope_spec(cfg, "neox", factors=False)
    return RopeSpec(mode=spec.mode, dim=spec.dim, base=spec.base, freq_scale=spec.freq_scale,
                    attn_factor=spec.attn_factor, freq_factors=None if all(f == 1.0 for f in ff) else tuple(ff),
                    ext_factor=spec.ext_factor, beta_fast=spec.beta_fast, beta_slow=spec.beta_slow,
                    yarn_ctx=spec.yarn_ctx)


def check_config(cfg: ModelConfig, path: str) -> None:
    linear_hparams(cfg, path)
    if cfg.rope_dim > cfg.head_dim:
        raise ModelError(f"{path}: {cfg.arch}.rope.dimension_count {cfg.rope_dim} exceeds the head dimension "
                         f"{cfg.head_dim}")


def attention_tensors(cfg: ModelConfig, p: str) -> list:
    """A full-attention layer's tensors (the query projection doubled: query and gate)."""
    d, hd, q_out = cfg.d_model, cfg.head_dim, cfg.n_heads * cfg.head_dim
    return (C.qkv_tensors(cfg, p, q_out=2 * q_out)
            + [C.mat(p + "attn_output.weight", q_out, d), C.vec(p + "attn_q_norm.weight", hd),
               C.vec(p + "attn_k_norm.weight", hd)])


def linear_tensors(cfg: ModelConfig, lin: Linear, p: str) -> list:
    """A gated DeltaNet layer's tensors."""
    d = cfg.d_model
    conv_dim = 2 * lin.key_dim + lin.value_dim
    ba = ([C.mat(p + "ssm_ba.weight", d, 2 * lin.n_v)] if lin.fused_ba else
          [C.mat(p + "ssm_beta.weight", d, lin.n_v), C.mat(p + "ssm_alpha.weight", d, lin.n_v)])
    return [C.mat(p + "attn_qkv.weight", d, conv_dim), C.mat(p + "attn_gate.weight", d, lin.value_dim)] + ba + [
            Tensor(p + "ssm_conv1d.weight", (lin.conv, conv_dim), "array"), C.vec(p + "ssm_dt.bias", lin.n_v),
            C.vec(p + "ssm_a", lin.n_v), C.vec(p + "ssm_norm.weight", lin.head_dim),
            C.mat(p + "ssm_out.weight", lin.value_dim, d)]


def layer_tensors(cfg: ModelConfig, lin: Linear, i: int) -> list:
    """Layer i's tensors before its FFN (qwen35moe shares them)."""
    p = f"blk.{i}."
    out = [C.vec(p + "attn_norm.weight", cfg.d_model), C.vec(p + "post_attention_norm.weight", cfg.d_model)]
    return out + (linear_tensors(cfg, lin, p) if lin.recurrent[i] else attention_tensors(cfg, p))


def tensors(cfg: ModelConfig) -> list:
    lin = linear_hparams(cfg)
    out = C.embedding_tensors(cfg)
    for i in range(cfg.n_layers):
        out += layer_tensors(cfg, lin, i) + C.ffn_tensors(cfg, f"blk.{i}.")
    return out


def ignored_tensor(cfg: ModelConfig, name: str) -> bool:
    """The nextn (MTP) blocks' tensors: known, loaded only by the MTP drafter."""
    if not name.startswith("blk."):
        return False
    head = name[4:].split(".", 1)[0]
    return head.isdigit() and cfg.n_layers <= int(head) < cfg.n_layers + cfg.nextn_layers


def build_linear_attention(b: ProgramBuilder, cfg: ModelConfig, lin: Linear, w: Weights, p: str, h: Value) -> Value:
    """The gated DeltaNet block on the normed input h: (N, d_model)."""
    S, eps = lin.head_dim, cfg.norm_eps
    qkv = b.linear(h, w[p + "attn_qkv.weight"], name=p + "qkv_mixed")
    z = b.linear(h, w[p + "attn_gate.weight"], name=p + "z")
    if lin.fused_ba:    # per key head: r betas then r alphas
        ba = b.linear(h, w[p + "ssm_ba.weight"], name=p + "mixed_ba")
        beta, alpha = b.deinterleave(ba, lin.n_v // lin.n_k, 2, names=(p + "beta", p + "alpha"))
    else:
        beta = b.linear(h, w[p + "ssm_beta.weight"], name=p + "beta")
        alpha = b.linear(h, w[p + "ssm_alpha.weight"], name=p + "alpha")
    conv = b.short_conv(qkv, w[p + "ssm_conv1d.weight"], act="silu", name=p + "conv_output_silu")
    q, k, v = b.split(conv, (lin.key_dim, lin.key_dim, lin.value_dim), names=(p + "q_conv", p + "k_conv",
                                                                              p + "v_conv"))
    q = b.l2_norm(q, eps, S, name=p + "q_l2")
    k = b.l2_norm(k, eps, S, name=p + "k_l2")
    o = b.delta_rule(q, k, v, alpha, beta, n_k_heads=lin.n_k, n_v_heads=lin.n_v, head_dim=S, a=w[p + "ssm_a"],
                     dt_bias=w[p + "ssm_dt.bias"], scale=1.0 / math.sqrt(S), key_heads=lin.key_heads,
                     name=p + "attn_output")
    o = b.head_rms_norm(o, w[p + "ssm_norm.weight"], eps, S, name=p + "ssm_norm")
    o = b.glu(z, o, "silu", name=p + "norm_gated")
    return b.linear(o, w[p + "ssm_out.weight"], name=p + "linear_attn_out")


def build_gated_attention(b: ProgramBuilder, cfg: ModelConfig, rope: RopeSpec, w: Weights, p: str,
                          h: Value) -> Value:
    """The full-attention block with its sigmoid output gate on the normed input h."""
    hd, eps = cfg.head_dim, cfg.norm_eps
    qg, k, v = C.build_qkv(b, cfg, w, p, h, q_out=2 * cfg.n_heads * hd)
    q, gate = b.deinterleave(qg, hd, 2, names=(p + "q", p + "gate"))
    q = b.head_rms_norm(q, w[p + "attn_q_norm.weight"], eps, hd, name=p + "q_norm")
    k = b.head_rms_norm(k, w[p + "attn_k_norm.weight"], eps, hd, name=p + "k_norm")
    q, k = b.rope(q, rope, hd, name=p + "q_rope"), b.rope(k, rope, hd, name=p + "k_rope")
    a = b.attention(q, k, v, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=hd,
                    scale=1.0 / math.sqrt(hd), name=p + "attn")
    return b.linear(b.sigmoid_gate(a, gate, name=p + "attn_gated"), w[p + "attn_output.weight"],
                    name=p + "attn_out")


def build(b: ProgramBuilder, cfg: ModelConfig, w: Weights, ffn) -> Value:
    """The qwen35 stack with ``ffn(b, cfg, w, p, h) -> Value`` as each layer's FFN
    (qwen35moe passes its mixture of experts)."""
    lin = linear_hparams(cfg)
    rope = imrope_spec(cfg, lin.sections)
    x = b.embed(w["token_embd.weight"])
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        h = b.rms_norm(x, w[p + "attn_norm.weight"], cfg.norm_eps, name=p + "attn_norm")
        if lin.recurrent[i]:
            a = build_linear_attention(b, cfg, lin, w, p, h)
        else:
            a = build_gated_attention(b, cfg, rope, w, p, h)
        x = b.add(a, x, name=p + "attn_residual")
        if i == cfg.n_layers - 1 and not cfg.nextn_layers:
            x = b.take_rows(x, name="out_rows")
        h = b.rms_norm(x, w[p + "post_attention_norm.weight"], cfg.norm_eps, name=p + "attn_post_norm")
        x = b.add(ffn(b, cfg, w, p, h), x, name=p + "post_ffn")
    if not cfg.nextn_layers:
        return C.output_head(b, cfg, w, x)
    # a file with an MTP head: every row's final-normed hidden state is kept for it (llama.cpp's
    # h_nextn with embeddings_nextn_masked off), so the logits rows are taken after the norm
    h = b.rms_norm(x, w["output_norm.weight"], cfg.norm_eps, name="h_nextn")
    b.mark_hidden(h)
    out = w.get("output.weight")
    return b.linear(b.take_rows(h, name="out_rows"), w["token_embd.weight"] if out is None else out, name="logits")


def nextn_tensors(cfg: ModelConfig, ffn_tensors) -> list:
    """The first nextn block's tensors (the MTP head), ``ffn_tensors(cfg, p)`` its FFN's."""
    d, p = cfg.d_model, f"blk.{cfg.n_layers}."
    return ([C.vec(p + "attn_norm.weight", d), C.vec(p + "post_attention_norm.weight", d)]
            + attention_tensors(cfg, p) + ffn_tensors(cfg, p)
            + [C.mat(p + "nextn.eh_proj.weight", 2 * d, d), C.vec(p + "nextn.enorm.weight", d),
               C.vec(p + "nextn.hnorm.weight", d), C.mat(p + "nextn.embed_tokens.weight", d, cfg.vocab_size, True),
               C.mat(p + "nextn.shared_head_head.weight", d, cfg.vocab_size, True),
               C.vec(p + "nextn.shared_head_norm.weight", d, True)])


def build_mtp(b: ProgramBuilder, cfg: ModelConfig, w: Weights, ffn) -> Value:
    """The MTP head (llama.cpp qwen35.cpp graph_mtp): row t pairs the target's final-normed
    hidden state of position t-1 (the ``input`` "h") with the embedding of token t:
        x = Weh_proj [rmsnorm(embed(t)) * enorm, rmsnorm(h) * hnorm]
        x = x + gated_attention(rmsnorm(x) * attn_norm);  x = x + ffn(rmsnorm(x) * post_attention_norm)
        h' = rmsnorm(x) * shared_head_norm (else output_norm)   (kept: the next draft step's h)
        logits = Whead h'   (shared_head_head, else the model's output head)"""
    lin = linear_hparams(cfg)
    rope = imrope_spec(cfg, lin.sections)
    eps, p = cfg.norm_eps, f"blk.{cfg.n_layers}."
    e = b.embed(_first(w, p + "nextn.embed_tokens.weight", "token_embd.weight"), name="mtp_tok_embd")
    h = b.input("h", cfg.d_model)
    x = b.linear(b.concat(b.rms_norm(e, w[p + "nextn.enorm.weight"], eps, name="mtp_enorm"),
                          b.rms_norm(h, w[p + "nextn.hnorm.weight"], eps, name="mtp_hnorm"), name="mtp_concat"),
                 w[p + "nextn.eh_proj.weight"], name="mtp_eh_proj")
    a = build_gated_attention(b, cfg, rope, w, p, b.rms_norm(x, w[p + "attn_norm.weight"], eps, name=p + "attn_norm"))
    x = b.add(a, x, name="mtp_attn_residual")
    f = ffn(b, cfg, w, p, b.rms_norm(x, w[p + "post_attention_norm.weight"], eps, name=p + "attn_post_norm"))
    x = b.add(f, x, name="mtp_post_ffn")
    hn = b.rms_norm(x, _first(w, p + "nextn.shared_head_norm.weight", "output_norm.weight"), eps, name="mtp_h")
    b.mark_hidden(hn)
    head = _first(w, p + "nextn.shared_head_head.weight", "output.weight", "token_embd.weight")
    return b.linear(b.take_rows(hn, name="mtp_rows"), head, name="mtp_logits")


def _first(w: Weights, *names: str):
    """The first of ``names`` the file has (the last one is required)."""
    for n in names[:-1]:
        if n in w:
            return w[n]
    return w[names[-1]]


def mtp_forward(b: ProgramBuilder, cfg: ModelConfig, w: Weights) -> Value:
    return build_mtp(b, cfg, w, lambda b, cfg, w, p, h: C.build_ffn(b, w, p, h, "silu"))


def mtp_tensors(cfg: ModelConfig) -> list:
    return nextn_tensors(cfg, lambda cfg, p: C.ffn_tensors(cfg, p))


def forward(b: ProgramBuilder, cfg: ModelConfig, w: Weights) -> Value:
    return build(b, cfg, w, lambda b, cfg, w, p, h: C.build_ffn(b, w, p, h, "silu"))
