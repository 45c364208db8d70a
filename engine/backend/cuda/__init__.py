"""The CUDA backend: CuPy RawModule kernels, CUDA graphs, device tables.

Rooms: ``backend`` (``CudaBackend``: uploads weights, compiles the kernels and a Program),
``plan`` (the Program lowered to fused steps: ``FUSION_RULES``, then generic steps, then
buffers), ``program`` (``CudaProgram``: the steps run eagerly or as a captured tick graph;
the per-cache state), ``steps`` (the step executors and the GEMV launch), ``attention``
(the attention step: split-context decode kernel, flash or cuBLAS prefill), ``moe`` (the
moe steps, host and device, and the program's expert tiers), ``experts`` (the GPU expert
tier), ``kernels/`` (the CUDA C++: one kernel family per ``.cu`` file, shared ``.cuh``
headers) and ``source`` (their loader: modules, ``#line`` markers, NVRTC errors as
file:line), ``choice`` / ``tune`` (kernel variants and their measured choice), ``gemm``
(prefill GEMMs), ``sampling`` / ``tables`` (device sampling and the tables the graph
reads), ``kv`` (the KV cache on the device), ``matrix`` (``DevMatrix``, an uploaded
weight). Imports nothing of ``backend.cpu`` but its expert pool (``cpu.experts``), which
computes the experts held in host memory.
Importing a module here needs CuPy, but ``plan``, ``choice``, ``source`` and ``sampling``.
"""
