"""Whether the CPU backend's multi-threaded kernels may run yet (``PARALLEL.ready``).

Owns: the one flag the kernels' callers (``matmul.py``, ``attention.py``) read to choose a
threaded kernel or its single-threaded twin (the same numbers bit for bit). True by
default: a process that is not an engine compiles each kernel at its first call, as numba
does. An engine sets it False before it loads and ``warmup.py`` sets it True once the
threaded kernels are compiled (DESIGN.md: an engine's first reply does not wait for them).
Leaves compiling to ``warmup.py``.
"""

from __future__ import annotations


class ParallelKernels:
    """``ready``: the threaded kernels may run."""

    def __init__(self) -> None:
        self.ready = True


PARALLEL = ParallelKernels()
