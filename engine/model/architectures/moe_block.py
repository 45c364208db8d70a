"""The routed-experts FFN that the mixture-of-experts architectures share (llama.cpp's
build_moe_ffn with the tensors its create_tensor calls declare).

Owns: the expert tensors of one layer (``moe_tensors``: the router ``ffn_gate_inp``, the
expert stacks ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, their optional or
required biases, an optional shared expert ``ffn_*_shexp`` with its gate
``ffn_gate_inp_shexp``), one ``moe`` op over them (``build_moe``), and the checks every
MoE graph in llama.cpp makes (expert_count and expert_used_count present and positive).
Leaves the routing rule (gating, normalisation, activation) to each architecture module
and the op's arithmetic to the backends.
"""

from __future__ import annotations

from aotx.engine.backend.ops import ProgramBuilder, Value
from aotx.engine.errors import ModelError
from aotx.engine.model.config import ModelConfig
from aotx.engine.model.transformer import Tensor, Weights


def experts(name: str, k: int, m: int, n_expert: int) -> Tensor:
    """A stack of ``n_expert`` (m, k) matrices: ggml shape [k, m, E]."""
    return Tensor(name, (k, m, n_expert), "experts")


def expert_bias(name: str, n: int, n_expert: int, optional: bool = False) -> Tensor:
    """One (n,) bias per expert: ggml shape [n, E]."""
    return Tensor(name, (n, n_expert), "expert_vectors", optional)


def require_experts(cfg: ModelConfig, path: str) -> None:
    """llama.cpp: "n_expert must be > 0" / "n_expert_used must be > 0" for a MoE graph."""
    if cfg.n_expert <= 0 or cfg.n_expert_used <= 0:
        raise ModelError(f"{path}: {cfg.arch}.expert_count is {cfg.n_expert} and {cfg.arch}.expert_used_count "
                         f"{cfg.n_expert_used}; a {cfg.arch} model needs both positive")


def moe_tensors(cfg: ModelConfig, p: str, ff: int, *, biases: bool = False, shared_ff: int = 0,
                shared_gate: bool = False) -> list:
    """Layer ``p``'s router (d -> E), its E experts (gate, up: d -> ff; down: ff -> d),
    with required biases when ``biases`` (gpt-oss), and a shared expert of width
    ``shared_ff`` with its (d -> 1) gate when ``shared_ff`` > 0 (Qwen2-MoE; the gate required
    when ``shared_gate``: Qwen3.5-MoE)."""
    from aotx.engine.model.architectures.common import mat, vec

    d, E = cfg.d_model, cfg.n_expert
    out = [mat(p + "ffn_gate_inp.weight", d, E), experts(p + "ffn_gate_exps.weight", d, ff, E),
           experts(p + "ffn_up_exps.weight", d, ff, E), experts(p + "ffn_down_exps.weight", ff, d, E)]
    if biases:
        out += [vec(p + "ffn_gate_inp.bias", E), expert_bias(p + "ffn_gate_exps.bias", ff, E),
                expert_bias(p + "ffn_up_exps.bias", ff, E), expert_bias(p + "ffn_down_exps.bias", d, E)]
    if shared_ff:
        out += [mat(p + "ffn_gate_inp_shexp.weight", d, 1, not shared_gate), mat(p + "ffn_gate_shexp.weight", d, shared_ff),
                mat(p + "ffn_up_shexp.weight", d, shared_ff), mat(p + "ffn_down_shexp.weight", shared_ff, d)]
    return out


def build_moe(b: ProgramBuilder, cfg: ModelConfig, w: Weights, p: str, h: Value, *, gating: str, norm_w: bool,
              act: str = "silu", w_scale: float = 1.0) -> Value:
    """The ``moe`` op of layer ``p`` on the normed input ``h`` with the layer's tensors
    (whichever of the optional biases and shared expert the file has)."""
    shared = None
    if p + "ffn_gate_shexp.weight" in w:
        shared = (w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"], w[p + "ffn_down_shexp.weight"])
    return b.moe(h, router=w[p + "ffn_gate_inp.weight"], router_bias=w.get(p + "ffn_gate_inp.bias"),
                 gate=w[p + "ffn_gate_exps.weight"], up=w[p + "ffn_up_exps.weight"],
                 down=w[p + "ffn_down_exps.weight"], gate_bias=w.get(p + "ffn_gate_exps.bias"),
                 up_bias=w.get(p + "ffn_up_exps.bias"), down_bias=w.get(p + "ffn_down_exps.bias"),
                 n_used=cfg.n_expert_used, gating=gating, norm_w=norm_w, w_scale=w_scale, act=act, shared=shared,
                 shared_gate=w.get(p + "ffn_gate_inp_shexp.weight") if shared is not None else None,
                 name=p + "ffn_moe_out")
