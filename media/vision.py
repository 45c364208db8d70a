"""Vision encoder + projector from llama.cpp's two-file form (the ``mmproj`` GGUF).

Owns: preprocessing a decoded RGB picture as the mmproj's metadata says (resize,
mean/std, patching), the ViT blocks and the projector, on numpy or CuPy; the
file's keys and tensors are read and checked by ``mmproj.py``. The output is
``(n_tokens, n_embd_text) float32``: one embedding row per image position of the
text model. Leaves to others: decoding the file (``image.py``), where the rows go
in the prompt (``engine/runtime/media_prompt.py``) and the text model itself.

Format, as llama.cpp's ``tools/mtmd`` reads it (``clip-impl.h`` names,
``clip.cpp`` ``clip_model_loader::load_hparams``/``load_tensors``):
  keys ``clip.projector_type`` (or ``clip.vision.projector_type``),
  ``clip.vision.{image_size, patch_size, embedding_length, feed_forward_length,
  block_count, attention.head_count, attention.layer_norm_epsilon, image_mean,
  image_std}``, optional ``clip.vision.feature_layer``,
  ``clip.vision.projector.scale_factor`` (idefics3), ``clip.use_gelu`` /
  ``clip.use_silu`` (else quick GELU, as llama.cpp);
  tensors ``v.patch_embd.weight`` (ggml ne [P, P, 3, D]) and optional
  ``v.patch_embd.bias``, ``v.position_embd.weight`` ([D, n_pos]), optional
  ``v.class_embd``, ``v.pre_ln.*``, ``v.post_ln.*``; per block
  ``v.blk.N.{ln1, ln2, attn_q, attn_k, attn_v, attn_out, ffn_up, ffn_down}.{weight,
  bias}``; projector ``mm.0.*``, ``mm.2.*`` (mlp) or ``mm.model.fc.weight``
  (idefics3).

Computation (llama.cpp ``models/llava.cpp`` ``clip_graph_llava::build`` and
``models/siglip.cpp`` with ``clip.cpp`` ``clip_graph::build_vit``): patch
embedding (a stride-P convolution, done as a matmul over flattened patches),
+ position embeddings, optional pre-LayerNorm, pre-norm blocks (LayerNorm ->
multi-head self attention, all positions see all -> residual -> LayerNorm -> FFN
-> residual), optional post-LayerNorm, then the projector:
  * ``mlp`` (LLaVA-1.5): the class embedding goes first (CLIP's order; llama.cpp's
    llava graph currently appends it last, issue 25814, see ``encode``), the blocks
    run up to the second-to-last one (or to ``feature_layer``), the class position
    is dropped, then ``mm.2 . gelu(mm.0 . x + b0) + b2``;
  * ``idefics3`` (SmolVLM): every block runs, then pixel shuffle by the scale
    factor s (each s x s group of patches becomes one row of s*s*D features,
    ordered (dy, dx, d)) and ``mm.model.fc`` without bias.

Array module: every op goes through ``xp`` (numpy on the CPU, CuPy on CUDA, the
same code); weights are float32 on ``xp``'s device. Not done (said plainly):
projector types other than mlp/idefics3 are refused; llama.cpp's image slicing
(LLaVA-1.6 any-res, idefics3/SmolVLM tiles) is not done, the picture is encoded
once at ``image_size`` (for idefics3 that is the global image, as transformers'
processor without image splitting); ``clip.vision.feature_layer`` with more than
one layer (Granite) is refused.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aotx.engine.errors import MediaError
from aotx.media.mmproj import VisionConfig, read_config, read_weights, working_bytes

LLAVA_PAD_COLOR = (122, 116, 104)
"""Letterbox colour llama.cpp uses for mlp projectors (``load_hparams``: ``image_pad_color``)."""

@dataclass
class _Block:
    ln1_w: Any
    ln1_b: Any
    wq: Any
    bq: Any
    wk: Any
    bk: Any
    wv: Any
    bv: Any
    wo: Any
    bo: Any
    ln2_w: Any
    ln2_b: Any
    w_up: Any
    b_up: Any
    w_down: Any
    b_down: Any


class VisionEncoder:
    """A loaded mmproj: ``encode(pixels)`` -> ``(n_tokens, n_embd_out) float32``.

    Build with ``VisionEncoder.open(path, device=...)``. ``xp`` is the array module
    (numpy, or cupy when ``device == "cuda"``). ``encode`` serializes its calls."""

    def __init__(self, path: Path, cfg: VisionConfig, weights: dict[str, np.ndarray | None], xp=np,
                 name: str = ""):
        self.path = path
        self.cfg = cfg
        self.xp = xp
        self.name = name or path.stem
        self._lock = threading.Lock()
        put = (lambda a: None if a is None else xp.asarray(a, dtype=xp.float32))
        w = {k: put(v) for k, v in weights.items()}
        self.weight_bytes = int(sum(v.nbytes for v in weights.values() if v is not None))
        D, P = cfg.n_embd, cfg.patch_size
        self.patch_w = w["v.patch_embd.weight"].reshape(D, 3 * P * P)
        self.patch_b = w.get("v.patch_embd.bias")
        self.pos = w["v.position_embd.weight"]
        self.cls = w.get("v.class_embd")
        self.pre_ln = (w.get("v.pre_ln.weight"), w.get("v.pre_ln.bias"))
        self.post_ln = (w.get("v.post_ln.weight"), w.get("v.post_ln.bias"))
        self.blocks = []
        for i in range(cfg.n_layer):
            g = (lambda s: w.get(f"v.blk.{i}.{s}"))
            self.blocks.append(_Block(g("ln1.weight"), g("ln1.bias"), g("attn_q.weight"), g("attn_q.bias"),
                                      g("attn_k.weight"), g("attn_k.bias"), g("attn_v.weight"), g("attn_v.bias"),
                                      g("attn_out.weight"), g("attn_out.bias"), g("ln2.weight"), g("ln2.bias"),
                                      g("ffn_up.weight"), g("ffn_up.bias"), g("ffn_down.weight"),
                                      g("ffn_down.bias")))
        self.mm = {k: v for k, v in w.items() if k.startswith("mm.")}

    # ---- loading -------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, device: str = "cpu") -> "VisionEncoder":
        """Open, check and load the mmproj GGUF at ``path`` onto ``device`` ("cpu" or "cuda").

        Raises ModelError (exit code 2) naming the file and the key or tensor for a
        missing, truncated or malformed file, a text model passed by mistake, an
        unsupported projector, missing or mis-shaped tensors; MediaError when
        ``device`` is "cuda" and CuPy is not installed."""
        from aotx.engine.model.gguf_file import GGUFFile

        gf = GGUFFile.open(path)
        cfg = read_config(gf)
        xp = array_module(device)
        wts = read_weights(gf, cfg)
        name = str(gf.metadata.get("general.name") or Path(path).stem)
        return cls(Path(path), cfg, wts, xp, name)

    # ---- costs ------------------------------------------------------------------

    @property
    def working_bytes(self) -> int:
        """Peak extra bytes while one picture is encoded (``working_bytes(cfg)``)."""
        return working_bytes(self.cfg)

    def embeddings_bytes(self) -> int:
        """Bytes of one picture's output rows (float32)."""
        return 4 * self.cfg.n_tokens * self.cfg.n_embd_out

    # ---- preprocessing ----------------------------------------------------------

    def preprocess(self, image) -> np.ndarray:
        """An RGB ``PIL.Image`` (or ``(h, w, 3) uint8`` array) -> normalized pixels
        ``(S, S, 3) float32``, S = image_size.

        mlp: ``letterbox`` (aspect kept, centred on the LLaVA pad colour), as
        llama.cpp's fixed-size preprocessor. idefics3: stretched to S x S with
        Pillow's Lanczos filter, as transformers' Idefics3 processor resizes its
        global image (llama.cpp's idefics3 resize differs: measured up to 0.3 on
        embedding values of about 3 for a 40 x 24 picture). A picture already S x S
        is used as is. Values are ``(u8 / 255 - mean) / std`` per channel
        (``img_u8_to_f32``)."""
        c = self.cfg
        S = c.image_size
        if isinstance(image, np.ndarray):
            u8 = np.ascontiguousarray(image, dtype=np.uint8)
        else:
            u8 = np.asarray(image if image.mode == "RGB" else image.convert("RGB"), dtype=np.uint8)
        if u8.ndim != 3 or u8.shape[2] != 3 or u8.shape[0] < 1 or u8.shape[1] < 1:
            raise MediaError(f"vision encoder input must be an RGB picture, got an array of shape {u8.shape}")
        if u8.shape[:2] != (S, S):
            u8 = letterbox(u8, S, LLAVA_PAD_COLOR) if c.projector == "mlp" else _pil_resize(u8, S, S, "lanczos")
        mean = np.asarray(c.mean, np.float32)
        std = np.asarray(c.std, np.float32)
        return ((u8.astype(np.float32) / np.float32(255.0)) - mean) / std

    # ---- the network ------------------------------------------------------------

    def _ln(self, x, w, b):
        xp = self.xp
        mu = x.mean(axis=-1, keepdims=True)
        d = x - mu
        var = (d * d).mean(axis=-1, keepdims=True)
        y = d / xp.sqrt(var + xp.float32(self.cfg.eps))
        if w is not None:
            y = y * w
        if b is not None:
            y = y + b
        return y

    def _act(self, x, op: str):
        xp = self.xp
        if op == "gelu":  # ggml_gelu: the tanh approximation
            return 0.5 * x * (1.0 + xp.tanh(np.float32(math.sqrt(2.0 / math.pi)) * (x + 0.044715 * x * x * x)))
        if op == "gelu_quick":  # x * sigmoid(1.702 x)
            return x / (1.0 + xp.exp(np.float32(-1.702) * x))
        if op == "silu":
            return x / (1.0 + xp.exp(-x))
        raise AssertionError(op)

    @staticmethod
    def _lin(x, w, b):
        y = x @ w.T
        return y if b is None else y + b

    def _attention(self, x, blk: _Block):
        xp = self.xp
        c = self.cfg
        n, D = x.shape
        H, hd = c.n_head, D // c.n_head
        q = self._lin(x, blk.wq, blk.bq).reshape(n, H, hd).transpose(1, 0, 2)
        k = self._lin(x, blk.wk, blk.bk).reshape(n, H, hd).transpose(1, 0, 2)
        v = self._lin(x, blk.wv, blk.bv).reshape(n, H, hd).transpose(1, 0, 2)
        s = (q @ k.transpose(0, 2, 1)) * np.float32(1.0 / math.sqrt(hd))
        s = s - s.max(axis=-1, keepdims=True)
        e = xp.exp(s)
        p = e / e.sum(axis=-1, keepdims=True)
        o = (p @ v).transpose(1, 0, 2).reshape(n, D)
        return self._lin(o, blk.wo, blk.bo)

    def encode(self, pixels: np.ndarray, *, class_layout: str = "first") -> np.ndarray:
        """Normalized pixels ``(S, S, 3) float32`` (``preprocess``) -> ``(n_tokens,
        n_embd_out) float32`` numpy rows for the text model. Thread-safe (serialized).

        ``class_layout`` matters only with a class embedding: "first" is CLIP's
        order (class at position 0, patches at 1..n, the class row dropped before
        the projector), what the models were trained with. "llama.cpp-25814"
        reproduces llama.cpp's llava graph since its refactor (ggml-org/llama.cpp
        issue 25814, fix proposed in PR 25844): the class row is appended after the
        patches, positions 0..n follow that order and rows 1..n are projected (patch
        0 dropped, the class row kept). Only the reference test uses it, to check
        every other step against llama.cpp's numbers."""
        c = self.cfg
        S = c.image_size
        if pixels.shape != (S, S, 3):
            raise MediaError(f"vision encoder input has shape {pixels.shape}, expected ({S}, {S}, 3)")
        if class_layout not in ("first", "llama.cpp-25814"):
            raise ValueError(f"class_layout {class_layout!r}")
        with self._lock:
            out = self._encode(pixels, class_layout)
        return out

    def _encode(self, pixels: np.ndarray, class_layout: str = "first") -> np.ndarray:
        xp = self.xp
        c = self.cfg
        S, P = c.image_size, c.patch_size
        g = S // P
        img = xp.asarray(pixels, dtype=xp.float32)
        # (S, S, 3) -> (g, P, g, P, 3) -> (g, g, 3, P, P): one row per patch, raster order,
        # flattened like the conv kernel (channel, ky, kx)
        patches = img.reshape(g, P, g, P, 3).transpose(0, 2, 4, 1, 3).reshape(g * g, 3 * P * P)
        x = patches @ self.patch_w.T
        if self.patch_b is not None:
            x = x + self.patch_b
        cls_last = class_layout != "first"
        if self.cls is not None:
            parts = [x, self.cls.reshape(1, -1)] if cls_last else [self.cls.reshape(1, -1), x]
            x = xp.concatenate(parts, axis=0)
        x = x + self.pos
        if self.pre_ln[0] is not None:
            x = self._ln(x, *self.pre_ln)
        for blk in self.blocks[:c.n_layer_run]:
            x = x + self._attention(self._ln(x, blk.ln1_w, blk.ln1_b), blk)
            h = self._ln(x, blk.ln2_w, blk.ln2_b)
            h = self._act(self._lin(h, blk.w_up, blk.b_up), c.ffn_op)
            x = x + self._lin(h, blk.w_down, blk.b_down)
        if self.post_ln[0] is not None:
            x = self._ln(x, *self.post_ln)
        if c.projector == "mlp":
            if self.cls is not None:
                x = x[1:]  # CLIP order: drop the class row; llama.cpp-25814: drop patch 0
            x = self._act(self._lin(x, self.mm["mm.0.weight"], self.mm["mm.0.bias"]), "gelu")
            if "mm.2.weight" in self.mm:
                x = self._lin(x, self.mm["mm.2.weight"], self.mm["mm.2.bias"])
        else:
            s = c.n_merge
            D = x.shape[1]
            x = x.reshape(g // s, s, g // s, s, D).transpose(0, 2, 1, 3, 4).reshape((g // s) ** 2, s * s * D)
            x = x @ self.mm["mm.model.fc.weight"].T
        out = x.astype(xp.float32)
        if xp is not np:
            out = xp.asnumpy(out)
        return np.ascontiguousarray(out)

    def embed_image(self, image) -> np.ndarray:
        """``encode(preprocess(image))``: an RGB ``PIL.Image`` -> ``(n_tokens, n_embd_out) float32``."""
        return self.encode(self.preprocess(image))


def _pil_resize(img: np.ndarray, width: int, height: int, method: str) -> np.ndarray:
    from PIL import Image

    if img.shape[:2] == (height, width):
        return img.copy()
    filt = {"bicubic": Image.BICUBIC, "lanczos": Image.LANCZOS}[method]
    return np.asarray(Image.fromarray(img).resize((width, height), filt), dtype=np.uint8)


def letterbox(img: np.ndarray, size: int, pad: tuple[int, int, int]) -> np.ndarray:
    """``(h, w, 3) uint8`` -> ``(size, size, 3) uint8``: scaled to fit (aspect kept,
    sides rounded up, Pillow's bicubic) and centred on ``pad``: llama.cpp's
    ``mtmd_image_preprocessor_fixed_size`` for mlp projectors (``img_tool::resize`` with
    padding; its RESIZE_ALGO_BICUBIC_PILLOW is Pillow's filter, and the tests measure
    byte-equal input: the embeddings agree to the GELU-table gap)."""
    h, w, _ = img.shape
    if (w, h) == (size, size):
        return img.copy()
    f32 = np.float32
    scale = min(f32(size) / f32(w), f32(size) / f32(h))
    nw = max(min(int(math.ceil(f32(w) * scale)), size), 1)
    nh = max(min(int(math.ceil(f32(h) * scale)), size), 1)
    out = np.empty((size, size, 3), np.uint8)
    out[:] = np.asarray(pad, np.uint8)
    ox, oy = (size - nw) // 2, (size - nh) // 2
    out[oy:oy + nh, ox:ox + nw] = _pil_resize(img, nw, nh, "bicubic")
    return out


def array_module(device: str):
    """numpy for "cpu"; cupy for "cuda" (MediaError naming the package when missing)."""
    if device == "cuda":
        try:
            import cupy
        except ImportError:
            raise MediaError("the vision encoder on cuda needs CuPy: pip install 'aotx[cuda]'") from None
        return cupy
    if device != "cpu":
        raise MediaError(f"unknown device {device!r} for the vision encoder (cpu or cuda)")
    return np
