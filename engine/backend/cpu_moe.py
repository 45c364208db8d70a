"""Mixture-of-experts on the CPU: expert stacks, routing, the expert FFN and the CPU expert pool.

Owns:
* ``CpuExperts``: a 3-D GGUF expert tensor (ggml shape ``(k, m, E)``) as E matrices of
  shape (m, k), each a ``QuantMatrix`` over its slice of the file's memory map, built
  only when the CPU computes that expert (``materialize``); until then nothing of it is
  read. ``dequantize(e)`` gives an expert's float32 values (references, copies to a GPU).
* ``route``: the ``moe`` op's routing (ops.ProgramBuilder.moe): top-k of the softmax or of
  the raw logits, each family's normalisation, in float32 with a float64 softmax sum.
* ``expert_ffn`` and ``join``: one expert's gated FFN on the rows routed to it, and the
  weighted sum of a row's k expert outputs in selection order (j = 0 .. k-1), whatever
  computed them: a row's numbers do not depend on which tier ran which expert's
  arithmetic order beyond that expert's own kernel, nor on the other rows.
* ``ExpertPool``: the CPU expert pool. It computes the (row, expert) pairs the tier plan
  gives the CPU: every pair on a machine without a GPU. Its threads are numba's: before
  the first expert page is touched, each worker thread of the calling thread's numba pool
  is pinned to one core of the process's affinity set (sched_setaffinity through libc,
  from inside a parallel region), so the pages they first touch (repacked experts, the
  file pages they fault in) stay with the cores that use them and the workers do not
  migrate. The calling thread (numba's thread 0: the engine's tick thread) is left
  unpinned, so processes it starts keep the machine's affinity. numba's workqueue layer
  gives each calling thread its own workers, so the pool pins per calling thread, once.
  Counters (rows, expert calls, seconds) feed the startup profile and the traffic stats.

Leaves to others: which experts the CPU computes (the expert-tier plan of
engine/model/experts.py, through the executor), the op's definition (ops.py), the
matmul kernels (cpu_matmul.py) and the GPU tiers (the CUDA backend).

Batch invariance: each expert's matmuls run on the gathered rows routed to it; rows of
short segments (decode, verify) go through the per-row kernels (``per_row=True``), as
every other matmul of the CPU executor does, so their numbers do not depend on which
other rows chose the same expert.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
from typing import Any

import numba
import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit, prange

from aotx.engine.backend import quants

MOE_NORM_MIN = np.float32(6.103515625e-5)   # ops.MOE_NORM_MIN (llama.cpp's clamp of the weight sum)
_PAGE = 4096


# ------------------------------------------------------------------ expert stacks

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

    @property
    def nbytes(self) -> int:
        """Bytes of the experts materialized for the CPU so far (their QuantMatrices)."""
        return sum(w.nbytes for w in self._mats if w is not None)

    def raw(self, e: int) -> np.ndarray:
        """Expert e's bytes in the file's layout: (m, row_bytes) uint8 (a view of the map)."""
        return quants.as_byte_rows(self._data[e], self.qtype, self.k)

    def matrix(self, e: int):
        """Expert e as a QuantMatrix (m, k), built from the map on first use."""
        w = self._mats[e]
        if w is None:
            from aotx.engine.backend.cpu_matmul import QuantMatrix

            with self._lock:
                w = self._mats[e]
                if w is None:
                    w = QuantMatrix(self._data[e], self.qtype, self.m, self.k, f"{self.name}[{e}]", int8=self.int8)
                    self._mats[e] = w
        return w

    def materialize(self, experts) -> int:
        """Build the QuantMatrices of ``experts`` (an iterable of indices) now; returns the
        bytes they occupy."""
        return sum(self.matrix(int(e)).nbytes for e in experts)

    def dequantize(self, e: int) -> np.ndarray:
        """Expert e's values: float32 (m, k), equal to gguf's dequantization."""
        b = self.raw(e)
        return quants.dequantize_byte_rows(b, self.qtype, np.arange(self.m, dtype=np.int64),
                                           np.empty((self.m, self.k), np.float32))

    def __repr__(self) -> str:
        return f"CpuExperts({self.name!r}, {getattr(self.qtype, 'name', self.qtype)}, {self.n_expert} x {self.m}x{self.k})"


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


# ------------------------------------------------------------------ routing

@njit(cache=True, error_model="numpy")
def _route(logits, k, softmax_weight, norm_w, w_scale, sel, wts, margin):
    n, E = logits.shape
    p = np.empty(E, np.float32)
    taken = np.zeros(E, np.bool_)
    for i in range(n):
        if softmax_weight:
            for e in range(E):
                p[e] = logits[i, e]
        else:
            mx = logits[i, 0]
            for e in range(1, E):
                if logits[i, e] > mx:
                    mx = logits[i, e]
            s = 0.0
            for e in range(E):
                v = np.float32(np.exp(logits[i, e] - mx))
                p[e] = v
                s += v
            inv = np.float32(1.0 / s)
            for e in range(E):
                p[e] = p[e] * inv
        taken[:] = False
        for j in range(k):
            best = -1
            bv = np.float32(0.0)
            for e in range(E):
                if taken[e]:
                    continue
                if best < 0 or p[e] > bv:
                    best = e
                    bv = p[e]
            taken[best] = True
            sel[i, j] = best
            wts[i, j] = bv
        # the routing margin: the k-th kept logit minus the best left out (inf when none is)
        nxt = -np.inf
        for e in range(E):
            if not taken[e] and logits[i, e] > nxt:
                nxt = logits[i, e]
        margin[i] = logits[i, sel[i, k - 1]] - nxt
        if softmax_weight:
            mx = wts[i, 0]
            for j in range(1, k):
                if wts[i, j] > mx:
                    mx = wts[i, j]
            s = 0.0
            for j in range(k):
                v = np.float32(np.exp(wts[i, j] - mx))
                wts[i, j] = v
                s += v
            inv = np.float32(1.0 / s)
            for j in range(k):
                wts[i, j] = wts[i, j] * inv
        if norm_w:
            s = np.float32(0.0)
            for j in range(k):
                s += wts[i, j]
            if s < MOE_NORM_MIN:
                s = MOE_NORM_MIN
            for j in range(k):
                wts[i, j] = wts[i, j] / s
        if w_scale != 0.0 and w_scale != 1.0:
            for j in range(k):
                wts[i, j] = wts[i, j] * np.float32(w_scale)


def route(logits: np.ndarray, k: int, gating: str, norm_w: bool,
          w_scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-k routing of router logits (n, E) float32 (bias already added), as the ``moe``
    op defines it: returns ``sel`` (n, k) int32 expert ids in decreasing probability (ties:
    lower id first; a NaN row takes the first ids) and ``w`` (n, k) float32 weights.
    gating "softmax": p = softmax(logits), w = p[sel]; "softmax_weight": sel by the raw
    logits, w = softmax of those k. ``norm_w``: w / max(sum w, 6.1e-5); ``w_scale``
    multiplies w unless it is 0 or 1. Third: ``margin`` (n,) float32, the k-th kept logit
    minus the largest one left out: how far the row is from a routing tie, where two
    correct engines may pick different experts (the tests excuse such rows)."""
    n = logits.shape[0]
    sel = np.empty((n, k), np.int32)
    w = np.empty((n, k), np.float32)
    margin = np.empty(n, np.float32)
    if n:
        _route(np.ascontiguousarray(logits, np.float32), int(k), gating == "softmax_weight", bool(norm_w),
               float(w_scale), sel, w, margin)
    return sel, w, margin


# ------------------------------------------------------------------ activations and the join

@njit(cache=True, fastmath=True, error_model="numpy")
def swiglu_oai(gate, up, alpha, limit, out):
    """gpt-oss's clamped SwiGLU (ggml_swiglu_oai): x = min(g, limit), y = clamp(u, -limit,
    limit), out = x / (1 + exp(-alpha x)) * (y + 1). All (n, f) float32 (out may be gate)."""
    n, f = gate.shape
    a = np.float32(alpha)
    lim = np.float32(limit)
    for i in range(n):
        for j in range(f):
            x = min(gate[i, j], lim)
            y = min(max(up[i, j], -lim), lim)
            out[i, j] = x / (np.float32(1.0) + np.exp(-a * x)) * (y + np.float32(1.0))


@njit(cache=True, fastmath=True, error_model="numpy")
def silu_mul(gate, up, out):
    """out = silu(gate) * up, (n, f) float32 (out may be gate)."""
    n, f = gate.shape
    for i in range(n):
        for j in range(f):
            g = gate[i, j]
            out[i, j] = g / (np.float32(1.0) + np.exp(-g)) * up[i, j]


@njit(cache=True, error_model="numpy")
def _join(Y, w, out):
    n, k, d = Y.shape
    for i in range(n):
        for c in range(d):
            acc = w[i, 0] * Y[i, 0, c]
            for j in range(1, k):
                acc = acc + w[i, j] * Y[i, j, c]
            out[i, c] = acc


def join(Y: np.ndarray, w: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[i] = sum_j w[i, j] * Y[i, j] in the order j = 0, 1, ..., k-1 (float32, each
    product and sum rounded; no fused multiply-add reordering). Y: (n, k, d), w: (n, k),
    out: (n, d) float32."""
    if Y.shape[0]:
        _join(Y, w, out)
    return out


@njit(cache=True, error_model="numpy")
def _scatter(Y, y, rows, js):
    for t in range(rows.shape[0]):
        Y[rows[t], js[t]] = y[t]


def groups(sel: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """The (row, slot j) pairs of a routing ``sel`` (n, k) by expert: [(e, rows (c,) int64,
    js (c,) int64)], experts in increasing id, rows increasing within an expert."""
    flat = sel.reshape(-1).astype(np.int64)
    if flat.size == 0:
        return []
    order = np.argsort(flat, kind="stable")
    return _runs(order, flat[order], sel.shape[1])


def _runs(order: np.ndarray, es: np.ndarray, k: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """``groups`` of the flat pair indices ``order`` (sorted by expert, stable), whose
    experts are ``es``."""
    if order.size == 0:
        return []
    cut = np.flatnonzero(np.diff(es)) + 1
    return [(int(es[part_start]), part // k, part % k)
            for part_start, part in zip(np.concatenate(([0], cut)), np.split(order, cut))]


def expert_ffn(gate: CpuExperts, up: CpuExperts, down: CpuExperts, e: int, x: np.ndarray, act: str,
               alpha: float, limit: float, biases: tuple, per_row: bool) -> np.ndarray:
    """Expert e's output on rows x (c, d) float32: down(act(gate x + bg, up x + bu)) + bd,
    (c, d) float32. ``biases``: (gate, up, down) (E, n) arrays or None."""
    bg, bu, bd = biases
    g = gate.matrix(e).matmul(x, per_row=per_row)
    u = up.matrix(e).matmul(x, per_row=per_row)
    if bg is not None:
        g += bg[e]
    if bu is not None:
        u += bu[e]
    if act == "silu":
        silu_mul(g, u, g)
    else:
        swiglu_oai(g, u, alpha, limit, g)
    y = down.matrix(e).matmul(g, per_row=per_row)
    if bd is not None:
        y += bd[e]
    return y


# ------------------------------------------------------------------ the pool

_libc = None


def _setaffinity():
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            f = lib.sched_setaffinity
        except (OSError, AttributeError):
            _libc = False
            return None
        f.argtypes = (ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p)
        f.restype = ctypes.c_int
        _libc = f
    return _libc or None


_pin_kernel = None


def _make_pin_kernel(setaff):
    @njit(parallel=True, cache=False)
    def pin(masks, done, rcs):
        nt = masks.shape[0]
        for _ in prange(nt * 64):
            t = numba.get_thread_id()
            if t > 0 and done[t] == 0:        # thread 0 is the caller: left unpinned
                rcs[t] = setaff(0, masks.shape[1], masks[t].ctypes)
                done[t] = 1
    return pin


@njit(parallel=True, cache=True)
def _touch(flat, step):
    """Read one byte per page of ``flat`` (uint8, 1-D) in parallel: the pages fault in on
    the threads that will read them."""
    n = flat.shape[0]
    pages = (n + step - 1) // step
    acc = 0
    for p in prange(pages):
        acc += flat[p * step]
    return acc


class ExpertPool:
    """The CPU expert pool (module docstring): numba's worker threads, pinned to cores
    before the first expert page is touched, and counters. ``pin=False`` leaves them
    unpinned (tests on a shared machine). One pool per process (``shared()``): numba's
    threads are the process's."""

    _shared: ExpertPool | None = None
    _shared_lock = threading.Lock()

    def __init__(self, pin: bool = True):
        self.pin = bool(pin)
        self.cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.n_threads = numba.get_num_threads()
        self.pinned: dict[int, list[int]] = {}      # calling thread's native id -> core of each worker (-1: not)
        self.rows = 0
        self.expert_calls = 0
        self.seconds = 0.0

    @classmethod
    def shared(cls) -> ExpertPool:
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls(pin=os.environ.get("AOTX_PIN_EXPERT_THREADS", "1") != "0")
            return cls._shared

    def ensure_pinned(self) -> list[int]:
        """Pin the calling thread's numba workers (once per calling thread). Returns the
        core of each numba thread (-1 for the caller and for a worker that could not be
        pinned). Never raises: an OS without sched_setaffinity leaves them unpinned."""
        me = threading.get_native_id()
        got = self.pinned.get(me)
        if got is not None:
            return got
        cores = [-1] * self.n_threads
        setaff = _setaffinity() if self.pin and self.cores else None
        if setaff is not None and self.n_threads > 1:
            global _pin_kernel
            try:
                if _pin_kernel is None:
                    _pin_kernel = _make_pin_kernel(setaff)
                words = (max(self.cores) // 64) + 1
                masks = np.zeros((self.n_threads, words), np.uint64)
                want = [self.cores[t % len(self.cores)] for t in range(self.n_threads)]
                for t, c in enumerate(want):
                    masks[t, c // 64] |= np.uint64(1) << np.uint64(c % 64)
                done = np.zeros(self.n_threads, np.int64)
                rcs = np.full(self.n_threads, -1, np.int64)
                _pin_kernel(masks.view(np.uint8).reshape(self.n_threads, -1), done, rcs)
                cores = [want[t] if t > 0 and done[t] and rcs[t] == 0 else -1 for t in range(self.n_threads)]
            except Exception:  # noqa: BLE001 - pinning is an optimization; never fail a load over it
                cores = [-1] * self.n_threads
        self.pinned[me] = cores
        return cores

    def warm(self, stacks: list[CpuExperts], experts: list[int] | None = None) -> int:
        """Pin, then touch the pages of ``experts`` (default all) of every stack: build
        their QuantMatrices (a repacked copy is written by the pinned workers' pass) and
        fault the file pages in. Returns the bytes the CPU now holds for them."""
        self.ensure_pinned()
        total = 0
        for st in stacks:
            ids = range(st.n_expert) if experts is None else experts
            for e in ids:
                raw = st.raw(e).reshape(-1)
                if raw.size:
                    _touch(raw, _PAGE)
            total += st.materialize(ids)
        return total

    def compute(self, node: dict, x: np.ndarray, sel: np.ndarray, Y: np.ndarray, pairs, small: np.ndarray | None,
                all_small: bool) -> None:
        """Y[r, j] = expert sel[r, j]'s output on x[r] for the pairs ``pairs`` (from
        ``groups``: (e, rows, js) triples) of one moe node (``node``: its attrs). ``small``:
        bool (n,) rows of short segments (per-row kernels), or None with ``all_small``."""
        self.ensure_pinned()
        t0 = time.perf_counter()
        gate, up, down = node["gate"], node["up"], node["down"]
        biases = (node["gate_bias"], node["up_bias"], node["down_bias"])
        act, alpha, limit = node["act"], node["alpha"], node["limit"]
        n_rows = 0
        for e, rows, js in pairs:
            if all_small or small is None:
                parts = ((rows, js, True),)
            else:
                m = small[rows]
                parts = ((rows[m], js[m], True), (rows[~m], js[~m], False))
            for r, j, per_row in parts:
                if r.size == 0:
                    continue
                y = expert_ffn(gate, up, down, e, np.ascontiguousarray(x[r]), act, alpha, limit, biases, per_row)
                _scatter(Y, y, r, j)
                n_rows += int(r.size)
                self.expert_calls += 1
        self.rows += n_rows
        self.seconds += time.perf_counter() - t0

    def stats(self) -> dict[str, Any]:
        return {"threads": self.n_threads, "pinned": {str(k): v for k, v in self.pinned.items()},
                "rows": self.rows, "expert_calls": self.expert_calls, "seconds": round(self.seconds, 4)}


# ------------------------------------------------------------------ tiers on the CPU

CPU_TIERS = ("host", "mmap")


def measure(attrs: dict, rows: tuple[int, ...], pool: ExpertPool, reps: int = 5) -> dict[str, Any]:
    """Seconds for one expert's FFN of this moe node on n rows (for each n in ``rows``),
    the best of ``reps`` runs after a warm-up, on the CPU pool (pinned first). The expert
    measured is the node's expert 0 (all experts of a layer have one shape and type)."""
    pool.ensure_pinned()
    gate, up, down = attrs["gate"], attrs["up"], attrs["down"]
    biases = (attrs["gate_bias"], attrs["up_bias"], attrs["down_bias"])
    rng = np.random.default_rng(0)
    out: dict[int, float] = {}
    for n in rows:
        x = rng.standard_normal((n, gate.k)).astype(np.float32)
        expert_ffn(gate, up, down, 0, x, attrs["act"], attrs["alpha"], attrs["limit"], biases, True)
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            expert_ffn(gate, up, down, 0, x, attrs["act"], attrs["alpha"], attrs["limit"], biases, True)
            best = min(best, time.perf_counter() - t0)
        out[int(n)] = best
    return {"cpu": out}


def place(nodes: list, p: Any, pool: ExpertPool) -> dict[str, Any]:
    """Apply an expert-tier plan on the CPU backend: "host" experts are materialized and
    their pages touched now by the pinned pool; "mmap" ones stay in the file's map until a
    row is routed to them. A "gpu" tier is refused (ValueError): this backend has no GPU.
    Returns {"gpu_bytes": 0, "host_bytes": bytes now held, "recalibrate": True}."""
    held = 0
    for node, tiers in zip(nodes, p.tiers):
        a = node.attrs
        if len(tiers) != a["n_expert"] or any(t not in CPU_TIERS for t in tiers):
            raise ValueError(f"moe layer {a['moe_layer']}: tiers {sorted(set(tiers))} for {a['n_expert']} experts "
                             f"(the CPU backend has {', '.join(CPU_TIERS)})")
        host = [e for e, t in enumerate(tiers) if t == "host"]
        held += pool.warm([a["gate"], a["up"], a["down"]], host)
    return {"gpu_bytes": 0, "host_bytes": held, "recalibrate": True}


# ------------------------------------------------------------------ the whole op on host rows

def moe_rows(attrs: dict, x: np.ndarray, pool: ExpertPool, traffic: np.ndarray | None = None,
             small: np.ndarray | None = None, gpu: Any = None, worker: Any = None) -> np.ndarray:
    """The ``moe`` op on host rows x (n, d) float32: router (+ bias), routing, the experts
    on the pool, the join, the shared expert. ``small``: bool (n,), the rows of short
    segments (decode, verify), which go through the per-row kernels (their numbers
    independent of the batch) while the others take the prefill path; None: every row is
    small. ``attrs``: the node's attributes with CPU weights (``router`` and the shared
    expert's matrices as QuantMatrix, biases as numpy); ``traffic`` (E,) int64 gets the
    routed rows per expert added. For a backend whose own rows live elsewhere (the CUDA
    backend's CPU expert tier).

    ``gpu``: a GPU expert tier (duck typed: ``on`` (E,) bool, the experts it holds;
    ``launch_routed(experts, rows)`` starts their FFNs on the device for the (row, expert)
    pairs given as two (P,) int64 arrays, grouped by expert in increasing id, rows
    increasing within, and returns a handle; ``wait(handle) -> (P, d)`` float32 host
    outputs, one per pair in order). The pairs are split between the tiers with a few
    whole-array operations (no per-expert work for the GPU's). With GPU pairs, the CPU
    pool computes the other pairs on ``worker`` (a one-thread executor: numba releases the
    GIL) while this thread launches the GPU's; both join in Y before the weighted sum, so
    the result does not depend on which tier computed which expert beyond each tier's own
    kernel. Returns (n, d)."""
    x = np.ascontiguousarray(x, np.float32)
    n = x.shape[0]
    d = attrs["down"].m
    if n == 0:
        return np.empty((0, d), np.float32)
    all_small = small is None or bool(small.all())
    if all_small:
        small = None

    def mm(W, v):
        v = np.ascontiguousarray(v)
        if small is None:
            return W.matmul(v, per_row=True)
        y = np.empty((v.shape[0], W.m), np.float32)
        if small.any():
            y[small] = W.matmul(np.ascontiguousarray(v[small]), per_row=True)
        y[~small] = W.matmul(np.ascontiguousarray(v[~small]), per_row=False)
        return y

    logits = mm(attrs["router"], x)
    if attrs["router_bias"] is not None:
        logits += attrs["router_bias"]
    k = attrs["n_used"]
    sel, w, _ = route(logits, k, attrs["gating"], attrs["norm_w"], attrs["w_scale"])
    if traffic is not None:
        traffic += np.bincount(sel.reshape(-1), minlength=traffic.shape[0])
    Y = np.empty((n, k, d), np.float32)
    flat = sel.reshape(-1).astype(np.int64)
    if gpu is None or not gpu.on[flat].any():
        pool.compute(attrs, x, sel, Y, groups(sel), small, all_small)
    else:
        order = np.argsort(flat, kind="stable")      # pairs by expert, rows increasing within
        es = flat[order]
        here = gpu.on[es]
        cpu_pairs = _runs(order[~here], es[~here], k)
        fut = worker.submit(pool.compute, attrs, x, sel, Y, cpu_pairs, small, all_small) if cpu_pairs else None
        g = order[here]
        rows, js = g // k, g % k
        try:
            handle = gpu.launch_routed(es[here], rows)
            yg = gpu.wait(handle)
        finally:
            if fut is not None:
                fut.result()
        _scatter(Y, yg, rows, js)
    y = join(Y, w, np.empty((n, d), np.float32))
    shared = attrs.get("shared")
    if shared is not None:
        g = mm(shared[0], x)
        silu_mul(g, mm(shared[1], x), g)
        h = mm(shared[2], g)
        if attrs.get("shared_gate") is not None:
            h *= 1.0 / (1.0 + np.exp(-mm(attrs["shared_gate"], x)))
        y += h
    return y
