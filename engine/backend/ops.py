"""The op set every backend executes, and the ``Program`` an architecture is traced into.

Owns: the definition of each op (its inputs, attributes and exact semantics), the
symbolic values ops read and write, ``ProgramBuilder`` (what an architecture module calls
once at load to state its forward pass), ``Program`` (the resulting list of nodes, checked
for consistent widths) and ``RopeSpec`` with the RoPE tables every backend shares.
Leaves to others: the kernels (``cpu/backend.py``/``cpu/program.py``, the CUDA compiler), which
tensors an architecture has and the order of its ops (``engine/model/architectures``).

The model (a ggml-style graph, at the granularity of llama.cpp's build_norm / build_attn /
build_ffn): every value is a (rows, width) float32 matrix. ``rows`` is symbolic: ``"N"``,
the batch's rows (one per token of the batch, in segment order), or ``"R"``, the rows whose
logits are returned (``take_rows``). Weights are attributes of nodes: backend objects made
by ``backend.matrix`` / ``backend.vector`` at load. Every op except ``attention`` is
row-wise: a row's result depends only on that row (batch invariance, DESIGN.md);
``attention`` mixes rows only through each slot's KV cache.

engine/backend/IR.md is the prose version of this module for backend authors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aotx.engine.backend.rope import RopeSpec  # noqa: F401  (re-exported: ops.RopeSpec)

ROWS_N = "N"   # one row per token of the batch
ROWS_R = "R"   # one row per logits row (BatchLayout.out_rows)

ROPE_MODES = ("normal", "neox")
GLU_ACTS = ("silu", "gelu_tanh")
OPS = ("embed", "rms_norm", "head_rms_norm", "linear", "split", "rope", "attention", "glu", "add", "scale",
       "softcap", "take_rows", "moe",
       # recurrent layers (Qwen3.5's gated DeltaNet) and gated attention output
       "short_conv", "delta_rule", "l2_norm", "sigmoid_gate", "deinterleave",
       # rows the caller supplies (a multi-token-prediction head's hidden-state input), column concat
       "input", "concat",
       # Gemma 4: a second token table (per-layer embeddings), attention over another layer's KV
       "lookup", "shared_attention",
       # LFM2's short-convolution block: its input and output gates, element-wise products
       "mul")
#: a ``short_conv`` node's activation after the convolution
CONV_ACTS = ("none", "silu")
#: how a ``moe`` node turns router logits into expert weights (llama.cpp's
#: llama_expert_gating_func_type): "softmax" (probabilities over every expert, the top-k
#: of them kept: Qwen3-MoE, OLMoE, Qwen2-MoE) or "softmax_weight" (top-k of the raw
#: logits, then a softmax over those k: gpt-oss)
MOE_GATINGS = ("softmax", "softmax_weight")
#: an expert's gated activation: "silu" (SwiGLU: silu(g) * u), "swiglu_oai" (gpt-oss:
#: g clamped above at ``limit``, u clamped to +-limit, g * sigmoid(alpha g) * (u + 1)) or
#: "gelu_tanh" (GeGLU, the glu op's: gelu(g) * u with GELU's tanh form; Gemma 4)
MOE_ACTS = ("silu", "swiglu_oai", "gelu_tanh")
#: llama.cpp clamps the sum of the kept weights from below before dividing by it
#: (build_moe_ffn: the smallest normal float16)
MOE_NORM_MIN = 6.103515625e-5


class ProgramError(ValueError):
    """An architecture traced an inconsistent program (a width mismatch, a value used on
    the wrong rows). A bug in an architecture module, or a file whose tensors disagree
    with its metadata in a way the tensor checks did not catch; the model layer turns it
    into a ModelError naming the file."""


@dataclass(frozen=True, eq=False)
class Value:
    """A symbolic (rows, width) float32 matrix. ``id`` indexes ``Program.values``;
    ``name`` is for messages and dumps only (e.g. ``"blk.3.q"``)."""

    id: int
    rows: str
    width: int
    name: str = ""

    def __repr__(self) -> str:
        return f"%{self.id}<{self.rows}x{self.width}>{' ' + self.name if self.name else ''}"


@dataclass(frozen=True, eq=False)
class Node:
    """One op: ``op`` (one of OPS), ``inputs`` (Values), ``outs`` (Values it defines; one
    for every op but ``split``), ``attrs`` (op attributes, see ProgramBuilder)."""

    op: str
    inputs: tuple[Value, ...]
    outs: tuple[Value, ...]
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def out(self) -> Value:
        return self.outs[0]

    def __repr__(self) -> str:
        def show(k: str, v: Any) -> Any:
            if v is None or isinstance(v, (str, int, float, bool, RopeSpec)):
                return v
            if isinstance(v, tuple):
                return tuple(show(k, x) for x in v)
            return getattr(v, "name", None) or type(v).__name__     # weights, vectors, expert stacks

        shown = {k: show(k, v) for k, v in self.attrs.items()}
        outs = ", ".join(map(repr, self.outs))
        return f"{outs} = {self.op}({', '.join(map(repr, self.inputs))}; {shown})"


@dataclass(frozen=True, eq=False)
class KVLayer:
    """One layer of the KV cache: the attention node that owns it stores ``n_kv_heads``
    heads of ``head_dim`` for K and for V at every position."""

    n_kv_heads: int
    head_dim: int


@dataclass(frozen=True, eq=False)
class StateLayer:
    """One recurrent buffer of a slot, owned by the ``short_conv`` or ``delta_rule`` node
    whose ``attrs["state"]`` indexes it: ``kind`` "conv" (``shape`` (K-1, channels): the
    last K-1 inputs) or "delta" (``shape`` (n_heads, head_dim, head_dim): one matrix per
    head). float32, carried from one forward to the next like KV, but not indexable by
    position: a slot's state stands at exactly one position (IR.md section 9)."""

    kind: str
    shape: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class Program:
    """A traced forward pass: ``nodes`` in execution order (each input defined by an
    earlier node), ``values`` (by id), ``output`` (the (R, vocab) logits), ``d_model``
    (width of the ``embed`` output: what caller-supplied embeddings must have) and
    ``kv_layers`` (one entry per attention node, in order: ``attrs["layer"]`` indexes it)."""

    nodes: tuple[Node, ...]
    values: tuple[Value, ...]
    output: Value
    d_model: int
    kv_layers: tuple[KVLayer, ...]
    state_layers: tuple[StateLayer, ...] = ()
    hidden: Value | None = None      # (N, d) rows a backend keeps after each forward (mark_hidden)

    @property
    def vocab(self) -> int:
        return self.output.width

    def rope_specs(self) -> list[RopeSpec]:
        """The distinct RopeSpecs of the program's rope nodes, in first-use order."""
        out: list[RopeSpec] = []
        for n in self.nodes:
            if n.op == "rope" and n.attrs["spec"] not in out:
                out.append(n.attrs["spec"])
        return out

    def moe_nodes(self) -> list[Node]:
        """The program's ``moe`` nodes in order (``attrs["moe_layer"]`` is the index)."""
        return [n for n in self.nodes if n.op == "moe"]

    def dump(self) -> str:
        """One line per node (for debugging and for backend authors)."""
        return "\n".join(map(repr, self.nodes))


def _width_of(w: Any) -> tuple[int, ...]:
    """Shape of a weight object: (m, k) for a matrix (``.m``, ``.k``), (n,) for a vector."""
    if hasattr(w, "m") and hasattr(w, "k"):
        return (int(w.m), int(w.k))
    return tuple(int(s) for s in w.shape)


class ProgramBuilder:
    """Records ops into a Program. Each method checks its operands and returns the new
    Value(s); ``finish(logits)`` returns the Program. Semantics of every op (x: (rows, width)
    float32 unless said otherwise; "row-wise" = computed per row, independently):

    embed(table, scale)   -> (N, table.k): row i = scale * table row tokens[i]; rows given
                             as embeddings by the caller are replaced by those values, NOT
                             scaled (llama.cpp scales token embeddings only). Once, first.
    rms_norm(x, w, eps)   -> x / sqrt(mean(x**2) + eps) * w over the whole row; w (width,).
    head_rms_norm(x, w, eps, head_dim)
                          -> the same over each head_dim-sized chunk of the row (QK-norm);
                             w (head_dim,) shared by the heads.
    linear(x, W, bias)    -> x @ W.T (+ bias): W a matrix of shape (m, k) with k = width,
                             result (rows, m); bias (m,) or None.
    split(x, widths)      -> column blocks of x, left to right, widths summing to width
                             (fused QKV, fused gate/up).
    rope(x, spec, head_dim)
                          -> every head_dim chunk rotated by RopeSpec ``spec`` at the row's
                             position (only the first spec.dim dims of each head).
    attention(q, k, v, n_heads, n_kv_heads, head_dim, scale, window)
                          -> (N, n_heads*head_dim). First K and V of every row (k, v:
                             (N, n_kv_heads*head_dim)) are stored in this layer's cache at
                             the row's slot and position; then row i (slot s, position p)
                             attends with softmax(scale * q.k) over the slot's positions
                             [lo, p], lo = max(0, p + 1 - window) if window > 0 else 0.
                             Grouped-query: query head h reads KV head h // (n_heads //
                             n_kv_heads). The layer index is assigned in call order.
    glu(gate, up, act)    -> act(gate) * up; act "silu" (g / (1 + exp(-g))) or
                             "gelu_tanh" (0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))).
    add(a, b)             -> a + b (same rows and width).
    scale(x, s)           -> s * x.
    softcap(x, cap)       -> cap * tanh(x / cap) (Gemma's final logit soft-capping).
    take_rows(x)          -> (R, width): the rows of BatchLayout.out_rows, in that order.
    moe(x, router, gate, up, down, n_used, ...)
                          -> (rows, width): a routed mixture of gated FFN experts, row-wise;
                             see ``moe`` for the exact semantics.

    ``attention`` takes optional ``sinks`` (n_heads,): a per-head logit that joins the
    softmax's denominator and contributes no value (gpt-oss's attention sinks):
    p_t = exp(s_t - m) / (sum_u exp(s_u - m) + exp(sinks[h] - m)), m = max(max_u s_u, sinks[h]).
    """

    def __init__(self) -> None:
        self._nodes: list[Node] = []
        self._values: list[Value] = []
        self._kv: list[KVLayer] = []
        self._states: list[StateLayer] = []
        self._d_model = 0

    # ---- helpers -------------------------------------------------------------------

    def _new(self, rows: str, width: int, name: str) -> Value:
        v = Value(len(self._values), rows, int(width), name)
        self._values.append(v)
        return v

    def _emit(self, op: str, inputs: tuple[Value, ...], outs: tuple[Value, ...], **attrs: Any) -> None:
        for x in inputs:
            if not isinstance(x, Value) or x.id >= len(self._values) or self._values[x.id] is not x:
                raise ProgramError(f"{op}: operand {x!r} is not a value of this program")
        self._nodes.append(Node(op, inputs, outs, attrs))

    @staticmethod
    def _same(op: str, a: Value, b: Value) -> None:
        if a.rows != b.rows or a.width != b.width:
            raise ProgramError(f"{op}: operands {a!r} and {b!r} differ in rows or width")

    # ---- ops -----------------------------------------------------------------------

    def embed(self, table: Any, scale: float = 1.0, name: str = "embd") -> Value:
        if self._nodes:
            raise ProgramError("embed must be the first op")
        m, k = _width_of(table)
        self._d_model = k
        out = self._new(ROWS_N, k, name)
        self._emit("embed", (), (out,), table=table, scale=float(scale), vocab=m)
        return out

    def rms_norm(self, x: Value, weight: Any, eps: float, name: str = "") -> Value:
        if _width_of(weight) != (x.width,):
            raise ProgramError(f"rms_norm: weight {getattr(weight, 'name', '')} has shape {_width_of(weight)}, "
                               f"the value {x!r} has width {x.width}")
        out = self._new(x.rows, x.width, name)
        self._emit("rms_norm", (x,), (out,), weight=weight, eps=float(eps))
        return out

    def head_rms_norm(self, x: Value, weight: Any, eps: float, head_dim: int, name: str = "") -> Value:
        if x.width % head_dim or _width_of(weight) != (head_dim,):
            raise ProgramError(f"head_rms_norm: width {x.width}, head_dim {head_dim}, weight {_width_of(weight)}")
        out = self._new(x.rows, x.width, name)
        self._emit("head_rms_norm", (x,), (out,), weight=weight, eps=float(eps), head_dim=int(head_dim))
        return out

    def linear(self, x: Value, weight: Any, bias: Any = None, name: str = "") -> Value:
        m, k = _width_of(weight)
        if k != x.width:
            raise ProgramError(f"linear: matrix {getattr(weight, 'name', '')} takes {k} inputs, "
                               f"the value {x!r} has width {x.width}")
        if bias is not None and _width_of(bias) != (m,):
            raise ProgramError(f"linear: bias {getattr(bias, 'name', '')} has shape {_width_of(bias)}, expected ({m},)")
        out = self._new(x.rows, m, name)
        self._emit("linear", (x,), (out,), weight=weight, bias=bias)
        return out

    def split(self, x: Value, widths: tuple[int, ...] | list[int], names: tuple[str, ...] = ()) -> tuple[Value, ...]:
        widths = tuple(int(w) for w in widths)
        if sum(widths) != x.width or min(widths) <= 0:
            raise ProgramError(f"split: widths {widths} do not partition {x!r}")
        names = tuple(names) + ("",) * (len(widths) - len(names))
        outs = tuple(self._new(x.rows, w, n) for w, n in zip(widths, names))
        offsets = tuple(int(o) for o in np.cumsum((0,) + widths[:-1]))
        self._emit("split", (x,), outs, widths=widths, offsets=offsets)
        return outs

    def rope(self, x: Value, spec: RopeSpec, head_dim: int, name: str = "") -> Value:
        if spec.mode not in ROPE_MODES:
            raise ProgramError(f"rope: mode {spec.mode!r} (known: {', '.join(ROPE_MODES)})")
        if x.rows != ROWS_N or x.width % head_dim or spec.dim % 2 or not 0 < spec.dim <= head_dim:
            raise ProgramError(f"rope: {x!r} with head_dim {head_dim} and rope dim {spec.dim}")
        for f in (spec.freq_factors, spec.long_factors):
            if f is not None and len(f) != spec.dim // 2:
                raise ProgramError(f"rope: {len(f)} frequency factors for rope dim {spec.dim} (need {spec.dim // 2})")
        out = self._new(x.rows, x.width, name)
        self._emit("rope", (x,), (out,), spec=spec, head_dim=int(head_dim))
        return out

    def attention(self, q: Value, k: Value, v: Value, *, n_heads: int, n_kv_heads: int, head_dim: int,
                  scale: float, window: int = 0, sinks: Any = None, name: str = "") -> Value:
        if not (q.rows == k.rows == v.rows == ROWS_N):
            raise ProgramError("attention: q, k and v must be batch rows (N), before take_rows")
        if (q.width != n_heads * head_dim or k.width != n_kv_heads * head_dim or v.width != k.width
                or n_kv_heads <= 0 or n_heads % n_kv_heads):
            raise ProgramError(f"attention: q {q.width}, k {k.width}, v {v.width} for {n_heads} heads, "
                               f"{n_kv_heads} KV heads of {head_dim}")
        if window < 0:
            raise ProgramError(f"attention: window {window} must be 0 (none) or positive")
        if sinks is not None and _width_of(sinks) != (n_heads,):
            raise ProgramError(f"attention: sinks {getattr(sinks, 'name', '')} have shape {_width_of(sinks)}, "
                               f"expected ({n_heads},)")
        layer = len(self._kv)
        self._kv.append(KVLayer(int(n_kv_heads), int(head_dim)))
        out = self._new(ROWS_N, n_heads * head_dim, name)
        self._emit("attention", (q, k, v), (out,), layer=layer, n_heads=int(n_heads), n_kv_heads=int(n_kv_heads),
                   head_dim=int(head_dim), scale=float(scale), window=int(window), sinks=sinks)
        return out

    def glu(self, gate: Value, up: Value, act: str, name: str = "") -> Value:
        if act not in GLU_ACTS:
            raise ProgramError(f"glu: activation {act!r} (known: {', '.join(GLU_ACTS)})")
        self._same("glu", gate, up)
        out = self._new(gate.rows, gate.width, name)
        self._emit("glu", (gate, up), (out,), act=act)
        return out

    def add(self, a: Value, b: Value, name: str = "") -> Value:
        self._same("add", a, b)
        out = self._new(a.rows, a.width, name)
        self._emit("add", (a, b), (out,))
        return out

    def scale(self, x: Value, s: float, name: str = "") -> Value:
        out = self._new(x.rows, x.width, name)
        self._emit("scale", (x,), (out,), s=float(s))
        return out

    def softcap(self, x: Value, cap: float, name: str = "") -> Value:
        if not cap > 0:
            raise ProgramError(f"softcap: cap {cap} must be positive")
        out = self._new(x.rows, x.width, name)
        self._emit("softcap", (x,), (out,), cap=float(cap))
        return out

    def take_rows(self, x: Value, name: str = "") -> Value:
        if x.rows != ROWS_N:
            raise ProgramError(f"take_rows: {x!r} already has the logits rows")
        out = self._new(ROWS_R, x.width, name)
        self._emit("take_rows", (x,), (out,))
        return out

    def moe(self, x: Value, *, router: Any, gate: Any, up: Any, down: Any, n_used: int,
            gating: str = "softmax", norm_w: bool = False, w_scale: float = 1.0, act: str = "silu",
            router_bias: Any = None, gate_bias: Any = None, up_bias: Any = None, down_bias: Any = None,
            alpha: float = 1.702, limit: float = 7.0, shared: tuple[Any, Any, Any] | None = None,
            shared_gate: Any = None, router_x: Value | None = None, down_scale: Any = None,
            name: str = "") -> Value:
        """A mixture of E gated FFN experts with top-``n_used`` routing (llama.cpp's
        build_moe_ffn), row-wise. For each row x (width d), and r = the same row of
        ``router_x`` when given (the router reads its own input: Gemma 4), else x:

            l   = router r (+ router_bias)                      (E,)   router: matrix (E, d_r)
            p   = softmax(l) if gating == "softmax" else l      ("softmax_weight")
            S   = the n_used experts of largest p, in decreasing p (ties: lower index first)
            w_j = p[S_j];  "softmax_weight": w = softmax(w);  norm_w: w = w / max(sum w, MOE_NORM_MIN);
                  w = w * w_scale unless w_scale is 0 or 1
            y_j = down_e(act(gate_e x + gate_bias[e], up_e x + up_bias[e])) + down_bias[e],  e = S_j
                  or, with ``down_scale`` (E,): down_e(act(...)) * down_scale[e]  (no down_bias then)
            out = sum_j w_j y_j  (j = 0 .. n_used-1, in that order)
                  + s * shared_down(silu(shared_gate_w x) * shared_up x)   when ``shared``
                    (s = sigmoid(shared_gate x) when ``shared_gate``, else 1)

        gate, up: expert stacks of E matrices (ff, d); down: E matrices (d, ff) (backend
        objects from ``backend.experts``: ``.n_expert``, ``.m``, ``.k``, ``.name``, ``.qtype``);
        the biases: (E, ff) / (E, d) float32 (``backend.expert_vectors``) or None; act:
        MOE_ACTS ("swiglu_oai" uses ``alpha`` and ``limit``); shared: (gate (fs, d), up
        (fs, d), down (d, fs)) matrices of an always-on shared expert; shared_gate: a
        (1, d) matrix; router_x: a Value on x's rows; down_scale: (E,) float32 (llama.cpp's
        per-expert ``ffn_down_exps.scale``, applied to the down matmul's result). The
        node's ``moe_layer`` attribute numbers the moe nodes in call order (the expert
        tiers plan per moe layer); its inputs are (x,) or (x, router_x)."""
        d = x.width
        if gating not in MOE_GATINGS:
            raise ProgramError(f"moe: gating {gating!r} (known: {', '.join(MOE_GATINGS)})")
        if act not in MOE_ACTS:
            raise ProgramError(f"moe: activation {act!r} (known: {', '.join(MOE_ACTS)})")
        E, rk = _width_of(router)
        r = x if router_x is None else router_x
        if rk != r.width:
            raise ProgramError(f"moe: router {getattr(router, 'name', '')} takes {rk} inputs, {r!r} has width "
                               f"{r.width}")
        if r.rows != x.rows:
            raise ProgramError(f"moe: the router's input {r!r} is not on the rows of {x!r}")
        for st, want_k, what in ((gate, d, "gate"), (up, d, "up"), (down, None, "down")):
            if int(st.n_expert) != E:
                raise ProgramError(f"moe: {what} experts {st.name} number {st.n_expert}, the router routes {E}")
            if want_k is not None and int(st.k) != want_k:
                raise ProgramError(f"moe: {what} experts {st.name} take {st.k} inputs, {x!r} has width {d}")
        ff = int(gate.m)
        if int(up.m) != ff or int(down.k) != ff or int(down.m) != d:
            raise ProgramError(f"moe: expert shapes gate {gate.m}x{gate.k}, up {up.m}x{up.k}, down {down.m}x{down.k} "
                               f"do not chain for width {d}")
        if not 0 < n_used <= E:
            raise ProgramError(f"moe: {n_used} experts used per row of {E}")
        for b, shape, what in ((router_bias, (E,), "router"), (gate_bias, (E, ff), "gate"), (up_bias, (E, ff), "up"),
                               (down_bias, (E, d), "down")):
            if b is not None and _width_of(b) != shape:
                raise ProgramError(f"moe: {what} bias {getattr(b, 'name', '')} has shape {_width_of(b)}, "
                                   f"expected {shape}")
        if shared is not None:
            sg, su, sd = shared
            fs = _width_of(sg)[0]
            if _width_of(sg) != (fs, d) or _width_of(su) != (fs, d) or _width_of(sd) != (d, fs):
                raise ProgramError(f"moe: shared expert shapes {_width_of(sg)}, {_width_of(su)}, {_width_of(sd)} do "
                                   f"not chain for width {d}")
            if shared_gate is not None and _width_of(shared_gate) != (1, d):
                raise ProgramError(f"moe: shared expert gate has shape {_width_of(shared_gate)}, expected (1, {d})")
        elif shared_gate is not None:
            raise ProgramError("moe: a shared expert gate without a shared expert")
        if down_scale is not None:
            if _width_of(down_scale) != (E,):
                raise ProgramError(f"moe: down scale {getattr(down_scale, 'name', '')} has shape "
                                   f"{_width_of(down_scale)}, expected ({E},)")
            if down_bias is not None:
                raise ProgramError("moe: a down scale and a down bias together (no architecture has both)")
        if not (limit > 0 and alpha > 0):
            raise ProgramError(f"moe: swiglu_oai alpha {alpha} and limit {limit} must be positive")
        layer = sum(n.op == "moe" for n in self._nodes)
        out = self._new(x.rows, d, name)
        self._emit("moe", (x,) if router_x is None else (x, router_x), (out,), moe_layer=layer, router=router,
                   router_bias=router_bias, gate=gate, up=up, down=down, gate_bias=gate_bias, up_bias=up_bias,
                   down_bias=down_bias, n_expert=E, n_used=int(n_used), ffn_dim=ff, gating=gating, norm_w=bool(norm_w),
                   w_scale=float(w_scale), act=act, alpha=float(alpha), limit=float(limit), shared=shared,
                   shared_gate=shared_gate, down_scale=down_scale)
        return out

    def finish(self, logits: Value) -> Program:
        """The Program whose output is ``logits`` ((R, vocab)). Raises ProgramError when
        the program has no embed, or its output is not on the logits rows."""
        if not self._nodes or self._nodes[0].op != "embed":
            raise ProgramError("a program starts with embed")
        if logits.rows != ROWS_R:
            raise ProgramError(f"the output {logits!r} must be on the logits rows (take_rows)")
        if sum(n.op == "take_rows" for n in self._nodes) != 1:
            raise ProgramError("a program takes the logits rows exactly once")
        return Program(tuple(self._nodes), tuple(self._values), logits, self._d_model, tuple(self._kv),
                       tuple(self._states), getattr(self, "_hidden", None))

    def lookup(self, table: Any, scale: float = 1.0, name: str = "") -> Value:
        """(N, table.k): row i = scale * table row tokens[i], like ``embed`` but anywhere in
        the program and for any table (Gemma 4's per-layer token embeddings). Rows the
        caller gives as embeddings take table row 0 (llama.cpp's padding-token rows)."""
        m, k = _width_of(table)
        out = self._new(ROWS_N, k, name)
        self._emit("lookup", (), (out,), table=table, scale=float(scale), vocab=m)
        return out

    def shared_attention(self, q: Value, *, kv_layer: int, n_heads: int, head_dim: int, scale: float,
                         window: int = 0, name: str = "") -> Value:
        """``attention`` of q over the KV cache of the earlier attention node whose layer is
        ``kv_layer`` (Gemma 4's last layers reuse KV): nothing is stored; row i attends to
        what that layer stored for its slot, positions [lo, p] as ``attention`` says."""
        if q.rows != ROWS_N or not 0 <= kv_layer < len(self._kv):
            raise ProgramError(f"shared_attention: {q!r} over KV layer {kv_layer} ({len(self._kv)} so far)")
        L = self._kv[kv_layer]
        if L.head_dim != head_dim or q.width != n_heads * head_dim or n_heads % L.n_kv_heads:
            raise ProgramError(f"shared_attention: q {q.width} for {n_heads} heads of {head_dim} over KV layer "
                               f"{kv_layer} ({L.n_kv_heads} heads of {L.head_dim})")
        out = self._new(ROWS_N, q.width, name)
        self._emit("shared_attention", (q,), (out,), layer=int(kv_layer), n_heads=int(n_heads),
                   n_kv_heads=L.n_kv_heads, head_dim=int(head_dim), scale=float(scale), window=int(window), sinks=None)
        return out

    def mark_hidden(self, x: Value) -> None:
        """Keep ``x`` ((N, d): every row of the batch) after each forward: the final-normed
        hidden state a multi-token-prediction head reads (backends: ``last_hidden``)."""
        if x.rows != ROWS_N:
            raise ProgramError(f"mark_hidden: {x!r} must be batch rows (N)")
        self._hidden = x

    def input(self, name: str, width: int) -> Value:
        """(N, width) rows the caller supplies with each forward (``inputs[name]``)."""
        out = self._new(ROWS_N, width, name)
        self._emit("input", (), (out,), name=name)
        return out

    def concat(self, a: Value, b: Value, name: str = "") -> Value:
        """[a, b] side by side: (rows, a.width + b.width)."""
        if a.rows != b.rows:
            raise ProgramError(f"concat: {a!r} and {b!r} are on different rows")
        out = self._new(a.rows, a.width + b.width, name)
        self._emit("concat", (a, b), (out,))
        return out

    # ---- recurrent layers (IR.md section 9) -------------------------------------------

    def _state(self, kind: str, shape: tuple[int, ...]) -> int:
        self._states.append(StateLayer(kind, tuple(int(d) for d in shape)))
        return len(self._states) - 1

    def short_conv(self, x: Value, weight: Any, act: str = "silu", name: str = "") -> Value:
        """A causal depthwise convolution over each slot's positions with a carried state
        (llama.cpp ggml_ssm_conv): weight (C, K) float32, x (N, C). Row i (slot s, position
        p): out[c] = act(sum_j weight[c, j] * u[p - K + 1 + j][c], j = 0 .. K-1 in that
        order), u[t] the slot's input at position t (earlier rows of the segment, else the
        slot's conv state; zero before position 0). After the forward the state holds the
        slot's last K-1 inputs. act: CONV_ACTS."""
        if x.rows != ROWS_N:
            raise ProgramError("short_conv: its input must be batch rows (N)")
        C, K = _width_of(weight)
        if C != x.width or K < 2:
            raise ProgramError(f"short_conv: kernel {getattr(weight, 'name', '')} of shape ({C}, {K}) for {x!r}")
        if act not in CONV_ACTS:
            raise ProgramError(f"short_conv: activation {act!r} (known: {', '.join(CONV_ACTS)})")
        out = self._new(ROWS_N, C, name)
        self._emit("short_conv", (x,), (out,), weight=weight, act=act, state=self._state("conv", (K - 1, C)))
        return out

    def delta_rule(self, q: Value, k: Value, v: Value, alpha: Value, beta: Value, *, n_k_heads: int,
                   n_v_heads: int, head_dim: int, a: Any, dt_bias: Any, scale: float, key_heads: str = "tiled",
                   name: str = "") -> Value:
        """The gated delta rule (Yang et al. 2024, "Gated Delta Networks"; llama.cpp
        ggml_gated_delta_net) with a state matrix S (head_dim x head_dim) per value head
        and slot. q, k (N, n_k_heads*head_dim), v (N, n_v_heads*head_dim), alpha, beta
        (N, n_v_heads); a, dt_bias: (n_v_heads,) vectors. Per row and value head h, with
        key head h % n_k_heads (``key_heads`` "tiled": ggml's broadcast, Qwen3.5) or
        h // (n_v_heads / n_k_heads) ("grouped": Qwen3-Next): g = a[h] * softplus(alpha[h] +
        dt_bias[h]) (softplus(x) = x above 20, else log(1 + exp(x))), b = sigmoid(beta[h]),
        S = exp(g) S;  d = b (v_h - S^T k);  S = S + k d^T;  out_h = scale S^T q."""
        if not (q.rows == k.rows == v.rows == alpha.rows == beta.rows == ROWS_N):
            raise ProgramError("delta_rule: every operand must be batch rows (N)")
        if (q.width != n_k_heads * head_dim or k.width != q.width or v.width != n_v_heads * head_dim
                or alpha.width != n_v_heads or beta.width != n_v_heads or n_k_heads <= 0 or n_v_heads % n_k_heads):
            raise ProgramError(f"delta_rule: q {q.width}, k {k.width}, v {v.width}, alpha {alpha.width}, beta "
                               f"{beta.width} for {n_k_heads} key and {n_v_heads} value heads of {head_dim}")
        for vec, what in ((a, "a"), (dt_bias, "dt_bias")):
            if _width_of(vec) != (n_v_heads,):
                raise ProgramError(f"delta_rule: {what} {getattr(vec, 'name', '')} has shape {_width_of(vec)}, "
                                   f"expected ({n_v_heads},)")
        if key_heads not in ("tiled", "grouped"):
            raise ProgramError(f"delta_rule: key_heads {key_heads!r} (known: tiled, grouped)")
        out = self._new(ROWS_N, v.width, name)
        self._emit("delta_rule", (q, k, v, alpha, beta), (out,), n_k_heads=int(n_k_heads), n_v_heads=int(n_v_heads),
                   head_dim=int(head_dim), a=a, dt_bias=dt_bias, scale=float(scale), key_heads=key_heads,
                   state=self._state("delta", (n_v_heads, head_dim, head_dim)))
        return out

    def l2_norm(self, x: Value, eps: float, head_dim: int, name: str = "") -> Value:
        """Each head_dim chunk of the row divided by sqrt(sum(chunk**2) + eps) (llama.cpp
        build_gdn_l2_norm: rms_norm with eps/head_dim, times 1/sqrt(head_dim))."""
        if x.width % head_dim:
            raise ProgramError(f"l2_norm: width {x.width}, head_dim {head_dim}")
        out = self._new(x.rows, x.width, name)
        self._emit("l2_norm", (x,), (out,), eps=float(eps), head_dim=int(head_dim))
        return out

    def sigmoid_gate(self, x: Value, gate: Value, name: str = "") -> Value:
        """x * sigmoid(gate), element-wise (Qwen3.5's gated attention output)."""
        self._same("sigmoid_gate", x, gate)
        out = self._new(x.rows, x.width, name)
        self._emit("sigmoid_gate", (x, gate), (out,))
        return out

    def mul(self, a: Value, b: Value, name: str = "") -> Value:
        """a * b, element-wise (LFM2's short-convolution gates: b * x before the convolution,
        c * conv after it; ggml_mul)."""
        self._same("mul", a, b)
        out = self._new(a.rows, a.width, name)
        self._emit("mul", (a, b), (out,))
        return out

    def deinterleave(self, x: Value, head_dim: int, parts: int, names: tuple[str, ...] = ()) -> tuple[Value, ...]:
        """x as n_heads consecutive groups of ``parts`` head_dim chunks (Qwen3.5's query and
        gate, interleaved per head); output j gathers chunk j of every head, (rows,
        n_heads*head_dim)."""
        if parts < 2 or x.width % (parts * head_dim):
            raise ProgramError(f"deinterleave: width {x.width} is not heads of {parts} x {head_dim}")
        names = tuple(names) + ("",) * (parts - len(names))
        outs = tuple(self._new(x.rows, x.width // parts, n) for n in names)
        self._emit("deinterleave", (x,), outs, head_dim=int(head_dim), parts=int(parts))
        return outs
