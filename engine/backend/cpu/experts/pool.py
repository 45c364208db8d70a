"""The CPU expert pool: pinned worker threads, the tiers it holds, and the moe op on host rows.

Owns:
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
* ``measure`` (the calibration's CPU timings of a layer) and ``place`` (a tier plan
  applied on the CPU backend: "host" experts materialized and touched, "mmap" ones left
  in the file's map).
* ``moe_rows``: the whole ``moe`` op on host rows (router, routing, the experts on the
  pool, a GPU tier's pairs beside them, the join, the shared expert): the CPU backend's
  rows and the CUDA backend's host step.
Leaves to others: which experts the CPU computes (engine/model/experts.py), the stacks
(stacks.py), the arithmetic (ffn.py, fused.py), the GPU tier (the CUDA backend, duck typed).
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
from numba import njit, prange

from aotx.engine.backend.cpu.experts.ffn import _runs, _scatter, expert_ffn, groups, join, route, silu_mul
from aotx.engine.backend.cpu.experts.fused import FusedExperts, fused_for
from aotx.engine.backend.cpu.experts.stacks import _PAGE, CpuExperts

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
            if len(set(ids)) == st.n_expert:
                st.prefer_huge_pages()
            for e in ids:
                raw = st.raw(e).reshape(-1)
                if raw.size:
                    _touch(raw, _PAGE)
            total += st.materialize(ids, threads=self.n_threads)
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

    def run_fused(self, fused: FusedExperts, x: np.ndarray, sel: np.ndarray, Y: np.ndarray,
                  skip: np.ndarray | None = None, traffic: np.ndarray | None = None) -> None:
        """``compute`` of every pair of ``sel`` whose expert is not in ``skip`` through the
        fused layer kernel (one call for the layer)."""
        self.ensure_pinned()
        t0 = time.perf_counter()
        P, G = fused.run(x, sel, Y, skip, traffic)
        self.rows += P
        self.expert_calls += G
        self.seconds += time.perf_counter() - t0

    def stats(self) -> dict[str, Any]:
        return {"threads": self.n_threads, "pinned": {str(k): v for k, v in self.pinned.items()},
                "rows": self.rows, "expert_calls": self.expert_calls, "seconds": round(self.seconds, 4)}


# ------------------------------------------------------------------ tiers on the CPU

CPU_TIERS = ("host", "mmap")


def measure(attrs: dict, rows: tuple[int, ...], pool: ExpertPool, reps: int = 5) -> dict[str, Any]:
    """Seconds per expert of this moe node's FFN on n rows (for each n in ``rows``), the
    best of ``reps`` runs after a warm-up, on the CPU pool (pinned first), through the
    kernel the layer runs. With the fused kernel the timing is a layer's call as decode and
    prefill make it: n rows, each routed to the same ``n_used`` experts (0 .. n_used - 1; a
    layer's experts have one shape and type), divided by n_used, so the plan's "n_used x
    one expert" is the layer's measured time, its threads' parallelism included (one
    expert's call alone, times n_used, priced a decode layer at up to the thread count
    times what it took: the H200 benchmark's plan said 2.6 tok/s where 7.7 ran). Without
    it, one expert's call (expert 0) on n rows."""
    pool.ensure_pinned()
    gate, up, down = attrs["gate"], attrs["up"], attrs["down"]
    biases = (attrs["gate_bias"], attrs["up_bias"], attrs["down_bias"])
    rng = np.random.default_rng(0)
    out: dict[int, float] = {}
    fused = fused_for(attrs)
    k_used = max(1, min(int(attrs.get("n_used", 1) or 1), int(attrs.get("n_expert", 1) or 1)))
    for n in rows:
        x = rng.standard_normal((n, gate.k)).astype(np.float32)
        per = 1
        if fused is not None:           # what the layer runs: the fused kernel, n rows x n_used experts
            per = k_used
            sel = np.ascontiguousarray(np.broadcast_to(np.arange(k_used, dtype=np.int32), (n, k_used)))
            Y = np.empty((n, k_used, down.m), np.float32)

            def once():
                fused.run(x, sel, Y)
        else:
            def once():
                expert_ffn(gate, up, down, 0, x, attrs["act"], attrs["alpha"], attrs["limit"], biases, True)
        once()
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            once()
            best = min(best, time.perf_counter() - t0)
        out[int(n)] = best / per
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

def _gpu_pairs(gpu: Any, Y: np.ndarray, g: np.ndarray, experts: np.ndarray, k: int, fut: Any) -> None:
    """The GPU tier's share of a moe op: the flat pairs ``g`` (row * k + j, sorted by expert,
    ``experts`` theirs) computed on the device while the CPU tier's future ``fut`` (or None)
    runs; joins it, then writes the GPU's rows into Y."""
    rows, js = g // k, g % k
    try:
        yg = gpu.wait(gpu.launch_routed(experts, rows))
    finally:
        if fut is not None:
            fut.result()
    _scatter(Y, yg, rows, js)


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
    if attrs.get("down_scale") is not None:
        raise ValueError(f"moe_rows: per-expert down scales ({attrs['down'].name}) are run by the CPU executor only")
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
    fused = fused_for(attrs)
    if gpu is None or not gpu.on[flat].any():
        if fused is not None:
            pool.run_fused(fused, x, sel, Y)
        else:
            pool.compute(attrs, x, sel, Y, groups(sel), small, all_small)
    elif fused is not None:                          # the CPU's pairs: every expert the GPU does not hold
        fut = worker.submit(pool.run_fused, fused, x, sel, Y, np.ascontiguousarray(gpu.on, np.bool_))
        order = np.argsort(flat, kind="stable")
        es = flat[order]
        here = gpu.on[es]
        _gpu_pairs(gpu, Y, order[here], es[here], k, fut)
    else:
        order = np.argsort(flat, kind="stable")      # pairs by expert, rows increasing within
        es = flat[order]
        here = gpu.on[es]
        cpu_pairs = _runs(order[~here], es[~here], k)
        fut = worker.submit(pool.compute, attrs, x, sel, Y, cpu_pairs, small, all_small) if cpu_pairs else None
        _gpu_pairs(gpu, Y, order[here], es[here], k, fut)
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
