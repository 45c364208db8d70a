"""Mixture-of-experts on the CPU: expert stacks, routing, the expert FFN and the CPU expert pool.

The one door the CUDA backend uses into the CPU backend (``pyproject.toml``'s contract):
it keeps experts in host memory as ``CpuExperts`` and runs them on the ``ExpertPool``
through ``moe_rows``. The rooms:

* ``stacks``: ``CpuExperts`` (a 3-D GGUF expert tensor as E matrices, built only when
  the CPU computes that expert, every expert's int8 tiles in one stack), per-expert
  biases, host matrices for the CUDA host step, ``lazy_empty``.
* ``ffn``: the ``moe`` op's arithmetic per row: ``route`` (top-k and each family's
  normalisation), the activations, one expert's gated FFN (``expert_ffn``), ``groups``
  of (row, slot) pairs by expert, and ``join`` (a row's k outputs summed in selection
  order, whatever tier computed them).
* ``fused``: ``FusedExperts``, the integer path's layer kernel: one numba call per moe
  layer for all its (row, expert) pairs, the same bits as ``expert_ffn`` per expert.
* ``pool``: ``ExpertPool`` (numba's workers pinned to cores before the first expert
  page is touched, counters), ``measure`` and ``place`` (the calibration's CPU timings,
  a tier plan applied), ``moe_rows`` (the whole op on host rows, a GPU tier beside it).

Leaves to others: which experts the CPU computes (the expert-tier plan of
engine/model/experts.py, through the executor), the op's definition (ops.py), the
matmul kernels (matmul.py, qdot.py) and the GPU tiers (the CUDA backend).

Batch invariance: each expert's matmuls run on the gathered rows routed to it; rows of
short segments (decode, verify) go through the per-row kernels (``per_row=True``), as
every other matmul of the CPU executor does, so their numbers do not depend on which
other rows chose the same expert.
"""

from aotx.engine.backend.cpu.experts.ffn import expert_ffn, gelu_mul, groups, join, route, silu_mul, swiglu_oai
from aotx.engine.backend.cpu.experts.fused import FusedExperts, fused_for
from aotx.engine.backend.cpu.experts.pool import CPU_TIERS, ExpertPool, measure, moe_rows, place
from aotx.engine.backend.cpu.experts.stacks import CpuExperts, expert_vectors, host_matrix, lazy_empty

__all__ = [
    "CPU_TIERS", "CpuExperts", "ExpertPool", "FusedExperts", "expert_ffn", "expert_vectors", "fused_for", "gelu_mul",
    "groups", "host_matrix", "join", "lazy_empty", "measure", "moe_rows", "place", "route", "silu_mul", "swiglu_oai",
]
