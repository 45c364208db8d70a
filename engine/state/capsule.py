"""Execution-state capsules: a slot's complete state at a committed boundary.

A slot's live state is a closed set of named buffers: K and V of every layer
for positions ``0..n-1``, the token ids those positions hold, the position
(``n``), the pending token (sampled, not yet fed), the sampler state (seed,
Philox step counter, penalty history), on a hybrid model the recurrent buffers
(each convolution's last inputs and each delta-rule layer's state matrices, as
the KV cache's ``state`` names them: ``conv.<i>``, ``delta.<i>``) and, with a
draft model, the drafter state (the draft slot's K and V up to its committed
boundary and the ids they hold; ``runtime/drafter.py``). A capsule is a copy of that set with a header: the
model fingerprint, backend, KV type (f16 | f32), dtype layout, length and a CRC32C over every buffer
(the drafter buffers have their own CRC32C in ``header.drafter``). Restore
copies back into the *same* live buffers (nothing resolved at load changes)
and is byte-exact.

Homes: "host" (a numpy copy in RAM: parking), "disk" (a file written
crash-safely through the journal's file layer: a private (0600) temporary file,
fsync, rename, fsync the directory; a failed write, such as a full disk, removes
the temporary file), and, on CUDA,
"device" (a copy beside the live buffers, provided by the CUDA backend).
Public reference: the FlashRT paper "Execution-State Capsules" (byte-exact
restore, token-identical greedy decode); unlike it, capsules here include the
sampler state and the drafter state, and live in three homes.

File format (little-endian): magic ``AOTXCAPS``, u32 version, u32 header
length, header (msgpack map), then the buffers raw: ``k``, ``v``, ``tokens``,
then, when ``header.shapes`` names them, ``draft_k``, ``draft_v``,
``draft_tokens``, then the recurrent buffers ``header.state`` names, in that order
(float32, shapes in ``header.shapes["state.<name>"]``). The drafter and recurrent
buffers were added without a version change: a reader that does not know them
stops before them and ignores the header's unknown fields, and a capsule without
drafter buffers restores with an empty drafter. The recurrent state stands at one
position, so a hybrid model's capsule restores whole, or at one of its
checkpoints: earlier positions where the slot's state was copied (the end of
each prompt it prefilled; ``header.checkpoints``, buffers ``ckpt.<n>.<name>`` after
the state's), never at any other prefix as KV alone could (``restorable``,
``usable_prefix``).
``k`` and ``v`` are float16 when ``header.kv_type`` is "f16", float32 for "f32" (the
field's default: capsules written before it were float32), and for "q8_0" / "q4_0" the
cache's bytes of llama.cpp's blocks (uint8, (n_layers, n_kv_heads, n, row bytes)); the drafter's are
``header.drafter["kv_type"]`` likewise. A capsule restores only into a KV cache of its
own type (converting would not be byte-exact).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import google_crc32c
import msgspec
import numpy as np

from aotx.engine.errors import AotxError
from aotx.engine.fileio import OS, FileIO, describe_os_error, read_regular, write_file
from aotx.engine.state.prefix import common_prefix

MAGIC = b"AOTXCAPS"
VERSION = 1
_HEAD = struct.Struct("<8sII")


class CapsuleError(AotxError):
    """A capsule cannot be used: corrupt, another model's, or of another layout."""


class CapsuleHeader(msgspec.Struct, frozen=True):
    """What a capsule is: model fingerprint, backend, dtype layout
    (``"kv:f32:(layers,kv_heads,n,head_dim)"``), length in tokens, per-buffer
    shapes, CRC32C over ``k``, ``v``, ``tokens``, and the sampler state.
    ``drafter``: empty, or the draft model's ``fingerprint`` and ``model`` name,
    ``n_tokens`` and ``crc32c`` over ``draft_k``, ``draft_v``, ``draft_tokens``."""

    fingerprint: str
    backend: str
    layout: str
    n_tokens: int
    shapes: dict[str, list[int]]
    crc32c: int
    pending_token: int = -1
    seed: int = 0
    step: int = 0
    history: list[int] = []
    drafter: dict[str, Any] = {}
    kv_type: str = "f32"
    # a constrained reply's grammar state (``runtime/constraints.GrammarState.snapshot``:
    # the grammar and the ids it consumed), so a fork or a restore continues the same
    # constraint; empty without one. Older readers ignore the field.
    grammar: dict[str, Any] = {}
    # the arithmetic that computed the KV ("cpu-int8", "cuda-int8", "cuda-f32": the
    # executor's numerics); a disk capsule of other numerics is not restored (its reply would
    # not be the one a fresh prefill gives). Empty: written before the field existed.
    numerics: str = ""
    # the recurrent buffers' names, in file order (empty: an attention-only model)
    state: list[str] = []
    # positions < n_tokens where the recurrent buffers were also kept (each a full set)
    checkpoints: list[int] = []


# the dtype of a capsule's K and V by its KV type (q8_0 / q4_0: llama.cpp's blocks, as bytes)
_KV_DTYPES = {"f16": np.float16, "f32": np.float32, "q8_0": np.uint8, "q4_0": np.uint8}


def _kv_type_of(a) -> str:
    """ "f16" or "f32" from an array's dtype (numpy or cupy)."""
    return "f16" if np.dtype(a.dtype) == np.float16 else "f32"


@dataclass
class Capsule:
    """Buffers: ``k``, ``v``: (n_layers, n_kv_heads, n, head_dim) float16 or float32 (the
    header's kv_type);
    ``tokens``: (n,) int32. Sampler state in the header. Drafter state (or None):
    ``draft_k``, ``draft_v``: the draft model's (n_layers', n_kv_heads', m, head_dim')
    float16 or float32; ``draft_tokens``: (m,) int32. ``state``: a hybrid model's
    recurrent buffers at position n (name -> float32 array), or None."""

    header: CapsuleHeader
    k: np.ndarray
    v: np.ndarray
    tokens: np.ndarray
    home: str = "host"
    last_used: float = field(default=0.0)
    draft_k: np.ndarray | None = None
    draft_v: np.ndarray | None = None
    draft_tokens: np.ndarray | None = None
    state: dict[str, np.ndarray] | None = None
    checkpoints: dict[int, dict[str, np.ndarray]] | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes + self.tokens.nbytes) + sum(
            int(a.nbytes) for a in self._draft_buffers() + self._state_buffers())

    def _state_buffers(self) -> tuple[np.ndarray, ...]:
        if self.state is None:
            return ()
        ck = self.checkpoints or {}
        return tuple(self.state[n] for n in self.header.state) + tuple(
            ck[p][n] for p in self.header.checkpoints for n in self.header.state)

    def _draft_buffers(self) -> tuple[np.ndarray, ...]:
        return () if self.draft_k is None else (self.draft_k, self.draft_v, self.draft_tokens)


def _crc(*arrays: np.ndarray) -> int:
    c = 0
    for a in arrays:
        c = google_crc32c.extend(c, np.ascontiguousarray(a).tobytes())
    return int(c)


def snapshot(kv, slot: int, tokens: list[int], *, fingerprint: str, backend: str = "cpu",
             pending_token: int = -1, sampler=None, drafter=None, device: bool = False,
             grammar: dict[str, Any] | None = None, numerics: str = "",
             checkpoints: dict[int, dict[str, np.ndarray]] | None = None) -> Capsule:
    """Copy slot ``slot``'s state for positions 0..len(tokens)-1 out of the live KV cache.

    kv: the model's KV cache (any backend's: its ``snapshot_slot(slot, n)`` returns host
    (n_layers, n_kv, n, hd) copies of K and V, float16 or float32 by its ``kv_type``); tokens: the ids those positions
    hold; sampler: a SamplerState or None; drafter: None, or the drafter state as
    ``DraftModel.state(slot)`` returns it: (K, V, ids, header map). ``device=True`` (CUDA
    caches only) keeps K and V on the GPU beside the live buffers: home "device", no PCIe
    copy; their CRC32C is computed when they leave the device (``to_host``), so the
    header says 0 until then. grammar: the slot's constraint state as data, or None.
    checkpoints: a hybrid slot's recurrent buffers kept at earlier positions ({n: buffers},
    the slot's ``checkpoints``); those below len(tokens) go into the capsule.
    numerics: the arithmetic behind the KV (CapsuleHeader.numerics)."""
    n = len(tokens)
    rec = None
    if getattr(kv, "state", None) is not None:
        try:
            rec = kv.state.snapshot(slot, n)
        except ValueError as e:
            raise CapsuleError(f"cannot snapshot slot {slot} at {n} tokens: {e}") from None
    k, v = kv.snapshot_slot(slot, n, device=True) if device else kv.snapshot_slot(slot, n)
    toks = np.asarray(tokens, np.int32)
    shapes = {"k": list(k.shape), "v": list(v.shape), "tokens": [n]}
    names = list(rec) if rec is not None else []
    shapes.update({f"state.{name}": list(rec[name].shape) for name in names})
    ckpt = {p: c for p, c in sorted((checkpoints or {}).items()) if 0 < p < n} if rec is not None else {}
    dk = dv = dt = None
    dmeta: dict[str, Any] = {}
    if drafter is not None:
        dk, dv, dt, meta = drafter
        dt = np.asarray(dt, np.int32)
        shapes.update({"draft_k": list(dk.shape), "draft_v": list(dv.shape), "draft_tokens": [int(dt.shape[0])]})
        dmeta = {**meta, "n_tokens": int(dt.shape[0]), "crc32c": _crc(dk, dv, dt), "kv_type": _kv_type_of(dk)}
    kv_type = getattr(kv, "kv_type", "") or _kv_type_of(k)
    hdr = CapsuleHeader(
        fingerprint=fingerprint, backend=backend, layout=f"kv:{kv_type}:{list(k.shape[:2])}+n+[{k.shape[3]}]",
        n_tokens=n, shapes=shapes, crc32c=0 if device else _crc(k, v, toks, *(rec[x] for x in names), *(
            c[x] for c in ckpt.values() for x in names)),
        pending_token=pending_token, seed=getattr(sampler, "seed", 0), step=getattr(sampler, "step", 0),
        history=list(getattr(sampler, "history", [])), drafter=dmeta, kv_type=kv_type, grammar=dict(grammar or {}),
        numerics=numerics, state=names, checkpoints=list(ckpt))
    return Capsule(hdr, k, v, toks, home="device" if device else "host", draft_k=dk, draft_v=dv, draft_tokens=dt,
                   state=rec, checkpoints=ckpt or None)


def to_host(cap: Capsule) -> Capsule:
    """The capsule with its buffers in host memory (numpy) and its checksum set: a
    device capsule demoted to the host home, or ``cap`` itself when already there."""
    if isinstance(cap.k, np.ndarray):
        return cap
    k, v = cap.k.get(), cap.v.get()
    hdr = msgspec.structs.replace(cap.header, crc32c=_crc(k, v, cap.tokens, *cap._state_buffers()))
    return Capsule(hdr, k, v, cap.tokens, home="host", last_used=cap.last_used, draft_k=cap.draft_k,
                   draft_v=cap.draft_v, draft_tokens=cap.draft_tokens, state=cap.state, checkpoints=cap.checkpoints)


def restorable(cap: Capsule, n: int) -> bool:
    """Whether ``restore(cap, ..., n=n)`` can put the slot at position ``n``: any n up to
    the capsule's length for KV alone; with recurrent buffers the whole capsule or one of
    its checkpoints."""
    return 0 < n <= cap.n_tokens and (cap.state is None or n == cap.n_tokens or n in (cap.checkpoints or {}))


def usable_prefix(cap: Capsule, prompt: list[int]) -> int:
    """How many positions of ``prompt`` the capsule can put in place: the shared token
    prefix, or for a capsule with recurrent buffers its whole length when all of it is a
    prefix of ``prompt`` (else 0)."""
    n = common_prefix(cap.tokens.tolist(), prompt)
    if cap.state is not None and n != cap.n_tokens:
        return max((p for p in cap.checkpoints or {} if p <= n), default=0)
    return n


def restore(cap: Capsule, kv, slot: int, *, fingerprint: str, n: int | None = None) -> int:
    """Copy the capsule's first ``n`` positions (default all) back into slot ``slot``.

    Raises CapsuleError when the capsule belongs to another model, KV type or layout, or
    the cache cannot hold it. Returns the number of positions restored."""
    if cap.header.fingerprint != fingerprint:
        raise CapsuleError(f"capsule of model {cap.header.fingerprint} cannot restore into model {fingerprint}")
    kv_type = getattr(kv, "kv_type", "f32")
    if cap.header.kv_type != kv_type:
        raise CapsuleError(f"capsule holds {cap.header.kv_type} KV but this engine's KV cache is {kv_type}: "
                           f"restart with --kv-type {cap.header.kv_type} to restore it (or start the conversation "
                           f"over: its text is in the journal)")
    n = cap.n_tokens if n is None else min(n, cap.n_tokens)
    n_layers, n_kv, n_ctx, hd = kv.slot_shape
    if cap.k.shape[0] != n_layers or cap.k.shape[1] != n_kv or cap.k.shape[3] != getattr(kv, "row_width", hd):
        raise CapsuleError(f"capsule layout {cap.header.layout} does not match the KV cache")
    if n > n_ctx:
        raise CapsuleError(f"capsule of {n} tokens does not fit a context of {n_ctx}")
    st = getattr(kv, "state", None)
    if (st is None) != (cap.state is None):
        raise CapsuleError("capsule and KV cache disagree on recurrent state: " + (
            "the capsule has none" if cap.state is None else "the model has none"))
    if st is not None and not restorable(cap, n):
        raise CapsuleError(f"a capsule with recurrent state restores whole ({cap.n_tokens} tokens) or at a "
                           f"checkpoint ({sorted(cap.checkpoints or {})}), not at {n}")
    if st is not None:
        try:                                     # checks every buffer before it writes any
            st.restore(slot, cap.state if n == cap.n_tokens else cap.checkpoints[n], n)
        except ValueError as e:
            raise CapsuleError(f"capsule layout {cap.header.layout} does not match the model: {e}") from None
    kv.restore_slot(slot, cap.k, cap.v, n)
    return n


def verify(cap: Capsule) -> None:
    """Raise CapsuleError unless the buffers' CRC32C equals the header's (and the
    drafter buffers' equals ``header.drafter["crc32c"]``); a device capsule is checked
    on its host copy."""
    cap = to_host(cap)
    got = _crc(cap.k, cap.v, cap.tokens, *cap._state_buffers())
    if got != cap.header.crc32c:
        raise CapsuleError(f"capsule checksum mismatch (stored {cap.header.crc32c:#010x}, computed {got:#010x})")
    if cap.draft_k is not None:
        want = int(cap.header.drafter.get("crc32c", -1))
        got = _crc(*cap._draft_buffers())
        if got != want:
            raise CapsuleError(f"capsule drafter checksum mismatch (stored {want:#010x}, computed {got:#010x})")


TMP_SUFFIX = ".tmp"


def save(cap: Capsule, path: Path, fs: FileIO = OS) -> int:
    """Write the capsule to ``path`` crash-safely: a 0600 temporary file beside it
    (in a 0700 directory), fsync, rename, fsync the directory. Returns bytes.
    Raises OSError (ENOSPC, ...) with the temporary file already removed."""
    path = Path(path)
    fs.mkdir(path.parent)
    cap = to_host(cap)
    head = msgspec.msgpack.encode(cap.header)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    chunks = [_HEAD.pack(MAGIC, VERSION, len(head)), head] + [
        np.ascontiguousarray(a).data for a in (cap.k, cap.v, cap.tokens) + cap._draft_buffers()
        + cap._state_buffers()]
    size = write_file(fs, tmp, chunks)  # removes tmp on failure
    try:
        fs.replace(tmp, path)
        fs.fsync_dir(path.parent)
    except BaseException:
        try:
            fs.unlink(tmp)
        except OSError:
            pass
        raise
    return size


def remove_temporary(directory: Path, fs: FileIO = OS) -> list[str]:
    """Remove the temporary files a capsule write that failed or crashed left in
    ``directory`` (at start: a leftover tmp must never hold the disk's last space)."""
    removed = []
    d = Path(directory)
    if d.is_dir():
        for p in d.glob("*.caps" + TMP_SUFFIX):
            try:
                fs.unlink(p)
                removed.append(p.name)
            except OSError:
                pass
    return removed


def load(path: Path) -> Capsule:
    """Read and verify a capsule file. Raises CapsuleError naming the file and problem."""
    path = Path(path)
    try:
        data = read_regular(path)
    except OSError as e:
        raise CapsuleError(f"{path}: cannot read capsule ({describe_os_error(e)})") from None
    if len(data) < _HEAD.size:
        raise CapsuleError(f"{path}: truncated capsule ({len(data)} bytes)")
    magic, version, hlen = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise CapsuleError(f"{path}: not a capsule file")
    if version > VERSION:
        raise CapsuleError(f"{path}: capsule format version {version} is newer than this AOTX ({VERSION})")
    try:
        hdr = msgspec.msgpack.decode(data[_HEAD.size:_HEAD.size + hlen], type=CapsuleHeader)
    except msgspec.MsgspecError as e:
        raise CapsuleError(f"{path}: corrupt capsule header ({e})") from None
    off = _HEAD.size + hlen
    out = {}
    kdt = _KV_DTYPES.get(hdr.kv_type)
    ddt = _KV_DTYPES.get(str(hdr.drafter.get("kv_type", "f32")))
    if kdt is None or ddt is None:
        raise CapsuleError(f"{path}: unknown KV type {hdr.kv_type!r} in the capsule header")
    names = [("k", kdt), ("v", kdt), ("tokens", np.int32)]
    if "draft_k" in hdr.shapes:
        names += [("draft_k", ddt), ("draft_v", ddt), ("draft_tokens", np.int32)]
    names += [(f"state.{x}", np.float32) for x in hdr.state]
    names += [(f"ckpt.{p}.{x}", np.float32) for p in hdr.checkpoints for x in hdr.state]
    shapes = dict(hdr.shapes)           # a checkpoint's buffers have the state's shapes
    shapes.update({f"ckpt.{p}.{x}": hdr.shapes.get(f"state.{x}", []) for p in hdr.checkpoints for x in hdr.state})
    for name, dt in names:
        shape = tuple(shapes.get(name, []))
        nb = int(np.prod(shape)) * np.dtype(dt).itemsize
        if off + nb > len(data):
            raise CapsuleError(f"{path}: truncated capsule (buffer {name} runs past the end)")
        out[name] = np.frombuffer(data, dt, count=int(np.prod(shape)), offset=off).reshape(shape).copy()
        off += nb
    cap = Capsule(hdr, out["k"], out["v"], out["tokens"], home="disk", draft_k=out.get("draft_k"),
                  draft_v=out.get("draft_v"), draft_tokens=out.get("draft_tokens"),
                  state={x: out[f"state.{x}"] for x in hdr.state} if hdr.state else None,
                  checkpoints={p: {x: out[f"ckpt.{p}.{x}"] for x in hdr.state} for p in hdr.checkpoints} or None)
    try:
        verify(cap)
    except CapsuleError as e:
        raise CapsuleError(f"{path}: {e}") from None
    return cap
