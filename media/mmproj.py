"""The mmproj GGUF (llama.cpp's vision projector file): its keys, its tensors, its costs.

Owns: turning an opened ``GGUFFile`` into a checked ``VisionConfig`` and float32
weights (``read_config``, ``read_weights``), describing a file without loading it
(``inspect_mmproj``, for ``aotx models``) and finding one beside a text model
(``find_mmproj``). Leaves the computation to ``vision.py``. Keys and tensor names
as llama.cpp's ``tools/mtmd/clip-impl.h`` spells them and ``clip.cpp``
(``clip_model_loader::load_hparams``/``load_tensors``) reads them; the list is in
``vision.py``'s docstring. Every problem is a ModelError naming the file and the
key or tensor (exit code 2). Weights are dequantized to float32 at load (twice an
F16 file's size in memory).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aotx.engine.errors import ModelError

PROJECTORS = ("mlp", "idefics3")


@dataclass(frozen=True)
class VisionConfig:
    """Hyperparameters of one mmproj file (see the module docstring for the keys).

    ``n_layer_run`` is how many blocks run (llava: ``block_count - 1`` unless
    ``feature_layer`` says otherwise); ``n_merge`` the idefics3 pixel-shuffle
    factor (1 for mlp); ``n_embd_out`` the projector's output width, which must
    equal the text model's ``embedding_length``."""

    projector: str
    image_size: int
    patch_size: int
    n_embd: int
    n_head: int
    n_ff: int
    n_layer: int
    n_layer_run: int
    eps: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    ffn_op: str  # "gelu" | "gelu_quick" | "silu"
    n_merge: int
    n_embd_out: int
    has_class: bool

    @property
    def n_patches(self) -> int:
        """Patches of one ``image_size`` picture: (image_size / patch_size)^2."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def n_tokens(self) -> int:
        """Embedding rows one picture becomes (positions of the text model's context)."""
        return self.n_patches // (self.n_merge * self.n_merge)


# --------------------------------------------------------------------------- reading the file

def _meta(gf, key: str, kind: type, *, default: Any = None, required: bool = True):
    v = gf.metadata.get(key, default)
    if v is None:
        if required:
            raise ModelError(f"{gf.path}: mmproj metadata key {key!r} is missing")
        return None
    try:
        if kind is float:
            return float(v)
        if kind is int:
            if isinstance(v, bool) or int(v) != v:
                raise ValueError
            return int(v)
        if kind is bool:
            return bool(v)
        if kind is str:
            return str(v)
    except (TypeError, ValueError):
        pass
    raise ModelError(f"{gf.path}: mmproj metadata key {key!r} is {v!r}, expected a {kind.__name__}")


def read_config(gf) -> VisionConfig:
    """The ``VisionConfig`` of an opened mmproj ``GGUFFile``.

    Raises ModelError naming the file and the key: missing or mistyped keys, a
    projector type AOTX does not run, non-positive sizes, an image size that is
    not a multiple of the patch size, heads that do not divide the width."""
    p = gf.path
    if not any(str(k).startswith("clip.") for k in gf.metadata):
        raise ModelError(f"{p}: not an mmproj file (no clip.* metadata; general.architecture is "
                         f"{gf.architecture!r}); pass the vision projector GGUF, not the text model")
    if gf.metadata.get("clip.has_vision_encoder") is False:
        raise ModelError(f"{p}: this mmproj has no vision encoder (clip.has_vision_encoder is false)")
    proj = _meta(gf, "clip.projector_type", str, required=False) or \
        _meta(gf, "clip.vision.projector_type", str, required=False)
    if proj is None:
        raise ModelError(f"{p}: mmproj metadata key 'clip.projector_type' is missing")
    if proj not in PROJECTORS:
        raise ModelError(f"{p}: projector type {proj!r} is not supported (AOTX runs {', '.join(PROJECTORS)})")
    image_size = _meta(gf, "clip.vision.image_size", int)
    patch_size = _meta(gf, "clip.vision.patch_size", int)
    n_embd = _meta(gf, "clip.vision.embedding_length", int)
    n_head = _meta(gf, "clip.vision.attention.head_count", int)
    n_ff = _meta(gf, "clip.vision.feed_forward_length", int)
    n_layer = _meta(gf, "clip.vision.block_count", int)
    eps = _meta(gf, "clip.vision.attention.layer_norm_epsilon", float)
    for key, v in (("image_size", image_size), ("patch_size", patch_size), ("embedding_length", n_embd),
                   ("attention.head_count", n_head), ("feed_forward_length", n_ff), ("block_count", n_layer)):
        if v <= 0:
            raise ModelError(f"{p}: clip.vision.{key} is {v}; it must be positive")
    if image_size % patch_size:
        raise ModelError(f"{p}: clip.vision.image_size {image_size} is not a multiple of patch_size {patch_size}")
    if n_embd % n_head:
        raise ModelError(f"{p}: clip.vision.embedding_length {n_embd} is not a multiple of head_count {n_head}")
    if not (0.0 < eps < 1.0):
        raise ModelError(f"{p}: clip.vision.attention.layer_norm_epsilon is {eps}; expected a small positive number")
    mean, std = gf.metadata.get("clip.vision.image_mean"), gf.metadata.get("clip.vision.image_std")
    for key, v in (("image_mean", mean), ("image_std", std)):
        if not isinstance(v, (list, tuple)) or len(v) < 3 or not all(isinstance(x, (int, float)) for x in v[:3]):
            raise ModelError(f"{p}: mmproj metadata key 'clip.vision.{key}' is {v!r}, expected 3 numbers")
    if any(float(s) <= 0 for s in std[:3]):
        raise ModelError(f"{p}: clip.vision.image_std {list(std[:3])} has a non-positive entry")
    use_gelu = bool(gf.metadata.get("clip.use_gelu", False))
    use_silu = bool(gf.metadata.get("clip.use_silu", False))
    if use_gelu and use_silu:
        raise ModelError(f"{p}: clip.use_gelu and clip.use_silu are both true")
    ffn_op = "gelu" if use_gelu else "silu" if use_silu else "gelu_quick"

    n_run = n_layer
    feature = gf.metadata.get("clip.vision.feature_layer")
    if proj == "mlp":
        n_run = n_layer - 1  # llava: the second-to-last block's output (clip_graph_llava::build)
        if feature:
            layers = sorted({int(x) for x in feature})
            if len(layers) > 1:
                raise ModelError(f"{p}: clip.vision.feature_layer {layers} stacks several layers (Granite); "
                                 "AOTX runs one feature layer")
            n_run = layers[0]
        if not 0 <= n_run <= n_layer:
            raise ModelError(f"{p}: feature layer {n_run} is outside the {n_layer} blocks")
        if "mm.3.weight" in gf.tensors:  # llama.cpp turns such a file into PROJECTOR_TYPE_MLP_NORM
            raise ModelError(f"{p}: this mmproj has mm.3 (a normed 'Yi-type' mlp projector); AOTX runs the plain "
                             "LLaVA mlp")
    n_merge = 1
    if proj == "idefics3":
        n_merge = _meta(gf, "clip.vision.projector.scale_factor", int)
        side = image_size // patch_size
        if n_merge < 2 or side % n_merge:
            raise ModelError(f"{p}: clip.vision.projector.scale_factor {n_merge} must be at least 2 and divide "
                             f"the {side} patches per side")
    out_name = ("mm.2.weight" if "mm.2.weight" in gf.tensors else "mm.0.weight") if proj == "mlp" \
        else "mm.model.fc.weight"
    t = gf.tensors.get(out_name)
    if t is None:
        raise ModelError(f"{p}: tensor {out_name!r} is missing (projector {proj!r})")
    return VisionConfig(
        projector=proj, image_size=image_size, patch_size=patch_size, n_embd=n_embd, n_head=n_head, n_ff=n_ff,
        n_layer=n_layer, n_layer_run=n_run, eps=eps, mean=tuple(float(x) for x in mean[:3]),
        std=tuple(float(x) for x in std[:3]), ffn_op=ffn_op, n_merge=n_merge, n_embd_out=int(t.shape[-1]),
        has_class="v.class_embd" in gf.tensors)


def _dequant(gf, name: str, shape: tuple[int, ...] | None, *, required: bool = True) -> np.ndarray | None:
    """Tensor ``name`` as float32 in numpy order ((out, in) for a matrix), checked
    against ``shape`` (numpy order). Raises ModelError naming the file and tensor."""
    import gguf

    t = gf.tensors.get(name)
    if t is None:
        if required:
            raise ModelError(f"{gf.path}: tensor {name!r} is missing")
        return None
    try:
        a = np.asarray(gguf.quants.dequantize(t.data, t.qtype), dtype=np.float32)
    except (NotImplementedError, ValueError, TypeError) as e:
        raise ModelError(f"{gf.path}: tensor {name!r} of type {getattr(t.qtype, 'name', t.qtype)} cannot be "
                         f"read ({e})") from None
    want = tuple(reversed(t.shape))
    a = a.reshape(want)
    if shape is not None and tuple(a.shape) != tuple(shape):
        # ggml shapes are reported in ggml order (ne0 first), as gguf tools print them
        raise ModelError(f"{gf.path}: tensor {name!r} has shape {list(t.shape)}, expected "
                         f"{list(reversed(shape))}")
    if not np.isfinite(a).all():
        raise ModelError(f"{gf.path}: tensor {name!r} holds NaN or infinite values")
    return a


def read_weights(gf, cfg: VisionConfig) -> dict[str, np.ndarray | None]:
    """Every tensor the encoder uses, float32 in numpy order, checked against ``cfg``
    (None for an optional one the file lacks). Raises ModelError naming the tensor."""
    D, F, P = cfg.n_embd, cfg.n_ff, cfg.patch_size
    n_pos = cfg.n_patches + (1 if cfg.has_class else 0)
    wts: dict[str, np.ndarray | None] = {
        "v.patch_embd.weight": _dequant(gf, "v.patch_embd.weight", (D, 3, P, P)),
        "v.patch_embd.bias": _dequant(gf, "v.patch_embd.bias", (D,), required=False),
        "v.position_embd.weight": _dequant(gf, "v.position_embd.weight", (n_pos, D)),
        "v.class_embd": _dequant(gf, "v.class_embd", (D,), required=False),
    }
    for ln in ("pre_ln", "post_ln"):
        wts[f"v.{ln}.weight"] = _dequant(gf, f"v.{ln}.weight", (D,), required=False)
        wts[f"v.{ln}.bias"] = _dequant(gf, f"v.{ln}.bias", (D,), required=False)
    for i in range(cfg.n_layer):
        b = f"v.blk.{i}."
        for s in ("ln1", "ln2"):
            wts[b + s + ".weight"] = _dequant(gf, b + s + ".weight", (D,))
            wts[b + s + ".bias"] = _dequant(gf, b + s + ".bias", (D,), required=False)
        for s in ("attn_q", "attn_k", "attn_v", "attn_out"):
            wts[b + s + ".weight"] = _dequant(gf, b + s + ".weight", (D, D))
            wts[b + s + ".bias"] = _dequant(gf, b + s + ".bias", (D,), required=False)
        up = gf.tensors.get(b + "ffn_up.weight")
        down = gf.tensors.get(b + "ffn_down.weight")
        # old conversions store up and down swapped; llama.cpp swaps them back when
        # ffn_down's ne0 equals the width (clip.cpp load_tensors, is_ffn_swapped)
        swapped = up is not None and down is not None and int(down.shape[0]) == D and D != F
        nu, nd = (b + "ffn_down", b + "ffn_up") if swapped else (b + "ffn_up", b + "ffn_down")
        wts[b + "ffn_up.weight"] = _dequant(gf, nu + ".weight", (F, D))
        wts[b + "ffn_up.bias"] = _dequant(gf, nu + ".bias", (F,), required=False)
        wts[b + "ffn_down.weight"] = _dequant(gf, nd + ".weight", (D, F))
        wts[b + "ffn_down.bias"] = _dequant(gf, nd + ".bias", (D,), required=False)
    if cfg.projector == "mlp":
        w0 = _dequant(gf, "mm.0.weight", None)
        if w0.ndim != 2 or w0.shape[1] != D:
            raise ModelError(f"{gf.path}: tensor 'mm.0.weight' has shape {list(reversed(w0.shape))}, expected "
                             f"[{D}, n]")
        wts["mm.0.weight"] = w0
        wts["mm.0.bias"] = _dequant(gf, "mm.0.bias", (w0.shape[0],))
        if "mm.2.weight" in gf.tensors:
            wts["mm.2.weight"] = _dequant(gf, "mm.2.weight", (cfg.n_embd_out, w0.shape[0]))
            wts["mm.2.bias"] = _dequant(gf, "mm.2.bias", (cfg.n_embd_out,))
    else:
        s2 = cfg.n_merge * cfg.n_merge
        wts["mm.model.fc.weight"] = _dequant(gf, "mm.model.fc.weight", (cfg.n_embd_out, D * s2))
    return wts


def working_bytes(c: VisionConfig) -> int:
    """Peak extra bytes while one picture is encoded: activations (x, h, q, k, v,
    attention out: float32), one block's attention scores (heads x n x n) and the
    FFN's hidden rows; an estimate within a factor of about 2."""
    n = c.n_patches + (1 if c.has_class else 0)
    return 4 * (n * (6 * c.n_embd + c.n_ff) + c.n_head * n * n + c.n_tokens * c.n_embd_out * 2)


@dataclass(frozen=True)
class VisionInfo:
    """An mmproj file described without loading its weights (``aotx models``):
    what ``profile.profile_for`` needs: ``name``, ``cfg``, ``weight_bytes`` (as float32
    once loaded), ``working_bytes``."""

    path: Path
    name: str
    cfg: VisionConfig
    weight_bytes: int
    working_bytes: int


def inspect_mmproj(path: str | os.PathLike[str]) -> VisionInfo:
    """Read an mmproj's metadata and tensor sizes (no weights). Raises ModelError like ``open``."""
    from aotx.engine.model.gguf_file import GGUFFile

    gf = GGUFFile.open(path)
    cfg = read_config(gf)
    wb = 4 * sum(t.n_elements for t in gf.tensors.values())
    return VisionInfo(Path(path), str(gf.metadata.get("general.name") or Path(path).stem), cfg, wb,
                      working_bytes(cfg))


def find_mmproj(model_path: str | os.PathLike[str]) -> Path | None:
    """A file named ``mmproj*.gguf`` beside the text model (the first in name order), or None."""
    d = Path(model_path).expanduser().parent
    try:
        found = sorted(p for p in d.glob("mmproj*.gguf") if p.is_file())
    except OSError:
        return None
    return found[0] if found else None
