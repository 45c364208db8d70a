"""A float64 numpy interpreter of ``ops.Program``, written from the op semantics of
/work/coord/IR.md (and ``ops.ProgramBuilder``'s docstring), not from any backend.

``reference_logits(program, tokens)`` runs one sequence from position 0 in one slot and
returns (n, vocab) float64 logits of every position (``take_rows`` keeps every row). The
weights come from the program's own weight objects: a matrix's dequantized rows
(``W.rows``, exact float32 values of the file's blocks) and the vectors' float32 values,
both widened to float64. Any backend's executor must agree with it to float32 rounding
when it computes in float32 with a float32 KV cache. Developer tooling for tests; slow
(a Python loop over heads) and meant for tiny files.
"""

from __future__ import annotations

import numpy as np


def _matrix(W, cache: dict) -> np.ndarray:
    key = id(W)
    if key not in cache:
        cache[key] = np.asarray(W.rows(np.arange(W.m)), np.float64)
    return cache[key]


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, spec, head_dim: int, positions: np.ndarray, n_ctx: int) -> np.ndarray:
    n = x.shape[0]
    x = x.reshape(n, -1, head_dim).copy()
    half = spec.dim // 2
    j = np.arange(half, dtype=np.float64)
    inv = spec.base ** (-2.0 * j / spec.dim)
    ff = spec.factors_for(n_ctx)
    if ff is not None:
        inv = inv / np.asarray(ff, np.float64)
    ang = positions[:, None].astype(np.float64) * spec.freq_scale * inv[None, :]
    c = (np.cos(ang) * spec.attn_factor)[:, None, :]
    s = (np.sin(ang) * spec.attn_factor)[:, None, :]
    if spec.mode == "normal":
        ia, ib = np.arange(0, spec.dim, 2), np.arange(1, spec.dim, 2)
    else:
        ia, ib = np.arange(half), np.arange(half, spec.dim)
    a, b = x[:, :, ia].copy(), x[:, :, ib].copy()
    x[:, :, ia] = a * c - b * s
    x[:, :, ib] = a * s + b * c
    return x.reshape(n, -1)


def _attention(q, k, v, a: dict) -> np.ndarray:
    n = q.shape[0]
    H, KV, hd, window = a["n_heads"], a["n_kv_heads"], a["head_dim"], a["window"]
    q, k, v = q.reshape(n, H, hd), k.reshape(n, KV, hd), v.reshape(n, KV, hd)
    out = np.zeros((n, H, hd))
    for i in range(n):
        lo = max(0, i + 1 - window) if window > 0 else 0
        for h in range(H):
            g = h // (H // KV)
            s = a["scale"] * (k[lo:i + 1, g] @ q[i, h])
            s = np.exp(s - s.max())
            out[i, h] = (s / s.sum()) @ v[lo:i + 1, g]
    return out.reshape(n, H * hd)


def reference_logits(program, tokens, n_ctx: int | None = None) -> np.ndarray:
    """(n, vocab) float64 logits of ``tokens`` (one sequence from position 0). ``n_ctx``:
    the context size a KV cache would have (it selects Phi-3's long or short RoPE factors;
    default len(tokens))."""
    tokens = np.asarray(tokens, np.int64)
    n = tokens.shape[0]
    n_ctx = n if n_ctx is None else n_ctx
    positions = np.arange(n)
    mats: dict = {}
    env: dict[int, np.ndarray] = {}
    for node in program.nodes:
        a, op = node.attrs, node.op
        x = [env[v.id] for v in node.inputs]
        if op == "embed":
            y = _matrix(a["table"], mats)[tokens] * a["scale"]
        elif op == "rms_norm":
            y = _rms(x[0], np.asarray(a["weight"], np.float64), a["eps"])
        elif op == "head_rms_norm":
            hd = a["head_dim"]
            y = _rms(x[0].reshape(n, -1, hd), np.asarray(a["weight"], np.float64), a["eps"]).reshape(n, -1)
        elif op == "linear":
            y = x[0] @ _matrix(a["weight"], mats).T
            if a["bias"] is not None:
                y = y + np.asarray(a["bias"], np.float64)
        elif op == "split":
            for o, off in zip(node.outs, a["offsets"]):
                env[o.id] = x[0][:, off:off + o.width]
            continue
        elif op == "rope":
            y = _rope(x[0], a["spec"], a["head_dim"], positions, n_ctx)
        elif op == "attention":
            y = _attention(x[0], x[1], x[2], a)
        elif op == "glu":
            g = x[0]
            act = g / (1.0 + np.exp(-g)) if a["act"] == "silu" else \
                0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))
            y = act * x[1]
        elif op == "add":
            y = x[0] + x[1]
        elif op == "scale":
            y = a["s"] * x[0]
        elif op == "softcap":
            y = a["cap"] * np.tanh(x[0] / a["cap"])
        elif op == "take_rows":
            y = x[0]
        else:
            raise ValueError(f"unknown op {op!r}")
        env[node.out.id] = y
    return env[program.output.id]
