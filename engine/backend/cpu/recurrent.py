"""The recurrent layers on the CPU: short causal convolution and the gated delta rule, with
the per-slot state they carry.

Owns: the ops ``short_conv`` (the serial kernel, or ``conv_rows_par`` from PAR_ROWS rows),
``delta_rule`` (one recurrence for decode, verify and short prefill rows; the chunked form
for whole aligned chunks of long prefill segments), ``l2_norm``, ``sigmoid_gate``, ``mul`` and
``deinterleave`` (their numba kernels: cpu/recurrent_kernels.py, re-exported here), the
closures of ``input`` (caller rows) and ``concat`` (a multi-token-prediction head's); the state
(``RecurrentState``: one buffer per ``ops.StateLayer``, the position each slot's state
stands at, snapshot / restore for capsules, rollback of a verify window); and the closures
``CpuProgram`` binds for these ops (``compile_node``). Leaves matmuls, attention and the
order of ops to cpu/program.py and the architecture.

Positions: a slot's recurrent state has consumed exactly the positions 0 .. pos-1, so a
segment must start at pos (continuing) or at 0 (a fresh sequence: the state is zeroed);
anything else raises ValueError (the runtime reuses a hybrid slot's prefix only where its
state stands: IR.md section 9).

Batch invariance: every kernel computes a (slot, head) from that slot's state and its own
rows, by one fixed sequence of operations. The chunked form runs only on whole chunks of
CHUNK positions aligned to multiples of CHUNK inside one segment (prefill); every other
row - decode, speculative verify, the ragged ends of a prefill segment - runs the
recurrence. So a row's bits never depend on the other segments of the batch; the chunked
form differs from the recurrence by float32 rounding only (tests/test_recurrent_ops.py),
and a prompt prefilled in pieces whose boundaries are multiples of CHUNK gives the bits of
one piece. Which convolution a batch runs (serial, or rows in parallel from PAR_ROWS rows)
changes no bit: both run each element's same sequence of operations.

Rollback (speculative decoding): a segment of 2 .. UNDO_ROWS rows keeps the slot's state
from before it and the rows' inputs; ``rollback(slot, pos)`` restores that state and runs
the same recurrence over the kept rows again, which reproduces their state bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aotx.engine.backend.cpu.parallel import PARALLEL
from aotx.engine.backend.cpu.recurrent_kernels import (  # noqa: F401 (the kernels, re-exported)
    _chunk_by_heads, _gates, conv_rows, conv_rows_par, delta_chunk, delta_rows, l2_rows, sigmoid_gate_rows,
    unit_lower_solve)

CHUNK = 64          # delta rule: positions per chunk of the chunked (prefill) form
UNDO_ROWS = 16      # segments of 2 .. UNDO_ROWS rows can be rolled back (verify windows)
PAR_ROWS = 16       # the convolution runs its rows in parallel from this many rows of a forward

class RecurrentState:
    """Every recurrent buffer of every slot (``buffers[i]``: (n_slots, *layers[i].shape)
    float32, zero at first) and ``pos`` (n_slots,): the positions each slot's state has
    consumed. ``names`` are the capsule's buffer names, ``"<kind>.<i>"``.

    Per forward ``begin(layout)`` checks each segment's start against ``pos`` (zeroing a
    slot that starts at 0) and keeps undo data for short segments; the op closures read
    the segment table; ``end()`` advances ``pos``."""

    def __init__(self, layers: tuple, n_slots: int):
        self.layers = tuple(layers)
        self.names = tuple(f"{L.kind}.{i}" for i, L in enumerate(self.layers))
        self.buffers = [np.zeros((n_slots,) + tuple(L.shape), np.float32) for L in self.layers]
        self.pos = np.zeros(n_slots, np.int64)
        self.n_slots = n_slots
        self.seg_slot = self.seg_row0 = self.seg_n = self.seg_pos = np.zeros(0, np.int64)
        self.undo: dict[int, dict[str, Any]] = {}     # slot -> its last short segment's undo data

    @staticmethod
    def nbytes(layers: tuple, n_slots: int) -> int:
        return sum(4 * n_slots * int(np.prod(L.shape)) for L in layers)

    # ---- per forward ------------------------------------------------------------------

    def begin(self, layout: Any) -> None:
        segs = layout.segments
        self.seg_slot = np.array([s.slot for s in segs], np.int64)
        self.seg_row0 = np.asarray(layout.row0, np.int64)
        self.seg_n = np.array([s.n for s in segs], np.int64)
        self.seg_pos = np.array([s.pos for s in segs], np.int64)
        for s in segs:
            if s.pos == 0:
                for b in self.buffers:
                    b[s.slot] = 0.0
                self.pos[s.slot] = 0
            elif s.pos != self.pos[s.slot]:
                raise ValueError(f"slot {s.slot}: its recurrent state stands at position {int(self.pos[s.slot])}, "
                                 f"but a segment starts at {s.pos} (a hybrid model's state cannot be trimmed)")
            if 1 < s.n <= UNDO_ROWS:
                self.undo[s.slot] = {"pos": s.pos, "n": s.n, "pre": [b[s.slot].copy() for b in self.buffers],
                                     "inputs": [None] * len(self.buffers)}
            else:
                self.undo.pop(s.slot, None)

    def end(self) -> None:
        for slot, p, n in zip(self.seg_slot, self.seg_pos, self.seg_n):
            self.pos[slot] = p + n

    def undo_of(self, seg: int) -> dict[str, Any] | None:
        """The undo record segment ``seg`` of this forward fills (its ops keep their input
        rows there), or None when it cannot be rolled back."""
        u = self.undo.get(int(self.seg_slot[seg]))
        return u if u is not None and u["pos"] == self.seg_pos[seg] else None

    # ---- the interface the runtime and capsules use -----------------------------------

    def position(self, slot: int) -> int:
        return int(self.pos[slot])

    def snapshot(self, slot: int, n: int) -> dict[str, np.ndarray]:
        """Copies of ``slot``'s buffers by name; ValueError unless the state stands at ``n``."""
        if n != self.pos[slot]:
            raise ValueError(f"slot {slot}: its recurrent state stands at position {int(self.pos[slot])}, not {n}")
        return {name: b[slot].copy() for name, b in zip(self.names, self.buffers)}

    def restore(self, slot: int, bufs: dict[str, np.ndarray], n: int) -> None:
        """Byte-exact inverse of ``snapshot``: the buffers back, the state at position ``n``.
        ValueError when a buffer is missing or of another shape or dtype (nothing written)."""
        for name, b in zip(self.names, self.buffers):
            x = bufs.get(name)
            if x is None or x.shape != b.shape[1:] or np.dtype(x.dtype) != np.float32:
                raise ValueError(f"recurrent buffer {name}: {'missing' if x is None else f'{x.shape} {x.dtype}'}, "
                                 f"expected {b.shape[1:]} float32")
        for name, b in zip(self.names, self.buffers):
            b[slot] = bufs[name]
        self.pos[slot] = n
        self.undo.pop(slot, None)

    def rollback(self, slot: int, n: int) -> None:
        """Put ``slot``'s state back at position ``n``, inside its last short segment (a
        rejected draft suffix): the state before the segment, then the kept rows again
        through the same kernels. ValueError when the slot has no such segment."""
        if n == self.pos[slot]:
            return
        u = self.undo.get(slot)
        if u is None or not u["pos"] <= n < u["pos"] + u["n"]:
            raise ValueError(f"slot {slot}: cannot roll its recurrent state back from {int(self.pos[slot])} to {n}")
        keep = n - u["pos"]
        for i, (L, b) in enumerate(zip(self.layers, self.buffers)):
            b[slot] = u["pre"][i]
            if keep == 0:
                continue
            rows = u["inputs"][i]
            one = np.zeros(1, np.int64)
            if L.kind == "conv":
                x, w, silu = rows
                conv_rows(x[:keep], w, b, one + slot, one * 0, one + keep, silu,
                          np.empty((keep, x.shape[1]), np.float32))
            else:
                q, k, v, al, be, a, dtb, kmap, scale = rows
                delta_rows(q, k, v, al, be, a, dtb, b[slot], 0, keep, kmap, scale,
                           np.empty((v.shape[0], v.shape[1]), np.float32))
        self.pos[slot] = n
        del self.undo[slot]


# ---- the op closures CpuProgram binds (its buffers, aliases and env) ----------------------

def compile_node(prog: Any, i: int, node: Any):
    """The closure ``run(env, bt, kv)`` of new-op node ``node`` (index ``i``) of CpuProgram
    ``prog``; ``kv.state`` is the RecurrentState."""
    return _COMPILERS[node.op](prog, i, node)


def _out(prog: Any, node: Any, bt: Any, rows: int, width: int) -> np.ndarray:
    s = prog._slot(node.out)
    return bt.views[s] if s >= 0 else np.empty((rows, width), np.float32)


def _c_short_conv(prog, i, node):
    w = np.ascontiguousarray(node.attrs["weight"], np.float32)
    silu, L, xi, oi = node.attrs["act"] == "silu", node.attrs["state"], node.inputs[0].id, node.out.id
    C = node.out.width

    def run(env, bt, kv):
        st = kv.state
        x = env[xi]
        y = _out(prog, node, bt, bt.n, C)
        for s in range(st.seg_slot.shape[0]):
            u = st.undo_of(s)
            if u is not None:
                r0, n = int(st.seg_row0[s]), int(st.seg_n[s])
                u["inputs"][L] = (np.array(x[r0:r0 + n]), w, silu)
        conv = conv_rows_par if bt.n >= PAR_ROWS and PARALLEL.ready else conv_rows
        conv(x, w, st.buffers[L], st.seg_slot, st.seg_row0, st.seg_n, silu, y)
        env[oi] = y
    return run


def _c_delta_rule(prog, i, node):
    A = node.attrs
    Hk, H, S, scale, L = A["n_k_heads"], A["n_v_heads"], A["head_dim"], A["scale"], A["state"]
    a = np.ascontiguousarray(A["a"], np.float32)
    dtb = np.ascontiguousarray(A["dt_bias"], np.float32)
    qi, ki, vi, ai, bi = (x.id for x in node.inputs)
    oi = node.out.id
    heads = np.arange(H) % Hk if A["key_heads"] == "tiled" else np.arange(H) // (H // Hk)   # each v head's k head

    def run(env, bt, kv):
        st = kv.state
        q, k, v, al, be = env[qi], env[ki], env[vi], env[ai], env[bi]
        y = _out(prog, node, bt, bt.n, H * S)
        M_all = st.buffers[L]
        for s in range(st.seg_slot.shape[0]):
            slot, r0, n, p = int(st.seg_slot[s]), int(st.seg_row0[s]), int(st.seg_n[s]), int(st.seg_pos[s])
            u = st.undo_of(s)
            if u is not None:
                u["inputs"][L] = (np.array(q[r0:r0 + n]), np.array(k[r0:r0 + n]), np.array(v[r0:r0 + n]),
                                  np.array(al[r0:r0 + n]), np.array(be[r0:r0 + n]), a, dtb, heads, scale)
            M = M_all[slot]
            c0 = min(p + n, -(-p // CHUNK) * CHUNK)      # the first aligned chunk boundary
            c1 = max(c0, (p + n) // CHUNK * CHUNK)       # the last one
            if c0 > p:
                delta_rows(q, k, v, al, be, a, dtb, M, r0, r0 + c0 - p, heads, scale, y)
            for c in range(c0, c1, CHUNK):
                lo = r0 + c - p
                rs = slice(lo, lo + CHUNK)
                g, b = _gates(al[rs], be[rs], a, dtb)
                qh = np.ascontiguousarray(q[rs].reshape(CHUNK, Hk, S)[:, heads].transpose(1, 0, 2))
                kh = np.ascontiguousarray(k[rs].reshape(CHUNK, Hk, S)[:, heads].transpose(1, 0, 2))
                vh = np.ascontiguousarray(v[rs].reshape(CHUNK, H, S).transpose(1, 0, 2))
                o = np.empty((H, CHUNK, S), np.float32)
                _chunk_by_heads(qh, kh, vh, np.ascontiguousarray(g.T), np.ascontiguousarray(b.T), M, scale, o)
                y[rs] = o.transpose(1, 0, 2).reshape(CHUNK, H * S)
            if c1 < p + n:
                delta_rows(q, k, v, al, be, a, dtb, M, r0 + c1 - p, r0 + n, heads, scale, y)
        env[oi] = y
    return run


def _c_l2_norm(prog, i, node):
    hd, eps, xi, oi, w = node.attrs["head_dim"], node.attrs["eps"], node.inputs[0].id, node.out.id, node.out.width

    def run(env, bt, kv):
        x = env[xi]
        y = _out(prog, node, bt, x.shape[0], w)
        l2_rows(x, hd, eps, y)
        env[oi] = y
    return run


def _c_sigmoid_gate(prog, i, node):
    xi, gi, oi, w = node.inputs[0].id, node.inputs[1].id, node.out.id, node.out.width

    def run(env, bt, kv):
        x = env[xi]
        y = _out(prog, node, bt, x.shape[0], w)
        sigmoid_gate_rows(x, env[gi], y)
        env[oi] = y
    return run


def _c_mul(prog, i, node):
    ai, bi, oi, w = node.inputs[0].id, node.inputs[1].id, node.out.id, node.out.width

    def run(env, bt, kv):
        a = env[ai]
        y = _out(prog, node, bt, a.shape[0], w)
        np.multiply(a, env[bi], out=y)
        env[oi] = y
    return run


def _c_deinterleave(prog, i, node):
    hd, parts, xi = node.attrs["head_dim"], node.attrs["parts"], node.inputs[0].id
    outs = [o.id for o in node.outs]
    s0 = prog._slot(node.outs[0])
    w = node.outs[0].width

    def run(env, bt, kv):
        x = env[xi]
        n = x.shape[0]
        x3 = x.reshape(n, w // hd, parts, hd)
        for j, oid in enumerate(outs):
            y = bt.views[s0] if (j == 0 and s0 >= 0) else np.empty((n, w), np.float32)
            y.reshape(n, w // hd, hd)[:] = x3[:, :, j, :]
            env[oid] = y
    return run


def _c_input(prog, i, node):
    name, oi, w = node.attrs["name"], node.out.id, node.out.width

    def run(env, bt, kv):
        x = prog.inputs.get(name)
        if x is None or x.shape != (bt.n, w):
            raise ValueError(f"input {name!r}: expected ({bt.n}, {w}) rows, got "
                             f"{None if x is None else x.shape}")
        env[oi] = np.ascontiguousarray(x, np.float32)
    return run


def _c_concat(prog, i, node):
    ai, bi, oi, w = node.inputs[0].id, node.inputs[1].id, node.out.id, node.out.width
    wa = node.inputs[0].width

    def run(env, bt, kv):
        a = env[ai]
        y = _out(prog, node, bt, a.shape[0], w)
        y[:, :wa] = a
        y[:, wa:] = env[bi]
        env[oi] = y
    return run


def _c_lookup(prog, i, node):
    table, scale, oi = node.attrs["table"], np.float32(node.attrs["scale"]), node.out.id

    def run(env, bt, kv):
        ids = bt.tokens.astype(np.int64)
        if bt.embeds is not None:
            ids[bt.embeds[0]] = 0
        x = table.rows(ids)
        if scale != 1.0:
            x *= scale
        env[oi] = x
    return run


def _c_shared_attention(prog, i, node):
    """``attention`` without its store, over the KV of layer ``attrs["layer"]`` (cpu/program.py's
    ``_c_attention``, the same kernel and bookkeeping)."""
    from aotx.engine.backend.cpu import attention as cpu_attention
    from aotx.engine.backend.cpu import fdot as cpu_fdot

    a = node.attrs
    L, H, hd, window = a["layer"], a["n_heads"], a["head_dim"], int(a["window"])
    scale = np.float32(a["scale"])
    sinks = cpu_attention.checked_sinks(a["scale"], None, H)
    qi, oi, so = node.inputs[0].id, node.out.id, prog._slot(node.out)
    kernel_for, mode = cpu_attention.kernel_for, cpu_fdot.HOST_F16

    def run(env, bt, kv):
        n = bt.n
        q = np.ascontiguousarray(env[qi]).reshape(n, H, hd)
        y = bt.views[so] if so >= 0 else np.empty((n, H * hd), np.float32)
        keys = bt.keys.get(window)
        if keys is None:
            keys = bt.keys[window] = cpu_attention.attended_keys(bt.lengths, window)
        kernel_for(keys, H, hd, kv.half)(mode, q, kv.k[L], kv.v[L], bt.slots, bt.lengths, scale, window,
                                         y.reshape(n, H, hd), kv.half, sinks, False)
        env[oi] = y
    return run


_COMPILERS = {"short_conv": _c_short_conv, "lookup": _c_lookup, "shared_attention": _c_shared_attention, "delta_rule": _c_delta_rule, "l2_norm": _c_l2_norm,
              "sigmoid_gate": _c_sigmoid_gate, "mul": _c_mul, "deinterleave": _c_deinterleave, "input": _c_input,
              "concat": _c_concat}
