"""A tiny ``qwen35moe`` GGUF (Qwen3.5 / 3.6 mixture of experts): the layers of the tiny
``qwen35`` file (``qwen35.py``: a gated DeltaNet layer, a gated full-attention layer, one
nextn block) with 8 routed experts, 2 per token, renormalised, and a shared
expert gated by sigmoid(``ffn_gate_inp_shexp`` h) in place of the dense FFN.

Metadata: qwen35's keys plus expert_count, expert_used_count, expert_feed_forward_length
(64) and expert_shared_feed_forward_length (128), as Qwen2MoeModel's converter writes
them. The router and the shared expert's gate are F32 (the converter keeps them so); the
routers' logits have std ~4 (``qwen3moe.ROUTER_STD``) so that routing near-ties are rare.
The nextn block's FFN is a mixture of experts too. Deterministic for any seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType as T

from . import qwen35 as Q
from .common import Tokenizer, TinyWriter, std_vocab
from .experts import experts
from .qwen3moe import ROUTER_STD

TYPES = {"ffn_gate_inp": T.F32, "ffn_gate_inp_shexp": T.F32, "ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q5_0,
         "ffn_down_exps": T.Q8_0, "ffn_gate_shexp": T.Q8_0, "ffn_up_shexp": T.Q8_0, "ffn_down_shexp": T.Q5_0}


def moe_block(tw: TinyWriter, p: str, d_model: int, n_expert: int, expert_ffn: int, shared_ffn: int) -> None:
    tw.matrix(p + "ffn_gate_inp.weight", n_expert, d_model, TYPES["ffn_gate_inp"], std=ROUTER_STD / d_model ** 0.5)
    experts(tw, p + "ffn_gate_exps.weight", n_expert, expert_ffn, d_model, TYPES["ffn_gate_exps"])
    experts(tw, p + "ffn_up_exps.weight", n_expert, expert_ffn, d_model, TYPES["ffn_up_exps"])
    experts(tw, p + "ffn_down_exps.weight", n_expert, d_model, expert_ffn, TYPES["ffn_down_exps"])
    tw.matrix(p + "ffn_gate_inp_shexp.weight", 1, d_model, TYPES["ffn_gate_inp_shexp"])
    tw.matrix(p + "ffn_gate_shexp.weight", shared_ffn, d_model, TYPES["ffn_gate_shexp"])
    tw.matrix(p + "ffn_up_shexp.weight", shared_ffn, d_model, TYPES["ffn_up_shexp"])
    tw.matrix(p + "ffn_down_shexp.weight", d_model, shared_ffn, TYPES["ffn_down_shexp"])


def write(path: str | Path, tokenizer: Tokenizer, *, seed: int = 36, n_layers: int = 2, nextn: int = 1,
          d_model: int = 64, n_heads: int = 4, n_kv_heads: int = 2, head_dim: int = 32, rope_dim: int = 16,
          sections: tuple[int, ...] = (3, 3, 2, 0), n_k: int = 2, n_v: int = 4, state: int = 16, conv: int = 4,
          interval: int = 2, ffn: int = 256, n_expert: int = 8, n_expert_used: int = 2, expert_ffn: int = 64,
          shared_ffn: int = 128, a_mean: float = -0.6, context_length: int = 262144, pre: str = "qwen35",
          tied: bool = False, arch: str = "qwen35moe", fused_ba: bool = False, **defects: Any) -> Path:
    """Write the tiny qwen35moe file to ``path`` (``arch`` "qwen3next" with ``fused_ba`` and no
    ``sections``: Qwen3-Next's layout); ``defects`` go to ``TinyWriter``."""
    tw = TinyWriter(path, arch, seed=seed, name=f"tiny-{arch}", **defects)
    Q.hparams(tw, n_layers=n_layers, nextn=nextn, d_model=d_model, ffn=ffn, n_heads=n_heads, n_kv_heads=n_kv_heads,
              head_dim=head_dim, rope_dim=rope_dim, sections=sections, n_k=n_k, n_v=n_v, state=state, conv=conv,
              interval=interval, context_length=context_length)
    tw.w.add_expert_count(n_expert)
    tw.w.add_expert_used_count(n_expert_used)
    tw.w.add_expert_feed_forward_length(expert_ffn)
    tw.w.add_expert_shared_feed_forward_length(shared_ffn)
    tw.tokenizer(tokenizer.replace({"tokenizer.ggml.pre": pre}))
    tw.matrix("token_embd.weight", tokenizer.n_vocab, d_model, Q.TYPES["token_embd"], std=std_vocab(d_model))
    for i in range(n_layers + nextn):
        p = f"blk.{i}."
        tw.vector(p + "attn_norm.weight", d_model)
        tw.vector(p + "post_attention_norm.weight", d_model)
        if i < n_layers and (i + 1) % interval != 0:
            Q.linear_block(tw, p, d_model=d_model, n_k=n_k, n_v=n_v, state=state, conv=conv, a_mean=a_mean,
                           fused_ba=fused_ba)
        else:
            Q.attention_block(tw, p, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim)
        moe_block(tw, p, d_model, n_expert, expert_ffn, shared_ffn)
        if i >= n_layers:
            Q.nextn_block(tw, p, d_model)
    tw.vector("output_norm.weight", d_model, mean=3.0, std=0.3)
    if not tied:
        tw.matrix("output.weight", tokenizer.n_vocab, d_model, Q.TYPES["output"], std=std_vocab(d_model))
    return tw.write()
