"""Hybrid models' recurrent layers on the CUDA backend: their step executors and the
per-slot recurrent state on the device.

Owns: the executors of ``plan_recurrent``'s steps (``ShortConvStep``, ``DeltaRuleStep``,
``L2NormStep``, ``SigmoidGateStep``, ``DeinterleaveStep``: the launches of
``kernels/recurrent.cu``, the same on the graph and the eager path) and
``CudaRecurrentState``, the ``RecurrentState`` of engine/backend/__init__.py that a hybrid
program's KV cache carries as ``kv.state``: per state layer one float32 device buffer of
every slot, the position each slot's state stands at (host), snapshot / restore (byte-exact,
host arrays in the CPU's layout and names: ``conv.<i>``, ``delta.<i>``) and rollback of a
verify window. Leaves the order of steps, graphs and the KV cache to ``program.py`` and
``kv.py``, the CPU's state to ``cpu/recurrent.py`` (whose rules this one follows).

Graph-friendly: the kernels find each row's segment (rows of one slot at consecutive
positions) from the row table, start a segment at position 0 from a zero state and keep the
undo data of a segment of 2 .. UNDO_ROWS rows themselves, so a captured decode graph reads
and writes the state through fixed buffers; the host only checks and counts positions
(``begin`` before a forward's first launch, ``end`` after it). Padding rows (the scratch
slot) are skipped.

Rollback: a segment of 2 .. UNDO_ROWS rows leaves the slot's state from before it and its
input rows in ``undo_pre`` / ``undo_in``; ``rollback(slot, n)`` copies the old state back and
runs the kept rows again through the same kernels, which reproduces their state bit for
bit (tests/test_cuda_hybrid.py checks it on a GPU, tests/tools/gpu_dryrun_hybrid.py the
launches on fake CuPy).

Not thread-safe: one engine thread drives it; every method runs on the cache's stream and
waits for it.
"""

from __future__ import annotations

import cupy as cp
import numpy as np
from aotx.engine.backend.cuda import plan_recurrent as PR
from aotx.engine.backend.cuda.steps import NT, Z64, f32, i32, width_of
from aotx.engine.errors import ModelError

UNDO_ROWS = 16          # as cpu/recurrent.py and kernels/recurrent.cu (REC_UNDO_ROWS)
DELTA_HEADS = (16, 32, 64, 128)   # delta_rule<S>'s head sizes: one thread per value dimension, a column in registers


def _pad4(n: int) -> int:
    return (n + 3) // 4 * 4


def _ptr(a) -> np.uint64:
    return np.uint64(a.data.ptr)


def _host(x) -> np.ndarray:
    """A float32 host copy of a weight the backend may have uploaded already (``vector``: a
    CuPy array, which refuses numpy's implicit conversion) or kept on the host (``array``)."""
    return np.asarray(x.get() if hasattr(x, "get") else x, np.float32)


class ShortConvStep:
    """``short_conv``: the outputs (``short_conv``: every row in parallel, reading the old
    state), then the state (``conv_state``: per segment, with its undo data)."""

    def __init__(self, prog, s: PR.ShortConv):
        self.s = s
        w = np.ascontiguousarray(_host(s.weight))
        if w.ndim != 2:
            raise ModelError(f"short_conv weight of shape {w.shape}, expected (channels, kernel)")
        self.C, self.K = int(w.shape[0]), int(w.shape[1])
        self.w = cp.asarray(w)
        self.undo_width = _pad4(self.C)
        prog.need.update({"short_conv", "conv_state"})
        prog.state_steps[s.state] = self

    def _grid(self, rows: int) -> tuple[int, int]:
        return ((self.C + 127) // 128, rows)

    def graph(self, prog, c) -> None:
        s = self.s
        rows = c.rows(s.x)
        if rows == 0:
            return
        st = c.kv.state
        L = s.state
        prog.k["short_conv"](self._grid(rows), (128,),
                             (np.uint64(c.ptr(s.x)), i32(c.ld(s.x)), self.w, i32(self.C), i32(self.K), st.buffers[L],
                              np.uint64(c.slot_p), np.uint64(c.pos_p), i32(rows), i32(c.kv.scratch_slot),
                              i32(1 if s.silu else 0), np.uint64(c.ptr(s.out)), i32(c.ld(s.out))))
        self.update(prog.k, st, c.ptr(s.x), c.ld(s.x), c.slot_p, c.pos_p, rows, c.kv.scratch_slot, True)

    eager = graph

    def update(self, k, st, x: int, ldx: int, slot_p: int, pos_p: int, rows: int, skip: int, undo: bool) -> None:
        L = self.s.state
        k["conv_state"](self._grid(rows), (128,),
                        (np.uint64(x), i32(ldx), i32(self.C), i32(self.K), st.buffers[L], np.uint64(slot_p),
                         np.uint64(pos_p), i32(rows), i32(skip), st.undo_pre[L] if undo else Z64,
                         st.undo_in[L] if undo else Z64))

    def rerun(self, k, st, slot: int, keep: int, slot_p: int, pos_p: int) -> None:
        """The state after the first ``keep`` rows kept in the slot's undo data."""
        u = st.undo_in[self.s.state]
        self.update(k, st, u.data.ptr + slot * u.strides[0], self.undo_width, slot_p, pos_p, keep, st.n_slots,
                    False)


class DeltaRuleStep:
    """``delta_rule<S>``: one block per (value head, segment), the rows of a segment in order."""

    def __init__(self, prog, s: PR.DeltaRule):
        self.s = s
        H, Hk, S = s.n_v, s.n_k, s.head_dim
        if S not in DELTA_HEADS or H % Hk:
            raise ModelError(f"delta_rule with {H} value heads, {Hk} key heads of {S}: the CUDA kernel takes heads "
                             f"of {', '.join(map(str, DELTA_HEADS))} and value heads a multiple of key heads")
        self.H, self.Hk, self.S = H, Hk, S
        self.a = cp.asarray(np.ascontiguousarray(_host(s.a).reshape(-1)))
        self.dtb = cp.asarray(np.ascontiguousarray(_host(s.dt_bias).reshape(-1)))
        if self.a.shape[0] != H or self.dtb.shape[0] != H:
            raise ModelError(f"delta_rule: a / dt_bias of {self.a.shape[0]} / {self.dtb.shape[0]} values for {H} heads")
        self.undo_width = _pad4(2 * Hk * S + H * S + 2 * H)
        self.out_width = H * S
        self.name = f"delta_rule<{S}>"
        prog.need.add(self.name)
        prog.state_steps[s.state] = self

    def launch(self, k, st, q: int, ldq: int, kk: int, ldk: int, v: int, ldv: int, al: int, lda: int, be: int,
               ldb: int, slot_p: int, pos_p: int, rows: int, skip: int, undo: bool, out: int, ldo: int) -> None:
        s, L = self.s, self.s.state
        k[self.name]((self.H, rows), (self.S,),
                        (np.uint64(q), i32(ldq), np.uint64(kk), i32(ldk), np.uint64(v), i32(ldv), np.uint64(al),
                         i32(lda), np.uint64(be), i32(ldb), self.a, self.dtb, i32(self.H), i32(self.Hk),
                         i32(1 if s.grouped else 0), f32(s.scale), st.buffers[L], np.uint64(slot_p), np.uint64(pos_p),
                         i32(rows), i32(skip), st.undo_pre[L] if undo else Z64, st.undo_in[L] if undo else Z64,
                         i32(self.undo_width), np.uint64(out), i32(ldo)))

    def graph(self, prog, c) -> None:
        s = self.s
        rows = c.rows(s.q)
        if rows == 0:
            return
        self.launch(prog.k, c.kv.state, c.ptr(s.q), c.ld(s.q), c.ptr(s.k), c.ld(s.k), c.ptr(s.v), c.ld(s.v),
                    c.ptr(s.alpha), c.ld(s.alpha), c.ptr(s.beta), c.ld(s.beta), c.slot_p, c.pos_p, rows,
                    c.kv.scratch_slot, True, c.ptr(s.out), c.ld(s.out))

    eager = graph

    def rerun(self, k, st, slot: int, keep: int, slot_p: int, pos_p: int) -> None:
        """The state after the first ``keep`` rows kept in the slot's undo data (outputs to scratch)."""
        u = st.undo_in[self.s.state]
        base = u.data.ptr + slot * u.strides[0]
        kw, ld = self.Hk * self.S, self.undo_width
        al = base + 4 * (2 * kw + self.H * self.S)
        self.launch(k, st, base, ld, base + 4 * kw, ld, base + 8 * kw, ld, al, ld, al + 4 * self.H, ld, slot_p, pos_p,
                    keep, st.n_slots, False, st.scratch.data.ptr, int(st.scratch.shape[1]))


class L2NormStep:
    def __init__(self, prog, s: PR.L2Norm):
        self.s = s
        prog.need.add("l2_norm_rows")

    def graph(self, prog, c) -> None:
        s = self.s
        rows, w = c.rows(s.x), width_of(c, s.x)
        if rows == 0:
            return
        prog.k["l2_norm_rows"]((w // s.hd, rows), (32,), (np.uint64(c.ptr(s.x)), i32(c.ld(s.x)),
                                                          np.uint64(c.ptr(s.out)), i32(c.ld(s.out)), i32(s.hd),
                                                          f32(s.eps)))

    eager = graph


class SigmoidGateStep:
    def __init__(self, prog, s: PR.SigmoidGate):
        self.s = s
        prog.need.add("sigmoid_gate_rows")

    def graph(self, prog, c) -> None:
        s = self.s
        rows, w = c.rows(s.x), width_of(c, s.x)
        if rows == 0:
            return
        prog.k["sigmoid_gate_rows"](((rows * w + NT - 1) // NT,), (NT,),
                                    (np.uint64(c.ptr(s.x)), i32(c.ld(s.x)), np.uint64(c.ptr(s.g)), i32(c.ld(s.g)),
                                     np.uint64(c.ptr(s.out)), i32(c.ld(s.out)), i32(rows), i32(w)))

    eager = graph


class DeinterleaveStep:
    def __init__(self, prog, s: PR.Deinterleave):
        self.s = s
        prog.need.add("deinterleave_rows")

    def graph(self, prog, c) -> None:
        s = self.s
        rows = c.rows(s.x)
        if rows == 0:
            return
        for j, o in enumerate(s.outs):
            w = width_of(c, o)
            prog.k["deinterleave_rows"](((rows * w + NT - 1) // NT,), (NT,),
                                        (np.uint64(c.ptr(s.x)), i32(c.ld(s.x)), np.uint64(c.ptr(o)), i32(c.ld(o)),
                                         i32(rows), i32(w // s.hd), i32(s.hd), i32(s.parts), i32(j)))

    eager = graph


#: plan_recurrent's step types -> their executors (program.py's binding table takes these)
BIND = {PR.ShortConv: ShortConvStep, PR.DeltaRule: DeltaRuleStep, PR.L2Norm: L2NormStep,
        PR.SigmoidGate: SigmoidGateStep, PR.Deinterleave: DeinterleaveStep}


class CudaRecurrentState:
    """Every recurrent buffer of every slot on the device: ``buffers[i]`` (n_slots,
    *layers[i].shape) float32 (a delta layer's per head transposed: [h][i][j] = S_h[i][j]),
    ``undo_pre`` the same shapes, ``undo_in[i]`` (n_slots, UNDO_ROWS, width) the kept input
    rows; ``pos`` (n_slots,) host int64: the positions each slot's state has consumed;
    ``names`` the capsule's buffer names. ``steps``: the state layer -> its step executor
    (``rerun`` for rollback); ``kernels`` the program's kernels."""

    def __init__(self, layers: tuple, steps: dict, n_slots: int, stream, kernels: dict):
        self.layers = tuple(layers)
        self.names = tuple(f"{L.kind}.{i}" for i, L in enumerate(self.layers))
        missing = [i for i in range(len(self.layers)) if i not in steps]
        if missing:
            raise ModelError(f"state layers {missing} have no CUDA step")
        self.steps = [steps[i] for i in range(len(self.layers))]
        self.n_slots, self.stream, self.kernels = n_slots, stream, kernels
        self.buffers = [cp.zeros((n_slots,) + tuple(L.shape), cp.float32) for L in self.layers]
        self.undo_pre = [cp.zeros((n_slots,) + tuple(L.shape), cp.float32) for L in self.layers]
        self.undo_in = [cp.zeros((n_slots, UNDO_ROWS, st.undo_width), cp.float32) for st in self.steps]
        self.rows = cp.zeros((2, UNDO_ROWS), cp.int32)        # a rollback's row table: slots, positions
        self.scratch = cp.zeros((UNDO_ROWS, _pad4(max([getattr(s, "out_width", 4) for s in self.steps]))),
                                cp.float32)
        self.pos = np.zeros(n_slots, np.int64)
        self.undo: dict[int, tuple[int, int]] = {}       # slot -> (position, rows) of its last short segment
        self._segs: list = []
        cp.cuda.get_current_stream().synchronize()       # the zeros are done before the stream's first use

    @staticmethod
    def nbytes(layers: tuple, steps: dict, n_slots: int) -> int:
        """Device bytes of the state of ``n_slots`` slots (undo data included); 0 without layers."""
        if not layers:
            return 0
        n = sum(2 * 4 * n_slots * int(np.prod(L.shape)) for L in layers)
        n += sum(4 * n_slots * UNDO_ROWS * steps[i].undo_width for i in range(len(layers)) if i in steps)
        return n + 4 * UNDO_ROWS * (2 + _pad4(max([getattr(s, "out_width", 4) for s in steps.values()])))

    # ---- per forward -------------------------------------------------------------------

    def begin(self, layout) -> None:
        """Check every segment of the batch before anything runs: it starts at its slot's
        position (continuing) or at 0 (the kernels start it from zero); ValueError otherwise
        (a hybrid state cannot be trimmed), for a slot outside the cache, or a slot twice."""
        segs = list(layout.segments)
        seen: set[int] = set()
        for s in segs:
            if not 0 <= s.slot < self.n_slots:
                raise ValueError(f"slot {s.slot} out of range (the cache has {self.n_slots} slots)")
            if s.slot in seen:
                raise ValueError(f"slot {s.slot}: two segments in one batch (its recurrent state runs one)")
            seen.add(s.slot)
            if s.pos != 0 and s.pos != self.pos[s.slot]:
                raise ValueError(f"slot {s.slot}: its recurrent state stands at position {int(self.pos[s.slot])}, "
                                 f"but a segment starts at {s.pos} (a hybrid model's state cannot be trimmed)")
        for s in segs:
            if 1 < s.n <= UNDO_ROWS:
                self.undo[s.slot] = (int(s.pos), int(s.n))
            else:
                self.undo.pop(s.slot, None)
        self._segs = segs

    def end(self) -> None:
        for s in self._segs:
            self.pos[s.slot] = s.pos + s.n
        self._segs = []

    # ---- the interface the runtime and capsules use -----------------------------------

    def position(self, slot: int) -> int:
        return int(self.pos[slot])

    def snapshot(self, slot: int, n: int) -> dict[str, np.ndarray]:
        """Host copies of ``slot``'s buffers by name, in the CPU's layout; ValueError unless
        the state stands at ``n``."""
        if n != self.pos[slot]:
            raise ValueError(f"slot {slot}: its recurrent state stands at position {int(self.pos[slot])}, not {n}")
        out = {}
        with self.stream:
            for name, L, b in zip(self.names, self.layers, self.buffers):
                a = b[slot].transpose(0, 2, 1) if L.kind == "delta" else b[slot]
                out[name] = cp.ascontiguousarray(a).get(stream=self.stream)
        self.stream.synchronize()
        return out

    def restore(self, slot: int, bufs: dict, n: int) -> None:
        """Byte-exact inverse of ``snapshot``: the buffers back, the state at position ``n``.
        ValueError when a buffer is missing or of another shape or dtype (nothing written)."""
        for name, b in zip(self.names, self.buffers):
            x = bufs.get(name)
            if x is None or tuple(x.shape) != tuple(b.shape[1:]) or np.dtype(x.dtype) != np.float32:
                raise ValueError(f"recurrent buffer {name}: {'missing' if x is None else f'{x.shape} {x.dtype}'}, "
                                 f"expected {tuple(b.shape[1:])} float32")
        with self.stream:
            for name, L, b in zip(self.names, self.layers, self.buffers):
                x = cp.ascontiguousarray(cp.asarray(bufs[name]))
                b[slot] = x.transpose(0, 2, 1) if L.kind == "delta" else x
        self.stream.synchronize()
        self.pos[slot] = n
        self.undo.pop(slot, None)

    def rollback(self, slot: int, n: int) -> None:
        """Put ``slot``'s state back at position ``n`` inside its last short segment (a
        rejected draft suffix): the state before the segment, then the kept rows again
        through the same kernels. ValueError when the slot has no such segment."""
        if n == self.pos[slot]:
            return
        u = self.undo.get(slot)
        if u is None or not u[0] <= n < u[0] + u[1]:
            raise ValueError(f"slot {slot}: cannot roll its recurrent state back from {int(self.pos[slot])} to {n}")
        keep = n - u[0]
        tab = np.empty((2, UNDO_ROWS), np.int32)
        tab[0] = slot
        tab[1] = u[0] + np.arange(UNDO_ROWS)
        with self.stream:
            for b, pre in zip(self.buffers, self.undo_pre):
                b[slot] = pre[slot]
            if keep:
                self.rows[...] = cp.asarray(tab)
                sp = self.rows.data.ptr
                for step in self.steps:
                    step.rerun(self.kernels, self, slot, keep, sp, sp + 4 * UNDO_ROWS)
        self.stream.synchronize()
        self.pos[slot] = n
        del self.undo[slot]
