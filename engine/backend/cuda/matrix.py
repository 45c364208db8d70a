"""A weight matrix on the GPU (``DevMatrix``): what ``backend.CudaBackend.matrix`` uploads and
the CUDA program's steps (dense layers and the GPU expert tier) launch kernels on; and the
int8 activation rows its int8 GEMVs read (``q8_buffers``).

Its own module so that ``backend`` (which uploads weights), ``experts`` (which builds
expert stacks of this type) and ``tune`` (which times GEMVs on scratch rows) import it
without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy as cp


@dataclass
class DevMatrix:
    """A weight W of shape (m, k) on the device, rows in the file's block layout.

    ``data``: uint8 (m_pad, row_bytes); ``m_pad`` is m rounded up to even (kernels
    compute two rows per warp; the pad row is zero)."""

    name: str
    qtype: int
    m: int
    k: int
    row_bytes: int
    data: cp.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def q8_buffers(rows: int, k: int) -> tuple:
    """Scratch for ``rows`` rows of int8 activations of up to ``k`` inputs (``quant_rows``):
    xq (rows, ldq) int8 and xd (rows, ldq / 32) float2 block scales as float32 pairs, ldq
    = k rounded up to 32 (at least 32)."""
    ldq = max(32, (int(k) + 31) // 32 * 32)
    return cp.zeros((max(1, rows), ldq), cp.int8), cp.zeros((max(1, rows), ldq // 16), cp.float32)
