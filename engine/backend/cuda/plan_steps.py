"""The CUDA plan's steps: what ``plan.py`` lowers a Program's nodes into (one dataclass per
kind of step: the fused QKV / GLU / residual patterns, attention, the generic per-node steps,
the host MoE step). Data only: ``steps.py``, ``attention.py`` and ``moe.py`` execute them.
Re-exported by ``plan.py`` (``plan.Linear`` is this module's ``Linear``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# ---- steps ------------------------------------------------------------------------------------
# Value ids refer to Program.values; ``norm`` is (weight vector, eps) or None.

@dataclass
class Embed:
    out: int
    table: Any
    scale: float


@dataclass
class Linear:
    """out = W . norm(x) (+ bias); mode "store" or "add" (out is the residual's buffer)."""
    x: int
    norm: tuple | None
    w: Any
    bias: Any
    out: int
    mode: str = "store"


@dataclass
class Glu:
    """out = act(Wa[a0:a0+f] . norm(x) + bias_a) * (Wb[b0:b0+f] . norm(x) + bias_b)."""
    x: int
    norm: tuple | None
    wa: Any
    a0: int
    wb: Any
    b0: int
    f: int
    bias_a: Any
    bias_b: Any
    act: str
    out: int


@dataclass
class QKV:
    """The attention input of layer ``layer``: q (to ``q_out``), k and v (into the cache).

    mats: one (matrix, first row of [q; k; v] it holds) per launched matrix (one fused
    matrix, or Wq, Wk, Wv); biases: one (vector or None, first row) per bias part;
    q_norm / k_norm: (weight (hd,), eps) for QK-norm, or None."""
    x: int
    norm: tuple | None
    mats: list
    biases: list
    q_out: int
    layer: int
    spec: Any
    n_heads: int
    n_kv: int
    hd: int
    q_norm: tuple | None
    k_norm: tuple | None


@dataclass
class Attend:
    q: int
    out: int
    layer: int
    n_heads: int
    n_kv: int
    hd: int
    scale: float
    window: int
    sinks: Any = None          # (n_heads,) sink logits (gpt-oss) or None


@dataclass
class KVStore:
    """Generic: store rows of k and v into layer ``layer`` of the cache."""
    k: int
    v: int
    layer: int
    n_kv: int
    hd: int


@dataclass
class TakeRows:
    x: int
    out: int


@dataclass
class Norm:
    """out (+)= rms_norm(x) * w; with ``add`` out is the residual's buffer."""
    x: int
    w: Any
    eps: float
    out: int
    add: bool = False


@dataclass
class HeadOp:
    """Generic per-head RMSNorm (``w`` not None) and/or RoPE (``spec`` not None)."""
    x: int
    out: int
    hd: int
    w: Any = None
    eps: float = 0.0
    spec: Any = None


@dataclass
class Elementwise:
    """out = a + b ("add"), s * a ("scale"), s * tanh(a / s) ("softcap")."""
    op: str
    a: int
    b: int | None
    out: int
    s: float = 0.0


@dataclass
class GluRows:
    gate: int
    up: int
    act: str
    out: int


@dataclass
class MoeHost:
    """The ``moe`` op: the rows of x go to the host, the router, routing, the CPU
    tier's experts, join and shared expert run there (``cpu.experts.moe_rows``), the experts
    placed on the GPU tier on the device meanwhile; the result comes back into out.
    ``attrs``: the node's attributes. While a layer has experts off the GPU its step waits
    for the host (the tick runs eagerly, or as graphs between such steps); with every
    expert on the GPU it runs on the device (``moe.MoeStep.device_ready``)."""
    x: int
    out: int
    attrs: Any
