"""RoPE configurations and the tables every backend rotates by.

Owns: ``RopeSpec`` (one RoPE configuration: mode, rotated dimensions, base, linear and
YaRN scaling, frequency factors) and its float64 angle formula, rounded once into the
(n_ctx, dim/2) cos and sin tables both backends read. Leaves which layers use which spec
to the architecture modules and the rotation kernels to the backends.
``ops.RopeSpec`` is this class (ops.py re-exports it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

@dataclass(frozen=True)
class RopeSpec:
    """One RoPE configuration (llama.cpp's ggml_rope_ext arguments without YaRN).

    mode: "normal" rotates adjacent pairs (x[2j], x[2j+1]) (GGML_ROPE_TYPE_NORM: llama);
          "neox" rotates (x[j], x[j + dim/2]) (GGML_ROPE_TYPE_NEOX: qwen2, qwen3, gemma3, phi3).
    dim:  rotated dimensions of each head (even, <= head_dim); the rest pass through.
    base: theta base; pair j turns by angle  pos * freq_scale * base**(-2j/dim) / ff[j].
    freq_scale: 1 / the linear scaling factor (1.0 when unscaled).
    attn_factor: cos and sin are multiplied by it (ggml's mscale; Phi-3 long-rope's
          attention factor; 1.0 elsewhere). Rotating q and k both scales q.k by its square.
    freq_factors: (dim/2,) ff[j] (Llama 3's rope_freqs, Phi-3's short factors), or None (1).
    long_factors, long_ctx: Phi-3's long factors: a KV cache with n_ctx > long_ctx uses
          long_factors instead of freq_factors (llama.cpp get_rope_factors: n_ctx_seq >
          n_ctx_orig_yarn). None / 0 when absent.
    ext_factor, beta_fast, beta_slow, yarn_ctx: YaRN (Peng et al. 2023, as ggml's
          rope_yarn; gpt-oss): with ext_factor != 0 pair j turns by a mix of the scaled
          and the unscaled angle, theta = theta_s (1 - r_j) + theta_u r_j with
          r_j = ext_factor * (1 - clamp((j - lo) / max(0.001, hi - lo), 0, 1)), where
          lo = max(0, floor(c(beta_fast))), hi = min(dim - 1, ceil(c(beta_slow))),
          c(b) = dim * ln(yarn_ctx / (2 pi b)) / (2 ln base) (ggml_rope_yarn_corr_dims),
          and cos, sin are further multiplied by 1 + 0.1 ln(1 / freq_scale). ext_factor
          0 (the default) is plain RoPE.
    Hashable: backends share one table per distinct spec and cache size."""

    mode: str
    dim: int
    base: float
    freq_scale: float = 1.0
    attn_factor: float = 1.0
    freq_factors: tuple[float, ...] | None = None
    long_factors: tuple[float, ...] | None = None
    long_ctx: int = 0
    ext_factor: float = 0.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    yarn_ctx: int = 0

    def factors_for(self, n_ctx: int) -> tuple[float, ...] | None:
        """The frequency factors a KV cache of ``n_ctx`` positions uses."""
        if self.long_factors is not None and n_ctx > self.long_ctx:
            return self.long_factors
        return self.freq_factors

    def tables(self, n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin for positions 0..n_ctx-1: two (n_ctx, dim/2) float32 arrays,
        ``attn_factor * cos(angle)`` and ``attn_factor * sin(angle)`` with the angle of
        the class docstring (YaRN's mix and magnitude factor when ext_factor != 0), computed
        in float64 and rounded once (ggml computes theta in float32 by repeated
        multiplication; the two agree to ~1e-6 relative)."""
        ang, mscale = self.angles(np.arange(n_ctx, dtype=np.float64), n_ctx)
        return ((np.cos(ang) * mscale).astype(np.float32), (np.sin(ang) * mscale).astype(np.float32))

    def angles(self, positions: np.ndarray, n_ctx: int) -> tuple[np.ndarray, float]:
        """float64 (len(positions), dim/2) rotation angles, and the factor cos and sin are
        multiplied by (attn_factor, times YaRN's magnitude correction when ext_factor != 0),
        for a KV cache of ``n_ctx`` positions (the class docstring's formulas)."""
        half = self.dim // 2
        j = np.arange(half, dtype=np.float64)
        inv = self.base ** (-2.0 * j / self.dim)
        ff = self.factors_for(n_ctx)
        if ff is not None:
            inv = inv / np.asarray(ff, np.float64)
        extrap = np.asarray(positions, np.float64)[:, None] * inv[None, :]
        ang = extrap * self.freq_scale
        mscale = self.attn_factor
        if self.ext_factor != 0.0:
            lo, hi = self.yarn_corr_dims()
            mix = (1.0 - np.clip((j - lo) / max(0.001, hi - lo), 0.0, 1.0)) * self.ext_factor
            ang = ang * (1.0 - mix)[None, :] + extrap * mix[None, :]
            mscale *= 1.0 + 0.1 * math.log(1.0 / self.freq_scale)
        return ang, mscale

    def yarn_corr_dims(self) -> tuple[float, float]:
        """YaRN's correction range (ggml_rope_yarn_corr_dims): pairs below ``lo`` keep the
        unscaled angle, pairs above ``hi`` the scaled one."""
        def corr(b: float) -> float:
            return self.dim * math.log(self.yarn_ctx / (b * 2.0 * math.pi)) / (2.0 * math.log(self.base))

        return max(0.0, math.floor(corr(self.beta_fast))), min(self.dim - 1.0, math.ceil(corr(self.beta_slow)))
