"""Which segment files form the journal, and in what order: by sequence numbers, not names.

Owns: reading every segment's header, ordering the segments by the sequence
number each starts at (its header's base, CRC-checked; where the header is
destroyed, its first valid record's seq, found by resynchronisation), telling
apart a file that holds a segment under another number's name (``misplaced``: a
rename, a swap) and a file that repeats a segment another file holds
(``duplicate``: a copy), and choosing where the live chain starts (the newest
segment whose checkpoint is complete). Leaves to others: walking the chain record
by record (``segments.JournalScan``), repairing names (``salvage.py``).

A file name is only a hint: a journal whose files were renamed, swapped or copied
reads in the order its own checksummed headers and records give. A segment whose
header is destroyed starts where its first valid record says; a second file
starting at the same seq as another is a copy of it; and its number is the one its
place in the chain leaves (its file name's when that fits between its neighbours),
so that a destroyed header on a renamed file never gives two segments one number.
Nothing here changes a file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from aotx.engine.journal.damage import Problem, SegmentInfo, find_frame
from aotx.engine.journal.records import (
    FORMAT_VERSION, HEADER_BYTES, Checkpoint, CheckpointEnd, FrameError, decode_frame, decode_segment_header,
)
from aotx.engine.journal.segment_files import list_segments, read_segment


@dataclass
class Duplicate:
    """``path`` repeats segment ``number`` (seq from ``base_seq``), which ``kept`` holds."""

    path: str
    file_number: int
    number: int
    base_seq: int
    kept: str
    identical: bool


@dataclass
class ChainPlan:
    """``segments``: the live chain in sequence order; ``superseded``: the file numbers
    of older segments a complete checkpoint made redundant; ``duplicates``: files that
    repeat a segment of the chain (left out of it); ``newer``: file numbers of
    segments of a newer format version (left alone; ``version_problem`` says so)."""

    segments: list[SegmentInfo] = field(default_factory=list)
    superseded: list[int] = field(default_factory=list)
    duplicates: list[Duplicate] = field(default_factory=list)
    newer: list[int] = field(default_factory=list)
    version_problem: Problem | None = None

    misplaced: set[str] = field(default_factory=set)  # paths of chain segments to rename to their number


def plan_chain(directory: str | os.PathLike) -> ChainPlan:
    """Read every segment's header and order the segments. Raises ``JournalError``
    when a segment file cannot be read or is not a regular file."""
    plan = ChainPlan()
    infos: list[SegmentInfo] = []
    for number, path in list_segments(directory):
        head = read_segment(path, HEADER_BYTES)
        info = SegmentInfo(number, str(path), os.stat(path).st_size, file_number=number)
        try:
            info.header = decode_segment_header(head)
            info.number, info.key = info.header.number, info.header.base_seq
        except FrameError as e:
            info.header_error = e
        infos.append(info)
    for i, info in enumerate(infos):  # a newer format version anywhere is refused
        h = info.header
        if h is not None and h.version > FORMAT_VERSION:
            plan.version_problem = Problem(
                info.number, 0, "version", f"segment {info.number} has format version {h.version}; this AOTX "
                f"reads versions up to {FORMAT_VERSION} (upgrade AOTX, or move {info.path} aside)")
            plan.newer = [x.file_number for x in infos[i:]]
            infos = infos[:i]
            break
    for info in infos:
        if info.header is None:
            _key_from_records(info)
    infos = _drop_duplicates(infos, plan)
    infos = _in_sequence_order(infos)
    _number_headerless(infos)
    start = _start(infos)
    plan.superseded = [x.file_number for x in infos[:start]]
    plan.segments = infos[start:]
    plan.misplaced = _misplaced(plan.segments, infos)
    return plan


def _misplaced(chain: list[SegmentInfo], infos: list[SegmentInfo]) -> set[str]:
    """Chain segments in a file named for another number whose own name is free, or
    held by another such segment (a swap): salvage can give each its own name."""
    wrong = {x.path for x in chain if x.file_number != x.number}
    holder = {x.file_number: x.path for x in infos}
    numbers = [x.number for x in chain if x.path in wrong]
    return {x.path for x in chain if x.path in wrong and numbers.count(x.number) == 1
            and holder.get(x.number, "") in ("", *wrong)}


def _key_from_records(info: SegmentInfo) -> None:
    """A segment whose header is destroyed starts where its first valid record says;
    it opens a checkpoint when that record is a Checkpoint right after the header."""
    data = read_segment(info.path)
    found = find_frame(data, HEADER_BYTES, HEADER_BYTES, 1, unbounded=True) if len(data) > HEADER_BYTES else None
    if found is not None:
        info.key = found[3]


def _valid_records(path: str) -> int:
    data = read_segment(path)
    off, n = HEADER_BYTES, 0
    while off < len(data):
        try:
            _, _, _, off = decode_frame(data, off)
        except FrameError:
            break
        n += 1
    return n


def _drop_duplicates(infos: list[SegmentInfo], plan: ChainPlan) -> list[SegmentInfo]:
    """Of files holding the same segment, keep the one with the most valid records (one
    with an intact header, then the one named for its number, then the longer, on a
    tie); the others are duplicates. Files with intact headers hold the same segment
    when the headers name the same number and base seq; a file whose header is
    destroyed holds the segment whose base seq its first valid record carries (records
    carry their seq), and takes that segment's number when it is the one kept."""
    groups: dict[tuple[int, int], list[SegmentInfo]] = {}
    for info in infos:
        if info.header is not None:
            groups.setdefault((info.number, info.key), []).append(info)
    by_key: dict[int, tuple[int, int]] = {}
    for number, key in groups:  # a header-only segment may share its base with the next: the later wins
        if key not in by_key or number > by_key[key][0]:
            by_key[key] = (number, key)
    headerless: dict[int, list[SegmentInfo]] = {}
    for info in infos:
        if info.header is None and info.key:
            if info.key in by_key:
                groups[by_key[info.key]].append(info)
            else:
                headerless.setdefault(info.key, []).append(info)
    dropped: set[str] = set()
    for (number, base), group in [*groups.items(), *(((0, k), g) for k, g in headerless.items())]:
        if len(group) < 2:
            continue
        ranked = sorted(group, key=lambda x: (_valid_records(x.path), x.header is not None,
                                              x.file_number == x.number, x.size), reverse=True)
        kept = ranked[0]
        if number and kept.header is None:
            kept.number = number
        kept_data = read_segment(kept.path)
        for dup in ranked[1:]:
            data = read_segment(dup.path)
            plan.duplicates.append(Duplicate(dup.path, dup.file_number, number or kept.number, base, kept.path,
                                             identical=kept_data[HEADER_BYTES:].startswith(data[HEADER_BYTES:])))
            dropped.add(dup.path)
    return [x for x in infos if x.path not in dropped]


def _number_headerless(infos: list[SegmentInfo]) -> None:
    """Give the segments whose headers are destroyed the numbers their places leave. A
    run of them between two segments with intact headers (numbers ``p`` and ``q``) keeps
    the numbers in their file names when those rise between ``p`` and ``q``; else they
    take the numbers just before ``q`` (just after ``p`` at the end of the chain). A
    file renamed as well as damaged is then misplaced, and renamed back, like any other."""
    used = {x.number for x in infos if x.header is not None or x.number != x.file_number}
    i = 0
    while i < len(infos):
        if infos[i].header is not None or infos[i].number != infos[i].file_number:
            i += 1
            continue
        j = i
        while j < len(infos) and infos[j].header is None and infos[j].number == infos[j].file_number:
            j += 1
        run = infos[i:j]
        p = infos[i - 1].number if i else 0
        q = next((y.number for y in infos[j:] if y.header is not None), None)
        names = [x.file_number for x in run]
        if all(a < b for a, b in zip([p, *names], names)) and (q is None or names[-1] < q) and not used & set(names):
            numbers = names
        elif q is None:
            numbers = list(range(p + 1, p + 1 + len(run)))
        elif q - len(run) > p:
            numbers = list(range(q - len(run), q))
        else:  # no room between its neighbours: nothing better than its names
            numbers = names
        for x, n in zip(run, numbers):
            x.number = n
        used |= set(numbers)
        i = j


def _in_sequence_order(infos: list[SegmentInfo]) -> list[SegmentInfo]:
    """Segments by the seq they start at (then by number); one whose start is unknown
    (header and every record destroyed) goes where its file name puts it among the
    segments whose headers are intact (the others' names may be wrong too), or last
    when its name is the number of another segment."""
    known = sorted((x for x in infos if x.key), key=lambda x: (x.key, x.number, x.file_number))
    claimed = {y.number for y in known if y.header is not None}
    for x in sorted((x for x in infos if not x.key), key=lambda x: x.file_number):
        at = len(known)  # its name is another segment's number: nothing says where it was; last
        for i, y in enumerate(known):
            if x.file_number not in claimed and y.header is not None and y.number > x.file_number:
                at = i
                break
        known.insert(at, x)
    return known


def _start(infos: list[SegmentInfo]) -> int:
    """Index of the chain's first segment: the newest checkpoint segment whose
    checkpoint is complete; else the first segment when it begins the history
    (seq 1); else the newest checkpoint segment (damaged: salvage reads it)."""
    cps = [i for i, x in enumerate(infos) if x.header is not None and x.header.checkpoint]
    for i in reversed(cps):
        if checkpoint_complete(infos[i].path):
            return i
    if infos and infos[0].header is not None and infos[0].header.base_seq == 1 and not infos[0].header.checkpoint:
        return 0
    return cps[-1] if cps else 0


def checkpoint_complete(path: str | Path) -> bool:
    """Whether the segment at ``path`` opens with a Checkpoint whose streamed parts
    end (``CheckpointEnd``) within it (an inline, format-1 checkpoint is complete)."""
    data = read_segment(path)
    try:
        record, _, seq, off = decode_frame(data, HEADER_BYTES)
    except FrameError:
        return False
    if not isinstance(record, Checkpoint):
        return False
    if not record.streamed:
        return True
    while off < len(data):
        try:
            r, _, _, off = decode_frame(data, off)
        except FrameError:
            return False
        if isinstance(r, CheckpointEnd) and r.begin_seq == seq:
            return True
    return False
