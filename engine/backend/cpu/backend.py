"""The CPU backend: weights kept quantized in memory, numba kernels, numpy BLAS.

Owns: turning GGUF tensors into backend objects (``matrix``, ``vector``) and compiling
an ``ops.Program`` (``compile`` -> ``cpu_program.CpuProgram``: prebound kernel calls and
the CPU KV cache). The kernels live in ``cpu/matmul.py`` (quantized matmul),
``cpu/attention.py`` (attention over the KV cache) and ``cpu/ops.py`` (everything else).
Every op computes a row from that row alone, by one fixed sequence of operations (batch
invariance, DESIGN.md). The interface is engine/backend/IR.md section 6.
"""

from __future__ import annotations

import numpy as np

from aotx.engine.errors import ModelError


class CpuBackend:
    """Op set on the CPU. ``weight_bytes`` counts the bytes of every weight loaded.

    ``int8_activations``: every matmul of a weight type with an integer form (Q4_0, Q4_1,
    Q4_K, Q5_*, Q6_K, Q3_K, Q8_0, IQ4_*, MXFP4) rounds its activations to int8 per
    32-block as llama.cpp does and runs integer kernels (what the engine loads: fast;
    logits differ from a float64 reference by ~1e-2 relative); False: float32
    activations for every type (~1e-6 relative; slower). Either way a row's logits do
    not depend on the batch. ``numerics`` names the path: "cpu-int8" or "cpu-f32"."""

    name = "cpu"

    def __init__(self, int8_activations: bool = False) -> None:
        from aotx.engine.backend.cpu.heap import keep_scratch
        from aotx.engine.backend.quants import SUPPORTED_TYPES

        keep_scratch()                   # scratch arrays reused, not re-faulted per call (heap.py)
        self.int8_activations = bool(int8_activations)
        self.numerics = "cpu-int8" if self.int8_activations else "cpu-f32"
        self.weight_bytes = 0
        self.supported_types = SUPPORTED_TYPES

    def compile(self, program):
        """The CPU executor of ``program`` (an ops.Program): see cpu/program.py."""
        from aotx.engine.backend.cpu.program import CpuProgram

        return CpuProgram(program)

    def matrix(self, t):
        """A 2-D GGUF tensor (ggml shape ``[k, m]``) as a QuantMatrix of shape (m, k)."""
        from aotx.engine.backend.cpu.matmul import QuantMatrix
        from aotx.engine.backend.quants import SUPPORTED_TYPES

        if t.qtype not in SUPPORTED_TYPES:
            raise ModelError(f"tensor {t.name!r} has tensor type {getattr(t.qtype, 'name', t.qtype)}, "
                             f"which AOTX does not support "
                             f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})")
        k, m = t.shape
        qm = QuantMatrix(t.data, t.qtype, m, k, t.name, int8=self.int8_activations)
        self.weight_bytes += qm.nbytes
        return qm

    def experts(self, t):
        """A 3-D GGUF expert tensor (ggml shape ``[k, m, E]``) as ``cpu_moe.CpuExperts``: E
        matrices (m, k) over the file's memory map, built when first computed. Counted in
        ``weight_bytes`` at their file size (the CPU tier holds every expert)."""
        from aotx.engine.backend.cpu.experts import CpuExperts
        from aotx.engine.backend.quants import SUPPORTED_TYPES

        if t.qtype not in SUPPORTED_TYPES:
            raise ModelError(f"tensor {t.name!r} has tensor type {getattr(t.qtype, 'name', t.qtype)}, "
                             f"which AOTX does not support "
                             f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})")
        if len(t.shape) != 3:
            raise ModelError(f"tensor {t.name!r} should be 3-D (experts), has shape {list(t.shape)}")
        st = CpuExperts(t, int8=self.int8_activations)
        self.weight_bytes += int(t.n_bytes)
        return st

    def expert_vectors(self, t) -> np.ndarray:
        """A 2-D GGUF tensor of per-expert biases (ggml ``[n, E]``) as float32 (E, n)."""
        from aotx.engine.backend.cpu.experts import expert_vectors

        arr = expert_vectors(t)
        self.weight_bytes += arr.nbytes
        return arr

    def array(self, t) -> np.ndarray:
        """A small F32/F16/BF16 tensor of any rank (a convolution kernel, ggml ``[K, C]``) as
        a float32 array of the reversed shape ((C, K))."""
        from aotx.engine.backend.quants import dequantize_rows

        n = int(np.prod(t.shape))
        flat = dequantize_rows(np.asarray(t.data).reshape(1, -1), t.qtype, slice(0, 1), n)[0]
        arr = np.ascontiguousarray(np.asarray(flat, np.float32).reshape(tuple(reversed(tuple(t.shape)))))
        self.weight_bytes += arr.nbytes
        return arr

    def vector(self, t) -> np.ndarray:
        """A 1-D F32/F16 tensor as a float32 array (copied: these are small)."""
        from aotx.engine.backend.quants import dequantize_rows

        if len(t.shape) != 1:
            raise ModelError(f"tensor {t.name!r} should be 1-D, has shape {list(t.shape)}")
        arr = np.ascontiguousarray(dequantize_rows(np.asarray(t.data).reshape(1, -1), t.qtype, slice(0, 1),
                                                   t.shape[0])[0], dtype=np.float32)
        self.weight_bytes += arr.nbytes
        return arr
