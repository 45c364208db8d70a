"""The CPU op set besides matmul and attention: norms, RoPE (both modes), activations, adds.

Owns: numba kernels (compiled once, when first needed, and cached on disk: ``LazyKernel``). Leaves the quantized matmul to
``cpu/matmul.py``, attention over the KV cache (and storing K/V into it) to
``cpu/attention.py``, the order of ops to the architecture module and the program
executor (``cpu/program.py``). Every kernel here computes a row from that row alone
(one compiled loop per row, whatever the number of rows): batch-invariant.

Each kernel is compiled for ONE array layout (any strides, numba's "A"), given as an
explicit signature: numba would otherwise compile a second version for C-contiguous
arguments, and a one-row column block of a fused matrix IS C-contiguous while the same
block of two rows is not - the two versions vectorize differently (exp, tanh, fused
multiply-adds), so a row's numbers would depend on how many rows came with it (without
the signature phi3's fused gate/up rows differed in the last bits between a 1-row and a
2-row batch).
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

_F2 = "float32[:, :]"
_F3 = "float32[:, :, :]"
_SIG_RMS = [f"void({_F2}, float32[:], float64, {_F2})"]
_SIG_HEAD_RMS = [f"void({_F3}, float32[:], float64)"]
_SIG_ROPE = [f"void({_F3}, {ix}[:], {_F2}, {_F2})" for ix in ("int32", "int64")]
_SIG_GLU = [f"void({_F2}, {_F2}, {_F2})"]
_SIG_ADD = [f"void({_F2}, {_F2})"]


class LazyKernel:
    """A kernel compiled for its explicit signatures when it is first needed, not when the
    module is imported: an architecture that never uses it (gelu for a llama, NeoX RoPE,
    QK-norm) never compiles it, which a cold start (an empty numba cache) pays for. Once
    compiled it takes no other layout (``disable_compile``): as an ``njit(signatures)``
    kernel, an argument is converted to the signature's layout, never compiled again."""

    def __init__(self, fn, sigs: list[str], **options) -> None:
        self.py_func, self.sigs, self.options = fn, sigs, options
        self.__doc__, self.__name__ = fn.__doc__, fn.__name__
        self._disp = None

    def dispatcher(self):
        """The compiled numba dispatcher (compiled, or loaded from the cache, on first use)."""
        if self._disp is None:
            from numba.core import sigutils

            d = nb.njit(**self.options)(self.py_func)
            for s in self.sigs:
                d.compile(sigutils.normalize_signature(s)[0])
            d.disable_compile()
            self._disp = d
        return self._disp

    def __call__(self, *args):
        return (self._disp or self.dispatcher())(*args)


def _lazy(sigs: list[str], **options):
    return lambda fn: LazyKernel(fn, sigs, **options)


@_lazy(_SIG_RMS, cache=True, fastmath=True, error_model="numpy")
def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:
    """out[i] = x[i] / sqrt(mean(x[i]**2) + eps) * w.  x, out: (n, d) float32; w: (d,) float32.

    Source: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; llama.cpp's
    ggml_rms_norm accumulates the sum of squares in float (here float64 for safety).
    A zero row with ``eps == 0`` gives a zero row; error_model="numpy": NaN or 0 never raises."""
    n, d = x.shape
    for i in range(n):
        s = 0.0
        for j in range(d):
            v = np.float64(x[i, j])
            s += v * v
        ms = s / d + eps
        scale = np.float32(1.0 / math.sqrt(ms)) if ms > 0.0 else np.float32(0.0)
        for j in range(d):
            out[i, j] = x[i, j] * scale * w[j]


@_lazy(_SIG_HEAD_RMS, cache=True, fastmath=True, error_model="numpy")
def head_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> None:
    """In place: every head vector x[i, h] (length hd) becomes x / sqrt(mean(x**2) + eps) * w.

    x: (n, n_heads, hd) float32, may be a strided view (a column block of a fused QKV
    output); w: (hd,) float32, shared by the heads (QK-norm: Qwen3, Gemma 3)."""
    n, H, hd = x.shape
    for i in range(n):
        for h in range(H):
            s = 0.0
            for j in range(hd):
                v = np.float64(x[i, h, j])
                s += v * v
            ms = s / hd + eps
            scale = np.float32(1.0 / math.sqrt(ms)) if ms > 0.0 else np.float32(0.0)
            for j in range(hd):
                x[i, h, j] = x[i, h, j] * scale * w[j]


@_lazy(_SIG_ROPE, cache=True, fastmath=True, error_model="numpy")
def rope_inplace(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """Rotate adjacent pairs (x[2j], x[2j+1]) of every head by the table angle of row i's position.

    x: (n, n_heads, head_dim) float32, modified in place (may be a strided view);
    positions: (n,) int32; cos, sin: (n_ctx, rope_dim // 2) float32 from
    ``ops.RopeSpec.tables``. Only the first rope_dim dimensions rotate. Source: Su et al.
    2021 (RoFormer), in ggml's "normal" mode (GGML_ROPE_TYPE_NORM) that llama GGUFs use.
    """
    n, h, _ = x.shape
    half = cos.shape[1]
    for i in range(n):
        p = positions[i]
        for hh in range(h):
            for j in range(half):
                c = cos[p, j]
                s = sin[p, j]
                a = x[i, hh, 2 * j]
                b = x[i, hh, 2 * j + 1]
                x[i, hh, 2 * j] = a * c - b * s
                x[i, hh, 2 * j + 1] = a * s + b * c


@_lazy(_SIG_ROPE, cache=True, fastmath=True, error_model="numpy")
def rope_neox_inplace(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """Rotate the pairs (x[j], x[j + rope_dim/2]) of every head (GGML_ROPE_TYPE_NEOX: the
    GPT-NeoX layout that Qwen, Gemma and Phi-3 GGUFs use). Same arguments as rope_inplace."""
    n, h, _ = x.shape
    half = cos.shape[1]
    for i in range(n):
        p = positions[i]
        for hh in range(h):
            for j in range(half):
                c = cos[p, j]
                s = sin[p, j]
                a = x[i, hh, j]
                b = x[i, hh, j + half]
                x[i, hh, j] = a * c - b * s
                x[i, hh, j + half] = a * s + b * c


@_lazy(_SIG_GLU, cache=True, fastmath=True, error_model="numpy")
def silu_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """SwiGLU: out = silu(gate) * up, silu(g) = g / (1 + exp(-g)). All (n, f) float32
    (gate and up may be strided views; out may be gate).

    Source: Shazeer 2020, "GLU Variants Improve Transformer"."""
    n, f = gate.shape
    for i in range(n):
        for j in range(f):
            g = gate[i, j]
            out[i, j] = g / (np.float32(1.0) + np.exp(-g)) * up[i, j]


@_lazy(_SIG_GLU, cache=True, fastmath=True, error_model="numpy", parallel=True)
def silu_mul_par(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """``silu_mul`` with the rows on several threads (a prefill's rows): each element's
    arithmetic is silu_mul's, so the same bits."""
    n, f = gate.shape
    for i in nb.prange(n):
        for j in range(f):
            g = gate[i, j]
            out[i, j] = g / (np.float32(1.0) + np.exp(-g)) * up[i, j]


@_lazy(_SIG_GLU, cache=True, fastmath=True, error_model="numpy")
def gelu_tanh_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """GeGLU with the tanh approximation of GELU: out = 0.5 g (1 + tanh(sqrt(2/pi) (g +
    0.044715 g^3))) * up. All (n, f) float32 (out may be gate).

    Source: Hendrycks & Gimpel 2016 (GELU, tanh form), Shazeer 2020 (GeGLU); ggml's
    ggml_gelu_f32 uses the same constants (its CPU path reads a float16 table instead)."""
    n, f = gate.shape
    c = np.float32(0.7978845608028654)
    a3 = np.float32(0.044715)
    for i in range(n):
        for j in range(f):
            g = gate[i, j]
            out[i, j] = np.float32(0.5) * g * (np.float32(1.0) + np.tanh(c * (g + a3 * g * g * g))) * up[i, j]


@_lazy(_SIG_ADD, cache=True, fastmath=True, error_model="numpy")
def add_inplace(x: np.ndarray, y: np.ndarray) -> None:
    """x += y for (n, d) float32 (the residual add, without a temporary)."""
    n, d = x.shape
    for i in range(n):
        for j in range(d):
            x[i, j] += y[i, j]
