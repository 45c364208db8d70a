"""Audio decoding and normalization (media/audio.py): every container and sample
format on files generated here with soundfile, downmixing, resampling, and the
bad audio people have (empty, truncated, not audio, too long)."""

from __future__ import annotations

import numpy as np
import pytest

sf = pytest.importorskip("soundfile")
pytest.importorskip("soxr")

from aotx.engine.errors import MediaError  # noqa: E402
from aotx.media import audio  # noqa: E402


def tone(rate: int, seconds: float = 0.5, freq: float = 440.0, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def peak_hz(x: np.ndarray, rate: int) -> float:
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.fft.rfftfreq(len(x), 1 / rate)[spec.argmax()])


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


# --------------------------------------------------------------------------- formats

@pytest.mark.parametrize("fmt, subtype, ext, tol", [
    ("WAV", "PCM_U8", "wav", 0.02),    # 8-bit WAV is unsigned
    ("WAV", "PCM_16", "wav", 0.005),
    ("WAV", "PCM_24", "wav", 0.005),
    ("WAV", "PCM_32", "wav", 0.005),
    ("WAV", "FLOAT", "wav", 0.005),
    ("WAV", "DOUBLE", "wav", 0.005),
    ("WAVEX", "PCM_16", "wav", 0.005),  # WAVE_FORMAT_EXTENSIBLE header
    ("WAVEX", "FLOAT", "wav", 0.005),
    ("FLAC", "PCM_16", "flac", 0.005),
    ("FLAC", "PCM_24", "flac", 0.005),
    ("OGG", "VORBIS", "ogg", 0.03),
    ("AIFF", "PCM_16", "aiff", 0.005),
])
def test_formats_to_mono_16k(tmp_path, fmt, subtype, ext, tol):
    rate = 44_100
    x = tone(rate)
    stereo = np.stack([x, x], axis=1)
    path = tmp_path / f"a.{ext}"
    sf.write(path, stereo, rate, format=fmt, subtype=subtype)
    if fmt == "WAVEX":
        assert path.read_bytes()[20:22] == b"\xfe\xff", "the test file must carry the extensible format tag"
    a = audio.load_audio(path)
    assert a.rate == 16_000 and a.samples.dtype == np.float32 and a.samples.ndim == 1
    assert a.source_rate == rate and a.source_channels == 2
    assert abs(len(a.samples) - 8000) <= 1
    assert abs(peak_hz(a.samples, 16_000) - 440) < 5
    assert abs(rms(a.samples[1000:-1000]) - 0.5 / np.sqrt(2)) < tol * 4
    assert np.abs(a.samples).max() <= 1.0


def test_wav_8bit_values_are_centred(tmp_path):
    """8-bit WAV is unsigned (128 = silence): silence must decode to 0, not +1/2 DC."""
    path = tmp_path / "s8.wav"
    sf.write(path, np.zeros(1600, np.float32), 16_000, subtype="PCM_U8")
    assert np.abs(audio.load_audio(path).samples).max() < 0.01


@pytest.mark.parametrize("rate", [8_000, 11_025, 16_000, 22_050, 32_000, 44_100, 48_000, 96_000])
def test_any_rate_resampled(tmp_path, rate):
    path = tmp_path / f"r{rate}.wav"
    sf.write(path, tone(rate, 1.0, freq=1000.0), rate, subtype="FLOAT")
    a = audio.load_audio(path)
    assert a.source_rate == rate and abs(len(a.samples) - 16_000) <= 1
    assert abs(peak_hz(a.samples, 16_000) - 1000) < 3
    assert abs(rms(a.samples[500:-500]) - 0.5 / np.sqrt(2)) < 0.01


def test_resampler_filters_above_nyquist():
    """A 7 kHz tone at 48 kHz survives; a 12 kHz tone (above 16 kHz's Nyquist) is
    removed, not aliased down to 4 kHz as naive decimation would."""
    rate = 48_000
    keep = audio.resample(tone(rate, 1.0, freq=7000.0), rate)
    gone = audio.resample(tone(rate, 1.0, freq=12_000.0), rate)
    assert rms(keep[500:-500]) > 0.3
    assert rms(gone[500:-500]) < 0.01


def test_downmix_on_channel_axis():
    x = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]], np.float32)  # (frames=3, channels=2)
    m = audio.downmix(x)
    assert m.shape == (3,) and m.tolist() == [0.5, 0.5, 0.5]
    assert audio.downmix(np.ones(4, np.float32)).tolist() == [1, 1, 1, 1]
    with pytest.raises(ValueError):
        audio.downmix(np.ones((2, 2, 2)))


def test_multichannel_file(tmp_path):
    """5.1 audio with speech only in the centre channel: downmixed, not dropped."""
    x = tone(48_000)
    six = np.zeros((len(x), 6), np.float32)
    six[:, 2] = x
    path = tmp_path / "surround.wav"
    sf.write(path, six, 48_000, format="WAVEX", subtype="PCM_24")
    a = audio.load_audio(path)
    assert a.source_channels == 6
    assert abs(rms(a.samples[500:-500]) - 0.5 / np.sqrt(2) / 6) < 0.005


def test_mono_file(tmp_path):
    path = tmp_path / "m.flac"
    sf.write(path, tone(16_000), 16_000)
    a = audio.load_audio(path)
    assert a.source_channels == 1 and len(a.samples) == 8000 and a.seconds == 0.5


# --------------------------------------------------------------------------- bad audio

def test_zero_length(tmp_path):
    path = tmp_path / "empty.wav"
    sf.write(path, np.zeros((0, 1), np.float32), 16_000)
    with pytest.raises(MediaError, match="empty.wav: zero-length audio"):
        audio.load_audio(path)


def test_empty_file(tmp_path):
    path = tmp_path / "nothing.wav"
    path.write_bytes(b"")
    with pytest.raises(MediaError, match="empty"):
        audio.load_audio(path)


def test_truncated_wav(tmp_path):
    """libsndfile reads the half that is there without a word; AOTX says it is truncated."""
    path = tmp_path / "cut.wav"
    sf.write(path, tone(16_000, 1.0), 16_000)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(MediaError, match=r"cut.wav: truncated WAV: its header declares 32,000 bytes"):
        audio.load_audio(path)
    path.write_bytes(data[:30])
    with pytest.raises(MediaError, match="cut.wav"):
        audio.load_audio(path)


@pytest.mark.parametrize("fmt, ext", [("FLAC", "flac"), ("OGG", "ogg")])
def test_truncated_compressed(tmp_path, fmt, ext):
    rng = np.random.default_rng(0)
    path = tmp_path / f"cut.{ext}"
    sf.write(path, (rng.standard_normal(48_000) * 0.3).astype(np.float32), 48_000, format=fmt)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(MediaError, match=f"cut.{ext}: (truncated|not a readable)"):
        audio.load_audio(path)


def test_not_audio(tmp_path):
    path = tmp_path / "notes.wav"
    path.write_text("these are notes, not a recording\n" * 10)
    with pytest.raises(MediaError, match="notes.wav: not a readable audio file"):
        audio.load_audio(path)


def test_too_long(tmp_path):
    path = tmp_path / "long.wav"
    sf.write(path, tone(16_000, 2.0), 16_000)
    with pytest.raises(MediaError, match="2 s of audio, longer than the 1 s"):
        audio.load_audio(path, max_seconds=1.0)


def test_missing(tmp_path):
    with pytest.raises(MediaError, match="no such audio file"):
        audio.load_audio(tmp_path / "gone.wav")


def test_ogg_opus(tmp_path):
    path = tmp_path / "v.opus"
    sf.write(path, tone(48_000, 1.0), 48_000, format="OGG", subtype="OPUS")
    a = audio.load_audio(path)
    assert abs(len(a.samples) - 16_000) < 400 and abs(peak_hz(a.samples, 16_000) - 440) < 5
