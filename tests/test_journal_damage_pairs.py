"""Two damages at once: what a single-damage matrix does not reach.

``test_journal_damage_matrix.py`` damages one thing per case. A break-test that
damaged two or three things at once (2,000 random combinations over the same two
journals) found cases where recovery itself failed, so the engine could not start
and every conversation was out of reach:

* a segment whose header is destroyed took its number from its file name; when the
  file had been renamed or swapped as well, two segments of the chain had one
  number, and recovery stopped ("file exists" creating a segment it thought
  missing, or "salvage did not converge");
* with a copy of a segment beside them, the rename back to a name held by a file
  outside the renames looped for ever (a new free number at each turn);
* a checkpoint segment whose header and opening ``Checkpoint`` record were both
  destroyed was rebuilt as an ordinary segment, and the conversations its parts
  held were not reachable;
* before any recovery, ``aotx conversations list|show`` (which read the journal as
  it is on disk) did not show the conversations of a checkpoint whose opening
  record was damaged, though the engine's start salvaged them.

Each case runs recovery as the engine's start does and checks, as the matrix does,
that every record not destroyed is reachable, that what was destroyed is named,
and that a second start finds nothing to do. A bounded random run of pairs follows.
"""

from __future__ import annotations

import random
import signal
import time
from contextlib import contextmanager

import pytest

from aotx.engine.journal.reading import read_table
from aotx.engine.journal.records import HEADER_BYTES, Checkpoint
from aotx.engine.journal.segment_files import segment_name
from tests.test_journal_damage_matrix import Case, Written, assert_reachable, check_case, journals  # noqa: F401


@contextmanager
def time_limit(seconds: int):
    """Fail (instead of hanging the run) when the block takes longer than ``seconds``."""
    def over(*_):
        raise AssertionError(f"did not finish within {seconds} s")

    old = signal.signal(signal.SIGALRM, over)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def apply_ops(w: Written, ops: list[tuple]) -> tuple[dict[str, bytes], set[int]]:
    """The journal's files after ``ops``, and the seqs no file holds intact any more.

    Ops: ``("header", n)`` flips a bit of the header CRC of file n; ``("flip", n, off)``
    a bit at ``off``; ``("zero", n, a, b)``; ``("swap", n, m)``; ``("rename", n, m)``;
    ``("dup", n, m)`` copies file n to file m; ``("delete", n)``."""
    files: dict[str, tuple[int, bytearray]] = {
        k: (int(k[:10]) if k.endswith(".seg") else 0, bytearray(v)) for k, v in w.files.items()}
    for op, *a in ops:
        names = [segment_name(x) if isinstance(x, int) else x for x in a[:2]]
        if op == "header":
            files[names[0]][1][HEADER_BYTES - 1] ^= 0x10
        elif op == "flip":
            files[names[0]][1][a[1]] ^= 0x04
        elif op == "zero":
            files[names[0]][1][a[1]:a[2]] = bytes(a[2] - a[1])
        elif op == "swap":
            files[names[0]], files[names[1]] = files[names[1]], files[names[0]]
        elif op == "rename":
            files[names[1]] = files.pop(names[0])
        elif op == "dup":
            g, data = files[names[0]]
            files[names[1]] = (g, bytearray(data))
        elif op == "delete":
            del files[names[0]]
        else:
            raise ValueError(op)
    intact = set()
    for g, data in files.values():
        if g:
            orig = w.files[segment_name(g)]
            intact |= {s for s, (gg, o, e) in w.where.items() if gg == g and len(data) >= e and data[o:e] == orig[o:e]}
    return {k: bytes(v) for k, (_, v) in files.items()}, set(w.records) - intact


def _cp_record(w: Written) -> tuple[int, int, int]:
    """(segment, offset, end) of the checkpoint journal's opening Checkpoint record."""
    [where] = [w.where[s] for s, r in w.records.items() if isinstance(r, Checkpoint)]
    return where


PAIRS = {
    "a destroyed header on a segment swapped with the one before it":
        ("gap", [("header", 1), ("swap", 1, 2)]),
    "a destroyed header on a segment swapped with the one after it":
        ("gap", [("header", 2), ("swap", 2, 3)]),
    "a destroyed header on a segment renamed to a free number":
        ("gap", [("header", 2), ("rename", 2, 4)]),
    "a destroyed header on a copy of a segment, with two others swapped":
        ("gap", [("dup", 3, 4), ("swap", 2, 3), ("header", 2)]),
    "a destroyed header on a checkpoint segment swapped with a later one":
        ("checkpoint", [("swap", 2, 4), ("header", 4)]),
    "a destroyed header on a segment copied, the copy kept under a later number":
        ("checkpoint", [("dup", 3, 5), ("dup", 4, 6), ("header", 5)]),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_a_destroyed_header_on_a_renamed_swapped_or_copied_segment_still_lets_the_engine_start(
        journals, tmp_path, name):
    jname, ops = PAIRS[name]
    w = journals[jname]
    files, destroyed = apply_ops(w, ops)
    with time_limit(30):
        check_case(tmp_path / "j", w, Case(name, files, destroyed))


def test_a_checkpoint_segment_whose_header_and_opening_record_are_destroyed_keeps_its_conversations(
        journals, tmp_path):
    """Rebuilt as an ordinary segment, its parts were skipped: the conversations they
    held (and every record after them naming those conversations) were not reachable."""
    w = journals["checkpoint"]
    g, off, end = _cp_record(w)
    files, destroyed = apply_ops(w, [("header", g), ("flip", g, (off + end) // 2)])
    check_case(tmp_path / "j", w, Case("checkpoint header and record", files, destroyed))


@pytest.mark.parametrize("where", ["in the middle", "zeroed"])
def test_before_any_recovery_the_conversations_of_a_checkpoint_with_a_damaged_opening_show(
        journals, tmp_path, where):
    """``aotx conversations list|show`` with no engine running read the journal as it is
    on disk: they must show what the engine's start will salvage, not hide it."""
    w = journals["checkpoint"]
    g, off, end = _cp_record(w)
    ops = [("flip", g, (off + end) // 2)] if where == "in the middle" else [("zero", g, off, end)]
    files, destroyed = apply_ops(w, ops)
    d = tmp_path / "j"
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)
    table, problem = read_table(d)
    assert problem is not None
    assert_reachable(table, {s: r for s, r in w.records.items() if s not in destroyed})
    assert any(g_.first_seq in destroyed for g_ in table.gaps)  # and the loss is said


def random_ops(rng: random.Random, w: Written) -> list[tuple]:
    """Two or three damages: a destroyed header, a flipped bit, a zeroed range, a swap,
    a rename to a free number, a deleted segment."""
    ops: list[tuple] = []
    present = list(w.segments)
    size_of = {n: len(w.files[segment_name(n)]) for n in present}
    for _ in range(rng.randint(2, 3)):
        n = rng.choice(present)
        size = size_of[n]
        kind = rng.choice(["header", "flip", "zero", "swap", "rename", "delete"])
        if kind == "header":
            ops.append(("header", n))
        elif kind == "flip":
            ops.append(("flip", n, rng.randrange(HEADER_BYTES, size)))
        elif kind == "zero":
            a = rng.randrange(HEADER_BYTES, size)
            ops.append(("zero", n, a, min(size, a + rng.randint(1, 200))))
        elif kind == "swap" and len(present) > 1:
            ops.append(("swap", n, rng.choice([x for x in present if x != n])))
        elif kind == "rename":
            free = max(present) + 1
            ops.append(("rename", n, free))
            present[present.index(n)] = free
            size_of[free] = size
        elif kind == "delete" and len(present) > 2:
            ops.append(("delete", n))
            present.remove(n)
    return ops


def test_random_pairs_and_triples_of_damage_keep_every_surviving_record_reachable(journals, tmp_path, capsys):
    rng = random.Random(38)
    t0 = time.monotonic()
    n = 0
    for k in range(160):
        jname = rng.choice(sorted(journals))
        w = journals[jname]
        ops = random_ops(rng, w)
        try:  # an op naming a file an earlier op removed: skip the combination
            files, destroyed = apply_ops(w, ops)
        except KeyError:
            continue
        n += 1
        with time_limit(30):
            try:
                check_case(tmp_path / f"j{k}", w, Case(str(ops), files, destroyed))
            except AssertionError as e:
                raise AssertionError(f"{jname} journal, {ops}: {e}") from None
    with capsys.disabled():
        print(f"\n[damage pairs] {n} random combinations in {time.monotonic() - t0:.1f} s")
    assert n > 120


def test_a_segment_with_nothing_readable_under_the_name_of_another(journals, tmp_path):
    """The last segment cut inside its header and swapped with the checkpoint segment:
    the file with nothing readable took the number in its name, which the checkpoint
    segment's intact header also names; the chain's numbers went backwards and
    recovery stopped ("file exists" creating a segment it thought missing)."""
    w = journals["checkpoint"]
    first, last = segment_name(w.segments[0]), segment_name(w.segments[-1])
    files, _ = apply_ops(w, [("swap", first, last), ("flip", first, 0)])
    files[first] = files[first][:27]
    destroyed = {s for s, (g, _, _) in w.where.items() if g == w.segments[-1]}
    with time_limit(30):
        check_case(tmp_path / "j", w, Case("swap, cut, header", files, destroyed))


def test_two_swapped_segments_whose_headers_are_both_destroyed(journals, tmp_path):
    """Both files of a swap without their headers: each took a number from its wrong name
    in turn, the chain's numbers went backwards and recovery stopped."""
    w = journals["checkpoint"]
    a, b = w.segments[0], w.segments[1]
    files, destroyed = apply_ops(w, [("header", a), ("header", b), ("swap", a, b)])
    with time_limit(30):
        check_case(tmp_path / "j", w, Case("two headers, swapped", files, destroyed))


def test_a_swapped_segment_cut_inside_its_header_is_renamed_before_it_is_cut(journals, tmp_path):
    """Two segments swapped, then the one now first by name cut inside its header: the cut
    file went last and was a torn tail, so the scan stopped before naming it misplaced;
    the other file's rename back waited on its name for ever (salvage did not converge)."""
    w = journals["gap"]
    a, b = segment_name(w.segments[0]), segment_name(w.segments[1])
    files, _ = apply_ops(w, [("swap", a, b)])
    files[a] = files[a][:6]
    destroyed = {s for s, (g, _, _) in w.where.items() if g == w.segments[1]}
    with time_limit(30):
        check_case(tmp_path / "j", w, Case("swap, cut", files, destroyed))
