"""A GGUF file's header from its first bytes: metadata and tensor infos, no tensor data.

Owns: ``read_header(data)``, a pure function over a prefix of the file (the first
megabytes fetched with an HTTP range request before a download, or read from a
local file before loading it), and what the header tells without loading anything:
architecture, file type (quantization), trained context, tensor types and the
bytes the tensors take. Arrays of the metadata (the vocabulary) are skipped, not
decoded, so reading the header of a 262k-token vocabulary takes milliseconds.

``Incomplete`` says how many bytes a prefix must have at least (read more and try
again); ``ModelError`` names what is not GGUF. Leaves the full, checked reading of
a file to ``gguf_file.py`` and the model's hyperparameters to ``config.py``.
Format: the GGUF spec (ggml's docs/gguf.md), versions 2 and 3, little-endian.
"""

from __future__ import annotations

import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aotx.engine.errors import ModelError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_STRING = 1 << 26  # a longer key or value is corruption, not metadata

# value type -> struct format of a scalar (8 string, 9 array are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class Incomplete(Exception):
    """The prefix ends inside the header: at least ``need`` bytes are needed."""

    def __init__(self, need: int):
        super().__init__(f"the header needs at least {need} bytes")
        self.need = need


@dataclass(frozen=True)
class TensorHeader:
    name: str
    shape: tuple[int, ...]
    type_id: int  # GGML type id (gguf.GGMLQuantizationType)
    offset: int  # from the start of the data section
    n_bytes: int


@dataclass(frozen=True)
class Header:
    """``metadata``: scalar and string keys (arrays as their length, ``array_lengths``);
    ``data_offset``: where tensor data starts in the file."""

    version: int
    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: tuple[TensorHeader, ...]
    data_offset: int

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def tensor_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    @property
    def n_ctx_train(self) -> int:
        v = self.metadata.get(f"{self.arch}.context_length", 0)
        return int(v) if isinstance(v, (int, float)) else 0

    @property
    def type_names(self) -> set[str]:
        """The GGML type names of its tensors (``Q4_K``, ``F32``, ...)."""
        return {_type_name(t.type_id) for t in self.tensors}

    @property
    def quant(self) -> str:
        """llama.cpp's file type name (``Q4_K_M``, ``Q4_1``, ``F16``) from
        ``general.file_type``, else the type most of the weights' bytes have."""
        ft = self.metadata.get("general.file_type")
        if isinstance(ft, int):
            try:
                import gguf

                return gguf.LlamaFileType(ft).name.removeprefix("MOSTLY_").replace("GUESSED", "").strip("_")
            except (ValueError, ImportError):
                pass
        by: dict[str, int] = {}
        for t in self.tensors:
            if len(t.shape) >= 2:
                by[_type_name(t.type_id)] = by.get(_type_name(t.type_id), 0) + t.n_bytes
        return max(by, key=by.get) if by else ""


def _type_name(type_id: int) -> str:
    try:
        import gguf

        return gguf.GGMLQuantizationType(type_id).name
    except (ValueError, ImportError):
        return f"type{type_id}"


def _type_size(type_id: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a GGML type; raises ModelError when unknown."""
    import gguf

    try:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        raise ModelError(f"tensor type {type_id} is not a GGML type this gguf library knows") from None


class _Reader:
    def __init__(self, data: bytes | memoryview):
        self.data = memoryview(data)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.data):
            raise Incomplete(end)
        out = self.data[self.pos:end]
        self.pos = end
        return out

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def skip_strings(self, n: int, what: str) -> None:
        """Step over ``n`` length-prefixed strings without decoding them."""
        data, pos, end = self.data, self.pos, len(self.data)
        from_bytes = int.from_bytes
        for _ in range(n):
            if pos + 8 > end:
                raise Incomplete(pos + 8 + (n - _) * 9)
            k = from_bytes(data[pos:pos + 8], "little")
            if k > MAX_STRING:
                raise ModelError(f"{what}: a string of {k} bytes at offset {pos}: not a GGUF header")
            pos += 8 + k
        if pos > end:
            raise Incomplete(pos)
        self.pos = pos

    def string(self, what: str) -> str:
        n = self.scalar("<Q")
        if n > MAX_STRING:
            raise ModelError(f"{what}: a string of {n} bytes at offset {self.pos - 8}: not a GGUF header")
        return bytes(self.take(n)).decode("utf-8", "replace")


def read_header(data: bytes | memoryview, what: str = "file") -> Header:
    """Parse the GGUF header at the start of ``data`` (a prefix of the file is enough).

    Raises ``Incomplete(need)`` when ``data`` ends inside the header, ``ModelError``
    naming ``what`` when it is not GGUF (bad magic, unknown version or value type)."""
    r = _Reader(data)
    magic = bytes(r.take(4))
    if magic != MAGIC:
        raise ModelError(f"{what} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    version = r.scalar("<I")
    if version not in (2, 3) and int.from_bytes(version.to_bytes(4, "little"), "big") in (2, 3):
        raise ModelError(f"{what}: a big-endian GGUF file; AOTX reads little-endian GGUF files only "
                         f"(convert it with `gguf-convert-endian FILE little`)")
    if version not in (2, 3):
        raise ModelError(f"{what}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
    if n_tensors > 1 << 20 or n_kv > 1 << 20:
        raise ModelError(f"{what}: the header claims {n_tensors} tensors and {n_kv} metadata keys: corrupt")
    meta: dict[str, Any] = {}
    arrays: dict[str, int] = {}
    for _ in range(n_kv):
        key = r.string(what)
        if not key:
            raise ModelError(f"{what}: a metadata key is empty (key {len(meta) + 1} of {n_kv}): malformed GGUF")
        vt = r.scalar("<I")
        if vt == 9:
            it, n = r.scalar("<I"), r.scalar("<Q")
            arrays[key] = n
            if it == 9:
                raise ModelError(f"{what}: metadata array {key!r} holds arrays (nested arrays are not supported)")
            if it == 8:
                r.skip_strings(n, what)
            elif it in _SCALARS:
                r.take(n * struct.calcsize(_SCALARS[it]))
            else:
                raise ModelError(f"{what}: metadata array {key!r} has items of unknown type {it}")
            meta[key] = n
        elif vt == 8:
            meta[key] = r.string(what)
        elif vt in _SCALARS:
            meta[key] = r.scalar(_SCALARS[vt])
        else:
            raise ModelError(f"{what}: metadata key {key!r} has unknown value type {vt}")
    tensors = []
    for _ in range(n_tensors):
        name = r.string(what)
        n_dims = r.scalar("<I")
        if n_dims > 8:
            raise ModelError(f"{what}: tensor {name!r} has {n_dims} dimensions: corrupt")
        shape = tuple(r.scalar("<Q") for _ in range(n_dims))
        type_id, offset = r.scalar("<I"), r.scalar("<Q")
        block, size = _type_size(type_id)
        n = 1
        for d in shape:
            n *= d
        tensors.append(TensorHeader(name, shape, type_id, offset, n // block * size))
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    align = align if isinstance(align, int) and align > 0 else DEFAULT_ALIGNMENT
    data_offset = -(-r.pos // align) * align
    return Header(version, meta, arrays, tuple(tensors), data_offset)


def read_file_header(path: str | Path, first: int = 8 << 20) -> Header:
    """The header of the GGUF file at ``path``, reading only as much of it as it takes.
    Raises ModelError for a file that is not GGUF or ends inside its header."""
    p = Path(path)
    n = first
    if not stat.S_ISREG(p.stat().st_mode):  # a pipe would block the open (and the model list) forever
        raise ModelError(f"{p}: is not a regular file (a pipe, socket or device), not a GGUF file")
    with open(p, "rb") as fh:
        size = p.stat().st_size
        while True:
            fh.seek(0)
            data = fh.read(n)
            try:
                return read_header(data, str(p))
            except Incomplete as e:
                if n >= size:
                    raise ModelError(f"{p}: the file ends inside its GGUF header ({size} bytes): truncated") from None
                n = min(size, max(e.need, 2 * n))
