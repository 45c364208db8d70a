"""How many threads numpy's BLAS may use on the calling thread, for a stretch of small
matrix products (``one_thread()``).

Owns: finding numpy's OpenBLAS in this process and calling its
``openblas_set_num_threads_local`` (OpenBLAS 0.3.27+: the count of the calling thread only,
returning the previous one). Leaves every other BLAS setting alone; with another BLAS, or an
OpenBLAS without that function, ``one_thread()`` changes nothing.

Why: the chunked delta rule (``recurrent_kernels.delta_chunk``) runs a few dozen products of
64 x 128 matrices per chunk through numpy. On a machine with few cores, OpenBLAS's own
threads then compete with numba's OpenMP workers (which spin a while after each threaded
kernel) and such a product took 10-40x its single-threaded time. One thread gives the
same bits: OpenBLAS splits a GEMM over its output blocks, never over the reduction, so
the count of threads does not change a product's rounding (tests/test_recurrent_ops.py
checks the chunked form's bits under both counts).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager


@functools.lru_cache(maxsize=1)
def _set_local():
    """OpenBLAS's ``openblas_set_num_threads_local`` (int -> int) of the library numpy
    loaded, or None."""
    import numpy  # noqa: F401  (loads its BLAS)

    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
            fn = lib.openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


@contextmanager
def one_thread() -> Iterator[None]:
    """numpy's BLAS runs single-threaded on this thread inside the block (restored after)."""
    fn = _set_local()
    if fn is None:
        yield
        return
    prev = fn(1)
    try:
        yield
    finally:
        fn(prev)
