"""Helpers shared by test_quants.py and test_cpu_matmul.py: test weights in every
supported GGUF type.

`make_raw(qtype, m, k, rng)` returns uint8/typed raw rows as gguf.GGUFReader would give
them. Types the gguf package can quantize go through `gguf.quants.quantize`; for the K
types (Q2_K..Q6_K, which gguf 0.19 cannot quantize) it writes random blocks with sane
float16 scales, so that the reference `gguf.quants.dequantize` gives finite values.
"""

from __future__ import annotations

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

# byte offsets of the float16 scale fields inside each K block (ggml-common.h)
_K_F16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def can_quantize(qtype: T) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, 256), np.float32), qtype)
        return True
    except NotImplementedError:
        return False


def make_raw(qtype: T, m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw rows (m, row_bytes) uint8, or typed (m, k) for F32/F16, of a random matrix."""
    if qtype in _K_F16_FIELDS:
        be, bb = gguf.GGML_QUANT_SIZES[qtype]
        nb = k // be
        blocks = rng.integers(0, 256, (m, nb, bb), dtype=np.uint8)
        for off in _K_F16_FIELDS[qtype]:
            scale = (rng.uniform(0.5, 2.0, (m, nb)) * 1e-2).astype(np.float16)
            blocks[:, :, off:off + 2] = scale.view(np.uint8).reshape(m, nb, 2)
        return blocks.reshape(m, nb * bb)
    w = rng.standard_normal((m, k)).astype(np.float32)
    return gguf.quants.quantize(w, qtype)
