"""The CPU backend: numpy plus numba kernels over the weights' quantized blocks.

Rooms: ``backend`` (``CpuBackend``: uploads weights, compiles a Program), ``program``
(``CpuProgram``: buffers, joined matmuls, the KV cache, one step per op), ``matmul``
(``QuantMatrix`` and its matmul, integer or float path), ``repack`` (GGUF blocks
decomposed and laid out as the integer kernels' tiles), ``qdot`` (activation
quantization and the integer matmul kernel), ``lanes`` (its inner integer step as LLVM
IR), ``markers`` (the instruction-set and weight-kind markers that pick what compiles),
``fdot`` (fixed-order float dot products, float16 conversion), ``llvm_ir`` (the IR
building blocks those intrinsics share), ``attention`` (decode and prefill attention
over the cache), ``ops`` (norms, RoPE, activations), ``experts`` (the CPU expert pool:
stacks, routing, the fused layer kernel, the pool and placement; the CUDA backend runs
the experts it keeps in host memory through it, the one seam between the two backends).
Imports nothing of ``backend.cuda``.
"""

import os

# numba's parallel regions run on libgomp's pool, whose threads spin between regions:
# 300,000 pause loops by default (~10 ms on recent Intel cores). On a machine where
# another process holds a core, a join then waits for a descheduled thread while the
# spinning one burns its time slice: decode measured 0.7 tok/s on this workplace's busy
# 2-core machine, 24 tok/s with OMP_WAIT_POLICY=PASSIVE, 12 with GOMP_SPINCOUNT=2000
# (~100 us of spinning: enough to keep the pool awake between one decode step's regions).
# Set before libgomp loads (at numba's first parallel launch), so here, before any kernel
# module of this package runs; the user's settings win.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "2000")
