"""The ``moe`` op's arithmetic on the CPU, per row: routing, one expert's FFN, the join.

Owns:
* ``route``: the ``moe`` op's routing (ops.ProgramBuilder.moe): top-k of the softmax or of
  the raw logits, each family's normalisation, in float32 with a float64 softmax sum.
* the activations (``silu_mul``, gpt-oss's ``swiglu_oai``, Gemma 4's ``gelu_mul``),
  ``expert_ffn`` (one expert's gated FFN on the rows routed to it), ``groups`` (the (row, slot) pairs by expert) and
  ``join``: the weighted sum of a row's k expert outputs in selection order (j = 0 ..
  k-1), whatever computed them: a row's numbers do not depend on which tier ran which
  expert beyond that expert's own kernel, nor on the other rows.
Leaves to others: the stacks (stacks.py), the fused layer kernel (fused.py), the pool
and the whole op (pool.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from aotx.engine.backend.cpu.experts.stacks import CpuExperts

MOE_NORM_MIN = np.float32(6.103515625e-5)   # ops.MOE_NORM_MIN (llama.cpp's clamp of the weight sum)


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


@njit(cache=True, fastmath=True, error_model="numpy")
def gelu_mul(gate, up, out):
    """GeGLU: out = gelu(gate) * up with GELU's tanh form, the expression of the glu op's
    kernel (cpu/ops.py gelu_tanh_mul). (n, f) float32 (out may be gate)."""
    n, f = gate.shape
    c = np.float32(0.7978845608028654)
    a3 = np.float32(0.044715)
    for i in range(n):
        for j in range(f):
            g = gate[i, j]
            out[i, j] = np.float32(0.5) * g * (np.float32(1.0) + np.tanh(c * (g + a3 * g * g * g))) * up[i, j]


#: the fused kernel's activation codes (fused.py), by the moe op's ``act``
ACT_CODES = {"silu": 0, "swiglu_oai": 1, "gelu_tanh": 2}


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
    elif act == "gelu_tanh":
        gelu_mul(g, u, g)
    else:
        swiglu_oai(g, u, alpha, limit, g)
    y = down.matrix(e).matmul(g, per_row=per_row)
    if bd is not None:
        y += bd[e]
    return y
