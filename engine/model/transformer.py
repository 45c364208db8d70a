"""The one loaded-model class: tensors checked and loaded, the forward traced once, run by the backend.

Owns: turning an architecture module's tensor declarations into loaded weights (every
tensor's presence, shape and type checked against the file before any weight is loaded,
one ModelError line naming the tensor and the file otherwise), tracing the architecture's
``forward`` into an ``ops.Program`` once, asking the backend to compile it, and the model
interface of engine/model/interface.py that the runtime, the drafter and the capsules call
(``forward``, ``new_kv_cache``, ``kv_cache_bytes``, ``weight_bytes``, ``numerics``,
``device_path``; ``sample`` / ``greedy`` / ``last_logits`` / ``samples_exactly`` /
``load_masks`` where the backend samples on the device).

Leaves to the architecture module (``architectures/<arch>.py``) which tensors exist and
the order of ops; to the backend the kernels, buffers and graphs; to ``batch.py`` the
batch layout. Nothing here depends on the architecture or the backend by name.

An architecture module exposes ``tensors(cfg) -> list[Tensor | OneOf]`` and
``forward(b: ops.ProgramBuilder, cfg, w: Weights) -> Value`` (the (R, vocab) logits), and
optionally ``check_config(cfg, path)`` (hyperparameters it cannot run, as ModelError) and
``SWA_PATTERN`` (read by ``config.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from aotx.engine.backend.ops import ProgramBuilder, ProgramError
from aotx.engine.errors import ModelError
from aotx.engine.model.batch import BatchLayout, Segment
from aotx.engine.model.config import ModelConfig
from aotx.engine.model.interface import DEVICE_SAMPLING, HOST

KINDS = ("matrix", "vector", "host", "experts", "expert_pair", "expert_vectors", "array")
VECTOR_TYPES = frozenset({T.F32, T.F16, T.BF16})


@dataclass(frozen=True)
class Tensor:
    """A tensor an architecture reads: ``name``, ``shape`` in ggml order (``(k, m)`` for an
    (m, k) matrix, ``(n,)`` for a vector), ``kind``: "matrix" (``backend.matrix``),
    "vector" (``backend.vector``: norms, biases) or "host" (a float32 numpy array kept on
    the host: RoPE frequency factors); for mixtures of experts "experts" (a 3-D stack of E
    matrices, ggml shape ``(k, m, E)``: ``backend.experts``), "expert_pair" (a fused stack of
    ggml shape ``(k, 2m, E)`` whose experts are [first; second] halves, llama.cpp's
    ``ffn_gate_up_exps``: loaded as a tuple of two ``backend.experts`` stacks (k, m, E)
    over the file's rows, nothing copied) and "expert_vectors" (one bias
    per expert, ggml ``(n, E)``: ``backend.expert_vectors``); "array" (a small float tensor
    of any rank, F32/F16/BF16, as a float32 backend array of the reversed ggml shape:
    ``backend.array``; a convolution kernel); ``optional``: absent is fine (the weight is
    None)."""

    name: str
    shape: tuple[int, ...]
    kind: str = "matrix"
    optional: bool = False


@dataclass(frozen=True)
class OneOf:
    """Alternative tensor sets (fused ``attn_qkv`` or separate ``attn_q/k/v``): the first
    option whose first tensor is in the file is used, and then all of its required
    tensors must be there; when none is, the error names every option's first tensor."""

    options: tuple[tuple[Tensor, ...], ...]


class Weights:
    """Loaded weights by tensor name: ``w[name]`` (KeyError for a tensor that is absent or
    was never declared) and ``w.get(name)`` (None when absent)."""

    def __init__(self, loaded: dict[str, Any]):
        self._w = loaded

    def __getitem__(self, name: str) -> Any:
        v = self._w.get(name)
        if v is None:
            raise KeyError(f"tensor {name!r} was not loaded")
        return v

    def get(self, name: str) -> Any:
        return self._w.get(name)

    def __contains__(self, name: str) -> bool:
        return self._w.get(name) is not None


def _type_name(qtype: Any) -> str:
    return getattr(qtype, "name", str(qtype))


def check_tensor(gf, name: str, shape: tuple[int, ...]):
    """The file's tensor ``name``, checked to have ``shape`` (ggml order). Raises ModelError
    naming the file and the tensor when it is missing or mis-shaped."""
    t = gf.tensors.get(name)
    if t is None:
        raise ModelError(f"{gf.path}: tensor {name!r} is missing")
    if tuple(t.shape) != tuple(shape):
        raise ModelError(f"{gf.path}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
    return t


def resolve_tensors(specs: list, gf, backend) -> list[tuple[Tensor, Any]]:
    """Check every declared tensor against the file before anything is loaded: presence
    (alternatives of a OneOf resolved), shape and tensor type (matrices: the backend's
    ``supported_types``; vectors and host arrays: F32, F16 or BF16). Returns (spec, file
    tensor) pairs for the tensors present. Raises ModelError naming the first bad tensor."""
    supported = getattr(backend, "supported_types", None)
    flat: list[Tensor] = []
    for s in specs:
        if isinstance(s, OneOf):
            chosen = next((opt for opt in s.options if opt[0].name in gf.tensors), None)
            if chosen is None:
                names = " or ".join(repr(opt[0].name) for opt in s.options)
                raise ModelError(f"{gf.path}: tensor {s.options[0][0].name!r} is missing "
                                 f"(the file has neither {names})")
            flat.extend(chosen)
        else:
            flat.append(s)
    out: list[tuple[Tensor, Any]] = []
    for spec in flat:
        if spec.kind not in KINDS:
            raise ValueError(f"{spec.name}: unknown tensor kind {spec.kind!r}")
        if spec.optional and spec.name not in gf.tensors:
            continue
        t = check_tensor(gf, spec.name, spec.shape)
        if spec.kind in ("matrix", "experts", "expert_pair"):
            if supported is not None and t.qtype not in supported:
                raise ModelError(f"{gf.path}: tensor {spec.name!r} has tensor type {_type_name(t.qtype)}, which the "
                                 f"{backend.name.upper()} backend does not support (supported: "
                                 f"{', '.join(sorted(_type_name(q) for q in supported))})")
        elif t.qtype not in VECTOR_TYPES:
            raise ModelError(f"{gf.path}: tensor {spec.name!r} has tensor type {_type_name(t.qtype)}, which is not "
                             f"supported for a {_what(spec.kind)} "
                             f"(supported: F32, F16, BF16)")
        out.append((spec, t))
    return out


def _what(kind: str) -> str:
    return {"expert_vectors": "per-expert bias", "array": "small float tensor"}.get(kind, "1-D tensor")


def check_known(arch: ModuleType, cfg: ModelConfig, specs: list, gf) -> None:
    """For an architecture that sets ``KNOWN_TENSORS_ONLY``: every tensor of the file must
    be one it declares (any option of a OneOf) or one its ``ignored_tensor(cfg, name)``
    accepts; otherwise the file is a variant it does not know, refused naming the tensor."""
    if not getattr(arch, "KNOWN_TENSORS_ONLY", False):
        return
    known = set()
    for s in specs:
        for t in ([x for opt in s.options for x in opt] if isinstance(s, OneOf) else [s]):
            known.add(t.name)
    ignored = getattr(arch, "ignored_tensor", lambda cfg, name: False)
    for name in gf.tensors:
        if name not in known and not ignored(cfg, name):
            raise ModelError(f"{gf.path}: tensor {name!r} is not part of the {cfg.arch} architecture AOTX knows "
                             f"(a variant it cannot run)")


def _host_vector(t) -> np.ndarray:
    raw = np.ascontiguousarray(t.data).reshape(-1)
    if t.qtype == T.F32:
        return raw.view(np.float32).astype(np.float32)
    if t.qtype == T.F16:
        return raw.view(np.float16).astype(np.float32)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _halves(t) -> tuple[Any, Any]:
    """A fused expert tensor (ggml ``(k, 2m, E)``) as two tensors (k, m, E): rows [0, m) and
    [m, 2m) of every expert, views of the same map (each expert's half is contiguous)."""
    k, m2, E = (int(x) for x in t.shape)
    m = m2 // 2
    if m2 % 2:
        raise ModelError(f"tensor {t.name!r} has {m2} rows per expert, not two halves")
    data = np.asarray(t.data)
    return tuple(dataclasses.replace(t, name=f"{t.name}[{part}]", shape=(k, m, E), n_elements=t.n_elements // 2,
                                     n_bytes=t.n_bytes // 2, data=data[:, lo:lo + m])
                 for part, lo in (("first half", 0), ("second half", m)))


def load_weights(resolved: list[tuple[Tensor, Any]], gf, backend) -> Weights:
    """Hand every resolved tensor to the backend (``matrix`` / ``vector``) or keep it on
    the host ("host"). The backend's ValueErrors (rows that do not match a block size, an
    unsupported type it found itself) become ModelError naming the file and the tensor."""
    loaded: dict[str, Any] = {}
    for spec, t in resolved:
        try:
            if spec.kind == "host":
                loaded[spec.name] = _host_vector(t)
            elif spec.kind == "expert_pair":
                load = getattr(backend, "experts", None)
                if load is None:
                    raise ModelError(f"{gf.path}: the {backend.name.upper()} backend does not run mixtures of experts "
                                     f"(tensor {spec.name!r})")
                loaded[spec.name] = tuple(load(h) for h in _halves(t))
            else:
                load = {"matrix": backend.matrix, "vector": backend.vector}.get(spec.kind)
                if load is None:  # the expert kinds and arrays: only backends that run them have them
                    load = getattr(backend, spec.kind, None)
                    if load is None:
                        what = "recurrent layers" if spec.kind == "array" else "mixtures of experts"
                        raise ModelError(f"{gf.path}: the {backend.name.upper()} backend does not run {what} "
                                         f"(tensor {spec.name!r})")
                loaded[spec.name] = load(t)
        except ModelError as e:
            msg = str(e)
            raise ModelError(msg if msg.startswith(str(gf.path)) else f"{gf.path}: {msg}") from None
        except ValueError as e:
            msg = str(e)
            raise ModelError(f"{gf.path}: {msg if spec.name in msg else f'tensor {spec.name!r}: {msg}'}") from None
    return Weights(loaded)


class TransformerModel:
    """A loaded model of any supported architecture on any backend.

    ``cfg``: the ModelConfig; ``program``: the traced ops.Program; ``compiled``: the
    backend's executor. The interface is engine/model/interface.py's (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, gf, backend, arch: ModuleType):
        self.cfg = cfg
        self.backend = backend
        self.arch = arch
        check = getattr(arch, "check_config", None)
        if check is not None:
            check(cfg, str(gf.path))
        _check_block_count(cfg, gf)
        specs = arch.tensors(cfg)
        check_known(arch, cfg, specs, gf)
        resolved = resolve_tensors(specs, gf, backend)
        w = load_weights(resolved, gf, backend)
        self.weights, self._gf = w, gf       # the MTP head shares them (load_mtp)
        b = ProgramBuilder()
        try:
            logits = arch.forward(b, cfg, w)
            self.program = b.finish(logits)
            self.compiled = backend.compile(self.program)
        except ProgramError as e:
            raise ModelError(f"{gf.path}: the {cfg.arch} forward pass cannot be built from this file ({e})") from None
        # the device-sampling path's methods exist only where the backend samples on the
        # device (interface.py: the runtime reads device_path)
        self.device_path = DEVICE_SAMPLING if getattr(self.compiled, "device_sampling", False) else HOST
        if self.device_path == DEVICE_SAMPLING:
            self.sample = self._sample
            self.greedy = self._greedy
            self.last_logits = self.compiled.last_logits
            self.samples_exactly = self.compiled.samples_exactly
            self.load_masks = self.compiled.load_masks

    @property
    def numerics(self) -> str:
        """The arithmetic behind the logits, as the backend names it ("cpu-int8", "cuda-f32", ...)."""
        return self.backend.numerics

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights occupy in the backend's memory."""
        return self.backend.weight_bytes

    @property
    def prefill_weight_bytes(self) -> int:
        """Bytes of extra weight copies the backend keeps for prefill (CUDA's dense copies)."""
        return int(getattr(self.compiled, "prefill_weight_bytes", 0))

    def kv_cache_bytes(self, n_slots: int, n_ctx: int, kv_type: str = "f16") -> int:
        """Bytes ``new_kv_cache(n_slots, n_ctx, kv_type)`` would allocate."""
        return self.compiled.kv_cache_bytes(n_slots, n_ctx, kv_type)

    def new_kv_cache(self, n_slots: int, n_ctx: int, kv_type: str = "f16"):
        """Allocate KV for ``n_slots`` slots of ``n_ctx`` tokens each (zeroed); kv_type
        "f16" (default) or "f32"."""
        return self.compiled.new_kv_cache(n_slots, n_ctx, kv_type)

    def forward(self, tokens: np.ndarray, segments: list[Segment], kv,
                embeds: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """Run one batch: write each segment's K/V into its slot, return logits.

        tokens: (N,) int32, N = sum of segment lengths, in segment order. Returns
        (R, vocab) float32 where R counts one row per segment with ``logits`` (its last
        token) or every row of an ``all_logits`` segment, in order. Positions must lie
        inside the cache (the runtime checks context before scheduling). ``embeds``:
        ``(rows (k,) int64, values (k, d_model) float32)``: input embeddings that replace
        the token embeddings of those batch rows (image positions, whose ids are
        placeholders past the vocabulary; see runtime/media_prompt.py)."""
        return self.compiled.forward(tokens, BatchLayout.of(segments), kv, embeds)

    def last_hidden(self) -> np.ndarray | None:
        """The last forward's (N, d_model) final-normed hidden states, for a program that
        keeps them (an architecture with an MTP head), else None."""
        return getattr(self.compiled, "last_hidden", None)

    @property
    def has_mtp(self) -> bool:
        """The file has nextn (multi-token-prediction) blocks this architecture can run."""
        return bool(self.cfg.nextn_layers) and hasattr(self.arch, "mtp_forward")

    def load_mtp(self) -> "MtpHead":
        """Load the file's first nextn block as an MTP head on this backend (its own tensors;
        the embedding and output head shared with this model). Raises ModelError naming
        a missing tensor or an op the backend cannot run."""
        gf = self._gf
        if not self.has_mtp:
            raise ModelError(f"{gf.path}: the model has no MTP head (no {self.cfg.arch}.nextn_predict_layers)")
        w = load_weights(resolve_tensors(self.arch.mtp_tensors(self.cfg), gf, self.backend), gf, self.backend)
        b = ProgramBuilder()
        try:
            logits = self.arch.mtp_forward(b, self.cfg, Weights({**self.weights._w, **w._w}))
            program = b.finish(logits)
            return MtpHead(program, self.backend.compile(program))
        except ProgramError as e:
            raise ModelError(f"{gf.path}: the MTP head cannot be built from this file ({e})") from None
        except ValueError as e:     # a backend that cannot run one of its ops
            raise ModelError(f"{gf.path}: the MTP head does not run on the {self.backend.name} backend ({e})") from None

    def _sample(self, tokens: np.ndarray, segments: list[Segment], kv, rows, tick: int = 0) -> np.ndarray:
        """Run one batch and pick each logits row's next token on the device (only on the
        device-sampling path; see the CUDA backend). Returns (R,) int32."""
        return self.compiled.sample(tokens, BatchLayout.of(segments), kv, rows, tick)

    def _greedy(self, tokens: np.ndarray, segments: list[Segment], kv) -> np.ndarray:
        """``sample`` with every row greedy (only on the device-sampling path)."""
        return self.compiled.greedy(tokens, BatchLayout.of(segments), kv)


class MtpHead:
    """A multi-token-prediction head traced and compiled beside its model: ``forward(tokens,
    segments, kv, hidden)`` -> (R, vocab) logits, ``hidden`` the (N, d_model) rows of its
    ``input`` "h"; ``last_hidden()`` its own final-normed rows of that forward."""

    def __init__(self, program, compiled):
        self.program = program
        self.compiled = compiled
        self.d_model = program.d_model

    def new_kv_cache(self, n_slots: int, n_ctx: int, kv_type: str = "f16"):
        return self.compiled.new_kv_cache(n_slots, n_ctx, kv_type)

    def kv_cache_bytes(self, n_slots: int, n_ctx: int, kv_type: str = "f16") -> int:
        return self.compiled.kv_cache_bytes(n_slots, n_ctx, kv_type)

    def forward(self, tokens: np.ndarray, segments: list[Segment], kv, hidden: np.ndarray) -> np.ndarray:
        return self.compiled.forward(tokens, BatchLayout.of(segments), kv, None, {"h": hidden})

    def last_hidden(self) -> np.ndarray:
        return self.compiled.last_hidden


def _check_block_count(cfg: ModelConfig, gf) -> None:
    """Every architecture names its layers' tensors ``blk.<i>.*``: a block count past the
    blocks the file holds is refused here, before the tensor list is built (a flipped byte
    made block_count 83,886,129 and the list of expected tensors alone took gigabytes)."""
    blocks = set()
    for name in gf.tensors:
        if name.startswith("blk."):
            head = name[4:].split(".", 1)[0]
            if head.isdigit():
                blocks.add(int(head))
    if cfg.n_layers > len(blocks):
        have = f"blk.0 .. blk.{max(blocks)}" if blocks else "none"
        raise ModelError(f"{gf.path}: {cfg.arch}.block_count is {cfg.n_layers:,} but the file holds tensors for "
                         f"{len(blocks)} blocks ({have})")


def build(cfg: ModelConfig, gf, backend, arch: ModuleType) -> TransformerModel:
    """Load the file ``gf`` (its config ``cfg``) onto ``backend`` as architecture ``arch``
    (a module of ``architectures``; ``architectures.build(cfg, gf, backend)`` looks it up by
    name). Raises ModelError naming a missing, mis-shaped or unsupported tensor, or a
    hyperparameter the architecture cannot run."""
    return TransformerModel(cfg, gf, backend, arch)


