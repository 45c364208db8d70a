"""The lfm2 architecture (Liquid's LFM2 / LFM2.5 dense: 350M .. 2.6B): gated short-convolution
layers interleaved with grouped-query attention layers.

    x = embed(tokens)
Each block, pre-norm; a layer whose entry of the per-layer ``attention.head_count_kv`` is 0
is a short-convolution layer:
    h = rmsnorm(x) * attn_norm                                   (the "operator norm")
    b, c, u = split(Win_proj h)                                  (three d_model blocks, in that order)
    a = Wout_proj (c * short_conv(b * u, shortconv.conv))        (kernel L = shortconv.l_cache, no
                                                                  bias, no activation; the conv
                                                                  carries the last L-1 inputs b * u)
the others attention:
    q, k, v = Wq h, Wk h, Wv h                                   (or one fused attn_qkv, split)
    q = rope_neox(rmsnorm_per_head(q) * attn_q_norm);  k likewise with attn_k_norm
    a = Wo attention(q, k, v)                                    (scale 1/sqrt(head_dim); GQA;
                                                                  window attention.sliding_window
                                                                  when the file has one > 0)
then, in every layer:
    x = x + a;  x = x + Wdown (silu(Wgate h') * Wup h'),  h' = rmsnorm(x) * ffn_norm
    logits = Woutput . (rmsnorm(x) * token_embd_norm)            (tied to token_embd when absent)
The final norm is the tensor llama.cpp names LLM_TENSOR_OUTPUT_NORM_LFM2, stored as
``token_embd_norm`` ("fix for wrong tensor name" in llama-arch.cpp): it normalises the last
hidden state, not the embeddings.

Refused at load, by name: ``lfm2moe`` (no module: the registry names what is supported), the
ColBERT / embedding variants (their ``dense_2`` head: a tensor this module does not know;
``attention.causal`` false: bidirectional), any tensor this module does not declare.

Checked against llama.cpp (as vendored by llama-cpp-python 0.3.36, 0c1e5709):
src/models/lfm2.cpp (load_arch_hparams: shortconv.l_cache, is_recr = n_head_kv(il) == 0, every
attention layer sliding when attention.sliding_window > 0 (LLAMA_SWA_TYPE_STANDARD: a key
p0 is masked for query p1 when p1 - p0 >= n_swa); tensors: token_embd_norm as the output
norm, output or tied token_embd, create_tensor_qkv, shortconv.conv {l_cache, n_embd},
in_proj {n_embd, 3 n_embd}, out_proj and attn_output {n_embd, n_embd}; graph: b, c, x views
of in_proj's output, ggml_ssm_conv over [conv state, b*x], y = c * conv, the residual after
each block, build_ffn SILU PAR), llama_model_rope_type (LFM2: NEOX), conversion/lfm2.py
(head_count_kv per layer, 0 for "conv" layers; the conv weight squeezed to 2-D).
"""

from __future__ import annotations

import dataclasses
import math

from aotx.engine.backend.ops import ProgramBuilder, Value
from aotx.engine.errors import ModelError
from aotx.engine.model.architectures import common as C
from aotx.engine.model.architectures import hparams as K
from aotx.engine.model.config import ModelConfig
from aotx.engine.model.transformer import Tensor, Weights

#: every tensor of the file must be one this module declares (the ColBERT ``dense_2`` head
#: and anything else unknown is refused, naming the tensor)
KNOWN_TENSORS_ONLY = True


def kv_heads(cfg: ModelConfig, path: str = "model") -> tuple[int, ...]:
    """KV heads per layer (0: a short-convolution layer), from ``attention.head_count_kv``
    (an array, or one value for every layer). Raises ModelError naming the key."""
    per = K.array(cfg, path, "attention.head_count_kv", cfg.n_layers)
    per = (cfg.n_kv_heads,) * cfg.n_layers if per is None else per
    if any(h < 0 or (h and cfg.n_heads % h) for h in per):
        raise ModelError(f"{path}: {cfg.arch}.attention.head_count_kv {list(per)} must be 0 (a short-convolution "
                         f"layer) or divide head_count {cfg.n_heads}")
    if all(h == 0 for h in per):
        raise ModelError(f"{path}: {cfg.arch}.attention.head_count_kv is 0 for every layer: no attention layer")
    return per


def conv_length(cfg: ModelConfig, path: str = "model") -> int:
    """``shortconv.l_cache``: the convolution's kernel length (its state holds L-1 inputs)."""
    L = K.key(cfg, path, "shortconv.l_cache")
    if L < 2:
        raise ModelError(f"{path}: {cfg.arch}.shortconv.l_cache is {L}; it must be at least 2")
    return L


def check_config(cfg: ModelConfig, path: str) -> None:
    kv_heads(cfg, path)
    conv_length(cfg, path)
    if not K.key(cfg, path, "attention.causal", True, bool):
        raise ModelError(f"{path}: {cfg.arch}.attention.causal is false (a bidirectional LFM2 embedding model); "
                         f"AOTX runs causal language models only")
    if cfg.n_heads * cfg.head_dim != cfg.d_model:
        raise ModelError(f"{path}: {cfg.arch} needs head_count x head dimension ({cfg.n_heads} x {cfg.head_dim}) "
                         f"= embedding_length {cfg.d_model} (attn_output is square)")
    C.require_full_rope(cfg, path)
    if cfg.sliding_window is not None and cfg.sliding_window > 0:
        cfg.check_sliding_window(path)


def tensors(cfg: ModelConfig) -> list:
    d, per, L = cfg.d_model, kv_heads(cfg), conv_length(cfg)
    out = [C.mat("token_embd.weight", d, cfg.vocab_size), C.vec("token_embd_norm.weight", d),
           C.mat("output.weight", d, cfg.vocab_size, True)]
    for i, n_kv in enumerate(per):
        p = f"blk.{i}."
        out += [C.vec(p + "attn_norm.weight", d), C.vec(p + "ffn_norm.weight", d)]
        if n_kv == 0:
            out += [C.mat(p + "shortconv.in_proj.weight", d, 3 * d), Tensor(p + "shortconv.conv.weight", (L, d), "array"),
                    C.mat(p + "shortconv.out_proj.weight", d, d)]
        else:
            out += C.qkv_tensors(dataclasses.replace(cfg, n_kv_heads=n_kv), p)
            out += [C.vec(p + "attn_q_norm.weight", cfg.head_dim), C.vec(p + "attn_k_norm.weight", cfg.head_dim),
                    C.mat(p + "attn_output.weight", d, d)]
        out += C.ffn_tensors(cfg, p)
    return out


def build_shortconv(b: ProgramBuilder, cfg: ModelConfig, w: Weights, p: str, h: Value) -> Value:
    """The gated short-convolution block on the normed input h: (N, d_model)."""
    d = cfg.d_model
    bcx = b.linear(h, w[p + "shortconv.in_proj.weight"], name=p + "in_proj")
    bg, cg, u = b.split(bcx, (d, d, d), names=(p + "b", p + "c", p + "x"))
    conv = b.short_conv(b.mul(bg, u, name=p + "bx"), w[p + "shortconv.conv.weight"], act="none", name=p + "conv")
    return b.linear(b.mul(cg, conv, name=p + "y"), w[p + "shortconv.out_proj.weight"], name=p + "out_proj")


def build_attention(b: ProgramBuilder, cfg: ModelConfig, w: Weights, p: str, h: Value, n_kv: int, rope,
                    window: int) -> Value:
    """The attention block (QK-norm, NEOX RoPE, GQA) on the normed input h."""
    hd, eps = cfg.head_dim, cfg.norm_eps
    q, k, v = C.build_qkv(b, dataclasses.replace(cfg, n_kv_heads=n_kv), w, p, h)
    q = b.head_rms_norm(q, w[p + "attn_q_norm.weight"], eps, hd, name=p + "q_norm")
    k = b.head_rms_norm(k, w[p + "attn_k_norm.weight"], eps, hd, name=p + "k_norm")
    q, k = b.rope(q, rope, hd, name=p + "q_rope"), b.rope(k, rope, hd, name=p + "k_rope")
    a = b.attention(q, k, v, n_heads=cfg.n_heads, n_kv_heads=n_kv, head_dim=hd, scale=1.0 / math.sqrt(hd),
                    window=window, name=p + "attn")
    return b.linear(a, w[p + "attn_output.weight"], name=p + "attn_out")


def forward(b: ProgramBuilder, cfg: ModelConfig, w: Weights) -> Value:
    eps, per = cfg.norm_eps, kv_heads(cfg)
    rope = C.rope_spec(cfg, "neox", factors=False)
    window = cfg.sliding_window if cfg.sliding_window is not None and cfg.sliding_window > 0 else 0
    x = b.embed(w["token_embd.weight"])
    for i, n_kv in enumerate(per):
        p = f"blk.{i}."
        h = b.rms_norm(x, w[p + "attn_norm.weight"], eps, name=p + "operator_norm")
        a = build_shortconv(b, cfg, w, p, h) if n_kv == 0 else build_attention(b, cfg, w, p, h, n_kv, rope, window)
        x = b.add(x, a, name=p + "ffn_inp")
        if i == cfg.n_layers - 1:
            x = b.take_rows(x, name="out_rows")
        h = b.rms_norm(x, w[p + "ffn_norm.weight"], eps, name=p + "ffn_norm")
        x = b.add(x, C.build_ffn(b, w, p, h, "silu"), name=p + "l_out")
    x = b.rms_norm(x, w["token_embd_norm.weight"], eps, name="result_norm")
    out = w.get("output.weight")
    return b.linear(x, w["token_embd.weight"] if out is None else out, name="logits")
