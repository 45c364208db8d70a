"""Model hyperparameters from GGUF metadata, as one frozen dataclass.

Owns: reading ``<arch>.*`` keys (llama.cpp's names and defaults: its ``llama-arch.cpp``
LLM_KV table and ``llama-model.cpp`` load_hparams, checked against llama.cpp as vendored
by llama-cpp-python 0.3.36) into ``ModelConfig`` and checking they are consistent. Leaves
to the architecture module what the numbers mean for the forward pass (which scale the
queries use, whether the sliding-window keys apply at all and which layers slide by
default: ``swa_layers`` and ``check_sliding_window`` are called by the architectures that
have such layers).

Every problem is one ModelError line naming the file and the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aotx.engine.errors import ModelError

# rope.scaling.type values llama.cpp knows (llama_rope_scaling_type_from_string), and the
# ones AOTX runs. "longrope" (Phi-3) works through the rope_factors_long/short tensors;
# Llama 3's "llama3" scaling arrives as the rope_freqs tensor with no scaling type.
ROPE_SCALING_KNOWN = ("none", "linear", "yarn", "longrope")
ROPE_SCALING_SUPPORTED = ("none", "linear", "yarn", "longrope")
# YaRN as llama.cpp runs it for every architecture: its context constants (llama-context.cpp)
# with the hparams defaults (llama-hparams.h; the rope.scaling.yarn_* keys are not read for
# the architectures here): ext_factor 1 when the scaling type is yarn, beta_fast 32, beta_slow 1
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0
# keys an architecture module reads per layer itself (``hparams.array``); the config keeps
# their largest value (Gemma 4: KV heads and FFN widths differ between layer kinds)
PER_LAYER_KEYS = {"gemma4": ("attention.head_count_kv", "feed_forward_length"),
                  "lfm2": ("attention.head_count_kv",)}      # 0 for its short-convolution layers


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a decoder-only transformer.

    Dimensions are element counts. ``head_dim`` is the key (and value) length per head;
    ``rope_base`` RoPE's theta; ``rope_dim`` the rotated dimensions of each head;
    ``rope_scaling`` "none" | "linear" | "longrope" with ``rope_scale`` the linear factor
    (positions are divided by it; 1.0 unless "linear"); ``rope_attn_factor`` llama.cpp's
    rope.scaling.attn_factor (Phi-3 long-rope); ``n_ctx_orig`` rope.scaling.
    original_context_length (default ``n_ctx_train``: Phi-3 picks its long factors for a
    context past it); ``norm_eps`` the RMSNorm epsilon; ``n_ctx_train`` the trained
    context (tokens). Sliding-window attention, as the file states it (read for every
    architecture; only those with sliding layers use it, through ``swa_layers``):
    ``sliding_window`` (attention.sliding_window, None when absent), ``swa_pattern``
    (attention.sliding_window_pattern: None, a period n, or one bool per layer) and
    ``rope_base_swa`` (rope.freq_base_swa, default 10000) the RoPE base of those layers.
    ``final_logit_softcap``: 0, or Gemma's cap on the logits. ``yarn_ext_factor``: 1.0
    for rope.scaling.type "yarn" (``rope_scale`` then holds its factor), else 0.
    ``rope_base_swa_set``: the file has rope.freq_base_swa (gpt-oss's sliding layers
    keep rope.freq_base without it; gemma3's take the 10000 default).

    Mixture of experts (0 for a dense model): ``n_expert`` (expert_count), ``n_expert_used``
    (expert_used_count: experts per token), ``expert_ffn_dim`` (expert_feed_forward_length,
    0 when absent: the architecture picks its default), ``shared_ffn_dim``
    (expert_shared_feed_forward_length, 0 when absent).

    ``nextn_layers``: nextn_predict_layers, the multi-token-prediction blocks the file
    appends after the main stack (block_count counts them; ``n_layers`` does not).
    ``meta``: the file's metadata, for the keys only one architecture reads
    (``architectures/hparams.py`` reads them, naming the key in every error).
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
    rope_attn_factor: float = 1.0
    n_ctx_orig: int = 0
    sliding_window: int | None = None
    swa_pattern: int | tuple[bool, ...] | None = None
    rope_base_swa: float = 10000.0
    final_logit_softcap: float = 0.0
    yarn_ext_factor: float = 0.0
    rope_base_swa_set: bool = False
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ffn_dim: int = 0
    shared_ffn_dim: int = 0
    nextn_layers: int = 0
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False, repr=False)

    def check_sliding_window(self, path: str) -> None:
        """Raise ModelError unless the file's sliding window can be used: present,
        positive, at most the trained context (called by architectures with sliding layers)."""
        key = f"{self.arch}.attention.sliding_window"
        if self.sliding_window is None or self.sliding_window <= 0:
            raise ModelError(f"{path}: {key} is {self.sliding_window}; it must be positive "
                             f"(a model without sliding-window layers has no such key)")
        if self.sliding_window > self.n_ctx_train:
            raise ModelError(f"{path}: {key} {self.sliding_window} is larger than the trained context "
                             f"{self.arch}.context_length {self.n_ctx_train}")
        if isinstance(self.swa_pattern, tuple) and len(self.swa_pattern) != self.n_layers:
            raise ModelError(f"{path}: {self.arch}.attention.sliding_window_pattern has {len(self.swa_pattern)} "
                             f"entries for {self.n_layers} layers")
        if isinstance(self.swa_pattern, int) and self.swa_pattern < 0:
            raise ModelError(f"{path}: {self.arch}.attention.sliding_window_pattern is {self.swa_pattern}; "
                             f"it must not be negative")

    def swa_layers(self, default_pattern: int) -> tuple[bool, ...]:
        """One bool per layer, True where the layer attends to the last ``sliding_window``
        positions only: the file's per-layer pattern, or its period n (default
        ``default_pattern``): layer il slides when il % n < n - 1, every layer when n is 0
        (llama.cpp's set_swa_pattern)."""
        if isinstance(self.swa_pattern, tuple):
            return self.swa_pattern
        n = default_pattern if self.swa_pattern is None else self.swa_pattern
        return tuple(n == 0 or (il % n) < n - 1 for il in range(self.n_layers))

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], path: str = "model") -> "ModelConfig":
        """Build from GGUF metadata. Raises ModelError naming a missing or bad key."""
        arch = str(meta.get("general.architecture", ""))
        if not arch:
            raise ModelError(f"{path}: metadata has no general.architecture")

        def raw(key: str) -> Any:
            return meta.get(f"{arch}.{key}")

        def get(key: str, default: Any = None, kind: type = int) -> Any:
            full = f"{arch}.{key}"
            v = meta.get(full, default)
            if v is None:
                raise ModelError(f"{path}: metadata key {full!r} is missing")
            if isinstance(v, list) and v and key in PER_LAYER_KEYS.get(arch, ()):
                v = max(v)
            if isinstance(v, list):
                # llama.cpp's get_key_or_arr: one value per layer; AOTX needs them all equal
                if not v or any(x != v[0] for x in v):
                    raise ModelError(f"{path}: metadata key {full!r} has different values per layer "
                                     f"({v[:8]}{'...' if len(v) > 8 else ''}); AOTX needs one value for every layer")
                v = v[0]
            if isinstance(v, bool) or isinstance(v, str):
                raise ModelError(f"{path}: metadata key {full!r} has a bad value {v!r}")
            try:
                return kind(v)
            except (TypeError, ValueError):
                raise ModelError(f"{path}: metadata key {full!r} has a bad value {v!r}") from None

        def positive(key: str, val: float) -> None:
            if not val > 0:
                raise ModelError(f"{path}: {arch}.{key} is {val}; it must be positive")

        d_model = get("embedding_length")
        n_layers = get("block_count")
        n_heads = get("attention.head_count")
        n_kv = get("attention.head_count_kv", n_heads)
        # a mixture of experts may leave out the dense width (llama.cpp reads it optionally)
        ffn = get("feed_forward_length", 0 if raw("expert_count") else None)
        for key, val in (("embedding_length", d_model), ("attention.head_count", n_heads),
                         ("attention.head_count_kv", n_kv), ("block_count", n_layers), ("feed_forward_length", ffn)):
            if not (key == "feed_forward_length" and ffn == 0 and raw("expert_count")):
                positive(key, val)
        nextn = get("nextn_predict_layers", 0)
        if not 0 <= nextn < n_layers:
            raise ModelError(f"{path}: {arch}.nextn_predict_layers is {nextn}; it must be in 0..{arch}.block_count - 1 "
                             f"({n_layers - 1})")
        if n_heads % n_kv:
            raise ModelError(f"{path}: {arch}.attention.head_count is {n_heads}, not a multiple of "
                             f"head_count_kv {n_kv} ({arch}.attention.head_count_kv)")
        if raw("attention.key_length") is None and d_model % n_heads:
            raise ModelError(f"{path}: {arch}.embedding_length {d_model} is not a multiple of "
                             f"{arch}.attention.head_count {n_heads} (and there is no attention.key_length)")
        head_dim = get("attention.key_length", d_model // n_heads)
        positive("attention.key_length", head_dim)
        head_dim_v = get("attention.value_length", head_dim)
        if head_dim_v != head_dim:
            raise ModelError(f"{path}: {arch}.attention.value_length {head_dim_v} differs from "
                             f"{arch}.attention.key_length {head_dim}; AOTX needs them equal")
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            toks = meta.get("tokenizer.ggml.tokens")
            vocab = len(toks) if isinstance(toks, list) else 0
        rope_dim = get("rope.dimension_count", head_dim)
        if rope_dim <= 0 or rope_dim > head_dim or rope_dim % 2:
            raise ModelError(f"{path}: {arch}.rope.dimension_count is {rope_dim}; it must be even and in "
                             f"2..{head_dim} (the head dimension)")
        n_ctx = get("context_length", 2048)
        positive("context_length", n_ctx)
        rope_base = get("rope.freq_base", 10000.0, float)
        positive("rope.freq_base", rope_base)
        norm_eps = get("attention.layer_norm_rms_epsilon", 1e-5, float)
        if not norm_eps >= 0:
            raise ModelError(f"{path}: {arch}.attention.layer_norm_rms_epsilon is {norm_eps}; it must not be negative")

        scaling = raw("rope.scaling.type")
        scaling = "none" if scaling is None else str(scaling)
        if scaling not in ROPE_SCALING_KNOWN:
            raise ModelError(f"{path}: {arch}.rope.scaling.type is {scaling!r}, an unknown RoPE scaling type "
                             f"(known: {', '.join(ROPE_SCALING_KNOWN)})")
        if scaling not in ROPE_SCALING_SUPPORTED:
            raise ModelError(f"{path}: {arch}.rope.scaling.type {scaling!r} is not supported "
                             f"(AOTX supports {', '.join(ROPE_SCALING_SUPPORTED)})")
        factor_key = "rope.scaling.factor" if raw("rope.scaling.factor") is not None else "rope.scale_linear"
        factor = get(factor_key, 0.0, float)
        if factor < 0:
            raise ModelError(f"{path}: {arch}.{factor_key} is {factor}; it must be positive")
        # llama.cpp: a factor of 0 (or none) means 1; scaling "none" never scales
        scale = factor if scaling in ("linear", "yarn") and factor > 0 else 1.0
        attn_factor = get("rope.scaling.attn_factor", 1.0, float)
        positive("rope.scaling.attn_factor", attn_factor)
        n_ctx_orig = get("rope.scaling.original_context_length", n_ctx)
        positive("rope.scaling.original_context_length", n_ctx_orig)

        # sliding-window attention as the file states it; the architecture decides whether
        # it applies (llama.cpp reads these keys for gemma3, and ignores them for phi3)
        window = None if raw("attention.sliding_window") is None else get("attention.sliding_window")
        pat = raw("attention.sliding_window_pattern")
        if isinstance(pat, list):
            pattern: int | tuple[bool, ...] | None = tuple(bool(x) for x in pat)
        else:
            pattern = None if pat is None else get("attention.sliding_window_pattern")
        base_swa = get("rope.freq_base_swa", 10000.0, float)
        positive("rope.freq_base_swa", base_swa)
        softcap = get("final_logit_softcapping", 0.0, float)
        if softcap < 0:
            raise ModelError(f"{path}: {arch}.final_logit_softcapping is {softcap}; it must not be negative")
        # experts (llama.cpp load_hparams: expert_count, expert_used_count <= expert_count)
        n_expert = get("expert_count", 0)
        n_used = get("expert_used_count", 0)
        if n_expert < 0 or n_used < 0 or n_used > n_expert or (n_expert > 0) != (n_used > 0):
            raise ModelError(f"{path}: {arch}.expert_used_count {n_used} does not fit {arch}.expert_count {n_expert} "
                             f"(a model with experts uses 1 to expert_count of them per token)")
        expert_ff = get("expert_feed_forward_length", 0)
        shared_ff = get("expert_shared_feed_forward_length", 0)
        if expert_ff < 0 or shared_ff < 0:
            raise ModelError(f"{path}: {arch}.expert_feed_forward_length {expert_ff} / "
                             f"expert_shared_feed_forward_length {shared_ff} must not be negative")
        return cls(
            arch=arch,
            name=str(meta.get("general.name", "")),
            n_layers=n_layers - nextn,
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
            rope_scale=scale,
            norm_eps=norm_eps,
            rope_attn_factor=attn_factor,
            n_ctx_orig=n_ctx_orig,
            sliding_window=window,
            swa_pattern=pattern,
            rope_base_swa=base_swa,
            final_logit_softcap=softcap,
            yarn_ext_factor=1.0 if scaling == "yarn" else 0.0,
            rope_base_swa_set=raw("rope.freq_base_swa") is not None,
            n_expert=n_expert,
            n_expert_used=n_used,
            expert_ffn_dim=expert_ff,
            shared_ffn_dim=shared_ff,
            nextn_layers=nextn,
            meta=meta,
        )
