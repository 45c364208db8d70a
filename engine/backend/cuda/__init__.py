"""The CUDA backend: CuPy RawModule kernels, CUDA graphs, device tables.

Rooms: ``backend`` (``CudaBackend``: uploads weights, compiles a Program), ``plan`` (the
Program lowered to fused steps), ``program`` (``CudaProgram``: the steps run eagerly or
as a captured tick graph), ``source`` (the kernels' source and NVRTC), ``choice`` /
``tune`` (kernel variants and their measured choice), ``gemm`` (prefill GEMMs),
``sampling`` / ``tables`` (device sampling and the tables the graph reads), ``kv`` (the
KV cache on the device), ``matrix`` (``DevMatrix``, an uploaded weight). Imports nothing
of ``backend.cpu`` but its expert pool (``cpu.experts``), which computes the experts held
in host memory.
Importing a module here needs CuPy.
"""
