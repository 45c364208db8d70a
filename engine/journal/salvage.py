"""Salvage: the changes recovery makes to a damaged journal, each one crash-safe.

Owns: rewriting a damaged segment with a ``Gap`` record in place of its bad bytes
(after a fsynced byte-exact ``.damaged`` copy; the Gap padded to the bad bytes'
length where it fits, so every later record keeps its offset), creating missing
segments (the first holding a Gap for the records lost with them), renaming a
segment found under another number's name back to its own (through a free
number, so a swap never needs a name that is not a segment's), moving a file
that repeats a segment aside as a ``.damaged`` copy, and cutting a torn tail.
Leaves to others: finding the damage (``segments.JournalScan``), the policy and
the report (``recovery.py``).

Every change goes through the file layer (``fileio``), so the crash-state tests
see each write, fsync, rename and unlink: the copy is durable before the rewrite,
a rewrite is a temporary file renamed over the segment, and the directory is
fsynced after each step. A crash between two steps leaves a journal the next
recovery reads to the same records.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec

from aotx.engine.fileio import FileIO, write_file
from aotx.engine.journal.damage import Damage
from aotx.engine.journal.records import (
    HEADER_BYTES, FrameError, Gap, decode_segment_header, encode_frame, encode_segment_header, fit_frame,
)
from aotx.engine.journal.segment_files import (
    DAMAGED_SUFFIX, TMP_SUFFIX, list_segments, read_segment, segment_name,
)
from aotx.engine.journal.segments import JournalScan


def _copy_name(path: Path, data: bytes) -> tuple[Path, bool]:
    """Where the byte-exact copy of ``path`` goes, and whether an identical copy is
    already there (a salvage that crashed before its rewrite leaves one)."""
    for p in sorted(path.parent.glob(path.name + ".*" + DAMAGED_SUFFIX)):
        try:
            if p.stat().st_size == len(data) and p.read_bytes() == data:
                return p, True
        except OSError:
            continue
    stamp = int(time.time())
    dest = path.with_name(f"{path.name}.{stamp}{DAMAGED_SUFFIX}")
    k = 1
    while dest.exists():
        dest = path.with_name(f"{path.name}.{stamp}-{k}{DAMAGED_SUFFIX}")
        k += 1
    return dest, False


def salvage(d: Path, scan: JournalScan, fs: FileIO) -> list[tuple[Damage, str]]:
    """Repair what ``scan`` found. Names first: when files repeat a segment or hold one
    under another number's name, this pass only moves the repeats aside and renames
    the segments back (the next scan then reads names and numbers that agree).
    Otherwise: rewrite every damaged segment with ``Gap`` records in place of its bad
    bytes (after a fsynced byte-exact copy) and create missing segments. Returns each
    damage with the name of the copy kept ("" when there was nothing to copy)."""
    names = [dm for dm in scan.damage if dm.kind in ("duplicate", "misplaced")]
    if names:
        return _fix_names(d, names, fs)
    out: list[tuple[Damage, str]] = []
    infos = {s.number: s for s in scan.segments}
    by_segment: dict[int, list[Damage]] = {}
    for dm in scan.damage:
        if dm.missing:
            _create_missing(d, dm, fs)
            out.append((dm, ""))
        else:
            by_segment.setdefault(dm.segment, []).append(dm)
    for number, damages in by_segment.items():
        info = infos[number]
        path = Path(info.path)
        data = read_segment(path)
        copy, exists = _copy_name(path, data)
        if not exists:
            write_file(fs, copy, [data], exclusive=True)
            fs.fsync_dir(d)
        tmp = path.with_name(path.name + TMP_SUFFIX)
        write_file(fs, tmp, _rebuild(data, damages, copy.name))
        fs.replace(tmp, path)
        fs.fsync_dir(d)
        out += [(dm, copy.name) for dm in damages]
    return out


def _fix_names(d: Path, damages: list[Damage], fs: FileIO) -> list[tuple[Damage, str]]:
    """Move every repeat of a segment aside (renamed to a ``.damaged`` name: the file
    itself is the byte-exact copy), then rename each misplaced segment to its own
    name; a cycle (two segments swapped) goes through a free segment number, so every
    state a crash can leave between two renames is a set of whole segments."""
    out: list[tuple[Damage, str]] = []
    stamp = int(time.time())
    for dm in damages:
        if dm.kind == "duplicate":
            src = Path(dm.path)
            dest = src.with_name(f"{src.name}.{stamp}{DAMAGED_SUFFIX}")
            k = 1
            while os.path.lexists(dest):
                dest = src.with_name(f"{src.name}.{stamp}-{k}{DAMAGED_SUFFIX}")
                k += 1
            fs.replace(src, dest)
            fs.fsync_dir(d)
            out.append((dm, dest.name))
    todo = [(Path(dm.path), d / segment_name(dm.segment), dm) for dm in damages if dm.kind == "misplaced"]
    while todo:
        progressed = False
        for item in list(todo):
            src, dst, dm = item
            if not os.path.lexists(dst):
                fs.replace(src, dst)
                fs.fsync_dir(d)
                todo.remove(item)
                out.append((dm, ""))
                progressed = True
        if todo and not progressed:  # every target is held: free one held by another of them
            srcs = {src for src, _, _ in todo}
            cycle = [i for i, (_, dst, _) in enumerate(todo) if dst in srcs]
            if not cycle:  # held by files outside the renames: leave these to be read where they are
                break
            src, dst, dm = todo[cycle[0]]
            blocker = next(i for i, (s, _, _) in enumerate(todo) if s == dst)
            free = d / segment_name(max(n for n, _ in list_segments(d)) + 1)
            fs.replace(dst, free)
            fs.fsync_dir(d)
            todo[blocker] = (free, todo[blocker][1], todo[blocker][2])
    return out


def copy_name(segment: int, created_at: int) -> str:
    """The usual name of the byte-exact copy of ``segment`` made at ``created_at``
    (a Gap record leaves its ``copy`` field empty when the copy is named so)."""
    return f"{segment_name(segment)}.{int(created_at)}{DAMAGED_SUFFIX}"


def _gap(dm: Damage, copy: str) -> Gap:
    now = int(time.time())
    if copy:
        try:  # the copy's name holds its time: keep the two equal so the name can be derived
            now = int(copy[len(segment_name(dm.segment)) + 1:-len(DAMAGED_SUFFIX)])
        except ValueError:
            pass
    return Gap(last_seq=dm.last_lost, segment=dm.segment, offset=dm.offset, nbytes=dm.end - dm.offset,
               copy="" if copy == copy_name(dm.segment, now) else copy,
               reason=dm.message[:200], created_at=now,
               affected=[{k: v for k, v in f.items() if k in ("conv_id", "msg_id", "type")} for f in dm.found],
               opens_checkpoint=dm.opens_checkpoint)


def _gap_frame(dm: Damage, copy: str) -> bytes:
    """The Gap frame for ``dm``: exactly the size of the bad bytes when some form of it
    fits (dropping detail until it does: what it affected, the reason, where the bad
    bytes were, the time that names the copy), so that every later record keeps its offset and every receipt stays
    exact; else the full record (later offsets in the segment move)."""
    gap = _gap(dm, copy)
    size = dm.end - dm.offset
    for drop in ((), ("affected",), ("affected", "reason"), ("affected", "reason", "offset", "nbytes"),
                 ("affected", "reason", "offset", "nbytes", "created_at", "copy"),
                 ("affected", "reason", "offset", "nbytes", "created_at", "copy", "segment")):
        g = msgspec.structs.replace(gap, **{k: type(getattr(gap, k))() for k in drop})
        f = fit_frame(g, dm.tick, dm.first_lost, size)
        if f is not None:
            return f
    return encode_frame(gap, dm.tick, dm.first_lost)


def _rebuild(data: bytes, damages: list[Damage], copy: str) -> list[bytes]:
    """The segment's new bytes: its header (rebuilt when damaged), its valid bytes,
    and a Gap frame wherever records were lost (sized to the bad bytes when it fits)."""
    header = data[:HEADER_BYTES]
    try:
        h = decode_segment_header(header)
        number, base, flags = h.number, h.base_seq, h.flags
    except FrameError:  # a damaged header is rebuilt below
        number, base, flags = 0, 1, 0
    pieces: list[bytes] = []
    cursor = HEADER_BYTES
    rebuilt = False
    for dm in sorted(damages, key=lambda x: (x.offset, not x.header, not x.prefix)):
        number = dm.segment
        if dm.header:
            base, flags, rebuilt = dm.base_seq, dm.flags, True
            continue
        if dm.prefix:
            base, rebuilt = dm.first_lost, True
        pieces.append(data[cursor:dm.offset])
        if dm.n_lost:
            pieces.append(_gap_frame(dm, copy))
        cursor = max(cursor, dm.end)
    pieces.append(data[cursor:])
    head = encode_segment_header(number, base, flags) if rebuilt else header
    return [head] + [p for p in pieces if p]


def _create_missing(d: Path, dm: Damage, fs: FileIO) -> None:
    """Segment files ``dm.segment .. dm.through`` are gone: create them, the first
    holding a Gap for the records lost with them, the rest empty."""
    for n in range(dm.segment, max(dm.through, dm.segment) + 1):
        if n == dm.segment:
            chunks = [encode_segment_header(n, dm.first_lost)]
            if dm.n_lost:
                chunks.append(encode_frame(_gap(dm, ""), dm.tick, dm.first_lost))
        else:
            chunks = [encode_segment_header(n, dm.last_lost + 1)]
        write_file(fs, d / segment_name(n), chunks, exclusive=True)
    fs.fsync_dir(d)


def cut(d: Path, seg, offset: int, fs: FileIO) -> int:
    """Truncate ``seg`` at ``offset`` (unlink it when its header is bad); fsync."""
    path = Path(seg.path)
    size = path.stat().st_size
    if offset == 0:
        fs.unlink(path)
        return size
    fd = fs.open(path, os.O_WRONLY)
    try:
        fs.ftruncate(fd, offset)
        fs.fsync(fd)
    finally:
        fs.close(fd)
    return size - offset

