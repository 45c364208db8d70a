"""The CPU backend: numpy plus numba kernels over the weights' quantized blocks.

Rooms: ``backend`` (``CpuBackend``: uploads weights, compiles a Program), ``program``
(``CpuProgram``: buffers, joined matmuls, the KV cache, one step per op), ``matmul``
(``QuantMatrix`` and the row-major matmul), ``qdot`` / ``fdot`` (the int8 and float dot
kernels by instruction set), ``attention`` (decode and prefill attention over the cache),
``ops`` (norms, RoPE, activations), ``experts`` (the CPU expert pool: routing, the
experts' int8 tiles, placement; the CUDA backend runs the experts it keeps in host memory
through it, the one seam between the two backends). Imports nothing of ``backend.cuda``.
"""
