"""Blocks several architectures share, as llama.cpp's llm_graph_context helpers are shared.

Owns: the tensor declarations and op sequences of the attention input projections
(``qkv_tensors`` / ``build_qkv``: fused ``attn_qkv`` or separate ``attn_q/k/v``, each with
optional biases: llama.cpp's create_tensor_qkv / build_qkv), the gated FFN
(``ffn_tensors`` / ``build_ffn``: build_ffn with LLM_FFN_PAR), the output head, the
RoPE spec a config implies, and a check every llama.cpp graph asserts (rope dim equals
head dim). Leaves the order of a block to each architecture module.
"""

from __future__ import annotations

from aotx.engine.backend.ops import ProgramBuilder, ProgramError, RopeSpec, Value
from aotx.engine.errors import ModelError
from aotx.engine.model.config import YARN_BETA_FAST, YARN_BETA_SLOW, ModelConfig
from aotx.engine.model.transformer import OneOf, Tensor, Weights


def vec(name: str, n: int, optional: bool = False) -> Tensor:
    return Tensor(name, (n,), "vector", optional)


def mat(name: str, k: int, m: int, optional: bool = False) -> Tensor:
    """An (m, k) matrix: ggml shape [k, m] (k inputs, m outputs)."""
    return Tensor(name, (k, m), "matrix", optional)


def embedding_tensors(cfg: ModelConfig, output_bias: bool = False) -> list:
    """token_embd, output_norm, the optional untied output head (and its bias)."""
    d, vocab = cfg.d_model, cfg.vocab_size
    out = [mat("token_embd.weight", d, vocab), vec("output_norm.weight", d), mat("output.weight", d, vocab, True)]
    if output_bias:
        out.append(vec("output.bias", vocab, True))
    return out


def qkv_tensors(cfg: ModelConfig, p: str, q_out: int | None = None) -> list:
    """Fused ``attn_qkv`` (with an optional fused bias) or ``attn_q/k/v`` (with optional
    biases). q_out defaults to n_heads * head_dim."""
    d = cfg.d_model
    q = cfg.n_heads * cfg.head_dim if q_out is None else q_out
    kv = cfg.n_kv_heads * cfg.head_dim
    biases = (vec(p + "attn_q.bias", q, True), vec(p + "attn_k.bias", kv, True), vec(p + "attn_v.bias", kv, True))
    fused = (mat(p + "attn_qkv.weight", d, q + 2 * kv), vec(p + "attn_qkv.bias", q + 2 * kv, True)) + biases
    split = (mat(p + "attn_q.weight", d, q), mat(p + "attn_k.weight", d, kv), mat(p + "attn_v.weight", d, kv)) + biases
    return [OneOf((fused, split))]


def build_qkv(b: ProgramBuilder, cfg: ModelConfig, w: Weights, p: str, h: Value,
              q_out: int | None = None) -> tuple[Value, Value, Value]:
    """q (N, q_out; default H*hd), k and v (N, KV*hd) from the normed input h."""
    q_out = cfg.n_heads * cfg.head_dim if q_out is None else q_out
    kv = cfg.n_kv_heads * cfg.head_dim
    fused = w.get(p + "attn_qkv.weight")
    if fused is not None:
        if any(p + f"attn_{x}.bias" in w for x in "qkv"):
            # llama.cpp concatenates such legacy biases; refused rather than dropped here
            raise ProgramError(f"tensor {p}attn_qkv.weight comes with separate attn_q/k/v biases, "
                               f"which AOTX does not combine")
        qkv = b.linear(h, fused, w.get(p + "attn_qkv.bias"), name=p + "qkv")
        q, k, v = b.split(qkv, (q_out, kv, kv), names=(p + "q", p + "k", p + "v"))
        return q, k, v
    q = b.linear(h, w[p + "attn_q.weight"], w.get(p + "attn_q.bias"), name=p + "q")
    k = b.linear(h, w[p + "attn_k.weight"], w.get(p + "attn_k.bias"), name=p + "k")
    v = b.linear(h, w[p + "attn_v.weight"], w.get(p + "attn_v.bias"), name=p + "v")
    return q, k, v


def ffn_tensors(cfg: ModelConfig, p: str, biases: bool = False) -> list:
    """ffn_gate, ffn_up (d -> ff) and ffn_down (ff -> d), with optional biases."""
    d, f = cfg.d_model, cfg.ffn_dim
    out = [mat(p + "ffn_gate.weight", d, f), mat(p + "ffn_up.weight", d, f), mat(p + "ffn_down.weight", f, d)]
    if biases:
        out += [vec(p + "ffn_gate.bias", f, True), vec(p + "ffn_up.bias", f, True), vec(p + "ffn_down.bias", d, True)]
    return out


def build_ffn(b: ProgramBuilder, w: Weights, p: str, h: Value, act: str) -> Value:
    """down(act(gate(h)) * up(h)) (llama.cpp build_ffn, LLM_FFN_PAR)."""
    g = b.linear(h, w[p + "ffn_gate.weight"], w.get(p + "ffn_gate.bias"), name=p + "gate")
    u = b.linear(h, w[p + "ffn_up.weight"], w.get(p + "ffn_up.bias"), name=p + "up")
    return b.linear(b.glu(g, u, act, name=p + "glu"), w[p + "ffn_down.weight"], w.get(p + "ffn_down.bias"),
                    name=p + "ffn_out")


def rope_factor_tensors(cfg: ModelConfig, longrope: bool) -> list:
    """RoPE frequency factors, (rope_dim/2,) float kept on the host (they only shape the
    RoPE tables), all optional: Phi-3's long-rope ``rope_factors_long/short`` when
    ``longrope``, else Llama 3's ``rope_freqs`` (llama.cpp's llama loads the former only
    for rope.scaling.type "longrope")."""
    half = cfg.rope_dim // 2
    if longrope:
        return [Tensor("rope_factors_long.weight", (half,), "host", True),
                Tensor("rope_factors_short.weight", (half,), "host", True)]
    return [Tensor("rope_freqs.weight", (half,), "host", True)]


def rope_spec(cfg: ModelConfig, mode: str, w: Weights | None = None, base: float | None = None,
              factors: bool = True) -> RopeSpec:
    """The RoPE of ``cfg`` in ``mode`` ("normal" | "neox"), with ``base`` (default
    rope.freq_base). ``factors``: apply the file's frequency factors (llama.cpp
    get_rope_factors: rope_freqs when present; else the long factors for a context past
    rope.scaling.original_context_length and the short ones below it)."""
    ff = long = None
    if factors and w is not None:
        freqs = w.get("rope_freqs.weight")
        if freqs is not None:
            ff = tuple(float(x) for x in freqs)
        else:
            short, lng = w.get("rope_factors_short.weight"), w.get("rope_factors_long.weight")
            ff = tuple(float(x) for x in short) if short is not None else None
            long = tuple(float(x) for x in lng) if lng is not None else None
            if long is not None and ff is None:
                ff = (1.0,) * (cfg.rope_dim // 2)
    yarn = {}
    if cfg.yarn_ext_factor:  # llama.cpp applies YaRN to every rope of the graph (cparams)
        yarn = dict(ext_factor=cfg.yarn_ext_factor, beta_fast=YARN_BETA_FAST, beta_slow=YARN_BETA_SLOW,
                    yarn_ctx=cfg.n_ctx_orig)
    return RopeSpec(mode=mode, dim=cfg.rope_dim, base=cfg.rope_base if base is None else float(base),
                    freq_scale=1.0 / cfg.rope_scale, attn_factor=cfg.rope_attn_factor, freq_factors=ff,
                    long_factors=long, long_ctx=cfg.n_ctx_orig if long is not None else 0, **yarn)


def output_head(b: ProgramBuilder, cfg: ModelConfig, w: Weights, x: Value) -> Value:
    """rms_norm(output_norm), then the output matrix (tied to token_embd when the file has
    no ``output.weight``) with its optional bias, then Gemma's soft-capping when set."""
    x = b.rms_norm(x, w["output_norm.weight"], cfg.norm_eps, name="result_norm")
    out = w.get("output.weight")
    logits = b.linear(x, w["token_embd.weight"] if out is None else out, w.get("output.bias"), name="logits")
    if cfg.final_logit_softcap > 0:
        logits = b.softcap(logits, cfg.final_logit_softcap, name="logits")
    return logits


def require_full_rope(cfg: ModelConfig, path: str) -> None:
    """llama.cpp's llama/qwen2/qwen3 graphs assert rope dim == head dim (n_rot == n_embd_head)."""
    if cfg.rope_dim != cfg.head_dim:
        raise ModelError(f"{path}: {cfg.arch}.rope.dimension_count {cfg.rope_dim} differs from the head "
                         f"dimension {cfg.head_dim}; {cfg.arch} rotates whole heads")
