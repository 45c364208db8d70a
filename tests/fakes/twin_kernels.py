"""Two tiny numba kernels that stand for a serial twin and its threaded kernel, for the
tests of ``engine/backend/cpu/warmup.py`` (compiling threaded kernels in the background)."""

from __future__ import annotations

from numba import njit, prange


@njit(cache=True)
def serial(x, out):
    for i in range(x.shape[0]):
        out[i] = x[i] * 2.0 + 1.0


@njit(cache=True, parallel=True)
def threaded(x, out):
    for i in prange(x.shape[0]):
        out[i] = x[i] * 2.0 + 1.0
