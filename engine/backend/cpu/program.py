"""The CPU executor of an ``ops.Program``: a list of prebound kernel calls, and the CPU KV cache.

Owns: compiling a Program once at load (``CpuProgram``): consecutive linears of one input
(q/k/v, gate/up) are joined into one matmul and a split (``join_linears``: the same
numbers, one activation quantization and one kernel call instead of several); every node
becomes a closure bound to its kernel, weights and attributes; buffers are assigned by a small liveness
pass (a value's buffer is reused once its last reader has run; row-wise ops on a dead
input run in place); the per-batch facts (where each row's K/V goes, each row's slot and
attention length) are computed once per forward from the ``BatchLayout``, not per layer. Also the KV cache (``CpuKVCache``: float32 or f16 bits)
and its RoPE tables. Leaves the kernels to ``cpu/ops.py`` / ``cpu/matmul.py`` /
``cpu/attention.py``, the order of ops to the architecture (the Program), slots and
scheduling to the runtime.

Batch invariance (DESIGN.md): every row of a batch - decode step, speculative
verify window, prefill chunk, logits row - goes through the same kernels in one call per
op: ``QuantMatrix.matmul`` and ``cpu_attention.attention_rows`` compute each row by one
fixed sequence of operations whatever the other rows are, so a row's logits do not
depend on how it was batched, chunked or which slot it sits in.

Not thread-safe: one thread runs a CpuProgram's forwards (the engine's tick thread); the
buffers are reused across calls. The returned logits are a fresh array.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from aotx.engine.backend.cpu import attention as cpu_attention
from aotx.engine.backend.cpu import fdot as cpu_fdot
from aotx.engine.backend.cpu import kvquant
from aotx.engine.backend.cpu import ops as cpu_ops
from aotx.engine.backend.cpu import recurrent as cpu_recurrent
from aotx.engine.backend.cpu.kvcache import KV_TYPES, CpuKVCache, check_kv_type  # noqa: F401 (re-exported)
from aotx.engine.backend.cpu.parallel import PARALLEL
from aotx.engine.backend.ops import ROWS_N, Node, Program, RopeSpec, Value

PAR_GLU_ROWS = 16   # silu(gate) * up runs its rows on several threads from this many rows


class _Batch:
    """What one forward's kernels need to know about its rows, computed once per call:
    each row's slot, position (where its K/V goes) and attention length."""

    __slots__ = ("n", "tokens", "positions", "out_rows", "slots", "lengths", "embeds", "n_out", "views", "keys")

    def __init__(self, tokens: np.ndarray, layout: Any, embeds: Any):
        self.n = int(layout.n_rows)
        self.tokens = tokens
        self.positions = np.ascontiguousarray(layout.positions, np.int32)
        self.out_rows = layout.out_rows
        self.n_out = int(layout.out_rows.shape[0])
        self.embeds = embeds
        self.slots = np.ascontiguousarray(layout.slots, np.int32)
        # a row at position p attends to positions .. p (its own K/V stored first)
        self.lengths = self.positions + np.int32(1)
        self.keys: dict[int, int] = {}     # window -> (row, position) pairs attended (cpu_attention)


def join_linears(program: Program) -> tuple[Program, int]:
    """``program`` with each run of consecutive ``linear`` nodes that read one value (q, k,
    v of a block; gate and up) replaced by one linear over the joined matrix
    (``cpu_matmul.join_rows``) and a ``split`` that defines the same values: one kernel call
    and one activation quantization instead of two or three, the same numbers. Runs whose
    matrices cannot be joined, or whose biases are present on some members only, stay as
    they are. Returns the program and how many runs were joined."""
    from aotx.engine.backend.cpu.matmul import join_rows

    nodes, values, joined = [], list(program.values), 0
    src = program.nodes
    i = 0
    while i < len(src):
        n = src[i]
        j = i + 1
        if n.op == "linear" and n.out.id != program.output.id:
            while (j < len(src) and src[j].op == "linear" and src[j].inputs[0].id == n.inputs[0].id
                   and src[j].out.id != program.output.id):
                j += 1
        run = src[i:j]
        w = None
        if len(run) > 1:
            biases = [r.attrs["bias"] for r in run]
            if all(b is None for b in biases) or all(b is not None for b in biases):
                w = join_rows([r.attrs["weight"] for r in run])
        if w is None:
            nodes.extend(run)
            i = j
            continue
        bias = None if biases[0] is None else np.concatenate([np.asarray(b, np.float32) for b in biases])
        out = Value(len(values), n.out.rows, w.m, "+".join(r.out.name for r in run))
        values.append(out)
        nodes.append(Node("linear", n.inputs, (out,), {"weight": w, "bias": bias}))
        widths = tuple(r.out.width for r in run)
        offsets = tuple(int(o) for o in np.cumsum((0,) + widths[:-1]))
        nodes.append(Node("split", (out,), tuple(r.out for r in run), {"widths": widths, "offsets": offsets}))
        joined += 1
        i = j
    if not joined:
        return program, 0
    return dataclasses.replace(program, nodes=tuple(nodes), values=tuple(values)), joined


class _Buffers:
    """Reusable float32 buffers by slot id: slot i holds (capacity, width_i) and hands out
    its first ``rows`` rows (a contiguous view)."""

    def __init__(self, widths: list[int]):
        self.widths = widths
        self.bufs: list[np.ndarray | None] = [None] * len(widths)

    def get(self, i: int, rows: int) -> np.ndarray:
        b = self.bufs[i]
        if b is None or b.shape[0] < rows:
            b = self.bufs[i] = np.empty((max(rows, 1), self.widths[i]), np.float32)
        return b[:rows]


class CpuProgram:
    """A Program compiled for the CPU. See the module docstring.

    ``forward(tokens, layout, kv, embeds=None) -> (R, vocab) float32`` (the interface of
    engine/backend/IR.md section 6); ``new_kv_cache`` / ``kv_cache_bytes``."""

    device_sampling = False
    prefill_weight_bytes = 0

    def __init__(self, program: Program, *, join: bool = True):
        self.traced = program               # as the architecture traced it
        self.inputs: dict[str, np.ndarray] = {}
        self.last_hidden: np.ndarray | None = None
        # what runs: with q/k/v and gate/up joined into one matmul each (join_linears)
        self.program, self.joined = join_linears(program) if join else (program, 0)
        program = self.program
        self._specs = program.rope_specs()
        self._plan_buffers()
        self.moe_nodes = program.moe_nodes()
        # moe layer -> the last forward's (n, k) expert ids and (n,) routing margins
        self.last_routing: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.expert_pool = None
        self.traffic = [np.zeros(n.attrs["n_expert"], np.int64) for n in self.moe_nodes]
        if self.moe_nodes:
            from aotx.engine.backend.cpu.experts import ExpertPool

            self.expert_pool = ExpertPool.shared()
        self._steps: list[Callable[[list, _Batch, CpuKVCache], None]] = [self._compile(i, n)
                                                                          for i, n in enumerate(program.nodes)]

    # ---- public --------------------------------------------------------------------

    def new_kv_cache(self, n_slots: int, n_ctx: int, kv_type: str = "f16") -> CpuKVCache:
        """Allocate KV for ``n_slots`` slots of ``n_ctx`` tokens each (zeroed); its ``state``
        holds the recurrent layers' buffers (``recurrent.RecurrentState``), None without them."""
        kv = CpuKVCache(self.program, n_slots, n_ctx, kv_type)
        layers = self.program.state_layers
        kv.state = cpu_recurrent.RecurrentState(layers, n_slots) if layers else None
        return kv

    def kv_cache_bytes(self, n_slots: int, n_ctx: int, kv_type: str = "f16") -> int:
        """Bytes ``new_kv_cache(n_slots, n_ctx, kv_type)`` allocates (recurrent state included)."""
        return (CpuKVCache.nbytes(self.program, n_slots, n_ctx, kv_type)
                + cpu_recurrent.RecurrentState.nbytes(self.program.state_layers, n_slots))

    def forward(self, tokens: np.ndarray, layout: Any, kv: CpuKVCache,
                embeds: tuple[np.ndarray, np.ndarray] | None = None,
                inputs: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """Run one batch; returns (R, vocab) float32 logits (a fresh array). ``inputs``: the
        rows of the program's ``input`` ops by name; ``last_hidden`` then holds a copy of the
        program's ``hidden`` rows (when it marks one)."""
        self.inputs = inputs or {}
        bt = _Batch(tokens, layout, embeds)
        if bt.n_out == 0 and bt.n == 0:
            return np.empty((0, self.program.vocab), np.float32)
        if bt.n and (int(bt.positions.min()) < 0 or int(bt.positions.max()) >= kv.n_ctx
                     or int(bt.slots.min()) < 0 or int(bt.slots.max()) >= kv.n_slots):
            raise ValueError(f"a row's slot or position lies outside the KV cache ({kv.n_slots} slots of "
                             f"{kv.n_ctx} positions)")   # the kernels store without bounds checks
        bt.views = self._views(bt)
        env: list[Any] = [None] * len(self.program.values)
        state = getattr(kv, "state", None)    # recurrent layers: each segment continues its slot's state
        state is not None and state.begin(layout)
        for step in self._steps:
            step(env, bt, kv)
        state is not None and state.end()
        if self.program.hidden is not None:
            self.last_hidden = np.array(env[self.program.hidden.id])
        return env[self.program.output.id]

    # ---- expert tiers (experts/, engine/model/experts.py) ----------------

    def measure_experts(self, layer: int, rows: tuple[int, ...]) -> dict:
        """Calibration: seconds of one expert of moe layer ``layer`` on n rows, CPU tier."""
        from aotx.engine.backend.cpu import experts as cpu_moe

        return cpu_moe.measure(self.moe_nodes[layer].attrs, rows, self.expert_pool)

    def place_experts(self, plan) -> dict:
        """Apply an expert-tier plan (every expert "host" or "mmap" here)."""
        from aotx.engine.backend.cpu import experts as cpu_moe

        return cpu_moe.place(self.moe_nodes, plan, self.expert_pool)

    def expert_stats(self) -> dict:
        """Traffic: rows routed to each expert of each moe layer since load, and the pool's
        counters."""
        return {"traffic": [t.tolist() for t in self.traffic], "pool": self.expert_pool.stats()}

    # ---- buffer planning -----------------------------------------------------------

    def _plan_buffers(self) -> None:
        """Give every value a buffer slot, an alias (in place / a view of another value's
        buffer) or its own fresh array (the embedding rows and the logits)."""
        prog = self.program
        nodes = prog.nodes
        last = [-1] * len(prog.values)
        for i, n in enumerate(nodes):
            for x in n.inputs:
                last[x.id] = i
        last[prog.output.id] = len(nodes)
        if prog.hidden is not None:        # read after the last node (last_hidden)
            last[prog.hidden.id] = len(nodes)
        self._last = last
        base = list(range(len(prog.values)))     # the value whose buffer a value lives in
        glast = list(last)                       # per root: the last reader of any value in its buffer
        self._view = [False] * len(prog.values)  # a column block of another value's buffer
        slot_of: dict[int, int] = {}            # root value id -> buffer slot
        widths: list[int] = []
        slot_rows: list[str] = []
        free: dict[tuple[str, int], list[int]] = {}
        inplace = [False] * len(nodes)

        def root(v: int) -> int:
            while base[v] != v:
                v = base[v]
            return v

        split_of = [-1] * len(prog.values)      # for a column block: the value that was split

        def alias(v: int, parent: int, view: bool) -> None:
            base[v] = parent
            self._view[v] = view
            r = root(parent)
            glast[r] = max(glast[r], last[v])

        def dead_after(x: int, i: int) -> bool:
            """Nothing reads x's elements after node i: a column block only needs itself and
            the split value dead (its sibling blocks are other columns)."""
            if self._view[x]:
                return last[x] <= i and last[split_of[x]] <= i
            return glast[root(x)] <= i

        for i, n in enumerate(nodes):
            op = n.op
            if op == "split":
                for o in n.outs:
                    alias(o.id, n.inputs[0].id, True)
                    split_of[o.id] = n.inputs[0].id
                continue
            out = n.out
            if op != "embed" and out.id != prog.output.id:
                x = n.inputs[0] if n.inputs else None
                if (op in ("rope", "head_rms_norm", "scale", "softcap", "add", "glu") and dead_after(x.id, i)
                        and (op in ("rope", "head_rms_norm") or not self._view[x.id])):
                    split_of[out.id] = split_of[x.id]
                    alias(out.id, x.id, self._view[x.id])
                    inplace[i] = True
                else:
                    key = (out.rows, out.width)
                    pool = free.setdefault(key, [])
                    if pool:
                        slot_of[out.id] = pool.pop()
                    else:
                        slot_of[out.id] = len(widths)
                        widths.append(out.width)
                        slot_rows.append(out.rows)
            # the buffers whose every value has been read for the last time are free again
            # (after this node's output has its own)
            for x in n.inputs:
                r = root(x.id)
                if r in slot_of and glast[r] <= i and r != root(out.id):
                    k = (prog.values[r].rows, prog.values[r].width)
                    if slot_of[r] not in free.setdefault(k, []):
                        free[k].append(slot_of[r])
        self._slot_of = slot_of
        self._slot_rows = slot_rows
        self._inplace = inplace
        self._buffers = _Buffers(widths)

    def _views(self, bt: _Batch) -> list[np.ndarray]:
        """This forward's view of every buffer slot (its first N or R rows)."""
        get = self._buffers.get
        return [get(i, bt.n if rows == ROWS_N else bt.n_out) for i, rows in enumerate(self._slot_rows)]

    def _slot(self, v) -> int:
        """The buffer slot node output ``v`` is written into; -1: a fresh array (the logits)."""
        return self._slot_of.get(v.id, -1)

    # ---- compiling nodes -----------------------------------------------------------

    def _compile(self, i: int, node) -> Callable[[list, _Batch, CpuKVCache], None]:
        if node.outs[0].id == self.program.output.id and node.op not in ("linear", "scale", "softcap", "take_rows"):
            raise ValueError(f"a program whose output is made by {node.op} is not supported on the CPU")
        own = getattr(self, "_c_" + node.op, None)
        return own(i, node) if own is not None else cpu_recurrent.compile_node(self, i, node)

    def _c_embed(self, i, node):
        table, scale, o = node.attrs["table"], node.attrs["scale"], node.out.id

        def run(env, bt, kv):
            ids = bt.tokens.astype(np.int64)
            if bt.embeds is not None:
                ids[bt.embeds[0]] = 0
            x = table.rows(ids)
            if scale != 1.0:
                x *= np.float32(scale)
            if bt.embeds is not None:
                x[bt.embeds[0]] = bt.embeds[1]
            env[o] = x
        return run

    def _c_rms_norm(self, i, node):
        w, eps, xi, oi = node.attrs["weight"], node.attrs["eps"], node.inputs[0].id, node.out.id
        s = self._slot(node.out)
        kern = cpu_ops.rms_norm.dispatcher()

        def run(env, bt, kv):
            y = bt.views[s]
            kern(env[xi], w, eps, y)
            env[oi] = y
        return run

    def _c_head_rms_norm(self, i, node):
        w, eps, hd = node.attrs["weight"], node.attrs["eps"], node.attrs["head_dim"]
        xi, oi, inplace, H = node.inputs[0].id, node.out.id, self._inplace[i], node.out.width // hd
        kern = cpu_ops.head_rms_norm.dispatcher()

        def run(env, bt, kv):
            x = env[xi] if inplace else env[xi].copy()
            kern(x.reshape(x.shape[0], H, hd), w, eps)
            env[oi] = x
        return run

    def _c_linear(self, i, node):
        W, bias, xi, oi = node.attrs["weight"], node.attrs["bias"], node.inputs[0].id, node.out.id
        s = self._slot(node.out)
        view = self._view[xi]
        m = W.m

        mm = W.bound_matmul()                # W.matmul without its per-call checks

        def run(env, bt, kv):
            x = env[xi]
            if view:
                x = np.ascontiguousarray(x)
            y = bt.views[s] if s >= 0 else np.empty((x.shape[0], m), np.float32)
            mm(x, y)                         # row-invariant for every number of rows
            if bias is not None:
                y += bias
            env[oi] = y
        return run

    def _c_split(self, i, node):
        xi = node.inputs[0].id
        parts = [(o.id, off, off + o.width) for o, off in zip(node.outs, node.attrs["offsets"])]

        def run(env, bt, kv):
            x = env[xi]
            for oid, a, b in parts:
                env[oid] = x[:, a:b]
        return run

    def _c_rope(self, i, node):
        spec: RopeSpec = node.attrs["spec"]
        si = self._specs.index(spec)
        hd = node.attrs["head_dim"]
        kern = (cpu_ops.rope_inplace if spec.mode == "normal" else cpu_ops.rope_neox_inplace).dispatcher()
        xi, oi, inplace, H = node.inputs[0].id, node.out.id, self._inplace[i], node.out.width // hd

        def run(env, bt, kv):
            x = env[xi] if inplace else env[xi].copy()
            cos, sin = kv.rope[si]
            kern(x.reshape(bt.n, H, hd), bt.positions, cos, sin)
            env[oi] = x
        return run

    def _c_attention(self, i, node):
        a = node.attrs
        L, H, KV, hd, scale, window = a["layer"], a["n_heads"], a["n_kv_heads"], a["head_dim"], a["scale"], a["window"]
        qi, ki, vi = (x.id for x in node.inputs)
        oi, so = node.out.id, self._slot(node.out)
        has_sinks = a.get("sinks") is not None
        sinks = cpu_attention.checked_sinks(scale, a.get("sinks"), H)   # attention_rows' checks, once
        scale, window = np.float32(scale), int(window)
        store16, store32 = cpu_attention.store_f16, cpu_attention.store_f32
        kernel_for, mode = cpu_attention.kernel_for, cpu_fdot.HOST_F16
        store_q, kernel_for_q = kvquant._store_q, kvquant.kernel_for_q
        rot = kvquant._rot_args(hd, True) if hd % kvquant.BLOCK == 0 else None

        def run(env, bt, kv):
            n = bt.n
            q = np.ascontiguousarray(env[qi]).reshape(n, H, hd)
            kc, vc = kv.k[L], kv.v[L]
            y = bt.views[so]
            keys = bt.keys.get(window)
            if keys is None:
                keys = bt.keys[window] = cpu_attention.attended_keys(bt.lengths, window)
            # every row's K/V to its slot and position in one call (float16 rounded or
            # quantized there; forward has checked the slots and positions against the cache)
            # (contiguous copies: one kernel signature for one row and for many, not two)
            k_rows = np.ascontiguousarray(env[ki]).reshape(n, KV, hd)
            v_rows = np.ascontiguousarray(env[vi]).reshape(n, KV, hd)
            if kv.quant:   # (rotated first where llama.cpp rotates: kvquant.rotations)
                store_q(kc, vc, k_rows, v_rows, bt.slots, bt.positions, kvquant.KIND[kv.kv_type], *rot)
                kernel_for_q(keys, H, hd)(q, kc, vc, bt.slots, bt.lengths, scale, window, y.reshape(n, H, hd), sinks,
                                          has_sinks, kvquant.KIND[kv.kv_type], *rot)
                env[oi] = y
                return
            (store16 if kv.half else store32)(kc, vc, k_rows, v_rows, bt.slots, bt.positions)
            # every row (decode, verify, prefill) in one call, one kernel (attention_rows' checks made here)
            kernel_for(keys, H, hd, kv.half)(mode, q, kc, vc, bt.slots, bt.lengths, scale, window,
                                             y.reshape(n, H, hd), kv.half, sinks, has_sinks)
            env[oi] = y
        return run

    def _c_glu(self, i, node):
        silu = node.attrs["act"] == "silu"
        kern = (cpu_ops.silu_mul if silu else cpu_ops.gelu_tanh_mul).dispatcher()
        par = cpu_ops.silu_mul_par if silu else None     # the same bits, rows on several threads
        gi, ui, oi, inplace = node.inputs[0].id, node.inputs[1].id, node.out.id, self._inplace[i]
        s = self._slot(node.out)

        def run(env, bt, kv):
            g = env[gi]
            y = g if inplace else bt.views[s]
            (par if par is not None and g.shape[0] >= PAR_GLU_ROWS and PARALLEL.ready else kern)(g, env[ui], y)
            env[oi] = y
        return run

    def _c_add(self, i, node):
        ai, bi, oi, inplace = node.inputs[0].id, node.inputs[1].id, node.out.id, self._inplace[i]
        s = self._slot(node.out)
        kern = cpu_ops.add_inplace.dispatcher()

        def run(env, bt, kv):
            if inplace:
                y = env[ai]
                kern(y, env[bi])
            else:
                y = bt.views[s]
                np.add(env[ai], env[bi], out=y)
            env[oi] = y
        return run

    def _c_scale(self, i, node):
        f, xi, oi, inplace, s = np.float32(node.attrs["s"]), node.inputs[0].id, node.out.id, self._inplace[i], \
            self._slot(node.out)

        def run(env, bt, kv):
            y = env[xi] if inplace else (bt.views[s] if s >= 0 else np.empty_like(env[xi]))
            np.multiply(env[xi], f, out=y)
            env[oi] = y
        return run

    def _c_softcap(self, i, node):
        cap, xi, oi, inplace, s = np.float32(node.attrs["cap"]), node.inputs[0].id, node.out.id, self._inplace[i], \
            self._slot(node.out)

        def run(env, bt, kv):
            y = env[xi] if inplace else (bt.views[s] if s >= 0 else np.empty_like(env[xi]))
            np.multiply(env[xi], np.float32(1.0) / cap, out=y)
            np.tanh(y, out=y)
            y *= cap
            env[oi] = y
        return run

    def _c_moe(self, i, node):
        """Router, top-k, the experts on the rows routed to them (the CPU expert pool), the
        join in selection order, the shared expert (experts/)."""
        from aotx.engine.backend.cpu import experts as cpu_moe

        a = node.attrs
        router, rbias, k = a["router"], a["router_bias"], a["n_used"]
        gating, norm_w, w_scale = a["gating"], a["norm_w"], a["w_scale"]
        shared, sgate, dscale = a["shared"], a["shared_gate"], a.get("down_scale")
        xi, oi, s, d = node.inputs[0].id, node.out.id, self._slot(node.out), node.out.width
        ri = node.inputs[1].id if len(node.inputs) > 1 else xi      # the router's input
        view = self._view[xi]
        pool = self.expert_pool
        attrs = dict(a)
        traffic = self.traffic[a["moe_layer"]]
        fused = cpu_moe.fused_for(attrs)      # None: stacks off the integer path (per-expert calls)

        def mm(W, x, bt):
            return W.matmul(x, np.empty((x.shape[0], W.m), np.float32))   # row-invariant for every n

        def run(env, bt, kv):
            x = env[xi]
            if view:
                x = np.ascontiguousarray(x)
            n = x.shape[0]
            logits = mm(router, x if ri == xi else np.ascontiguousarray(env[ri]), bt)
            if rbias is not None:
                logits += rbias
            sel, w, margin = cpu_moe.route(logits, k, gating, norm_w, w_scale)
            self.last_routing[attrs["moe_layer"]] = (sel, margin)
            Y = np.empty((n, k, d), np.float32)
            # every matmul is row-invariant for every n: no rows need a separate kernel
            if fused is not None:
                pool.run_fused(fused, x, sel, Y, None, traffic)       # counts the traffic
            else:
                traffic[:] += np.bincount(sel.reshape(-1), minlength=traffic.shape[0])
                pool.compute(attrs, x, sel, Y, cpu_moe.groups(sel), None, True)
            if dscale is not None:
                Y *= dscale[sel][:, :, None]           # down_e(...) * down_scale[e], before the weights
            y = bt.views[s] if s >= 0 else np.empty((n, d), np.float32)
            cpu_moe.join(Y, w, y)
            if shared is not None:
                g = mm(shared[0], x, bt)
                cpu_moe.silu_mul(g, mm(shared[1], x, bt), g)
                h = mm(shared[2], g, bt)
                if sgate is not None:
                    h *= 1.0 / (1.0 + np.exp(-mm(sgate, x, bt)))
                y += h
            env[oi] = y
        return run

    def _c_take_rows(self, i, node):
        xi, oi, s = node.inputs[0].id, node.out.id, self._slot(node.out)

        def run(env, bt, kv):
            x = env[xi]
            y = bt.views[s] if s >= 0 else np.empty((bt.n_out, x.shape[1]), np.float32)
            if bt.n_out == bt.n:              # every row wants logits (out_rows is 0..n-1, in order)
                y[:] = x
            else:
                np.take(x, bt.out_rows, axis=0, out=y)
            env[oi] = y
        return run
