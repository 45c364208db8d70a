"""The qwen3next architecture (Qwen3-Next-80B-A3B): qwen35moe's stack (``qwen35.py``,
``qwen35moe.py``) in Qwen3-Next's layout.

Differences from Qwen3.5-MoE, all in the gated DeltaNet layers and the RoPE:
    beta | alpha = Wssm_ba h            per key head: r betas then r alphas (r = n_v / n_k)
    value head h reads key head h // r  (grouped; Qwen3.5's converter reorders to tiled h % n_k)
    RoPE: NEOX over rope.dimension_count dims (no M-RoPE sections)
The rest is qwen35moe's: gated full attention with QK-norm, the post-attention norm,
routed experts with a sigmoid-gated shared expert, an MTP head in the nextn block.

Checked against llama.cpp (as vendored by llama-cpp-python 0.3.36, 0c1e5709):
src/models/qwen3next.cpp (tensors: ssm_ba {n_embd, 2 n_v}, attn_qkv/attn_gate (the
legacy fused ``ssm_in`` is refused by name), the MoE block; graph: mixed_ba reshaped to
[2 r, n_k] and split, q/k repeated interleaved to the value heads, ggml_rope_ext),
llama_model_rope_type (QWEN3NEXT: NEOX), conversion/qwen.py Qwen3NextModel.
"""

from __future__ import annotations

from aotx.engine.model.architectures.qwen35moe import (  # noqa: F401  (the same module surface)
    KNOWN_TENSORS_ONLY, check_config, forward, ignored_tensor, mtp_forward, mtp_tensors, tensors,
)
