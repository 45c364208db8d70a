"""Model hyperparameters from GGUF metadata, as one frozen dataclass.

Owns: reading ``<arch>.*`` keys (llama.cpp's names, see its ``llama-arch.cpp``
LLM_KV table) into ``ModelConfig`` and checking they are consistent. Leaves to
the architecture module what the numbers mean for the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aotx.engine.errors import ModelError


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a decoder-only transformer.

    Dimensions are element counts; ``rope_base`` is RoPE's theta; ``norm_eps`` the
    RMSNorm epsilon; ``n_ctx_train`` the context length the model was trained for
    (tokens). ``rope_scaling`` is "none" | "linear" | "yarn" with ``rope_scale``
    the factor (positions are divided by it for "linear").
    """

    arch: str
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    n_ctx_train: int
    rope_base: float
    rope_dim: int
    rope_scaling: str
    rope_scale: float
    norm_eps: float

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], path: str = "model") -> "ModelConfig":
        """Build from GGUF metadata. Raises ModelError naming a missing or bad key."""
        arch = str(meta.get("general.architecture", ""))
        if not arch:
            raise ModelError(f"{path}: metadata has no general.architecture")
        def get(key: str, default: Any = None, kind: type = int) -> Any:
            full = f"{arch}.{key}"
            v = meta.get(full, default)
            if v is None:
                raise ModelError(f"{path}: metadata key {full!r} is missing")
            if isinstance(v, list):
                raise ModelError(f"{path}: metadata key {full!r} is an array; per-layer values are not supported")
            try:
                return kind(v)
            except (TypeError, ValueError):
                raise ModelError(f"{path}: metadata key {full!r} has a bad value {v!r}") from None

        d_model = get("embedding_length")
        n_heads = get("attention.head_count")
        n_kv = get("attention.head_count_kv", n_heads)
        n_layers = get("block_count")
        ffn = get("feed_forward_length")
        for key, val in (("embedding_length", d_model), ("attention.head_count", n_heads),
                         ("attention.head_count_kv", n_kv), ("block_count", n_layers), ("feed_forward_length", ffn)):
            if val <= 0:
                raise ModelError(f"{path}: {arch}.{key} is {val}; it must be positive")
        if d_model % n_heads:
            raise ModelError(f"{path}: embedding_length {d_model} is not a multiple of head_count {n_heads}")
        if n_heads % n_kv:
            raise ModelError(f"{path}: head_count {n_heads} is not a multiple of head_count_kv {n_kv}")
        head_dim = get("attention.key_length", d_model // n_heads)
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            toks = meta.get("tokenizer.ggml.tokens")
            vocab = len(toks) if isinstance(toks, list) else 0
        rope_dim = get("rope.dimension_count", head_dim)
        if head_dim <= 0:
            raise ModelError(f"{path}: {arch}.attention.key_length is {head_dim}; it must be positive")
        if rope_dim <= 0 or rope_dim > head_dim or rope_dim % 2:
            raise ModelError(f"{path}: {arch}.rope.dimension_count is {rope_dim}; it must be even and in "
                             f"2..{head_dim} (the head dimension)")
        n_ctx = get("context_length", 2048)
        if n_ctx <= 0:
            raise ModelError(f"{path}: {arch}.context_length is {n_ctx}; it must be positive")
        rope_base = get("rope.freq_base", 10000.0, float)
        norm_eps = get("attention.layer_norm_rms_epsilon", 1e-5, float)
        if not rope_base > 0 or not norm_eps >= 0:
            raise ModelError(f"{path}: {arch}.rope.freq_base {rope_base} must be positive and "
                             f"{arch}.attention.layer_norm_rms_epsilon {norm_eps} must not be negative")
        scaling = str(meta.get(f"{arch}.rope.scaling.type", "none"))
        try:
            scale = float(meta.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
        except (TypeError, ValueError):
            raise ModelError(f"{path}: metadata key '{arch}.rope.scaling.factor' has a bad value") from None
        if scaling == "linear" and not scale > 0:
            raise ModelError(f"{path}: {arch}.rope.scaling.factor is {scale}; it must be positive")
        if scaling not in ("none", "linear"):
            raise ModelError(f"{path}: RoPE scaling {scaling!r} is not supported (AOTX supports none and linear)")
        return cls(
            arch=arch,
            name=str(meta.get("general.name", "")),
            n_layers=n_layers,
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            ffn_dim=ffn,
            vocab_size=int(vocab),
            n_ctx_train=n_ctx,
            rope_base=rope_base,
            rope_dim=rope_dim,
            rope_scaling=scaling,
            rope_scale=scale if scaling == "linear" else 1.0,
            norm_eps=norm_eps,
        )
