"""A tiny ``qwen35`` GGUF (Qwen3.5 / 3.6 dense): gated DeltaNet layers with a carried
convolution and recurrent state, gated full-attention layers, and one nextn (MTP) block.

Shape: 2 layers, a gated DeltaNet layer then a full-attention one (``attention.recurrent_layers``
[T, F, F] with the nextn block, and ``full_attention_interval`` 2, as the converter writes
both; Qwen3.5's own files have 3 of 4 layers linear: the module reads the pattern from the
file), d_model 64, FFN 256. Two layers keep the file as sensitive to activation rounding as
the other tiny files (two correct engines, llama.cpp and a float64 reference, differ by a
mean 0.07 on the logits; with 4 layers, 0.14). Linear attention: 2 key heads and 4 value heads of 16
(``ssm.group_count`` 2, ``ssm.time_step_rank`` 4, ``ssm.state_size`` 16,
``ssm.inner_size`` 64), convolution kernel 4 over 2*32 + 64 = 128 channels. Full
attention: 4 query heads of 32 (the query projection doubled: query and gate per head),
2 KV heads, QK-norm, interleaved M-RoPE over 16 of the 32 dimensions with sections
[3, 3, 2, 0] (``rope.dimension_sections``), base 1e7.

The state is made load-bearing: ``ssm_a`` (stored as -exp(A_log) by the converter) around
-0.6 and ``ssm_dt.bias`` around -1 give a per-token decay exp(a softplus(alpha + dt))
near 0.8, so a position's recurrent state remembers several tokens back.

The nextn block (``blk.4``) is a full-attention block plus ``nextn.eh_proj`` (2*d -> d),
``nextn.enorm``, ``nextn.hnorm`` and ``nextn.shared_head_norm``; it shares token_embd and
the output head (no ``nextn.embed_tokens`` / ``shared_head_head``), as Qwen3.5's files do.
llama.cpp skips it unless it loads the MTP head.

Pre-tokenizer ``qwen35``. Deterministic: ``write(path, tokenizer, seed=...)`` gives the
same bytes for the same arguments; any seed gives a file llama.cpp loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType as T

from .common import Tokenizer, TinyWriter, std_vocab

TYPES = {"token_embd": T.Q8_0, "output": T.Q8_0, "attn_q": T.F16, "attn_k": T.F16, "attn_v": T.Q8_0,
         "attn_output": T.BF16, "attn_qkv": T.Q8_0, "attn_gate": T.Q5_0, "ssm_alpha": T.F32, "ssm_beta": T.F32,
         "ssm_out": T.Q4_0, "ffn_gate": T.Q5_0, "ffn_up": T.Q5_0, "ffn_down": T.Q4_K, "nextn.eh_proj": T.Q8_0}


def attention_block(tw: TinyWriter, p: str, *, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    """A gated full-attention layer's tensors (also the nextn block's)."""
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    tw.matrix(p + "attn_q.weight", 2 * q, d_model, TYPES["attn_q"])
    tw.matrix(p + "attn_k.weight", kv, d_model, TYPES["attn_k"])
    tw.matrix(p + "attn_v.weight", kv, d_model, TYPES["attn_v"])
    tw.vector(p + "attn_q_norm.weight", head_dim, std=0.3)
    tw.vector(p + "attn_k_norm.weight", head_dim, std=0.3)
    tw.matrix(p + "attn_output.weight", d_model, q, TYPES["attn_output"])


def linear_block(tw: TinyWriter, p: str, *, d_model: int, n_k: int, n_v: int, state: int, conv: int,
                 a_mean: float, fused_ba: bool = False) -> None:
    """A gated DeltaNet layer's tensors (``fused_ba``: Qwen3-Next's one ``ssm_ba`` matrix)."""
    key, value = n_k * state, n_v * state
    tw.matrix(p + "attn_qkv.weight", 2 * key + value, d_model, TYPES["attn_qkv"])
    tw.matrix(p + "attn_gate.weight", value, d_model, TYPES["attn_gate"])
    if fused_ba:
        tw.matrix(p + "ssm_ba.weight", 2 * n_v, d_model, TYPES["ssm_beta"])
    else:
        tw.matrix(p + "ssm_beta.weight", n_v, d_model, TYPES["ssm_beta"])
        tw.matrix(p + "ssm_alpha.weight", n_v, d_model, TYPES["ssm_alpha"])
    tw.matrix(p + "ssm_conv1d.weight", 2 * key + value, conv, T.F32, std=0.5)
    tw.vector(p + "ssm_dt.bias", n_v, mean=-1.0, std=0.5)
    tw.vector(p + "ssm_a", n_v, mean=a_mean, std=0.15)
    tw.vector(p + "ssm_norm.weight", state)
    tw.matrix(p + "ssm_out.weight", d_model, value, TYPES["ssm_out"])


def ffn_block(tw: TinyWriter, p: str, d_model: int, ffn: int) -> None:
    tw.matrix(p + "ffn_gate.weight", ffn, d_model, TYPES["ffn_gate"])
    tw.matrix(p + "ffn_up.weight", ffn, d_model, TYPES["ffn_up"])
    tw.matrix(p + "ffn_down.weight", d_model, ffn, TYPES["ffn_down"])


def hparams(tw: TinyWriter, *, n_layers: int, nextn: int, d_model: int, ffn: int, n_heads: int, n_kv_heads: int,
            head_dim: int, rope_dim: int, sections: tuple[int, ...] | None, n_k: int, n_v: int, state: int, conv: int,
            interval: int, context_length: int) -> None:
    """The keys Qwen3NextModel / Qwen3_5TextModel's converter writes (qwen35moe adds its own)."""
    w = tw.w
    tw.decoder_hparams(n_layers=n_layers + nextn, context_length=context_length, d_model=d_model, ffn=ffn,
                       n_heads=n_heads, n_kv_heads=n_kv_heads, rope_base=10000000.0, norm_eps=1e-6)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_ssm_conv_kernel(conv)
    w.add_ssm_state_size(state)
    w.add_ssm_group_count(n_k)
    w.add_ssm_time_step_rank(n_v)
    w.add_ssm_inner_size(n_v * state)
    w.add_array(f"{tw.arch}.attention.recurrent_layers",
                [(i + 1) % interval != 0 for i in range(n_layers)] + [False] * nextn)
    w.add_full_attention_interval(interval)
    w.add_rope_dimension_count(rope_dim)
    if sections is not None:
        w.add_rope_dimension_sections(list(sections))
    if nextn:
        w.add_nextn_predict_layers(nextn)


def nextn_block(tw: TinyWriter, p: str, d_model: int) -> None:
    """The MTP block's own tensors (after its attention and FFN)."""
    tw.matrix(p + "nextn.eh_proj.weight", d_model, 2 * d_model, TYPES["nextn.eh_proj"])
    tw.vector(p + "nextn.enorm.weight", d_model)
    tw.vector(p + "nextn.hnorm.weight", d_model)
    tw.vector(p + "nextn.shared_head_norm.weight", d_model, mean=3.0, std=0.3)


def write(path: str | Path, tokenizer: Tokenizer, *, seed: int = 35, n_layers: int = 2, nextn: int = 1,
          d_model: int = 64, n_heads: int = 4, n_kv_heads: int = 2, head_dim: int = 32, rope_dim: int = 16,
          sections: tuple[int, ...] = (3, 3, 2, 0), n_k: int = 2, n_v: int = 4, state: int = 16, conv: int = 4,
          interval: int = 2, ffn: int = 256, a_mean: float = -0.6, context_length: int = 262144,
          pre: str = "qwen35", tied: bool = True, **defects: Any) -> Path:
    """Write the tiny qwen35 file to ``path``; ``defects`` go to ``TinyWriter``."""
    tw = TinyWriter(path, "qwen35", seed=seed, name="tiny-qwen35", **defects)
    hparams(tw, n_layers=n_layers, nextn=nextn, d_model=d_model, ffn=ffn, n_heads=n_heads, n_kv_heads=n_kv_heads,
            head_dim=head_dim, rope_dim=rope_dim, sections=sections, n_k=n_k, n_v=n_v, state=state, conv=conv,
            interval=interval, context_length=context_length)
    tw.tokenizer(tokenizer.replace({"tokenizer.ggml.pre": pre}))
    tw.matrix("token_embd.weight", tokenizer.n_vocab, d_model, TYPES["token_embd"], std=std_vocab(d_model))
    for i in range(n_layers + nextn):
        p = f"blk.{i}."
        tw.vector(p + "attn_norm.weight", d_model)
        tw.vector(p + "post_attention_norm.weight", d_model)
        if i < n_layers and (i + 1) % interval != 0:
            linear_block(tw, p, d_model=d_model, n_k=n_k, n_v=n_v, state=state, conv=conv, a_mean=a_mean)
        else:
            attention_block(tw, p, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim)
        ffn_block(tw, p, d_model, ffn)
        if i >= n_layers:
            nextn_block(tw, p, d_model)
    tw.vector("output_norm.weight", d_model, mean=3.0, std=0.3)
    if not tied:
        tw.matrix("output.weight", tokenizer.n_vocab, d_model, TYPES["output"], std=std_vocab(d_model))
    return tw.write()
