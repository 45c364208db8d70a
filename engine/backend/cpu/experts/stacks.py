"""Expert stacks: a 3-D GGUF expert tensor as E matrices the CPU computes with.

Owns: ``CpuExperts``, a 3-D GGUF expert tensor (ggml shape ``(k, m, E)``) as E matrices of
shape (m, k), each a ``QuantMatrix`` over its slice of the file's memory map, built only
when the CPU computes that expert (``materialize``); until then nothing of it is read.
``dequantize(e)`` gives an expert's float32 values (references, copies to a GPU). On the
integer path every expert's tiles live in one stack per array (Q4_K / Q6_K in the compact
layout: the file's scale integers; repack.repack_compact), filled on first use, so the
fused layer kernel (fused.py) reaches any expert by offset. Also ``expert_vectors``
(per-expert biases), ``host_matrix`` (the CUDA host step's router and shared-expert
weights) and ``lazy_empty`` (memory committed only where written).
Leaves to others: the arithmetic (ffn.py, fused.py), the pool (pool.py), the layouts
(repack.py) and the matmul (matmul.py).
"""

from __future__ import annotations

import mmap
import threading
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from aotx.engine.backend import quants
from aotx.engine.backend.cpu import matmul as cpu_matmul, repack as cpu_repack

_PAGE = 4096

class CpuExperts:
    """E expert matrices of shape (m, k) from one 3-D GGUF tensor ``t`` (ggml ``(k, m, E)``;
    ``t.data``: the memory map, ``(E, m, row_bytes)`` uint8 for block types or a typed
    ``(E, m, k)`` array). ``matrix(e)`` is expert e's QuantMatrix (built on first use);
    ``nbytes_per_expert``: its bytes in the file. Attributes of the op set's expert stacks:
    ``n_expert``, ``m``, ``k``, ``name``, ``qtype``."""

    def __init__(self, t: Any, int8: bool = False):
        k, m, E = (int(x) for x in t.shape)
        self.k, self.m, self.n_expert = k, m, E
        self.name = t.name
        self.qtype = t.qtype
        self.int8 = int8
        data = np.asarray(t.data)
        if data.shape[0] != E:
            raise ValueError(f"tensor {t.name!r}: expected {E} experts, the data has shape {list(data.shape)}")
        self._data = data
        self.nbytes_per_expert = int(t.n_bytes) // E
        quants.as_byte_rows(data[0], t.qtype, k)   # a row length the type cannot hold fails here, by name
        self._mats: list[Any] = [None] * E
        self._lock = threading.Lock()
        # the integer path: every expert's tiles in one stack per array (E, tiles, ...), so the
        # fused layer kernel (moe_experts) reaches any expert by offset; allocated now, untouched:
        # an expert's pages are written (and held) only when it is materialized. ``ready[e]``:
        # expert e's tiles are in place.
        self.kind = cpu_repack.KIND_OF.get(t.qtype) if int8 else None
        # Q4_K / Q6_K: the compact tiles (their scales as the file has them: 0.59 / 1.08 bytes
        # per weight, not 0.75 / 1.25; the same numbers), what a decode step reads per expert
        self.compact = self.kind is not None and t.qtype in cpu_repack.COMPACT_OF and cpu_matmul.COMPACT
        if self.compact:
            self.kind = cpu_repack.COMPACT_OF[t.qtype]
        self.ready = np.zeros(E, np.bool_)
        self.tiles: tuple | None = None
        if self.kind is not None:
            shp = cpu_repack.tile_shapes(t.qtype, m, k, compact=self.compact)
            self.tiles = tuple(lazy_empty((E,) + shp[a][0], shp[a][1]) for a in ("qs", "qh", "d", "mn"))
            self._tile_bytes = sum(int(a[0].nbytes) for a in self.tiles)
            self.flat_tiles = _flat(self.tiles)

    @property
    def nbytes(self) -> int:
        """Bytes of the experts materialized for the CPU so far (their tiles or QuantMatrices)."""
        if self.tiles is not None:
            return int(self.ready.sum()) * self._tile_bytes
        return sum(w.nbytes for w in self._mats if w is not None)

    def raw(self, e: int) -> np.ndarray:
        """Expert e's bytes in the file's layout: (m, row_bytes) uint8 (a view of the map)."""
        return quants.as_byte_rows(self._data[e], self.qtype, self.k)

    def matrix(self, e: int):
        """Expert e as a QuantMatrix (m, k), built from the map on first use (on the integer
        path: a view of its tiles in the stack, repacked into place then)."""
        w = self._mats[e]
        if w is None:
            with self._lock:
                w = self._mats[e]
                if w is None:
                    name = f"{self.name}[{e}]"
                    if self.tiles is None:
                        w = cpu_matmul.QuantMatrix(self._data[e], self.qtype, self.m, self.k, name, int8=self.int8)
                    else:
                        w = cpu_matmul.from_tiles(self._data[e], self.qtype, self.m, self.k,
                                                  (self.kind,) + self._fill(e), name)
                    self._mats[e] = w
        return w

    def _fill(self, e: int) -> tuple[np.ndarray, ...]:
        """Repack expert e into its place in the stack (once; the caller holds the lock);
        returns its (qs, qh, d, mn) views."""
        views = tuple(a[e] for a in self.tiles)
        if not self.ready[e] and self.compact:
            _, *parts = cpu_repack.repack_compact(self.raw(e), self.qtype, self.m, self.k)
            for v, part in zip(views, parts):
                v[...] = part
            self.ready[e] = True
        if not self.ready[e]:
            half = self.tiles[2].dtype == np.uint16
            try:
                kind, *parts = cpu_repack.repack(self.raw(e), self.qtype, self.m, self.k, half)
            except cpu_repack._NotHalf:
                self._widen_scales()            # a scale beyond float16: the whole stack keeps float32
                return self._fill(e)
            for v, part in zip(views, parts):
                v[...] = part
            self.ready[e] = True
        return views

    def _widen_scales(self) -> None:
        """Re-lay the stack with float32 scales (c = mn + off * d stored, as repack does
        with half=False), re-repacking the experts already in place."""
        qs, qh, d, mn = self.tiles
        self.tiles = (qs, qh, np.empty(d.shape, np.float32), np.empty(mn.shape, np.float32))
        self._tile_bytes = sum(int(a[0].nbytes) for a in self.tiles)
        self.flat_tiles = _flat(self.tiles)
        for e in np.flatnonzero(self.ready):
            _, _, _, de, me = cpu_repack.repack(self.raw(int(e)), self.qtype, self.m, self.k, False)
            self.tiles[2][e], self.tiles[3][e] = de, me
        self._mats = [None] * self.n_expert  # their views point at the old scales

    def prefer_huge_pages(self) -> None:
        """Every expert of this stack is about to be materialized (the plan holds them all on
        the host): lay the tiles out in ``np.empty`` arrays, whose transparent huge pages the
        streaming kernels' TLB likes (``lazy_empty``'s 4 KiB pages cost ~5% of decode at the
        Qwen3-30B-A3B layer shape), before any expert is written. A no-op once one is."""
        if self.tiles is None or self.ready.any():
            return
        self.tiles = tuple(np.empty(a.shape, a.dtype) for a in self.tiles)
        self.flat_tiles = _flat(self.tiles)

    def materialize(self, experts, threads: int = 1) -> int:
        """Build the QuantMatrices of ``experts`` (an iterable of indices) now; returns the
        bytes they occupy. ``threads`` > 1: the repacking into the stack runs on that many
        threads first (``_repack_many``)."""
        experts = [int(e) for e in experts]
        if threads > 1:
            self._repack_many(experts, threads)
        return sum(self.matrix(e).nbytes for e in experts)

    def _repack_many(self, experts: list[int], threads: int) -> None:
        """Repack the experts of ``experts`` not yet in the stack on ``threads`` threads (numpy
        releases the GIL in its array loops; a 30B-A3B expert matrix takes ~3 ms on one): each
        expert's tiles are computed off the lock and written into its place under it. An
        expert whose scales do not fit float16 is left to ``matrix`` (it widens the stack)."""
        from concurrent.futures import ThreadPoolExecutor

        if self.tiles is None:
            return
        todo = [e for e in dict.fromkeys(experts) if not self.ready[e]]
        if len(todo) < 2:
            return
        half = self.tiles[2].dtype == np.uint16

        def one(e: int):
            try:
                if self.compact:
                    _, *parts = cpu_repack.repack_compact(self.raw(e), self.qtype, self.m, self.k)
                else:
                    _, *parts = cpu_repack.repack(self.raw(e), self.qtype, self.m, self.k, half)
            except cpu_repack._NotHalf:
                return e, None
            return e, parts

        with ThreadPoolExecutor(max_workers=min(threads, len(todo)), thread_name_prefix="aotx-repack") as ex:
            for e, parts in ex.map(one, todo):
                if parts is None:
                    continue
                with self._lock:
                    if not self.ready[e] and (self.compact or (self.tiles[2].dtype == np.uint16) == half):
                        for v, part in zip((a[e] for a in self.tiles), parts):
                            v[...] = part
                        self.ready[e] = True

    def dequantize(self, e: int) -> np.ndarray:
        """Expert e's values: float32 (m, k), equal to gguf's dequantization."""
        b = self.raw(e)
        return quants.dequantize_byte_rows(b, self.qtype, np.arange(self.m, dtype=np.int64),
                                           np.empty((self.m, self.k), np.float32))

    def __repr__(self) -> str:
        return f"CpuExperts({self.name!r}, {getattr(self.qtype, 'name', self.qtype)}, {self.n_expert} x {self.m}x{self.k})"


def host_matrix(data: np.ndarray, qtype: int, m: int, k: int, name: str, int8: bool) -> Any:
    """A CPU ``QuantMatrix`` over ``data`` ((m, row bytes) uint8 GGUF blocks of ``qtype``):
    the CUDA host step's router and shared-expert weights, computed by the CPU kernels."""
    from gguf import GGMLQuantizationType as T

    from aotx.engine.backend.cpu.matmul import QuantMatrix

    return QuantMatrix(data, T(qtype), m, k, name, int8=int8)


def _flat(tiles: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """(E, T, ...) stacks as (E T, ...) views: one matrix of E T tiles for the kernels."""
    return tuple(a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]) for a in tiles)


def expert_vectors(t: Any) -> np.ndarray:
    """A 2-D GGUF tensor of one bias per expert (ggml ``(n, E)``) as float32 (E, n)."""
    n, E = (int(x) for x in t.shape)
    raw = np.ascontiguousarray(t.data).reshape(E, -1)
    if t.qtype == T.F32:
        out = raw.view(np.float32).reshape(E, n)
    elif t.qtype == T.F16:
        out = raw.view(np.float16).reshape(E, n).astype(np.float32)
    elif t.qtype == T.BF16:
        out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(E, n)
    else:
        raise ValueError(f"tensor {t.name!r}: per-expert biases of type {t.qtype.name} (F32, F16 or BF16 expected)")
    return np.ascontiguousarray(out, dtype=np.float32)


def lazy_empty(shape: tuple, dtype) -> np.ndarray:
    """An uninitialized array whose memory is committed only where it is written, 4 KiB at a
    time: an expert stack (every expert of a layer, most never materialized when the plan
    leaves them in the file) must not hold what it does not use. numpy asks the kernel for
    transparent huge pages on large arrays, so writing one expert's few KiB of scales
    committed a whole 2 MiB page (a 64 MiB stack with one byte written per 2 MiB held 63 MiB);
    an anonymous mapping with huge pages refused holds what is written. Small arrays, and
    systems without ``MADV_NOHUGEPAGE``, get ``np.empty``."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if n < (4 << 20) or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return np.empty(shape, dt)
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    except OSError:     # a kernel without transparent huge pages: nothing to refuse
        pass
    return np.frombuffer(buf, dt).reshape(shape)

