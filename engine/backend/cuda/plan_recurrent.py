"""The plan's steps of hybrid models' ops (IR.md section 9) on the CUDA backend.

Owns: the step types of ``short_conv``, ``delta_rule``, ``l2_norm``, ``sigmoid_gate`` and
``deinterleave`` (each names the values it reads and writes: ``reads()``, ``writes()``) and
``lower(node)``, which ``plan.generic_steps`` calls for those ops. Pure, like ``plan.py``
(no CuPy). Leaves the executors and the per-slot state to ``recurrent.py``, the kernels to
``kernels/recurrent.cu``, buffers to ``plan.py``.

The ops of section 9 that a forward of the main stack does not use (``input``, ``concat``,
``lookup``, ``shared_attention``: MTP heads, Gemma 4) have no step: ``plan`` refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: the ops ``lower`` takes
OPS = ("short_conv", "delta_rule", "l2_norm", "sigmoid_gate", "deinterleave")


@dataclass
class ShortConv:
    """out = act(causal depthwise convolution of x over the slot's positions); the state is
    ``Program.state_layers[state]`` ("conv", (K-1, C)). ``weight``: (C, K) float32."""
    x: int
    out: int
    weight: Any
    silu: bool
    state: int

    def reads(self) -> list[int]:
        return [self.x]

    def writes(self) -> list[int]:
        return [self.out]


@dataclass
class DeltaRule:
    """The gated delta rule over q, k (N, Hk*S), v (N, H*S), alpha, beta (N, H) into out
    (N, H*S); ``state`` indexes ``Program.state_layers`` ("delta", (H, S, S)). ``a``,
    ``dt_bias``: (H,) vectors; ``grouped``: value head h reads key head h // (H/Hk), else
    h % Hk (tiled)."""
    q: int
    k: int
    v: int
    alpha: int
    beta: int
    out: int
    n_k: int
    n_v: int
    head_dim: int
    a: Any
    dt_bias: Any
    scale: float
    grouped: bool
    state: int

    def reads(self) -> list[int]:
        return [self.q, self.k, self.v, self.alpha, self.beta]

    def writes(self) -> list[int]:
        return [self.out]


@dataclass
class L2Norm:
    """out = each hd chunk of x / sqrt(sum(chunk^2) + eps)."""
    x: int
    out: int
    hd: int
    eps: float

    def reads(self) -> list[int]:
        return [self.x]

    def writes(self) -> list[int]:
        return [self.out]


@dataclass
class SigmoidGate:
    """out = x * sigmoid(g)."""
    x: int
    g: int
    out: int

    def reads(self) -> list[int]:
        return [self.x, self.g]

    def writes(self) -> list[int]:
        return [self.out]


@dataclass
class Deinterleave:
    """outs[j] gathers the j-th hd chunk of every head's group of ``parts`` chunks of x."""
    x: int
    outs: tuple
    hd: int
    parts: int

    def reads(self) -> list[int]:
        return [self.x]

    def writes(self) -> list[int]:
        return list(self.outs)


def lower(n) -> Any:
    """The step of node ``n`` (an ``ops.Node`` whose op is in ``OPS``)."""
    A = n.attrs
    ids = [x.id for x in n.inputs]
    if n.op == "short_conv":
        if A["act"] not in ("none", "silu"):
            raise ValueError(f"short_conv activation {A['act']!r}")
        return ShortConv(ids[0], n.out.id, A["weight"], A["act"] == "silu", int(A["state"]))
    if n.op == "delta_rule":
        return DeltaRule(*ids, n.out.id, int(A["n_k_heads"]), int(A["n_v_heads"]), int(A["head_dim"]), A["a"],
                         A["dt_bias"], float(A["scale"]), A["key_heads"] == "grouped", int(A["state"]))
    if n.op == "l2_norm":
        return L2Norm(ids[0], n.out.id, int(A["head_dim"]), float(A["eps"]))
    if n.op == "sigmoid_gate":
        return SigmoidGate(ids[0], ids[1], n.out.id)
    if n.op == "deinterleave":
        return Deinterleave(ids[0], tuple(o.id for o in n.outs), int(A["head_dim"]), int(A["parts"]))
    raise ValueError(f"op {n.op!r} is not a recurrent op")
