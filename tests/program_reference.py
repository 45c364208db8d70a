"""A float64 numpy interpreter of ``ops.Program``, written from the op semantics of
engine/backend/IR.md (and ``ops.ProgramBuilder``'s docstring), not from any backend.

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
    ang, mscale = spec.angles(positions, n_ctx)   # RopeSpec's formula (YaRN included), in float64
    c = (np.cos(ang) * mscale)[:, None, :]
    s = (np.sin(ang) * mscale)[:, None, :]
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
    sinks = a.get("sinks")
    q, k, v = q.reshape(n, H, hd), k.reshape(n, KV, hd), v.reshape(n, KV, hd)
    out = np.zeros((n, H, hd))
    for i in range(n):
        lo = max(0, i + 1 - window) if window > 0 else 0
        for h in range(H):
            g = h // (H // KV)
            s = a["scale"] * (k[lo:i + 1, g] @ q[i, h])
            m = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            e = np.exp(s - m)
            den = e.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - m))
            out[i, h] = (e / den) @ v[lo:i + 1, g]
    return out.reshape(n, H * hd)


def _experts(st, cache: dict) -> list[np.ndarray]:
    key = id(st)
    if key not in cache:
        cache[key] = [np.asarray(st.dequantize(e), np.float64) for e in range(st.n_expert)]
    return cache[key]


def _moe(x: np.ndarray, a: dict, mats: dict, r: np.ndarray | None = None) -> np.ndarray:
    """ops.ProgramBuilder.moe's definition, row by row, in float64 (``r``: the router's
    own input, when the node has one)."""
    n, d = x.shape
    lg = (x if r is None else r) @ _matrix(a["router"], mats).T
    if a["router_bias"] is not None:
        lg = lg + np.asarray(a["router_bias"], np.float64)
    G, U, D = (_experts(a[k], mats) for k in ("gate", "up", "down"))
    bias = [None if a[k] is None else np.asarray(a[k], np.float64) for k in ("gate_bias", "up_bias", "down_bias")]
    k = a["n_used"]
    out = np.zeros((n, d))
    for i in range(n):
        p = np.exp(lg[i] - lg[i].max()) / np.exp(lg[i] - lg[i].max()).sum() if a["gating"] == "softmax" else lg[i]
        sel = sorted(range(a["n_expert"]), key=lambda e: (-p[e], e))[:k]
        w = p[sel]
        if a["gating"] == "softmax_weight":
            w = np.exp(w - w.max()) / np.exp(w - w.max()).sum()
        if a["norm_w"]:
            w = w / max(w.sum(), 6.103515625e-5)
        if a["w_scale"] not in (0.0, 1.0):
            w = w * a["w_scale"]
        for j, e in enumerate(sel):
            g, u = G[e] @ x[i], U[e] @ x[i]
            if bias[0] is not None:
                g, u = g + bias[0][e], u + bias[1][e]
            if a["act"] == "silu":
                h = g / (1.0 + np.exp(-g)) * u
            elif a["act"] == "gelu_tanh":
                h = 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3))) * u
            else:
                gc, uc = np.minimum(g, a["limit"]), np.clip(u, -a["limit"], a["limit"])
                h = gc / (1.0 + np.exp(-a["alpha"] * gc)) * (uc + 1.0)
            y = D[e] @ h
            if a.get("down_scale") is not None:
                y = y * float(a["down_scale"][e])
            if bias[2] is not None:
                y = y + bias[2][e]
            out[i] += w[j] * y
    if a["shared"] is not None:
        sg, su, sd = (_matrix(m, mats) for m in a["shared"])
        g = x @ sg.T
        h = (g / (1.0 + np.exp(-g)) * (x @ su.T)) @ sd.T
        if a["shared_gate"] is not None:
            h = h / (1.0 + np.exp(-(x @ _matrix(a["shared_gate"], mats).T)))
        out = out + h
    return out


def _short_conv(x: np.ndarray, w: np.ndarray, act: str) -> np.ndarray:
    """ops.ProgramBuilder.short_conv from position 0 (zero state): out[t] = sum_j w[:, j] x[t-K+1+j]."""
    n, C = x.shape
    K = w.shape[1]
    u = np.concatenate([np.zeros((K - 1, C)), x])
    y = sum(w[:, j] * u[j:j + n] for j in range(K))
    return y / (1.0 + np.exp(-y)) if act == "silu" else y


def _delta_rule(q, k, v, alpha, beta, a: dict) -> np.ndarray:
    """ops.ProgramBuilder.delta_rule from position 0 (zero state), in float64: per value
    head h (key head h % n_k_heads, or h // (H / n_k_heads) for "grouped" key_heads),
    S = exp(g) S; d = b (v - S^T k); S += k d^T; o = scale S^T q."""
    n = q.shape[0]
    Hk, H, S = a["n_k_heads"], a["n_v_heads"], a["head_dim"]
    A, dtb = np.asarray(a["a"], np.float64), np.asarray(a["dt_bias"], np.float64)
    q, k, v = q.reshape(n, Hk, S), k.reshape(n, Hk, S), v.reshape(n, H, S)
    x = alpha + dtb
    g = A * np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))
    b = 1.0 / (1.0 + np.exp(-beta))
    out = np.zeros((n, H, S))
    for h in range(H):
        St = np.zeros((S, S))
        hk = h % Hk if a.get("key_heads", "tiled") == "tiled" else h // (H // Hk)
        for t in range(n):
            St = np.exp(g[t, h]) * St
            d = b[t, h] * (v[t, h] - St.T @ k[t, hk])
            St = St + np.outer(k[t, hk], d)
            out[t, h] = a["scale"] * (St.T @ q[t, hk])
    return out.reshape(n, H * S)


def reference_logits(program, tokens, n_ctx: int | None = None, inputs: dict | None = None) -> np.ndarray:
    """(n, vocab) float64 logits of ``tokens`` (one sequence from position 0). ``n_ctx``:
    the context size a KV cache would have (it selects Phi-3's long or short RoPE factors;
    default len(tokens)); ``inputs``: the rows of the program's ``input`` ops by name."""
    tokens = np.asarray(tokens, np.int64)
    n = tokens.shape[0]
    n_ctx = n if n_ctx is None else n_ctx
    positions = np.arange(n)
    mats: dict = {}
    env: dict[int, np.ndarray] = {}
    kvs: dict[int, tuple[np.ndarray, np.ndarray]] = {}     # attention layer -> its K and V
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
            kvs[a["layer"]] = (x[1], x[2])
            y = _attention(x[0], x[1], x[2], a)
        elif op == "shared_attention":
            y = _attention(x[0], *kvs[a["layer"]], a)
        elif op == "lookup":
            y = _matrix(a["table"], mats)[tokens] * a["scale"]
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
        elif op == "moe":
            y = _moe(x[0], a, mats, x[1] if len(x) > 1 else None)
        elif op == "short_conv":
            y = _short_conv(x[0], np.asarray(a["weight"], np.float64), a["act"])
        elif op == "delta_rule":
            y = _delta_rule(*x, a)
        elif op == "l2_norm":
            hd = a["head_dim"]
            x3 = x[0].reshape(n, -1, hd)
            y = (x3 / np.sqrt(np.sum(x3 * x3, axis=-1, keepdims=True) + a["eps"])).reshape(n, -1)
        elif op == "sigmoid_gate":
            y = x[0] / (1.0 + np.exp(-x[1]))
        elif op == "mul":
            y = x[0] * x[1]
        elif op == "input":
            y = np.asarray(inputs[a["name"]], np.float64)
        elif op == "concat":
            y = np.concatenate([x[0], x[1]], axis=1)
        elif op == "deinterleave":
            x4 = x[0].reshape(n, -1, a["parts"], a["head_dim"])
            for j, o in enumerate(node.outs):
                env[o.id] = x4[:, :, j, :].reshape(n, -1)
            continue
        else:
            raise ValueError(f"unknown op {op!r}")
        env[node.out.id] = y
    return env[program.output.id]
