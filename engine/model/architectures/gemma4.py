"""The gemma4 architecture (Gemma 4 dense: E2B, E4B, 31B): sliding-window layers with their
own head size and RoPE, per-layer token embeddings fed into every layer, and the last
layers reusing earlier layers' KV.

    x  = embed(tokens) * sqrt(d_model)                    (image rows enter unscaled)
    P  = (rmsnorm_per_layer(Wplp x / sqrt(d_model)) * per_layer_proj_norm
          + per_layer_token_embd(tokens) * sqrt(d_ple)) / sqrt(2)     (per-layer inputs, N x L x d_ple)
Each block l (``attention.sliding_window_pattern``: sliding or global; a sliding layer has
head size key_length_swa, RoPE over rope.dimension_count_swa dims at base
rope.freq_base_swa, window attention.sliding_window; a global layer head size
key_length, RoPE at rope.freq_base with the file's ``rope_freqs`` factors, no window):
    h  = rmsnorm(x) * attn_norm
    q  = rope(rmsnorm_per_head(Wq h) * attn_q_norm)
    k  = rope(rmsnorm_per_head(Wk h) * attn_k_norm);  v = rmsnorm_per_head(Wv h (Wk h without attn_v))
    a  = attention(q, k, v, scale 1)                      (layers past block_count - shared_kv_layers
                                                           store nothing and attend over the last KV
                                                           layer of their kind)
    x  = x + rmsnorm(Wo a) * post_attention_norm
    x  = x + rmsnorm(Wdown (gelu(Wgate rmsnorm(x) * ffn_norm) * Wup ...)) * post_ffw_norm
         (mixture-of-experts layers, 26B-A4B: the dense FFN is a shared expert beside
          routed ones, and the sum of the two is what post_ffw_norm normalises:
              m = rmsnorm(FFN(rmsnorm(x) * ffn_norm)) * post_ffw_norm_1
              e = rmsnorm(moe(rmsnorm(x) * pre_ffw_norm_2; router input
                              rmsnorm(x) / sqrt(d_model) * ffn_gate_inp.scale)) * post_ffw_norm_2
              x = x + rmsnorm(m + e) * post_ffw_norm
          moe: softmax over the expert_count router logits, the top expert_used_count
          renormalised, GeGLU experts from ffn_gate_up_exps (or ffn_gate_exps and
          ffn_up_exps), each expert's down output times ffn_down_exps.scale[e] when the
          file has it)
    x  = x + rmsnorm(Wproj (gelu(Winp_gate x) * P_l)) * post_norm          (with per-layer inputs)
    x  = x * layer_output_scale                           (when the file has it)
    logits = softcap(Woutput . (rmsnorm(x) * output_norm)) (tied; cap final_logit_softcapping,
                                                          30 when the file has none, as llama.cpp)
The norms' weights are used as stored (Gemma 4's converter adds no 1). A file with
``expert_count`` has the mixture-of-experts block in every layer (llama.cpp decides per
layer by ``ffn_gate_inp``; a file mixing the two kinds is refused naming the missing
tensor), and one without it is refused naming any router tensor it has. Per-expert
gate or up scales (``ffn_gate_exps.scale``, which llama.cpp's generic pass would apply)
are refused by name, as every tensor this module does not declare.

Checked against llama.cpp (as vendored by llama-cpp-python 0.3.36, 0c1e5709):
src/models/gemma4.cpp (load_arch_hparams, tensors, graph, build_inp_per_layer,
project_per_layer_inputs), llama-model.cpp (KV reuse: layer l >= n_layer_kv_from_start
reads layer n_layer_kv_from_start - 2 if it slides, else - 1; get_rope_freq_base /
_scale for sliding layers; llama_model_rope_type GEMMA4: NEOX), llama-hparams.cpp
(n_embd_head_k / n_rot per layer kind, has_kv), conversion/gemma.py Gemma4Model (the keys;
rope_freqs 1 for rotated, 1e30 for unrotated pairs of the global layers; router.scale ->
ffn_gate_inp.scale, per_expert_scale -> ffn_down_exps.scale), llama-graph.cpp
build_moe_ffn (probs_in: the router's logits computed outside; gate_up views; the down
scale applied by build_lora_mm_id before the weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from aotx.engine.backend.ops import ProgramBuilder, RopeSpec, Value
from aotx.engine.errors import ModelError
from aotx.engine.model.architectures import common as C
from aotx.engine.model.architectures import hparams as K
from aotx.engine.model.architectures import moe_block as M
from aotx.engine.model.config import ModelConfig
from aotx.engine.model.transformer import OneOf, Tensor, Weights

KNOWN_TENSORS_ONLY = True
#: llama.cpp's f_final_logit_softcapping when the file has no final_logit_softcapping key
DEFAULT_SOFTCAP = 30.0


@dataclass(frozen=True)
class Layers:
    """Per-layer facts: ``swa`` (sliding), ``n_kv`` KV heads, ``ffn`` widths, the head
    sizes and rotated dims of the two kinds, ``kv_from`` (None: the layer stores its own
    KV; else the layer whose KV it reads), ``ple`` the per-layer input width (0: none)."""

    swa: tuple[bool, ...]
    n_kv: tuple[int, ...]
    ffn: tuple[int, ...]
    head_swa: int
    head_full: int
    rot_swa: int
    rot_full: int
    kv_from: tuple[int | None, ...]
    ple: int

    def head(self, i: int) -> int:
        return self.head_swa if self.swa[i] else self.head_full


def layers(cfg: ModelConfig, path: str = "model") -> Layers:
    """Read and check the per-layer keys. Raises ModelError naming the key."""
    n = cfg.n_layers
    swa = K.array(cfg, path, "attention.sliding_window_pattern", n, bool)
    if swa is None:
        raise ModelError(f"{path}: metadata key '{cfg.arch}.attention.sliding_window_pattern' is missing")

    def per_layer(key: str, default: int) -> tuple[int, ...]:
        arr = K.array(cfg, path, key, n)
        return arr if arr is not None else (K.key(cfg, path, key, default),) * n

    n_kv = per_layer("attention.head_count_kv", cfg.n_heads)
    ffn = per_layer("feed_forward_length", cfg.ffn_dim)
    head_swa = K.key(cfg, path, "attention.key_length_swa")
    if K.key(cfg, path, "attention.value_length_swa") != head_swa:
        raise ModelError(f"{path}: {cfg.arch}.attention.value_length_swa differs from key_length_swa; Gemma 4 "
                         f"needs them equal")
    rot_swa = K.key(cfg, path, "rope.dimension_count_swa", head_swa)
    shared = K.key(cfg, path, "attention.shared_kv_layers", 0)
    ple = K.key(cfg, path, "embedding_length_per_layer_input")
    for key, v in (("attention.key_length_swa", head_swa), ("rope.dimension_count_swa", rot_swa)):
        K.positive(cfg, path, key, v)
    if rot_swa > head_swa or rot_swa % 2:
        raise ModelError(f"{path}: {cfg.arch}.rope.dimension_count_swa {rot_swa} must be even and at most "
                         f"key_length_swa {head_swa}")
    if any(h <= 0 or cfg.n_heads % h for h in n_kv):
        raise ModelError(f"{path}: {cfg.arch}.attention.head_count_kv {list(n_kv)} must divide head_count "
                         f"{cfg.n_heads} in every layer")
    first_shared = n - shared
    kv_from: list[int | None] = [None] * n
    if shared:
        if not 2 <= first_shared < n or not swa[first_shared - 2] or swa[first_shared - 1]:
            raise ModelError(f"{path}: {cfg.arch}.attention.shared_kv_layers {shared}: the last layers reuse the KV "
                             f"of layers {first_shared - 2} (sliding) and {first_shared - 1} (global), which the "
                             f"sliding_window_pattern does not give")
        for i in range(first_shared, n):
            kv_from[i] = first_shared - 2 if swa[i] else first_shared - 1
    if ple < 0:
        raise ModelError(f"{path}: {cfg.arch}.embedding_length_per_layer_input is {ple}")
    return Layers(tuple(swa), tuple(n_kv), tuple(ffn), head_swa, cfg.head_dim, rot_swa, cfg.rope_dim,
                  tuple(kv_from), ple)


def check_config(cfg: ModelConfig, path: str) -> None:
    cfg.check_sliding_window(path)
    L = layers(cfg, path)
    if all(L.swa):
        raise ModelError(f"{path}: {cfg.arch}.attention.sliding_window_pattern has no global layer")
    if cfg.n_expert or cfg.n_expert_used:
        M.require_experts(cfg, path)
        if cfg.expert_ffn_dim <= 0:
            raise ModelError(f"{path}: metadata key '{cfg.arch}.expert_feed_forward_length' is missing")


def moe_tensors(cfg: ModelConfig, p: str) -> list:
    """A mixture-of-experts layer's tensors beside the dense FFN (llama.cpp
    load_arch_tensors with ffn_gate_inp present, and the generic pass's down scale)."""
    d, E, ff = cfg.d_model, cfg.n_expert, cfg.expert_ffn_dim
    return [C.mat(p + "ffn_gate_inp.weight", d, E), Tensor(p + "ffn_gate_inp.scale", (d,), "host"),
            C.vec(p + "pre_ffw_norm_2.weight", d), C.vec(p + "post_ffw_norm_1.weight", d),
            C.vec(p + "post_ffw_norm_2.weight", d),
            OneOf(((Tensor(p + "ffn_gate_up_exps.weight", (d, 2 * ff, E), "expert_pair"),),
                   (M.experts(p + "ffn_gate_exps.weight", d, ff, E), M.experts(p + "ffn_up_exps.weight", d, ff, E)))),
            M.experts(p + "ffn_down_exps.weight", ff, d, E), Tensor(p + "ffn_down_exps.scale", (E,), "host", True)]


def build_moe(b: ProgramBuilder, cfg: ModelConfig, w: Weights, p: str, x: Value) -> Value:
    """The routed experts of layer ``p`` on the attention block's output x, normed by
    post_ffw_norm_2 (the router reads rmsnorm(x) / sqrt(d_model) * ffn_gate_inp.scale,
    folded into one norm weight)."""
    eps, d = cfg.norm_eps, cfg.d_model
    h = b.rms_norm(x, w[p + "pre_ffw_norm_2.weight"], eps, name=p + "ffn_norm_2")
    rw = (w[p + "ffn_gate_inp.scale"] * np.float32(1.0 / math.sqrt(d))).astype(np.float32)
    r = b.rms_norm(x, rw, eps, name=p + "ffn_moe_router_in")
    pair = w.get(p + "ffn_gate_up_exps.weight")
    gate, up = pair if pair is not None else (w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"])
    e = b.moe(h, router=w[p + "ffn_gate_inp.weight"], router_x=r, gate=gate, up=up, down=w[p + "ffn_down_exps.weight"],
              n_used=cfg.n_expert_used, gating="softmax", norm_w=True, act="gelu_tanh",
              down_scale=w.get(p + "ffn_down_exps.scale"), name=p + "ffn_moe_out")
    return b.rms_norm(e, w[p + "post_ffw_norm_2.weight"], eps, name=p + "ffn_moe")


def tensors(cfg: ModelConfig) -> list:
    L = layers(cfg)
    d, H = cfg.d_model, cfg.n_heads
    out = C.embedding_tensors(cfg)
    if L.ple:
        n_pl = L.ple * cfg.n_layers
        out += [C.mat("per_layer_token_embd.weight", n_pl, cfg.vocab_size), C.mat("per_layer_model_proj.weight", d, n_pl),
                C.vec("per_layer_proj_norm.weight", L.ple)]
    out.append(Tensor("rope_freqs.weight", (cfg.head_dim // 2,), "host"))
    for i in range(cfg.n_layers):
        p, hd, kv = f"blk.{i}.", L.head(i), L.n_kv[i] * L.head(i)
        has_kv = L.kv_from[i] is None
        out += [C.vec(p + "attn_norm.weight", d), C.mat(p + "attn_q.weight", d, H * hd),
                C.mat(p + "attn_k.weight", d, kv, not has_kv), C.mat(p + "attn_v.weight", d, kv, True),
                C.mat(p + "attn_output.weight", H * hd, d), C.vec(p + "attn_q_norm.weight", hd),
                C.vec(p + "attn_k_norm.weight", hd, not has_kv), C.vec(p + "post_attention_norm.weight", d),
                Tensor(p + "layer_output_scale.weight", (1,), "host", True),
                C.vec(p + "ffn_norm.weight", d), C.mat(p + "ffn_gate.weight", d, L.ffn[i]),
                C.mat(p + "ffn_up.weight", d, L.ffn[i]), C.mat(p + "ffn_down.weight", L.ffn[i], d),
                C.vec(p + "post_ffw_norm.weight", d)]
        if cfg.n_expert:
            out += moe_tensors(cfg, p)
        if L.ple:
            out += [C.mat(p + "inp_gate.weight", d, L.ple), C.mat(p + "proj.weight", L.ple, d),
                    C.vec(p + "post_norm.weight", d)]
    return out


def rope_specs(cfg: ModelConfig, L: Layers, w: Weights) -> tuple[RopeSpec, RopeSpec]:
    """(sliding, global): NEOX over rot_swa dims at rope.freq_base_swa; NEOX over the
    global head at rope.freq_base with the rope_freqs factors (1e30: a pair that stays)."""
    sliding = RopeSpec(mode="neox", dim=L.rot_swa, base=cfg.rope_base_swa, attn_factor=cfg.rope_attn_factor)
    full = C.rope_spec(cfg, "neox", w=None, factors=False)
    ff = tuple(float(x) for x in w["rope_freqs.weight"])
    return sliding, RopeSpec(mode="neox", dim=L.rot_full, base=full.base, freq_scale=full.freq_scale,
                             attn_factor=full.attn_factor, freq_factors=ff[:L.rot_full // 2])


def per_layer_inputs(b: ProgramBuilder, cfg: ModelConfig, L: Layers, w: Weights, x: Value) -> tuple[Value, ...]:
    """P_l for every layer (N, d_ple) (llama.cpp project_per_layer_inputs)."""
    eps, n = cfg.norm_eps, cfg.n_layers
    proj = b.scale(b.linear(x, w["per_layer_model_proj.weight"], name="per_layer_proj"), 1.0 / math.sqrt(cfg.d_model))
    proj = b.head_rms_norm(proj, w["per_layer_proj_norm.weight"], eps, L.ple, name="per_layer_proj_norm")
    tok = b.lookup(w["per_layer_token_embd.weight"], scale=math.sqrt(L.ple), name="inp_per_layer_selected")
    both = b.scale(b.add(proj, tok), 1.0 / math.sqrt(2.0), name="inp_per_layer")
    return b.split(both, (L.ple,) * n, names=tuple(f"inp_per_layer.{i}" for i in range(n)))


def forward(b: ProgramBuilder, cfg: ModelConfig, w: Weights) -> Value:
    L = layers(cfg)
    eps, H = cfg.norm_eps, cfg.n_heads
    sliding, full = rope_specs(cfg, L, w)
    x = b.embed(w["token_embd.weight"], scale=math.sqrt(cfg.d_model))
    ple = per_layer_inputs(b, cfg, L, w, x) if L.ple else None
    kv_layer: dict[int, int] = {}            # model layer -> its KV layer (attention node order)
    for i in range(cfg.n_layers):
        p, hd, swa = f"blk.{i}.", L.head(i), L.swa[i]
        rope, window = (sliding, cfg.sliding_window) if swa else (full, 0)
        h = b.rms_norm(x, w[p + "attn_norm.weight"], eps, name=p + "attn_norm")
        q = b.linear(h, w[p + "attn_q.weight"], name=p + "q")
        if L.kv_from[i] is None:
            k = b.linear(h, w[p + "attn_k.weight"], name=p + "k")
            v = b.linear(h, w[p + "attn_v.weight"], name=p + "v") if p + "attn_v.weight" in w else k
        q = b.rope(b.head_rms_norm(q, w[p + "attn_q_norm.weight"], eps, hd, name=p + "q_norm"), rope, hd,
                   name=p + "q_rope")
        if L.kv_from[i] is None:
            k = b.rope(b.head_rms_norm(k, w[p + "attn_k_norm.weight"], eps, hd, name=p + "k_norm"), rope, hd,
                       name=p + "k_rope")
            v = b.head_rms_norm(v, np.ones(hd, np.float32), eps, hd, name=p + "v_norm")
            kv_layer[i] = len(kv_layer)
            a = b.attention(q, k, v, n_heads=H, n_kv_heads=L.n_kv[i], head_dim=hd, scale=1.0, window=window,
                            name=p + "attn")
        else:
            a = b.shared_attention(q, kv_layer=kv_layer[L.kv_from[i]], n_heads=H, head_dim=hd, scale=1.0,
                                   window=window, name=p + "attn")
        o = b.rms_norm(b.linear(a, w[p + "attn_output.weight"], name=p + "attn_out"),
                       w[p + "post_attention_norm.weight"], eps, name=p + "attn_post_norm")
        x = b.add(o, x, name=p + "attn_out_res")
        f = C.build_ffn(b, w, p, b.rms_norm(x, w[p + "ffn_norm.weight"], eps, name=p + "ffn_norm"), "gelu_tanh")
        if cfg.n_expert:
            f = b.add(b.rms_norm(f, w[p + "post_ffw_norm_1.weight"], eps, name=p + "ffn_mlp"),
                      build_moe(b, cfg, w, p, x), name=p + "ffn_moe_combined")
        x = b.add(b.rms_norm(f, w[p + "post_ffw_norm.weight"], eps, name=p + "ffn_post_norm"), x, name=p + "ffn_res")
        if ple is not None:
            g = b.glu(b.linear(x, w[p + "inp_gate.weight"], name=p + "pe_gate"), ple[i], "gelu_tanh", name=p + "pe")
            e = b.rms_norm(b.linear(g, w[p + "proj.weight"], name=p + "pe_proj"), w[p + "post_norm.weight"], eps,
                           name=p + "pe_norm")
            x = b.add(x, e, name=p + "pe_res")
        s = w.get(p + "layer_output_scale.weight")
        if s is not None:
            x = b.scale(x, float(s[0]), name=p + "out_scaled")
    x = b.rms_norm(x, w["output_norm.weight"], eps, name="result_norm")
    out = w.get("output.weight")
    logits = b.linear(b.take_rows(x, name="out_rows"), w["token_embd.weight"] if out is None else out, name="logits")
    cap = K.key(cfg, "model", "final_logit_softcapping", DEFAULT_SOFTCAP, float)
    return b.softcap(logits, cap, name="logits") if cap > 0 else logits
