"""Open a GGUF file, memory-mapped, and check it before anything trusts it.

Owns: the container (header, metadata, tensor infos, read here by a strict parser
over the memory map), the metadata as plain Python values, and the per-tensor
checks a model load relies on (type known, dimensions non-zero, data inside the
file). Leaves to others: what the tensors mean (``config.py``, ``architectures/``)
and how they are computed (``engine/backend``). The ``gguf`` package supplies the
format's constants (value types, tensor types and their block sizes).

Why not ``gguf.GGUFReader``: it trusts the file. It flattens nested arrays
(``[[1, 2], [3]]`` reads as ``[1, 2, 3]``), truncates a string whose declared
length runs past the end of the file instead of refusing it, accepts an empty
key, and byte-swaps a big-endian file it cannot then validate. A model file is
input a user feeds us (often downloaded), so every length, count and type code is
checked here before it is used.

Every problem becomes a ``ModelError`` whose one-line message names the file, the
bad key or tensor, the problem and where possible the byte offset; nothing from
numpy, mmap or struct reaches a user. Format: GGUF v2/v3, little-endian (ggml's
docs/gguf.md): magic ``GGUF``, version u32, tensor count u64, KV count u64, KV
pairs (key string, value type u32, value), tensor infos (name, n_dims u32, dims
u64 x n_dims, type u32, offset u64), padding to ``general.alignment`` (default
32), tensor data. A string is a u64 byte length then UTF-8 bytes; an array is an
element type u32, a u64 count, then the elements. Nested arrays (an array whose
element type is ARRAY) are refused, as ggml's own reader refuses them.
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aotx.engine.errors import ModelError

GGUF_MAGIC = b"GGUF"
_MIN_HEADER = 24  # magic(4) + version(4) + n_tensors(8) + n_kv(8)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4

# GGUF metadata value types (gguf_metadata_value_type), with how to read them.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_TYPE_NAMES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool", "string", "array",
               "uint64", "int64", "float64")
_SCALAR_DTYPES: dict[int, np.dtype] = {
    UINT8: np.dtype("u1"), INT8: np.dtype("i1"), UINT16: np.dtype("<u2"), INT16: np.dtype("<i2"),
    UINT32: np.dtype("<u4"), INT32: np.dtype("<i4"), FLOAT32: np.dtype("<f4"), BOOL: np.dtype("u1"),
    UINT64: np.dtype("<u8"), INT64: np.dtype("<i8"), FLOAT64: np.dtype("<f8"),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file.

    ``shape`` is in ggml order (``ne0`` first: the contiguous dimension, e.g.
    ``(k, m)`` for an ``(m, k)`` weight matrix). ``data`` is a read-only view into
    the memory map: ``(m, bytes_per_row) uint8`` for block-quantized types and
    BF16, or a typed ``(m, k)`` array for F32/F16 (the layout ``gguf.GGUFReader``
    gives). ``offset`` and ``n_bytes`` are absolute file offsets and sizes in bytes.
    """

    name: str
    qtype: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    offset: int
    data: np.ndarray


@dataclass
class GGUFFile:
    """A checked, memory-mapped GGUF file: ``metadata`` (key -> str/int/float/bool/list)
    and ``tensors`` (name -> TensorInfo). Raises ``ModelError`` from ``open``."""

    path: Path
    size: int
    version: int
    alignment: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    _map: Any = None  # the np.memmap every tensor's data views

    @property
    def architecture(self) -> str:
        """``general.architecture`` (for example ``"llama"``)."""
        return str(self.metadata.get("general.architecture", ""))

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "GGUFFile":
        """Open and check ``path``.

        Raises ModelError when the file is missing, not a regular file, not GGUF,
        big-endian, of an unknown GGUF version, truncated, or malformed: an empty,
        duplicate or non-UTF-8 metadata key, an unknown value type, a string or
        array whose declared length runs past the end of the file, a nested
        array, a bool that is neither 0 nor 1, an alignment of 0 (or not a power
        of two), a tensor with a zero dimension or more than 4, of an unknown
        type, misaligned, or whose data lies past the end of the file.
        """
        p = Path(path).expanduser()
        try:
            st = p.stat()
        except FileNotFoundError:
            raise ModelError(f"{p}: no such model file") from None
        except OSError as e:
            raise ModelError(f"{p}: cannot read the file ({e.strerror})") from None
        if stat.S_ISDIR(st.st_mode):
            raise ModelError(f"{p}: is a directory, not a GGUF file")
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block or never end
            raise ModelError(f"{p}: is not a regular file (a pipe, socket or device), not a GGUF file")
        size = st.st_size
        try:
            with open(p, "rb") as fh:
                head = fh.read(_MIN_HEADER)
        except OSError as e:
            raise ModelError(f"{p}: cannot read the file ({e.strerror})") from None
        if len(head) < 4 or head[:4] != GGUF_MAGIC:
            raise ModelError(f"{p}: not a GGUF file (the first 4 bytes are {head[:4]!r}, expected b'GGUF')")
        if len(head) < _MIN_HEADER:
            raise ModelError(f"{p}: truncated GGUF file ({size} bytes, the header alone needs {_MIN_HEADER})")
        try:
            mm = np.memmap(p, mode="r")
        except (OSError, ValueError, MemoryError) as e:
            raise ModelError(f"{p}: cannot map the file ({e})") from None
        try:
            parsed = parse(memoryview(mm))
        except ModelError as e:
            raise ModelError(f"{p}: {e}") from None
        tensors = {t.name: _tensor_view(mm, parsed.data_start, t) for t in parsed.tensors}
        return cls(p, size, parsed.version, parsed.alignment, parsed.metadata, tensors, mm)


# ------------------------------------------------------------------ the parser

@dataclass(frozen=True)
class RawTensor:
    """A tensor info record as read: ``type_id`` a ggml type, ``offset`` relative to
    the start of the data section."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int


@dataclass(frozen=True)
class Parsed:
    """What ``parse`` read from a GGUF file's bytes."""

    version: int
    alignment: int
    metadata: dict[str, Any]
    value_types: dict[str, int]  # key -> GGUF value type id
    tensors: list[RawTensor]
    data_start: int  # absolute offset of the (aligned) tensor data section


class _Cursor:
    """Reads little-endian fields from ``buf``, refusing any read past its end."""

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf: memoryview, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos
        self.end = len(buf)

    def need(self, n: int, what: str) -> None:
        if n > self.end - self.pos:
            raise ModelError(f"truncated GGUF file: {what} at byte {self.pos} needs {n} bytes, but only "
                             f"{max(0, self.end - self.pos)} remain")

    def u32(self, what: str) -> int:
        self.need(4, what)
        v = _U32.unpack_from(self.buf, self.pos)[0]
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        v = _U64.unpack_from(self.buf, self.pos)[0]
        self.pos += 8
        return v

    def raw_string(self, what: str) -> bytes:
        at = self.pos
        n = self.u64(f"the length of {what}")
        if n > self.end - self.pos:
            raise ModelError(f"{what} declares a string of {n} bytes at byte {at}, but only "
                             f"{self.end - self.pos} bytes remain in the file (truncated or corrupt)")
        b = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return b


def _utf8(b: bytes, what: str) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelError(f"{what} is not valid UTF-8 (byte {e.start}: {b[e.start:e.start + 1]!r})") from None


def _type_name(t: int) -> str:
    return _TYPE_NAMES[t] if 0 <= t < len(_TYPE_NAMES) else f"unknown type {t}"


def parse(buf: memoryview | bytes) -> Parsed:
    """Parse and check a whole GGUF file's bytes (a memory map or ``bytes``).

    A pure function: it reads ``buf`` and returns the header, the metadata (keys to
    str, int, float, bool or lists of those) and the tensor infos; the tensor data
    itself is only bounds-checked. Raises ModelError (without the file's name; the
    caller adds it) naming the key or tensor, the problem and its byte offset.
    """
    buf = memoryview(buf)
    if buf.format != "B" or buf.ndim != 1:
        buf = buf.cast("B")
    size = len(buf)
    if size < 4 or bytes(buf[:4]) != GGUF_MAGIC:
        raise ModelError(f"not a GGUF file (the first 4 bytes are {bytes(buf[:4])!r}, expected b'GGUF')")
    if size < _MIN_HEADER:
        raise ModelError(f"truncated GGUF file ({size} bytes, the header alone needs {_MIN_HEADER})")
    cur = _Cursor(buf, 4)
    version = cur.u32("the version")
    swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in (2, 3) and swapped in (2, 3):
        raise ModelError(f"a big-endian GGUF file (version {swapped} stored big-endian); AOTX reads "
                         f"little-endian GGUF files only: convert it with gguf-py's gguf-convert-endian "
                         f"(`gguf-convert-endian FILE little`)")
    if version not in (2, 3):
        raise ModelError(f"GGUF version {version} is not supported (AOTX reads versions 2 and 3)")
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.u64("the metadata count")
    # Each KV pair needs at least 8 + 1 + 4 + 1 bytes, each tensor info 8 + 1 + 4 + 8 + 4 + 8.
    if n_tensors > size // 33 or n_kv > size // 14:
        raise ModelError(f"truncated or corrupt GGUF header (tensor count {n_tensors}, metadata count "
                         f"{n_kv} cannot fit in {size} bytes)")

    metadata: dict[str, Any] = {}
    types: dict[str, int] = {}
    for i in range(n_kv):
        at = cur.pos
        kb = cur.raw_string(f"metadata key #{i}")
        if not kb:
            raise ModelError(f"metadata key #{i} (at byte {at}) is empty; every GGUF key needs a name")
        key = _utf8(kb, f"metadata key #{i} (at byte {at}) {kb[:64]!r}")
        if key in metadata:
            raise ModelError(f"metadata key {key!r} appears twice (again at byte {at})")
        vtype = cur.u32(f"the value type of metadata key {key!r}")
        metadata[key] = _read_value(cur, vtype, key)
        types[key] = vtype

    tensors: list[RawTensor] = []
    seen: set[str] = set()
    for i in range(n_tensors):
        at = cur.pos
        nb = cur.raw_string(f"the name of tensor #{i}")
        if not nb:
            raise ModelError(f"tensor #{i} (at byte {at}) has an empty name")
        name = _utf8(nb, f"the name of tensor #{i} (at byte {at})")
        if name in seen:
            raise ModelError(f"tensor {name!r} appears twice (again at byte {at})")
        seen.add(name)
        n_dims = cur.u32(f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ModelError(f"tensor {name!r} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
        shape = tuple(cur.u64(f"dimension {d} of tensor {name!r}") for d in range(n_dims))
        type_id = cur.u32(f"the tensor type of tensor {name!r}")
        offset = cur.u64(f"the data offset of tensor {name!r}")
        tensors.append(RawTensor(name, shape, type_id, offset))

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        if types["general.alignment"] != UINT32:
            raise ModelError(f"general.alignment is a {_type_name(types['general.alignment'])}; GGUF "
                             f"requires a uint32")
        alignment = metadata["general.alignment"]
        if alignment == 0 or alignment & (alignment - 1):
            raise ModelError(f"general.alignment is {alignment}; it must be a non-zero power of two")
    data_start = -(-cur.pos // alignment) * alignment
    _check_tensor_infos(size, data_start, alignment, tensors)
    return Parsed(version, alignment, metadata, types, tensors, data_start)


def _string_array(cur: _Cursor, n: int, key: str) -> list[str]:
    """``n`` strings at the cursor (a vocabulary's tokens or merges: 250k of them for
    Qwen3.5). The checks and messages of ``raw_string`` and ``_utf8``, the message made only
    for the element that fails (formatting three messages per element was ~1 s of a
    load)."""
    buf, pos, end = cur.buf, cur.pos, cur.end
    u64 = _U64.unpack_from
    out = []
    for j in range(n):
        m = u64(buf, pos)[0] if end - pos >= 8 else None
        if m is None or m > end - pos - 8:
            cur.pos = pos          # raw_string raises, with its message
            cur.raw_string(f"element {j} of metadata key {key!r}")
        b = bytes(buf[pos + 8:pos + 8 + m])
        try:
            out.append(b.decode("utf-8"))
        except UnicodeDecodeError:
            cur.pos = pos + 8 + m
            _utf8(b, f"element {j} of metadata key {key!r}")
        pos += 8 + m
    cur.pos = pos
    return out


def _read_value(cur: _Cursor, vtype: int, key: str) -> Any:
    """One metadata value of type ``vtype`` at the cursor, as a Python value."""
    if vtype == STRING:
        return _utf8(cur.raw_string(f"metadata key {key!r}"), f"the value of metadata key {key!r}")
    if vtype == ARRAY:
        at = cur.pos
        etype = cur.u32(f"the element type of metadata key {key!r}")
        n = cur.u64(f"the length of metadata key {key!r}")
        if etype == ARRAY:
            raise ModelError(f"metadata key {key!r} (at byte {at}) is an array of arrays; nested arrays "
                             f"are not supported")
        if etype == STRING:
            if n > (cur.end - cur.pos) // 8:
                raise ModelError(f"metadata key {key!r} declares an array of {n} strings at byte {at}, but "
                                 f"only {cur.end - cur.pos} bytes remain in the file (truncated or corrupt)")
            return _string_array(cur, n, key)
        dt = _SCALAR_DTYPES.get(etype)
        if dt is None:
            raise ModelError(f"metadata key {key!r} (at byte {at}) is an array of unknown value type {etype} "
                             f"(GGUF value types are 0..{len(_TYPE_NAMES) - 1})")
        if n > (cur.end - cur.pos) // dt.itemsize:
            raise ModelError(f"metadata key {key!r} declares an array of {n} {_TYPE_NAMES[etype]} at byte "
                             f"{at}, but only {cur.end - cur.pos} bytes remain in the file (truncated or corrupt)")
        arr = np.frombuffer(cur.buf, dt, count=n, offset=cur.pos)
        cur.pos += n * dt.itemsize
        if etype == BOOL:
            bad = np.flatnonzero(arr > 1)
            if bad.size:
                raise ModelError(f"element {int(bad[0])} of metadata key {key!r} is a bool of value "
                                 f"{int(arr[bad[0]])} (must be 0 or 1)")
            return arr.astype(bool).tolist()
        return arr.tolist()
    dt = _SCALAR_DTYPES.get(vtype)
    if dt is None:
        raise ModelError(f"metadata key {key!r} (value at byte {cur.pos - 4}) has unknown value type {vtype} "
                         f"(GGUF value types are 0..{len(_TYPE_NAMES) - 1})")
    cur.need(dt.itemsize, f"the value of metadata key {key!r}")
    v = np.frombuffer(cur.buf, dt, count=1, offset=cur.pos)[0].item()
    cur.pos += dt.itemsize
    if vtype == BOOL:
        if v > 1:
            raise ModelError(f"metadata key {key!r} is a bool of value {v} (must be 0 or 1)")
        return bool(v)
    return v


def _check_tensor_infos(size: int, data_start: int, alignment: int, tensors: list[RawTensor]) -> None:
    """Check every tensor info against ggml's rules before any data is mapped: no
    zero dimension, a known type whose block size divides the row length, an offset
    that is a multiple of ``alignment``, and data that ends inside the file (``size``
    bytes; offsets are relative to ``data_start``). Raises ModelError naming the
    tensor (not the file)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for t in tensors:
        name, shape = t.name, list(t.shape)
        if any(d == 0 for d in shape):
            raise ModelError(f"tensor {name!r} has a zero dimension (shape {shape})")
        try:
            qtype = GGMLQuantizationType(t.type_id)
            block, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelError(f"tensor {name!r} has an unknown tensor type id {t.type_id}") from None
        if shape[0] % block:
            raise ModelError(f"tensor {name!r} is {qtype.name} with rows of {shape[0]} elements, "
                             f"not a multiple of its block size {block}")
        if t.offset % alignment:
            raise ModelError(f"tensor {name!r} has data offset {t.offset}, not a multiple of "
                             f"general.alignment {alignment}")
        n_elements = 1
        for d in shape:
            n_elements *= d
        start = data_start + t.offset
        end = start + n_elements // block * block_bytes
        if end > size:
            raise ModelError(f"tensor {name!r} ({qtype.name}, shape {shape}) lies past the end of the file "
                             f"(its data needs bytes {start}..{end}, the file has {size}): "
                             f"the file is truncated or corrupt")


_TYPED = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


def _tensor_view(mm: np.memmap, data_start: int, t: RawTensor) -> TensorInfo:
    """A checked tensor's TensorInfo with its data as a read-only view of the map,
    shaped as ``gguf.GGUFReader`` shapes it (typed for float/int types, bytes per row
    for block types and BF16)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    qtype = GGMLQuantizationType(t.type_id)
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    n_elements = int(np.prod(t.shape, dtype=object))
    n_bytes = n_elements // block * block_bytes
    offset = data_start + t.offset
    np_shape = tuple(reversed(t.shape))
    raw = mm[offset:offset + n_bytes]
    typed = _TYPED.get(qtype.name)
    if typed is not None:
        data = raw.view(typed).reshape(np_shape)
    else:
        data = raw.reshape(quant_shape_to_byte_shape(np_shape, qtype))
    return TensorInfo(t.name, qtype, t.shape, n_elements, n_bytes, offset, data)
