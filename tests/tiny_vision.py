"""Tiny mmproj GGUF files (vision encoder + projector) for tests, from a seed.

``write_tiny_mmproj(path, projector="mlp"|"idefics3", ...)`` writes a small CLIP-style
encoder in llama.cpp's mmproj layout (keys and tensor names as
``tools/mtmd/clip-impl.h`` spells them) with the ``gguf`` package's writer: random
float32 weights (or ``qtype``), deterministic for a seed. ``sample_image(size, seed)``
is a deterministic RGB picture. ``tests/data/make_vision_refs.py`` feeds both to
llama.cpp (through llama-cpp-python's mtmd binding) to make the reference
embeddings the tests compare against; changing anything here changes those files.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


def write_tiny_mmproj(path: str | Path, *, projector: str = "mlp", image_size: int = 32, patch_size: int = 8,
                      n_embd: int = 32, n_head: int = 4, n_ff: int = 64, n_layer: int = 3, n_embd_out: int = 64,
                      scale_factor: int = 2, class_embd: bool = True, seed: int = 0, use_gelu: bool = False,
                      qtype: T = T.F32, drop: tuple[str, ...] = (), metadata: dict | None = None) -> Path:
    """Write a tiny mmproj GGUF and return its path.

    mlp: CLIP-like (class embedding when ``class_embd``, pre-LayerNorm, no
    post-LayerNorm, biases everywhere, ``mm.0``/``mm.2``). idefics3: SigLIP-like
    (no class, post-LayerNorm, ``mm.model.fc``). ``n_embd_out`` must equal the text
    model's width. ``drop`` leaves tensors or keys out; ``metadata`` overrides keys
    (value None removes one)."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    D, F, P = n_embd, n_ff, patch_size
    n_pos = (image_size // P) ** 2 + (1 if (class_embd and projector == "mlp") else 0)

    def mat(o: int, i: int, scale: float | None = None) -> np.ndarray:
        return (rng.standard_normal((o, i)) * (scale or 1.0 / np.sqrt(i))).astype(np.float32)

    def vec(n: int, base: float = 0.0, scale: float = 0.1) -> np.ndarray:
        return (base + scale * rng.standard_normal(n)).astype(np.float32)

    t: dict[str, np.ndarray] = {
        "v.patch_embd.weight": (rng.standard_normal((D, 3, P, P)) / np.sqrt(3 * P * P)).astype(np.float32),
        "v.patch_embd.bias": vec(D),
        "v.position_embd.weight": (0.5 * rng.standard_normal((n_pos, D))).astype(np.float32),
    }
    if projector == "mlp":
        if class_embd:
            t["v.class_embd"] = vec(D, 0.0, 1.0)
        t["v.pre_ln.weight"], t["v.pre_ln.bias"] = vec(D, 1.0), vec(D)
    for i in range(n_layer):
        b = f"v.blk.{i}."
        t[b + "ln1.weight"], t[b + "ln1.bias"] = vec(D, 1.0), vec(D)
        for s in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t[b + s + ".weight"], t[b + s + ".bias"] = mat(D, D), vec(D)
        t[b + "ln2.weight"], t[b + "ln2.bias"] = vec(D, 1.0), vec(D)
        t[b + "ffn_up.weight"], t[b + "ffn_up.bias"] = mat(F, D), vec(F)
        t[b + "ffn_down.weight"], t[b + "ffn_down.bias"] = mat(D, F), vec(D)
    if projector == "mlp":
        t["mm.0.weight"], t["mm.0.bias"] = mat(n_embd_out, D), vec(n_embd_out)
        t["mm.2.weight"], t["mm.2.bias"] = mat(n_embd_out, n_embd_out), vec(n_embd_out)
    else:
        t["v.post_ln.weight"], t["v.post_ln.bias"] = vec(D, 1.0), vec(D)
        t["mm.model.fc.weight"] = mat(n_embd_out, D * scale_factor * scale_factor)

    kv = {
        "general.name": f"tiny-{projector}-mmproj",
        "general.description": "random test weights",
        "clip.has_vision_encoder": True,
        "clip.has_text_encoder": False,
        "clip.projector_type": projector,
        "clip.use_gelu": use_gelu,
        "clip.vision.image_size": image_size,
        "clip.vision.patch_size": P,
        "clip.vision.embedding_length": D,
        "clip.vision.feed_forward_length": F,
        "clip.vision.projection_dim": n_embd_out,
        "clip.vision.block_count": n_layer,
        "clip.vision.attention.head_count": n_head,
        "clip.vision.attention.layer_norm_epsilon": 1e-6 if projector == "idefics3" else 1e-5,
        "clip.vision.image_mean": list(MEAN),
        "clip.vision.image_std": list(STD),
    }
    if projector == "idefics3":
        kv["clip.vision.projector.scale_factor"] = scale_factor
        kv["clip.vision.preproc_image_size"] = image_size
    for k, v in (metadata or {}).items():
        if v is None:
            kv.pop(k, None)
        else:
            kv[k] = v

    w = gguf.GGUFWriter(path, "clip")
    for k, v in kv.items():
        if k in drop:
            continue
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, list):
            w.add_array(k, v)
        else:
            w.add_string(k, v)
    for name, arr in t.items():
        if name in drop:
            continue
        if qtype != T.F32 and arr.ndim == 2 and arr.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0 \
                and not name.startswith("v.position"):
            if qtype == T.F16:
                w.add_tensor(name, arr.astype(np.float16))
            else:
                w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def sample_image(size: int | tuple[int, int] = 32, seed: int = 1) -> np.ndarray:
    """A deterministic RGB picture ``(h, w, 3) uint8``: smooth gradients plus noise."""
    w, h = (size, size) if isinstance(size, int) else size
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([255 * xx / max(w - 1, 1), 255 * yy / max(h - 1, 1), 128 + 100 * np.sin(xx * 0.3 + yy * 0.2)],
                    axis=-1)
    img = base + rng.integers(-40, 41, size=(h, w, 3))
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)
