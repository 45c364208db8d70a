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

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ROWS_N = "N"   # one row per token of the batch
ROWS_R = "R"   # one row per logits row (BatchLayout.out_rows)

ROPE_MODES = ("normal", "neox")
GLU_ACTS = ("silu", "gelu_tanh")
OPS = ("embed", "rms_norm", "head_rms_norm", "linear", "split", "rope", "attention", "glu", "add", "scale",
       "softcap", "take_rows", "moe")
#: how a ``moe`` node turns router logits into expert weights (llama.cpp's
#: llama_expert_gating_func_type): "softmax" (probabilities over every expert, the top-k
#: of them kept: Qwen3-MoE, OLMoE, Qwen2-MoE) or "softmax_weight" (top-k of the raw
#: logits, then a softmax over those k: gpt-oss)
MOE_GATINGS = ("softmax", "softmax_weight")
#: an expert's gated activation: "silu" (SwiGLU: silu(g) * u) or "swiglu_oai" (gpt-oss:
#: g clamped above at ``limit``, u clamped to +-limit, g * sigmoid(alpha g) * (u + 1))
MOE_ACTS = ("silu", "swiglu_oai")
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
    ext_factor, beta_fast, beta_slow, yarn_ctx: YaRN (Peng et al. 2023, as ggml's
          rope_yarn; gpt-oss): with ext_factor != 0 pair j turns by a mix of the scaled
          and the unscaled angle, theta = theta_s (1 - r_j) + theta_u r_j with
          r_j = ext_factor * (1 - clamp((j - lo) / max(0.001, hi - lo), 0, 1)), where
          lo = max(0, floor(c(beta_fast))), hi = min(dim - 1, ceil(c(beta_slow))),
          c(b) = dim * ln(yarn_ctx / (2 pi b)) / (2 ln base) (ggml_rope_yarn_corr_dims),
          and cos, sin are further multiplied by 1 + 0.1 ln(1 / freq_scale). ext_factor
          0 (the default) is plain RoPE.
    Hashable: backends share one table per distinct spec and cache size."""

    mode: str
    dim: int
    base: float
    freq_scale: float = 1.0
    attn_factor: float = 1.0
    freq_factors: tuple[float, ...] | None = None
    long_factors: tuple[float, ...] | None = None
    long_ctx: int = 0
    ext_factor: float = 0.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    yarn_ctx: int = 0

    def factors_for(self, n_ctx: int) -> tuple[float, ...] | None:
        """The frequency factors a KV cache of ``n_ctx`` positions uses."""
        if self.long_factors is not None and n_ctx > self.long_ctx:
            return self.long_factors
        return self.freq_factors

    def tables(self, n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin for positions 0..n_ctx-1: two (n_ctx, dim/2) float32 arrays,
        ``attn_factor * cos(angle)`` and ``attn_factor * sin(angle)`` with the angle of
        the class docstring (YaRN's mix and magnitude factor when ext_factor != 0), computed
        in float64 and rounded once (ggml computes theta in float32 by repeated
        multiplication; the two agree to ~1e-6 relative)."""
        ang, mscale = self.angles(np.arange(n_ctx, dtype=np.float64), n_ctx)
        return ((np.cos(ang) * mscale).astype(np.float32), (np.sin(ang) * mscale).astype(np.float32))

    def angles(self, positions: np.ndarray, n_ctx: int) -> tuple[np.ndarray, float]:
        """float64 (len(positions), dim/2) rotation angles, and the factor cos and sin are
        multiplied by (attn_factor, times YaRN's magnitude correction when ext_factor != 0),
        for a KV cache of ``n_ctx`` positions (the class docstring's formulas)."""
        half = self.dim // 2
        j = np.arange(half, dtype=np.float64)
        inv = self.base ** (-2.0 * j / self.dim)
        ff = self.factors_for(n_ctx)
        if ff is not None:
            inv = inv / np.asarray(ff, np.float64)
        extrap = np.asarray(positions, np.float64)[:, None] * inv[None, :]
        ang = extrap * self.freq_scale
        mscale = self.attn_factor
        if self.ext_factor != 0.0:
            lo, hi = self.yarn_corr_dims()
            mix = (1.0 - np.clip((j - lo) / max(0.001, hi - lo), 0.0, 1.0)) * self.ext_factor
            ang = ang * (1.0 - mix)[None, :] + extrap * mix[None, :]
            mscale *= 1.0 + 0.1 * math.log(1.0 / self.freq_scale)
        return ang, mscale

    def yarn_corr_dims(self) -> tuple[float, float]:
        """YaRN's correction range (ggml_rope_yarn_corr_dims): pairs below ``lo`` keep the
        unscaled angle, pairs above ``hi`` the scaled one."""
        def corr(b: float) -> float:
            return self.dim * math.log(self.yarn_ctx / (b * 2.0 * math.pi)) / (2.0 * math.log(self.base))

        return max(0.0, math.floor(corr(self.beta_fast))), min(self.dim - 1.0, math.ceil(corr(self.beta_slow)))


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
            shared_gate: Any = None, name: str = "") -> Value:
        """A mixture of E gated FFN experts with top-``n_used`` routing (llama.cpp's
        build_moe_ffn), row-wise. For each row x (width d):

            l   = router x (+ router_bias)                      (E,)   router: matrix (E, d)
            p   = softmax(l) if gating == "softmax" else l      ("softmax_weight")
            S   = the n_used experts of largest p, in decreasing p (ties: lower index first)
            w_j = p[S_j];  "softmax_weight": w = softmax(w);  norm_w: w = w / max(sum w, MOE_NORM_MIN);
                  w = w * w_scale unless w_scale is 0 or 1
            y_j = down_e(act(gate_e x + gate_bias[e], up_e x + up_bias[e])) + down_bias[e],  e = S_j
            out = sum_j w_j y_j  (j = 0 .. n_used-1, in that order)
                  + s * shared_down(silu(shared_gate_w x) * shared_up x)   when ``shared``
                    (s = sigmoid(shared_gate x) when ``shared_gate``, else 1)

        gate, up: expert stacks of E matrices (ff, d); down: E matrices (d, ff) (backend
        objects from ``backend.experts``: ``.n_expert``, ``.m``, ``.k``, ``.name``, ``.qtype``);
        the biases: (E, ff) / (E, d) float32 (``backend.expert_vectors``) or None; act:
        MOE_ACTS ("swiglu_oai" uses ``alpha`` and ``limit``); shared: (gate (fs, d), up
        (fs, d), down (d, fs)) matrices of an always-on shared expert; shared_gate: a
        (1, d) matrix. The node's ``moe_layer`` attribute numbers the moe nodes in call
        order (the expert tiers plan per moe layer)."""
        d = x.width
        if gating not in MOE_GATINGS:
            raise ProgramError(f"moe: gating {gating!r} (known: {', '.join(MOE_GATINGS)})")
        if act not in MOE_ACTS:
            raise ProgramError(f"moe: activation {act!r} (known: {', '.join(MOE_ACTS)})")
        E, rk = _width_of(router)
        if rk != d:
            raise ProgramError(f"moe: router {getattr(router, 'name', '')} takes {rk} inputs, {x!r} has width {d}")
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
        if not (limit > 0 and alpha > 0):
            raise ProgramError(f"moe: swiglu_oai alpha {alpha} and limit {limit} must be positive")
        layer = sum(n.op == "moe" for n in self._nodes)
        out = self._new(x.rows, d, name)
        self._emit("moe", (x,), (out,), moe_layer=layer, router=router, router_bias=router_bias, gate=gate, up=up,
                   down=down, gate_bias=gate_bias, up_bias=up_bias, down_bias=down_bias, n_expert=E,
                   n_used=int(n_used), ffn_dim=ff, gating=gating, norm_w=bool(norm_w), w_scale=float(w_scale),
                   act=act, alpha=float(alpha), limit=float(limit), shared=shared, shared_gate=shared_gate)
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
