"""Malloc settings that let the CPU kernels' large scratch arrays be reused, not re-faulted.

Owns: ``keep_scratch()``, called when a CPU backend is made. The kernels run on numba's worker
threads, each with its own glibc arena; a scratch array of a few MB (a float16 cache's span
converted to float32 for attention: 4 MB per KV head at 16k tokens of history) is mapped for
the call and unmapped after it (or trimmed off the arena's top), so its pages are faulted in
afresh at every call. Measured on the 2-core machine (SmolLM2-135M, float16 cache, decode
after 16,384 tokens of history, a quiet machine): 7.6-7.9 tokens/s as glibc comes, 23-24 with
allocations up to 32 MB kept off mmap and a heap top trimmed only past 256 MB (4,096 tokens:
63-68 either way); one arena for all threads (``M_ARENA_MAX`` 1) gave 19-23 but cost 4-8% at
4,096 tokens (the threads share its lock). What stays mapped is what the process used at its
peak, reused by the next call. Does nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3          # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20    # glibc's ceiling for it on 64-bit (half a thread heap's 64 MB)
TRIM_THRESHOLD = 256 << 20
_done = False


def keep_scratch() -> bool:
    """Set the two thresholds (once per process); True where glibc took both."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):       # musl and others: no mallopt, nothing to do
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) & bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done
