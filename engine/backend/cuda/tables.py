"""The device tables a CUDA decode graph reads and writes, each with its pinned host mirror.

Owns (DESIGN.md, "The tick": the device tables): the row table ``tab`` (4, b_max) int32: per
batch row its token, slot and position, then the batch rows whose logits are wanted; the
sampler table ``prm`` (b_max, P_WORDS) and the penalty history ``hist`` (b_max, H_MAX)
(layouts in ``sampling.py``); the sampled ids; the publication records ``rec``
(b_max, REC_WORDS): (tick, slot, position, token) per logits row. The host fills a
mirror, one asynchronous copy per table moves it before a replay, and the records come
back the same way. Leaves what the kernels do with them to ``program.py`` and its steps.

Rows: ``b_max`` = the slot count rounded up to a power of two, at least
``GRAPH_MIN_ROWS``: a replay runs up to ``b_max`` rows (decode steps of many slots, a
speculative verify window, a short prefill), all through the same captured kernels.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from aotx.engine.backend.cuda import sampling as CS

GRAPH_MIN_ROWS = 128           # a graph replay takes at least this many rows (verify windows, short prefills)

H2D = cp.cuda.runtime.memcpyHostToDevice
D2H = cp.cuda.runtime.memcpyDeviceToHost


def pinned(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zeroed numpy array in page-locked host memory (asynchronous copies need it)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    mem = cp.cuda.alloc_pinned_memory(n)
    a = np.frombuffer(mem, dtype, int(np.prod(shape))).reshape(shape)
    a[...] = 0
    return a


def rows_for(n_slots: int) -> int:
    """``b_max`` for a cache of ``n_slots`` slots."""
    b = 1
    while b < max(n_slots, GRAPH_MIN_ROWS):
        b *= 2
    return b


class DeviceTables:
    """The tables of one KV cache's graphs (``b_max`` rows). Device arrays ``tab``, ``prm``,
    ``hist``, ``ids``, ``rec``; mirrors ``tab_np``, ``prm_np``, ``hist_np``, ``rec_np``."""

    def __init__(self, b_max: int):
        b = self.b_max = b_max
        # the row table and the sampler table are one block (and one copy per replay): tab
        # (token, slot, position per row; output rows) then prm (the sampler table)
        self._block = cp.zeros(4 * b + b * CS.P_WORDS, cp.int32)
        self._block_np = pinned((4 * b + b * CS.P_WORDS,), np.int32)
        self.tab = self._block[:4 * b].reshape(4, b)
        self.tab_np = self._block_np[:4 * b].reshape(4, b)
        self.prm = self._block[4 * b:].reshape(b, CS.P_WORDS)
        self.prm_np = self._block_np[4 * b:].reshape(b, CS.P_WORDS)
        self.hist = cp.zeros((b, CS.H_MAX), cp.int32)         # penalty history
        self.hist_np = pinned((b, CS.H_MAX), np.int32)
        self.ids = cp.zeros(b, cp.int32)
        self.rec = cp.zeros((b, CS.REC_WORDS), cp.int32)      # publication records
        self.rec_np = pinned((b, CS.REC_WORDS), np.int32)

    @property
    def nbytes(self) -> int:
        """Device bytes of the tables (each has a mirror of the same size in pinned memory)."""
        return int(self._block.nbytes + self.hist.nbytes + self.ids.nbytes + self.rec.nbytes)

    # device addresses of the row table's rows
    @property
    def tok_ptr(self) -> int:
        return self.tab.data.ptr

    @property
    def slot_ptr(self) -> int:
        return self.tab.data.ptr + 4 * self.b_max

    @property
    def pos_ptr(self) -> int:
        return self.tab.data.ptr + 8 * self.b_max

    @property
    def out_ptr(self) -> int:
        return self.tab.data.ptr + 12 * self.b_max

    def fill_rows(self, tokens: np.ndarray, layout, b: int, scratch_slot: int) -> int:
        """Write the row table's mirror for a batch of ``len(tokens)`` rows padded to ``b``
        (padding rows: token 0, the scratch slot, position 0); returns the number of logits
        rows (the batch rows ``layout.out_rows``, in order)."""
        t = self.tab_np
        n = int(tokens.shape[0])
        t[0, :n] = tokens
        t[1, :n] = layout.slots
        t[2, :n] = layout.positions
        t[0, n:b] = 0
        t[1, n:b] = scratch_slot
        t[2, n:b] = 0
        out = layout.out_rows
        R = int(out.shape[0])
        t[3, :R] = out
        t[3, R:] = 0
        return R

    def upload(self, stream, r: int, need_hist: bool) -> None:
        """Copy the row table and ``r`` sampler rows (one copy: they are one block) and
        (``need_hist``) their histories to the device."""
        n = 4 * (4 * self.b_max + CS.P_WORDS * r)
        cp.cuda.runtime.memcpyAsync(self._block.data.ptr, self._block_np.ctypes.data, n, H2D, stream.ptr)
        if need_hist:
            cp.cuda.runtime.memcpyAsync(self.hist.data.ptr, self.hist_np.ctypes.data, 4 * CS.H_MAX * r, H2D,
                                        stream.ptr)

    def download_records(self, stream, R: int) -> None:
        """Queue the copy of ``R`` publication records to the mirror (valid after a sync)."""
        cp.cuda.runtime.memcpyAsync(self.rec_np.ctypes.data, self.rec.data.ptr, 4 * CS.REC_WORDS * R, D2H, stream.ptr)
