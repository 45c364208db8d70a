"""OCR: the image-to-text specialist for models that cannot see.

Owns: reading the text in an RGB picture with RapidOCR 3.x on onnxruntime (the
PP-OCR detection, orientation and recognition models ship inside the
``rapidocr`` wheel: nothing is downloaded; checked with the network blocked),
and putting the recognized pieces back into lines, top to bottom and left to
right. Leaves to others: decoding the file (``image.py``) and telling the user
that the model saw text, not the picture (``profile.render_for_prompt``).

onnxruntime's telemetry (on by default in its official Linux wheels: a device
id file under ``~/.cache/Microsoft`` and events sent to Microsoft) is turned off
with ``ORT_DISABLE_TELEMETRY=1`` before onnxruntime starts, unless the user set
that variable.

Limits said plainly: the text layout is rebuilt as lines only (columns, tables
and indentation are lost); pieces below RapidOCR's confidence of 0.5 are
dropped; pictures larger than ``DET_MAX_SIDE`` on their longer side are scaled
down for detection, so very small text in a very large screenshot can be missed.
The shipped models are PP-OCR's Chinese-and-English ones: Latin script and
Chinese read well, other scripts poorly.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aotx.engine.errors import MediaError

DET_MAX_SIDE = 1600
"""Longer side (pixels) the detector works at; larger pictures are scaled down for it.

RapidOCR's default instead scales the *shorter* side up to 736, which turns a
640 x 150 screenshot into a 3140 x 736 detection pass (5 s instead of 0.5 s on 2 cores)."""

WORKING_BYTES = 576 << 20
"""Memory beyond the model files (bytes) while reading one picture at the
detection limit: onnxruntime, OpenCV and the detector's and recognizer's
activations. Measured: the process grew 318 MB reading the 640 x 150 shipped
screenshot and 574 MB reading a 2560 x 1440 one with 40 lines; rounded up."""


@dataclass(frozen=True)
class OcrText:
    """What ``OcrModel.read`` returns: ``text`` (lines joined by newlines, "" when
    none), ``lines`` one string per line, ``mean_score`` the mean recognition
    confidence (0-1, 0.0 without text) and the wall ``seconds`` it took."""

    text: str
    lines: tuple[str, ...]
    mean_score: float
    seconds: float


def model_files() -> list[Path]:
    """The ONNX files RapidOCR loads from its wheel (``*.onnx`` in ``rapidocr/models``),
    located without importing rapidocr. Raises MediaError when rapidocr is missing."""
    import importlib.util

    spec = importlib.util.find_spec("rapidocr")
    if spec is None or not spec.submodule_search_locations:
        raise MediaError("OCR is not installed: package rapidocr is missing (pip install 'aotx[media]')")
    return sorted((Path(list(spec.submodule_search_locations)[0]) / "models").glob("*.onnx"))


def weights_bytes() -> int:
    """Bytes of the OCR models on disk (about what onnxruntime holds in memory for them)."""
    return sum(p.stat().st_size for p in model_files())


def group_lines(boxes: np.ndarray, texts: list[str]) -> list[str]:
    """Pieces of text with their quadrilaterals -> lines of text, top to bottom.

    ``boxes`` is ``(n, 4, 2)`` float pixel corners (x, y), ``texts`` the n strings.
    Two pieces share a line when their vertical centres are closer than half the
    smaller height; within a line pieces are ordered by left edge and joined by
    one space."""
    items = []
    for box, text in zip(boxes, texts):
        box = np.asarray(box, dtype=np.float64)
        top, bottom = box[:, 1].min(), box[:, 1].max()
        items.append(((top + bottom) / 2, max(bottom - top, 1.0), box[:, 0].min(), text))
    items.sort(key=lambda it: (it[0], it[2]))
    lines: list[list[tuple]] = []
    for it in items:
        if lines:
            last = lines[-1]
            cy = sum(x[0] for x in last) / len(last)
            h = min(min(x[1] for x in last), it[1])
            if abs(it[0] - cy) < h / 2:
                last.append(it)
                continue
        lines.append([it])
    return [" ".join(x[3] for x in sorted(line, key=lambda x: x[2])).strip() for line in lines]


class OcrModel:
    """RapidOCR on onnxruntime (CPU), loaded once. ``read`` is thread-safe: RapidOCR
    keeps per-call settings on its object, so calls are serialized by a lock.
    ``threads`` 0 means half the cores, 1 to 4. Raises MediaError when the
    models are missing or fail to load."""

    def __init__(self, *, threads: int = 0):
        if threads <= 0:  # half the cores (at most 4): the engine's own CPU work runs beside it
            threads = max(1, min(4, (os.cpu_count() or 1) // 2))
        if not model_files():
            raise MediaError("OCR models are missing from the rapidocr package; reinstall rapidocr")
        # onnxruntime's official Linux wheels (1DS telemetry, since 2026) write a device id and an
        # event cache under ~/.cache/Microsoft and upload events to Microsoft unless this is set before
        # onnxruntime initializes. AOTX runs locally and writes only under its own root: opt out,
        # unless the user chose otherwise. (Latched per process: too late if onnxruntime already ran.)
        os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
        try:
            from rapidocr import RapidOCR
        except ImportError as e:
            raise MediaError(f"OCR cannot start: {e} (pip install 'aotx[media]')") from None
        params = {
            "Global.log_level": "error",
            "Det.limit_type": "max",
            "Det.limit_side_len": DET_MAX_SIDE,
            "EngineConfig.onnxruntime.intra_op_num_threads": threads,
        }
        try:
            self._engine = RapidOCR(params=params)
        except Exception as e:  # noqa: BLE001 - rapidocr raises its own and onnxruntime's types
            raise MediaError(f"OCR models failed to load: {e}") from None
        self._lock = threading.Lock()

    def read(self, image) -> OcrText:
        """An RGB ``PIL.Image.Image`` (as ``image.load_image`` returns) -> ``OcrText``."""
        if image.mode != "RGB":
            raise ValueError(f"expected an RGB image, got mode {image.mode}")
        t0 = time.perf_counter()
        with self._lock:
            try:
                out = self._engine(image)
            except Exception as e:  # noqa: BLE001
                raise MediaError(f"OCR failed on a {image.width} x {image.height} image: {e}") from None
        texts = list(out.txts or ())
        if not texts:
            return OcrText("", (), 0.0, time.perf_counter() - t0)
        lines = tuple(line for line in group_lines(out.boxes, texts) if line)
        score = float(np.mean(out.scores)) if out.scores is not None and len(out.scores) else 0.0
        return OcrText("\n".join(lines), lines, score, time.perf_counter() - t0)


_MODEL: OcrModel | None = None
_MODEL_LOCK = threading.Lock()


def get_model() -> OcrModel:
    """The process-wide ``OcrModel``, loaded on first use (thread-safe)."""
    global _MODEL
    with _MODEL_LOCK:
        if _MODEL is None:
            _MODEL = OcrModel()
        return _MODEL
