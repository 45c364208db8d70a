"""The op set every backend executes, and the ``Program`` an architecture is traced into.

Owns: the definition of each op (its inputs, attributes and exact semantics), the
symbolic values ops read and write, ``ProgramBuilder`` (what an architecture module calls
once at load to state its forward pass), ``Program`` (the resulting list of nodes, checked
for consistent widths) and ``RopeSpec`` with the RoPE tables every backend shares.
Leaves to others: the kernels (``cpu.py``/``cpu_program.py``, the CUDA compiler), which
tensors an architecture has and the order of its ops (``engine/model/architectures``).

The model (a ggml-style graph, at the granularity of llama.cpp's build_norm / build_attn /
build_ffn): every value is a (rows, width) float32 matrix. ``rows`` is symbolic: ``"N"``,
the batch's rows (one per token of the batch, in segment order), or ``"R"``, the rows whose
logits are returned (``take_rows``). Weights are attributes of nodes: backend objects made
by ``backend.matrix`` / ``backend.vector`` at load. Every op except ``attention`` is
row-wise: a row's result depends only on that row (batch invariance, shared/DESIGN.md);
``attention`` mixes rows only through each slot's KV cache.

/work/coord/IR.md is the prose version of this module for backend authors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ROWS_N = "N"   # one row per token of the batch
ROWS_R = "R"   # one row per logits row (BatchLayout.out_rows)

ROPE_MODES = ("normal", "neox")
GLU_ACTS = ("silu", "gelu_tanh")
OPS = ("embed", "rms_norm", "head_rms_norm", "linear", "split", "rope", "attention", "glu", "add", "scale",
       "softcap", "take_rows")


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


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE configuration (llama.cpp's ggml_rope_ext arguments without YaRN).

    mode: "normal" rotates adjacent pairs (x[2j], x[2j+1]) (GGML_ROPE_TYPE_NORM: llama);
          "neox" rotates (x[j], x[j + dim/2]) (GGML_ROPE_TYPE_NEOX: qwen2, qwen3, gemma3, phi3).
    dim:  rotated dimensions of each head (even, <= head_dim); the rest pass through.
    base: theta base; pair j turns by angle  pos * freq_scale * base**(-2j/dim) / ff[j].
    freq_scale: 1 / the linear scaling factor (1.0 when unscaled).
    attn_factor: cos and sin are multiplied by it (ggml's mscale; Phi-3 long-rope's
          attention factor; 1.0 elsewhere). Rotating q and k both scales q.k by its square.
    freq_factors: (dim/2,) ff[j] (Llama 3's rope_freqs, Phi-3's short factors), or None (1).
    long_factors, long_ctx: Phi-3's long factors: a KV cache with n_ctx > long_ctx uses
          long_factors instead of freq_factors (llama.cpp get_rope_factors: n_ctx_seq >
          n_ctx_orig_yarn). None / 0 when absent.
    Hashable: backends share one table per distinct spec and cache size."""

    mode: str
    dim: int
    base: float
    freq_scale: float = 1.0
    attn_factor: float = 1.0
    freq_factors: tuple[float, ...] | None = None
    long_factors: tuple[float, ...] | None = None
    long_ctx: int = 0

    def factors_for(self, n_ctx: int) -> tuple[float, ...] | None:
        """The frequency factors a KV cache of ``n_ctx`` positions uses."""
        if self.long_factors is not None and n_ctx > self.long_ctx:
            return self.long_factors
        return self.freq_factors

    def tables(self, n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin for positions 0..n_ctx-1: two (n_ctx, dim/2) float32 arrays,
        ``attn_factor * cos(angle)`` and ``attn_factor * sin(angle)`` with the angle of
        the class docstring, computed in float64 and rounded once (ggml computes theta in
        float32 by repeated multiplication; the two agree to ~1e-6 relative)."""
        half = self.dim // 2
        j = np.arange(half, dtype=np.float64)
        inv = self.base ** (-2.0 * j / self.dim)
        ff = self.factors_for(n_ctx)
        if ff is not None:
            inv = inv / np.asarray(ff, np.float64)
        ang = (np.arange(n_ctx, dtype=np.float64)[:, None] * self.freq_scale) * inv[None, :]
        return ((np.cos(ang) * self.attn_factor).astype(np.float32),
                (np.sin(ang) * self.attn_factor).astype(np.float32))


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
        shown = {k: (getattr(v, "name", None) or type(v).__name__) if k in ("weight", "bias", "table") and v is not None
                 else v for k, v in self.attrs.items()}
        outs = ", ".join(map(repr, self.outs))
        return f"{outs} = {self.op}({', '.join(map(repr, self.inputs))}; {shown})"


@dataclass(frozen=True, eq=False)
class KVLayer:
    """One layer of the KV cache: the attention node that owns it stores ``n_kv_heads``
    heads of ``head_dim`` for K and for V at every position."""

    n_kv_heads: int
    head_dim: int


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
    """

    def __init__(self) -> None:
        self._nodes: list[Node] = []
        self._values: list[Value] = []
        self._kv: list[KVLayer] = []
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
                  scale: float, window: int = 0, name: str = "") -> Value:
        if not (q.rows == k.rows == v.rows == ROWS_N):
            raise ProgramError("attention: q, k and v must be batch rows (N), before take_rows")
        if (q.width != n_heads * head_dim or k.width != n_kv_heads * head_dim or v.width != k.width
                or n_kv_heads <= 0 or n_heads % n_kv_heads):
            raise ProgramError(f"attention: q {q.width}, k {k.width}, v {v.width} for {n_heads} heads, "
                               f"{n_kv_heads} KV heads of {head_dim}")
        if window < 0:
            raise ProgramError(f"attention: window {window} must be 0 (none) or positive")
        layer = len(self._kv)
        self._kv.append(KVLayer(int(n_kv_heads), int(head_dim)))
        out = self._new(ROWS_N, n_heads * head_dim, name)
        self._emit("attention", (q, k, v), (out,), layer=layer, n_heads=int(n_heads), n_kv_heads=int(n_kv_heads),
                   head_dim=int(head_dim), scale=float(scale), window=int(window))
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

    def finish(self, logits: Value) -> Program:
        """The Program whose output is ``logits`` ((R, vocab)). Raises ProgramError when
        the program has no embed, or its output is not on the logits rows."""
        if not self._nodes or self._nodes[0].op != "embed":
            raise ProgramError("a program starts with embed")
        if logits.rows != ROWS_R:
            raise ProgramError(f"the output {logits!r} must be on the logits rows (take_rows)")
        if sum(n.op == "take_rows" for n in self._nodes) != 1:
            raise ProgramError("a program takes the logits rows exactly once")
        return Program(tuple(self._nodes), tuple(self._values), logits, self._d_model, tuple(self._kv))


def check_scale(value: float, what: str) -> float:
    """``value`` as a finite positive float (attention scales, embedding scales), else
    ProgramError naming ``what``."""
    v = float(value)
    if not (math.isfinite(v) and v > 0):
        raise ProgramError(f"{what} is {value}; it must be finite and positive")
    return v
