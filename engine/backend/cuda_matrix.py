"""A weight matrix on the GPU (``DevMatrix``): what ``cuda.CudaBackend.matrix`` uploads and
the CUDA program's steps (dense layers and the GPU expert tier) launch kernels on.

Its own module so that ``cuda`` (which compiles programs) and ``cuda_program`` (which
builds expert stacks of this type) both import it without importing each other.
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
