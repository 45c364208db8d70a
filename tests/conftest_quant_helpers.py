"""Helpers shared by test_quants*.py, test_cpu_matmul.py and test_cuda_quants.py: test
weights in every supported GGUF type.

`make_raw(qtype, m, k, rng)` returns uint8/typed raw rows as gguf.GGUFReader would give
them. Types the gguf package can quantize (Q4_0..Q8_0, BF16, MXFP4) go through
`gguf.quants.quantize` of standard-normal weights; for the types it cannot quantize
(Q2_K..Q6_K, IQ4_NL and IQ4_XS in gguf 0.19) it writes random blocks byte by byte with
sane float16 scales, so that the reference `gguf.quants.dequantize` gives finite values.
Every other byte of such a block (quants, packed sub-block scales) is uniformly random,
which is a valid block of these types.
"""

from __future__ import annotations

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

# byte offsets of the float16 scale fields inside each block the helpers write (ggml-common.h)
F16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
              T.IQ4_NL: (0,), T.IQ4_XS: (0,)}


def can_quantize(qtype: T) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, 256), np.float32), qtype)
        return True
    except NotImplementedError:
        return False


def random_blocks(qtype: T, m: int, k: int, rng: np.random.Generator, scale: float = 1e-2) -> np.ndarray:
    """uint8 (m, row_bytes): random bytes, with each float16 field of F16_FIELDS set to
    `scale` times U(0.5, 2). Any other type: every byte random (for MXFP4 that covers all
    256 E8M0 exponents, subnormal and overflowing ones included)."""
    be, bb = gguf.GGML_QUANT_SIZES[qtype]
    nb = k // be
    blocks = rng.integers(0, 256, (m, nb, bb), dtype=np.uint8)
    for off in F16_FIELDS.get(qtype, ()):
        d = (rng.uniform(0.5, 2.0, (m, nb)) * scale).astype(np.float16)
        blocks[:, :, off:off + 2] = d.view(np.uint8).reshape(m, nb, 2)
    return blocks.reshape(m, nb * bb)


def make_raw(qtype: T, m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw rows (m, row_bytes) uint8, or typed (m, k) for F32/F16, of a random matrix."""
    if qtype in F16_FIELDS:
        return random_blocks(qtype, m, k, rng)
    w = rng.standard_normal((m, k)).astype(np.float32)
    return gguf.quants.quantize(w, qtype)
