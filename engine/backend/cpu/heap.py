"""One malloc arena for the process, so that the CPU kernels' large scratch arrays are reused.

Owns: ``one_arena()``, called when a CPU backend is made. The kernels run on numba's worker
threads, and glibc gives each thread its own arena; a thread arena's heap is trimmed back to
the system as soon as its top is free, so a scratch array of a few MB (a float16 cache's span
converted to float32 for attention: 4 MB per KV head at 16k tokens of history) is mapped and
faulted in afresh at every call. On the 2-core machine, decode after 16,384 tokens of history
(SmolLM2-135M, float16 cache) ran at 4.6-5.0 tokens/s with thread arenas and 12.9-13.7 with
one (``MALLOC_ARENA_MAX=1``; 4,096 tokens: unchanged, 25.5-27.3). ``mallopt(M_ARENA_MAX, 1)``
does what that variable does, for arenas made after it (the worker threads start later).
Leaves everything else to glibc; does nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_ARENA_MAX = -8          # glibc's malloc.h
_done = False


def one_arena() -> bool:
    """Ask glibc for one malloc arena (once per process); True where it took."""
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
    _done = bool(mallopt(M_ARENA_MAX, 1))
    return _done
