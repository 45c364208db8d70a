"""Open a GGUF file, memory-mapped, and check it before anything trusts it.

Owns: the container (through the `gguf` package's ``GGUFReader``), the metadata
as plain Python values, and the per-tensor checks a model load relies on (type
known, dimensions non-zero, data inside the file). Leaves to others: what the
tensors mean (``config.py``, ``architectures/``) and how they are computed
(``engine/backend``).

Every problem becomes a ``ModelError`` whose one-line message names the file and
the bad field or tensor; nothing from numpy, mmap or struct reaches a user.
Format: GGUF v2/v3 (ggml's docs/gguf.md): magic ``GGUF``, version u32, tensor
count u64, KV count u64, KV pairs, tensor infos, padding to ``general.alignment``
(default 32), tensor data.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aotx.engine.errors import ModelError

GGUF_MAGIC = b"GGUF"
_MIN_HEADER = 24  # magic(4) + version(4) + n_tensors(8) + n_kv(8)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file.

    ``shape`` is in ggml order (``ne0`` first: the contiguous dimension, e.g.
    ``(k, m)`` for an ``(m, k)`` weight matrix). ``data`` is a read-only view into
    the memory map: ``(m, bytes_per_row) uint8`` for block-quantized types and
    BF16, or a typed ``(m, k)`` array for F32/F16. ``offset`` and ``n_bytes`` are
    absolute file offsets and sizes in bytes.
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
    _reader: Any = None

    @property
    def architecture(self) -> str:
        """``general.architecture`` (for example ``"llama"``)."""
        return str(self.metadata.get("general.architecture", ""))

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "GGUFFile":
        """Open and check ``path``.

        Raises ModelError when the file is missing, not GGUF, of an unknown GGUF
        version, truncated, has an alignment of 0 (or not a power of two), a
        tensor with a zero dimension, of an unknown type, or whose data lies past
        the end of the file.
        """
        p = Path(path).expanduser()
        if not p.exists():
            raise ModelError(f"{p}: no such model file")
        if p.is_dir():
            raise ModelError(f"{p}: is a directory, not a GGUF file")
        try:
            size = p.stat().st_size
            with open(p, "rb") as fh:
                head = fh.read(_MIN_HEADER)
        except OSError as e:
            raise ModelError(f"{p}: cannot read the file ({e.strerror})") from None
        if len(head) < 4 or head[:4] != GGUF_MAGIC:
            raise ModelError(f"{p}: not a GGUF file (the first 4 bytes are {head[:4]!r}, expected b'GGUF')")
        if len(head) < _MIN_HEADER:
            raise ModelError(f"{p}: truncated GGUF file ({size} bytes, the header alone needs {_MIN_HEADER})")
        version = int.from_bytes(head[4:8], "little")
        if version not in (2, 3):
            raise ModelError(f"{p}: GGUF version {version} is not supported (AOTX reads versions 2 and 3)")
        # A corrupt count would make the reader try to allocate absurd lists.
        n_tensors = int.from_bytes(head[8:16], "little")
        n_kv = int.from_bytes(head[16:24], "little")
        if n_tensors > size // 24 or n_kv > size // 12:
            raise ModelError(f"{p}: truncated or corrupt GGUF header (tensor count {n_tensors}, metadata count "
                             f"{n_kv} cannot fit in {size} bytes)")
        raw_align = _peek_alignment(p)
        if raw_align is not None and (raw_align == 0 or raw_align & (raw_align - 1)):
            raise ModelError(f"{p}: general.alignment is {raw_align}; it must be a non-zero power of two")
        try:
            reader = _fast_reader_class()(p, "r")
        except ModelError as e:  # from _check_tensor_infos: names the tensor, not the file
            raise ModelError(f"{p}: {e}") from None
        except ValueError as e:
            msg = str(e)
            if "is not a valid GGMLQuantizationType" in msg or "GGMLQuantizationType" in msg:
                raise ModelError(f"{p}: a tensor has an unknown tensor type ({msg})") from None
            if "reshape" in msg or "cannot reshape" in msg or "size" in msg:
                raise ModelError(f"{p}: truncated GGUF file: tensor data runs past the end of the file "
                                 f"({size} bytes)") from None
            raise ModelError(f"{p}: truncated or malformed GGUF file ({msg})") from None
        except (IndexError, KeyError, OverflowError, UnicodeDecodeError, TypeError) as e:
            raise ModelError(f"{p}: truncated or malformed GGUF file ({type(e).__name__}: {e})") from None
        except (OSError, MemoryError) as e:
            raise ModelError(f"{p}: cannot map the file ({e})") from None
        except Exception as e:  # noqa: BLE001 - the reader's internals raise assorted errors on garbage
            raise ModelError(f"{p}: truncated or malformed GGUF file ({type(e).__name__}: {e})") from None

        metadata = {}
        for name, field in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            try:
                metadata[name] = _field_value(field)
            except Exception as e:  # noqa: BLE001
                raise ModelError(f"{p}: metadata field {name!r} cannot be decoded ({e})") from None

        tensors: dict[str, TensorInfo] = {}
        for t in reader.tensors:
            shape = tuple(int(d) for d in t.shape)
            if any(d == 0 for d in shape):
                raise ModelError(f"{p}: tensor {t.name!r} has a zero dimension (shape {list(shape)})")
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size or t.data.nbytes != t.n_bytes:
                raise ModelError(f"{p}: tensor {t.name!r} lies past the end of the file "
                                 f"(bytes {t.data_offset}..{end}, file size {size}); the file is truncated")
            tensors[t.name] = TensorInfo(t.name, t.tensor_type, shape, int(t.n_elements), int(t.n_bytes),
                                         int(t.data_offset), t.data)
        return cls(p, size, version, int(reader.alignment), metadata, tensors, reader)


_FAST_READER = None


def _fast_reader_class():
    """``gguf.GGUFReader`` with a fast path for metadata arrays.

    The stock reader builds two numpy views per array element, which takes seconds
    on a 49,152-token vocabulary. This subclass reads arrays of scalars as one view
    and arrays of strings with a single pass over a memoryview, producing the same
    ``ReaderField`` parts layout, so ``field.contents()`` gives identical values.
    Byte-swapped files take the stock path."""
    global _FAST_READER
    if _FAST_READER is not None:
        return _FAST_READER
    import gguf
    from gguf.constants import GGUFValueType

    class FastReader(gguf.GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int):  # type: ignore[override]
            if raw_type != GGUFValueType.ARRAY or self.byte_order != "I" or np.little_endian is False:
                return super()._get_field_parts(orig_offs, raw_type)
            offs = orig_offs
            raw_itype = self._get(offs, np.uint32)
            offs += 4
            alen = self._get(offs, np.uint64)
            offs += 8
            itype = GGUFValueType(int(raw_itype[0]))
            n = int(alen[0])
            if itype == GGUFValueType.STRING:
                mv = memoryview(self.data)
                parts: list = [raw_itype, alen]
                idxs: list[int] = []
                end = len(mv)
                for _ in range(n):
                    if offs + 8 > end:
                        raise ValueError("string array runs past the end of the file")
                    ln = int.from_bytes(mv[offs:offs + 8], "little")
                    if offs + 8 + ln > end:
                        raise ValueError("string array runs past the end of the file")
                    parts.append(mv[offs:offs + 8])
                    idxs.append(len(parts))
                    parts.append(mv[offs + 8:offs + 8 + ln])
                    offs += 8 + ln
                return offs - orig_offs, parts, idxs, [GGUFValueType.ARRAY, GGUFValueType.STRING]
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is None:
                return super()._get_field_parts(orig_offs, raw_type)
            arr = self._get(offs, nptype, n)
            if len(arr) != n:
                raise ValueError("array runs past the end of the file")
            return 12 + int(arr.nbytes), [raw_itype, alen, arr], [2], [GGUFValueType.ARRAY, itype]

        def _build_tensors(self, start_offs: int, fields: list) -> None:  # type: ignore[override]
            # Check before the stock reader maps the data: it would otherwise fail
            # inside numpy's reshape without naming the tensor.
            _check_tensor_infos(int(self.data.shape[0]), int(start_offs), int(self.alignment), fields)
            super()._build_tensors(start_offs, fields)

    _FAST_READER = FastReader
    return FastReader


def _check_tensor_infos(size: int, data_start: int, alignment: int, fields: list) -> None:
    """Check every tensor info (parts: name length, name, n_dims, dims, type, offset)
    against ggml's rules before any data is mapped: at most 4 dimensions, none zero, a
    known type whose block size divides the row length, an offset that is a multiple of
    ``alignment``, and data that ends inside the file (``size`` bytes; offsets are
    relative to ``data_start``). Raises ModelError naming the tensor (not the file)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for f in fields:
        try:
            _, name_b, _, dims, raw_type, off = f.parts
            name = bytes(name_b).decode("utf-8", "replace")
            shape = [int(d) for d in dims]
            type_id = int(raw_type[0])
            rel = int(off[0])
        except (ValueError, IndexError, TypeError):
            raise ModelError("a tensor info record is truncated or malformed") from None
        if not 1 <= len(shape) <= 4:
            raise ModelError(f"tensor {name!r} has {len(shape)} dimensions (GGUF allows 1 to 4)")
        if any(d == 0 for d in shape):
            raise ModelError(f"tensor {name!r} has a zero dimension (shape {shape})")
        try:
            qtype = GGMLQuantizationType(type_id)
            block, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelError(f"tensor {name!r} has an unknown tensor type id {type_id}") from None
        if shape[0] % block:
            raise ModelError(f"tensor {name!r} is {qtype.name} with rows of {shape[0]} elements, "
                             f"not a multiple of its block size {block}")
        if rel % alignment:
            raise ModelError(f"tensor {name!r} has data offset {rel}, not a multiple of "
                             f"general.alignment {alignment}")
        n_elements = 1
        for d in shape:
            n_elements *= d
        start = data_start + rel
        end = start + n_elements // block * block_bytes
        if end > size:
            raise ModelError(f"tensor {name!r} ({qtype.name}, shape {shape}) lies past the end of the file "
                             f"(its data needs bytes {start}..{end}, the file has {size}): "
                             f"the file is truncated or corrupt")


def _peek_alignment(p: Path) -> int | None:
    """``general.alignment`` read straight from the header (the reader rejects 0 with
    a generic message; we want ours). None when absent or unreadable."""
    try:
        with open(p, "rb") as fh:
            blob = fh.read(1 << 20)
    except OSError:
        return None
    key = b"general.alignment"
    i = blob.find(key)
    if i < 0 or i + len(key) + 8 > len(blob):
        return None
    vtype = int.from_bytes(blob[i + len(key): i + len(key) + 4], "little")
    if vtype != 4:  # GGUF_TYPE_UINT32
        return None
    return int.from_bytes(blob[i + len(key) + 4: i + len(key) + 8], "little")


def _field_value(field: Any) -> Any:
    """A reader field as a plain Python value (str, int, float, bool or list)."""
    v = field.contents()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, list):
        return [x.item() if isinstance(x, np.generic) else x for x in v]
    return v
