"""How the CUDA backend runs a Program: its nodes matched into fused steps, and buffers.

Owns: ``plan(program)``, a pure function of the ``ops.Program`` (no CuPy: it runs and is
tested on machines without a GPU) that returns the list of steps both CUDA executors run
(``program.py``: the captured graph and the eager path) and where every value lives: the
step types, the fusion rules (``FUSION_RULES``, each a function over a ``Lowering``, run in
order by ``plan``), the generic steps and the buffers. Leaves the kernels to ``kernels/``
and the launches to ``program.py`` and its step executors (``steps.py``, ``attention.py``,
``moe.py``).

Fusions (what today's decode graph does for llama, found by pattern in any program):
* ``rms_norm`` whose every reader is a ``linear``: the norm becomes the GEMV's prologue
  (the eager path computes it once per step into a scratch buffer).
* ``attention(rope(linear(h)), rope(linear(h)), linear(h))``, with the three linears
  separate or one ``split`` of a fused QKV linear, optionally ``head_rms_norm`` between
  a linear and its rope (QK-norm): one ``QKV`` step. Without QK-norm the graph runs it
  as GEMVs whose epilogue adds the bias, rotates and writes K and V into the cache; with
  QK-norm as one GEMV into a scratch row and ``head_rope_kv``. The attention node then
  only reads the cache (``Attend``).
* ``glu(linear(h), linear(h))`` (or the two halves of one fused gate/up linear): one GEMV
  with the SwiGLU / GEGLU epilogue.
* ``add(r, linear(a))``, where the residual ``r`` is read by nothing after the linear:
  the GEMV adds into r's buffer (``mode "add"``); ``add(r, rms_norm(linear(a)))``
  (gemma3's post-norms): the linear stores, then the norm adds into r's buffer.
Anything else runs as generic steps, one per node (``split`` is a view: no step); the
``moe`` op as one step (``MoeHost``: a host step, routing and the CPU expert tier on the host,
the GPU tier's experts on the device; or, every expert on the GPU, a device step); a hybrid
model's recurrent ops as the steps of ``plan_recurrent.py``.

Buffers: every materialized value gets a column range of a buffer ``(rows, width)``;
buffers are reused once their last reader has run. Widths are multiples of 4 floats
(the GEMV reads rows with float4 loads; an odd-row matrix writes its pad row).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from aotx.engine.backend.cuda import plan_recurrent as PR
from aotx.engine.backend.cuda.plan_steps import (
    QKV,
    Attend,
    Elementwise,
    Embed,
    Glu,
    GluRows,
    HeadOp,
    KVStore,
    Linear,
    MoeHost,
    Norm,
    TakeRows,
)

ROWS_N, ROWS_R = "N", "R"


#: a hybrid model with experts (qwen3next, qwen35moe): qwen35's recurrent steps match the CPU on
#: an H100 (2026-12-07), but qwen3next's logits were 5.9e-2 apart at the first prefill; until that
#: is found they are refused (AOTX_CUDA_HYBRID_MOE=1 runs them: the GPU test and the dry run)
HYBRID_MOE_REFUSAL = ("a hybrid model with a mixture of experts (qwen3next, qwen35moe) does not yet match the CPU "
                      "on CUDA: use --device cpu")

#: LFM2's short-convolution block (its gates are the ``mul`` op, which has no CUDA step yet)
MUL_REFUSAL = ("lfm2's short-convolution gates (op 'mul') have no CUDA step yet: use --device cpu")


class PlanError(ValueError):
    """The program cannot be run by the CUDA backend (say, a view that is not aligned)."""


def _pad4(n: int) -> int:
    return (n + 3) // 4 * 4


@dataclass
class Loc:
    """Where a value lives: columns [col, col + width) of buffer ``buf``."""
    buf: int
    col: int
    width: int


@dataclass
class Plan:
    steps: list
    loc: dict[int, Loc]
    buffers: list[tuple[str, int]]          # (rows "N" | "R", width) per buffer id
    output: int
    vocab: int
    d_model: int
    kv_layers: tuple
    rope_specs: list
    fused: dict[str, int] = field(default_factory=dict)   # counts, for tests and the startup profile
    state_layers: tuple = ()        # the Program's StateLayers (hybrid models: plan_recurrent.py)


# ---- matching ---------------------------------------------------------------------------------

class _Graph:
    def __init__(self, program):
        self.nodes = list(program.nodes)
        self.prod: dict[int, int] = {}
        self.cons: dict[int, list[int]] = {}
        for i, n in enumerate(self.nodes):
            for o in n.outs:
                self.prod[o.id] = i
            for x in n.inputs:
                self.cons.setdefault(x.id, []).append(i)
        self.output = program.output.id
        self.cons.setdefault(self.output, []).append(len(self.nodes))   # read by the caller

    def node_of(self, vid: int):
        i = self.prod.get(vid)
        return (i, self.nodes[i]) if i is not None else (None, None)

    def only_reader(self, vid: int) -> int | None:
        c = self.cons.get(vid, [])
        return c[0] if len(c) == 1 else None


class Lowering:
    """What the fusion rules share while a program is lowered: its graph (``g``: ``nodes``,
    producers, consumers), each value's width and row kind, the nodes a rule has consumed
    (``done``), the steps emitted at each node index (``at``; the plan runs them in node
    order), the values that share another's location (``alias``: a value id, or (value id,
    column offset) for a view) and the count of each fusion (``fused``)."""

    def __init__(self, program, fuse: bool = True):
        self.g = _Graph(program)
        self.nodes = self.g.nodes
        self.fuse = fuse
        self.width = {v.id: v.width for v in program.values}
        self.rows = {v.id: v.rows for v in program.values}
        self.done: set[int] = set()
        self.at: dict[int, list] = {}
        self.alias: dict = {}
        self.fused = {"qkv": 0, "glu": 0, "add": 0, "post_norm": 0, "norm_prologue": 0}

    def emit(self, i: int, step) -> None:
        self.at.setdefault(i, []).append(step)

    def steps(self) -> list:
        """The emitted steps in node order."""
        return [s for i in sorted(self.at) for s in self.at[i]]

    def linear_src(self, vid: int):
        """(linear node index, first row of its matrix) when ``vid`` is a linear's output,
        or a split output of a linear read only by that split; else None."""
        g = self.g
        i, n = g.node_of(vid)
        if n is None:
            return None
        if n.op == "linear":
            return i, 0
        if n.op == "split":
            j, lin = g.node_of(n.inputs[0].id)
            if lin is not None and lin.op == "linear" and g.only_reader(lin.out.id) == i:
                k = [o.id for o in n.outs].index(vid)
                return j, int(n.attrs["offsets"][k])
        return None

    def norm_of(self, x_vid: int):
        """(input value, (weight, eps)) when x is an rms_norm output read only by linears
        (the norm folds into their prologue), else (x, None)."""
        if not self.fuse:
            return x_vid, None
        i, n = self.g.node_of(x_vid)
        if n is None or n.op != "rms_norm":
            return x_vid, None
        if all(c < len(self.nodes) and self.nodes[c].op == "linear" for c in self.g.cons.get(x_vid, [])):
            return n.inputs[0].id, (n.attrs["weight"], n.attrs["eps"])
        return x_vid, None

    def dead_after(self, vid: int, i: int, add_i: int) -> bool:
        """Nothing but the add reads ``vid`` at or after node ``i``, and vid is defined before i."""
        p = self.g.prod.get(vid)
        if p is None or p >= i:
            return False
        return all(c < i or c == add_i for c in self.g.cons.get(vid, []))


# ---- the fusion rules: each finds its pattern in the nodes no earlier rule consumed ----------

def _match_qkv(L: Lowering, ia: int, a):
    """The QKV step of attention node ``a`` (index ``ia``) and the node indices it replaces, or None."""
    g, nodes = L.g, L.nodes
    hd, H, KV = a.attrs["head_dim"], a.attrs["n_heads"], a.attrs["n_kv_heads"]
    qd, kd = H * hd, KV * hd
    spec, heads, proj, chain = None, [], [], []
    for vid in (a.inputs[0].id, a.inputs[1].id):
        ir, r = g.node_of(vid)
        if r is None or r.op != "rope" or r.attrs["head_dim"] != hd or g.only_reader(vid) != ia:
            return None
        if spec is not None and r.attrs["spec"] != spec:
            return None
        spec = r.attrs["spec"]
        chain.append(ir)
        src = r.inputs[0].id
        if g.only_reader(src) != ir:
            return None
        ih, hn = g.node_of(src)
        if hn is not None and hn.op == "head_rms_norm":
            if hn.attrs["head_dim"] != hd or g.only_reader(hn.inputs[0].id) != ih:
                return None
            chain.append(ih)
            heads.append((hn.attrs["weight"], hn.attrs["eps"]))
            src = hn.inputs[0].id
        else:
            heads.append(None)
        proj.append(src)
    if g.only_reader(a.inputs[2].id) != ia:
        return None
    proj.append(a.inputs[2].id)
    if heads[0] is not None and heads[1] is not None and heads[0][1] != heads[1][1]:
        return None          # one eps in head_rope_kv
    srcs = [L.linear_src(p) for p in proj]
    if any(s is None for s in srcs):
        return None
    lin_idx = sorted({s[0] for s in srcs})
    lins = [nodes[i] for i in lin_idx]
    if len({n.inputs[0].id for n in lins}) != 1:
        return None
    if len(lins) == 1:       # one fused matrix split into q, k, v (in this order)
        split_i = g.node_of(proj[0])[0]
        if ([s[1] for s in srcs] != [0, qd, qd + kd] or lins[0].out.width != qd + 2 * kd
                or len(nodes[split_i].outs) != 3):
            return None
        mats = [(lins[0].attrs["weight"], 0)]
        biases = [(lins[0].attrs.get("bias"), 0)]
        chain.append(split_i)
    elif len(lins) == 3 and all(s[1] == 0 for s in srcs):
        order = [g.node_of(p)[1] for p in proj]
        if [n.out.width for n in order] != [qd, kd, kd]:
            return None
        mats = [(order[0].attrs["weight"], 0), (order[1].attrs["weight"], qd),
                (order[2].attrs["weight"], qd + kd)]
        biases = [(order[0].attrs.get("bias"), 0), (order[1].attrs.get("bias"), qd),
                  (order[2].attrs.get("bias"), qd + kd)]
    else:
        return None
    x, norm = L.norm_of(lins[0].inputs[0].id)
    step = QKV(x, norm, mats, biases, a.inputs[0].id, a.attrs["layer"], spec, H, KV, hd, heads[0], heads[1])
    return step, min(lin_idx), set(lin_idx) | set(chain)


def fuse_qkv_attention(L: Lowering) -> None:
    """``attention(rope(linear(h)), rope(linear(h)), linear(h))`` (three linears or one split
    fused linear; a ``head_rms_norm`` between a linear and its rope allowed): one ``QKV`` step
    at the first linear, then an ``Attend`` that only reads the cache."""
    for ia, a in enumerate(L.nodes):
        if a.op != "attention":
            continue
        m = _match_qkv(L, ia, a)
        if m is None:
            continue
        step, first, used = m
        L.done.update(used)
        L.done.add(ia)
        L.emit(first, step)
        L.emit(ia, Attend(step.q_out, a.out.id, a.attrs["layer"], step.n_heads, step.n_kv, step.hd,
                          a.attrs["scale"], a.attrs["window"], a.attrs.get("sinks")))
        L.fused["qkv"] += 1
        if step.norm is not None:
            L.fused["norm_prologue"] += 1


def fuse_glu(L: Lowering) -> None:
    """``glu(linear(h), linear(h))`` (or the two halves of one split linear): one ``Glu`` GEMV."""
    g, nodes = L.g, L.nodes
    for ig, n in enumerate(nodes):
        if n.op != "glu" or ig in L.done:
            continue
        ga, gb = n.inputs[0].id, n.inputs[1].id
        if g.only_reader(ga) != ig or g.only_reader(gb) != ig:
            continue
        sa, sb = L.linear_src(ga), L.linear_src(gb)
        if sa is None or sb is None:
            continue
        la, lb = nodes[sa[0]], nodes[sb[0]]
        if la.inputs[0].id != lb.inputs[0].id:
            continue
        if sa[0] == sb[0]:
            split_i = g.node_of(ga)[0]
            if split_i != g.node_of(gb)[0]:
                continue
            L.done.add(split_i)
        x, norm = L.norm_of(la.inputs[0].id)
        f = n.out.width
        ba, bb = la.attrs.get("bias"), lb.attrs.get("bias")
        L.done.update({sa[0], sb[0], ig})
        L.emit(min(sa[0], sb[0]), Glu(x, norm, la.attrs["weight"], sa[1], lb.attrs["weight"], sb[1], f,
                                      (ba, sa[1]) if ba is not None else None,
                                      (bb, sb[1]) if bb is not None else None, n.attrs["act"], n.out.id))
        L.fused["glu"] += 1
        if norm is not None:
            L.fused["norm_prologue"] += 1


def fuse_residual_add(L: Lowering) -> None:
    """``add(r, linear(a))`` where nothing after the linear reads the residual ``r``: the GEMV
    adds into r's buffer (``Linear`` mode "add"); ``add(r, rms_norm(...))`` (post-norms): the
    norm adds into r's buffer (``Norm(add=True)``). The add's output then aliases ``r``."""
    g, nodes = L.g, L.nodes
    for i_add, n in enumerate(nodes):
        if n.op != "add" or i_add in L.done:
            continue
        for r_vid, o_vid in ((n.inputs[0].id, n.inputs[1].id), (n.inputs[1].id, n.inputs[0].id)):
            if r_vid == o_vid or g.only_reader(o_vid) != i_add:
                continue
            io, o = g.node_of(o_vid)
            if o is None or io in L.done:
                continue
            if o.op == "linear" and L.dead_after(r_vid, io, i_add) and L.rows[r_vid] == L.rows[o_vid]:
                x, norm = L.norm_of(o.inputs[0].id)
                L.done.update({io, i_add})
                L.emit(io, Linear(x, norm, o.attrs["weight"], o.attrs.get("bias"), n.out.id, "add"))
                L.alias[n.out.id] = r_vid
                L.fused["add"] += 1
                if norm is not None:
                    L.fused["norm_prologue"] += 1
                break
            if o.op == "rms_norm" and L.dead_after(r_vid, io, i_add) and L.rows[r_vid] == L.rows[o_vid]:
                L.done.update({io, i_add})
                L.emit(io, Norm(o.inputs[0].id, o.attrs["weight"], o.attrs["eps"], n.out.id, add=True))
                L.alias[n.out.id] = r_vid
                L.fused["post_norm"] += 1
                break


#: the fusion rules in the order they run (a later rule sees only the nodes earlier ones left)
FUSION_RULES = (fuse_qkv_attention, fuse_glu, fuse_residual_add)


def generic_steps(L: Lowering) -> None:
    """Every node no rule consumed as its own step (an ``rms_norm`` whose readers all fold it
    into their prologue: none; a ``split``: a view, no step). Raises PlanError for an op the
    CUDA backend has no step for."""
    for i, n in enumerate(L.nodes):
        if i in L.done:
            continue
        op, A = n.op, n.attrs
        if op == "embed":
            L.emit(i, Embed(n.out.id, A["table"], A["scale"]))
        elif op == "linear":
            x, norm = L.norm_of(n.inputs[0].id)
            L.emit(i, Linear(x, norm, A["weight"], A.get("bias"), n.out.id))
            if norm is not None:
                L.fused["norm_prologue"] += 1
        elif op == "rms_norm":
            if L.norm_of(n.out.id)[1] is not None:
                continue        # folded into every reader's prologue
            L.emit(i, Norm(n.inputs[0].id, A["weight"], A["eps"], n.out.id))
        elif op == "head_rms_norm":
            L.emit(i, HeadOp(n.inputs[0].id, n.out.id, A["head_dim"], w=A["weight"], eps=A["eps"]))
        elif op == "rope":
            L.emit(i, HeadOp(n.inputs[0].id, n.out.id, A["head_dim"], spec=A["spec"]))
        elif op == "split":
            for o, off in zip(n.outs, A["offsets"]):
                L.alias[o.id] = (n.inputs[0].id, int(off))   # a view
        elif op == "attention":
            L.emit(i, KVStore(n.inputs[1].id, n.inputs[2].id, A["layer"], A["n_kv_heads"], A["head_dim"]))
            L.emit(i, Attend(n.inputs[0].id, n.out.id, A["layer"], A["n_heads"], A["n_kv_heads"], A["head_dim"],
                             A["scale"], A["window"], A.get("sinks")))
        elif op == "glu":
            L.emit(i, GluRows(n.inputs[0].id, n.inputs[1].id, A["act"], n.out.id))
        elif op == "add":
            L.emit(i, Elementwise("add", n.inputs[0].id, n.inputs[1].id, n.out.id))
        elif op == "scale":
            L.emit(i, Elementwise("scale", n.inputs[0].id, None, n.out.id, A["s"]))
        elif op == "softcap":
            L.emit(i, Elementwise("softcap", n.inputs[0].id, None, n.out.id, A["cap"]))
        elif op == "take_rows":
            L.emit(i, TakeRows(n.inputs[0].id, n.out.id))
        elif op == "moe":
            # refused in one line where no CUDA step computes a feature (Gemma 4's), never run half-right
            no = [what for what, on in (("a router with its own input", len(n.inputs) > 1),
                                        (f"the {A['act']} expert activation", A["act"] not in ("silu", "swiglu_oai")),
                                        ("per-expert down scales", A.get("down_scale") is not None)) if on]
            if no:
                raise PlanError(f"moe layer {n.out.name}: no CUDA step computes {', '.join(no)} (use --device cpu)")
            L.emit(i, MoeHost(n.inputs[0].id, n.out.id, A))
        elif op in PR.OPS:
            L.emit(i, PR.lower(n))
        elif op == "mul":
            raise PlanError(MUL_REFUSAL)
        else:
            raise PlanError(f"op {op!r} is not supported by the CUDA backend")


def plan(program, *, fuse: bool = True) -> Plan:
    """The steps and buffers of ``program`` (an ``ops.Program``, duck-typed): the fusion rules
    (``FUSION_RULES``, none with ``fuse=False``: every node as a generic step, the fallback
    path tested on its own), then one generic step per node left, then buffers.
    Raises PlanError for a program the CUDA backend cannot run."""
    L = Lowering(program, fuse)
    for rule in FUSION_RULES if fuse else ():
        rule(L)
    generic_steps(L)
    steps = L.steps()
    if getattr(program, "state_layers", ()) and any(isinstance(s, MoeHost) for s in steps) \
            and os.environ.get("AOTX_CUDA_HYBRID_MOE") != "1":
        raise PlanError(HYBRID_MOE_REFUSAL)
    loc, buffers = _assign(steps, L.alias, L.width, L.rows, L.g.output)
    return Plan(steps, loc, buffers, L.g.output, int(program.output.width), int(program.d_model),
                tuple(program.kv_layers), list(program.rope_specs()), L.fused,
                tuple(getattr(program, "state_layers", ())))


# ---- buffers ----------------------------------------------------------------------------------

def reads(s) -> list[int]:
    """Value ids a step reads."""
    if hasattr(s, "reads"):              # plan_recurrent's steps name their own
        return s.reads()
    if isinstance(s, (Linear, Glu, QKV)):
        return [s.x] + ([s.out] if isinstance(s, Linear) and s.mode == "add" else [])
    if isinstance(s, Attend):
        return [s.q]
    if isinstance(s, KVStore):
        return [s.k, s.v]
    if isinstance(s, TakeRows):
        return [s.x]
    if isinstance(s, Norm):
        return [s.x] + ([s.out] if s.add else [])
    if isinstance(s, HeadOp):
        return [s.x]
    if isinstance(s, Elementwise):
        return [s.a] + ([s.b] if s.b is not None else [])
    if isinstance(s, GluRows):
        return [s.gate, s.up]
    return [s.x] if isinstance(s, MoeHost) else []


def writes(s) -> list[int]:
    if hasattr(s, "writes"):
        return s.writes()
    if isinstance(s, QKV):
        return [s.q_out]
    if isinstance(s, KVStore):
        return []
    return [s.out]


def _assign(steps: list, alias: dict, width: dict, rows: dict, output: int) -> tuple[dict, list]:
    """Give every written value a Loc; reuse a buffer once its values are dead."""
    def root(v: int) -> tuple[int, int]:
        off = 0
        while v in alias:
            a = alias[v]
            if isinstance(a, tuple):
                v, o = a
                off += o
            else:
                v = a
        return v, off

    last: dict[int, int] = {}
    for i, s in enumerate(steps):
        for v in reads(s) + writes(s):
            r, _ = root(v)
            last[r] = i
    last[root(output)[0]] = len(steps)
    loc: dict[int, Loc] = {}
    buffers: list[tuple[str, int]] = []
    free: dict[tuple[str, int], list[int]] = {}
    live: dict[int, int] = {}           # buffer -> root value that owns it
    for i, s in enumerate(steps):
        for v in writes(s):
            r, _ = root(v)
            if r in loc or r != v:
                continue
            key = (rows[r], _pad4(width[r]))
            # an Attend's output must not share the buffer it reads q from
            lst = free.get(key, [])
            if lst:
                b = lst.pop()
            else:
                b = len(buffers)
                buffers.append(key)
            loc[r] = Loc(b, 0, width[r])
            live[b] = r
        # free buffers whose owner's last use is this step (after the writes: in-place is not assumed)
        for b, r in list(live.items()):
            if last.get(r, -1) <= i and r != root(output)[0]:
                free.setdefault(buffers[b], []).append(b)
                del live[b]
    for v in width:
        r, off = root(v)
        if r in loc and v not in loc:
            if off % 4:
                raise PlanError(f"value {v} is a view at column {off} of value {r}: not a multiple of 4 floats")
            loc[v] = Loc(loc[r].buf, loc[r].col + off, width[v])
    return loc, buffers
