"""Kernel choice: the measured winner per kernel site on this device, kept in an artifact.

Owns (DESIGN.md, "Kernel choice"): the artifact file, one per GPU model under
``<data dir>/kernel_choice/``; its key (GPU name, driver, CUDA runtime, CuPy version,
kernel source hash); reading it, where a missing, stale or corrupt file is a status with
a reason, never an exception; timing the candidates of the sites a program needs through
the closures the backend gives (``Site.measure``), after checking each candidate's output
(``Site.check``); recording the winners (atomic write: temporary file, fsync, rename,
fsync of the folder); and the one line the startup profile shows (``Resolution.summary``).

Leaves to the backend what the sites and candidates are, how one candidate is run and
timed (CUDA events around a captured graph), and what "the same output" means (bit for
bit for the decode GEMV variants, which batch invariance requires; a tolerance against
float32 for the prefill GEMMs).

Pure Python, no CuPy: tests drive it on the CPU with fake timers.

Policies (``resolve(policy=...)``):
* ``"off"``: no artifact is read or written; every site runs its default.
* ``"reuse"``: a valid artifact's winners are used; anything else runs the default, and
  the summary says why (no timing: what tests and tools get).
* ``"auto"``: like reuse, but sites without a valid recorded winner (first load on this
  device, a stale or corrupt artifact, a model with new shapes) are timed now, within
  ``budget_s``, and the artifact is written (what the engine does at load).
* ``"force"``: every site is timed again (``aotx tune``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = "aotx-kernel-choice"
VERSION = 1
POLICIES = ("off", "reuse", "auto", "force")
DEFAULT_BUDGET_S = 30.0   # most seconds a load spends timing candidates (sites after that run their default)
ROUNDS = 3                # each candidate is measured this many times, interleaved; the median counts
KEEP_DEFAULT = 1.02       # the default stays unless a candidate is more than 2% faster (fewer flips between runs)


def source_hash(*parts: str) -> str:
    """sha256 (hex, 16 chars) of the kernel sources and options: part of the artifact key,
    so a changed kernel makes the artifact stale."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class DeviceKey:
    """What an artifact was measured on. Two keys that differ in any field make the
    artifact stale."""

    gpu: str
    driver: str
    cuda: str
    cupy: str
    source: str

    def as_dict(self) -> dict[str, str]:
        return {"gpu": self.gpu, "driver": self.driver, "cuda": self.cuda, "cupy": self.cupy, "source": self.source}

    def differences(self, other: dict) -> list[str]:
        """``"field: theirs -> ours"`` for each field that differs from ``other`` (a dict)."""
        return [f"{k}: {other.get(k)!r} -> {v!r}" for k, v in self.as_dict().items() if other.get(k) != v]


def artifact_path(root: Path, gpu: str) -> Path:
    """``root/kernel_choice/<gpu name as a file name>.json``."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", gpu).strip("-") or "gpu"
    return Path(root) / "kernel_choice" / f"{slug}.json"


@dataclass
class Site:
    """One choice a program needs: ``key`` names the kernel job (say
    ``"gemv/add/Q4_KxQ4_K/m4096/k4096/plain@b16"``: what, tensor types, shape, batch
    bucket); ``candidates`` in preference order; ``default`` (one of them) runs when
    nothing better is known. ``check(c)`` returns None when candidate c computes what the
    default computes, else why not; ``measure(c)`` returns seconds per call. Either may
    raise: the candidate is then rejected with the error as the reason. ``weight`` orders
    the sites for the timing budget (bytes of weights, say: the largest first)."""

    key: str
    candidates: tuple[str, ...]
    default: str
    measure: Callable[[str], float] | None = None
    check: Callable[[str], str | None] | None = None
    weight: float = 1.0

    def __post_init__(self) -> None:
        self.candidates = tuple(self.candidates)
        if self.default not in self.candidates:
            raise ValueError(f"site {self.key}: default {self.default!r} is not a candidate")


@dataclass
class Resolution:
    """What ``resolve`` decided. ``choice``: site key -> candidate; ``source``: site key ->
    "artifact" | "tuned" | "default"; ``status`` of the artifact as read: "ok", "missing",
    "stale", "corrupt" or "off"; ``reason``: why it was not usable ("" when ok);
    ``notes``: per-site remarks (rejected candidates, recorded winners no longer offered);
    ``seconds`` spent timing; ``path`` of the artifact; ``written``: whether it was written
    now, or the error that stopped it."""

    choice: dict[str, str] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)
    status: str = "off"
    reason: str = ""
    notes: dict[str, str] = field(default_factory=dict)
    timings_us: dict[str, dict[str, float]] = field(default_factory=dict)
    seconds: float = 0.0
    path: Path | None = None
    written: bool | str = False
    policy: str = "off"
    prepare_s: float = 0.0      # compiling the candidates before the timing (not part of ``seconds``)

    def count(self, source: str) -> int:
        return sum(1 for s in self.source.values() if s == source)

    def summary(self) -> str:
        """One line for the startup profile: where the choices came from and, for every
        site that runs its default, why."""
        n = len(self.choice)
        parts = []
        if self.count("artifact"):
            parts.append(f"{self.count('artifact')} of {n} sites from the artifact")
        if self.count("tuned"):
            parts.append(f"{self.count('tuned')} timed now in {self.seconds:.1f} s"
                         + (f" after {self.prepare_s:.1f} s compiling the candidates" if self.prepare_s >= 0.05 else ""))
        if self.count("default"):
            parts.append(f"{self.count('default')} on the default kernel")
        line = "; ".join(parts) if parts else "no kernel sites"
        why = []
        if self.status != "ok":
            why.append(f"artifact {self.status}: {self.reason}" if self.status != "off" else self.reason)
        budget = sum(1 for k, v in self.notes.items() if v == "tuning budget spent" and self.source.get(k) == "default")
        if budget:
            why.append(f"{budget} sites not timed: tuning budget spent")
        if self.count("default") and self.policy == "reuse" and self.status != "ok":
            why.append("`aotx tune` times them")
        if isinstance(self.written, str):
            why.append(f"artifact not written: {self.written}")
        elif self.written and self.path is not None:
            why.append(f"written to {self.path}")
        return line + (f" ({'; '.join(why)})" if why else "")


# ---- the artifact ---------------------------------------------------------------------------

def read_artifact(path: Path, key: DeviceKey) -> tuple[str, str, dict[str, dict]]:
    """(status, reason, sites) of the artifact at ``path`` for ``key``: status "ok"
    (reason ""), "missing", "stale" (the reason lists the fields that changed) or
    "corrupt" (the reason names the defect). Never raises for a bad file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return "missing", f"no artifact at {path}", {}
    except (OSError, UnicodeDecodeError) as e:
        return "corrupt", f"{path}: cannot be read ({type(e).__name__}: {e})", {}
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        return "corrupt", f"{path}: not JSON (line {e.lineno} column {e.colno}: {e.msg})", {}
    err = _schema_error(doc)
    if err:
        return "corrupt", f"{path}: {err}", {}
    diff = key.differences(doc["key"])
    if diff:
        return "stale", f"measured with other {', '.join(diff)}", {}
    return "ok", "", doc["sites"]


def _schema_error(doc) -> str:
    if not isinstance(doc, dict):
        return f"the top level is a {type(doc).__name__}, not an object"
    if doc.get("format") != FORMAT:
        return f"format is {doc.get('format')!r}, expected {FORMAT!r}"
    if doc.get("version") != VERSION:
        return f"version is {doc.get('version')!r}, expected {VERSION}"
    k = doc.get("key")
    if not isinstance(k, dict) or not all(isinstance(k.get(f), str) for f in DeviceKey.__dataclass_fields__):
        return "'key' must hold the strings " + ", ".join(DeviceKey.__dataclass_fields__)
    sites = doc.get("sites")
    if not isinstance(sites, dict):
        return "'sites' must be an object"
    for name, e in sites.items():
        if not isinstance(e, dict) or not isinstance(e.get("winner"), str):
            return f"site {name!r} has no winner string"
        us = e.get("us", {})
        if not isinstance(us, dict) or not all(isinstance(v, (int, float)) for v in us.values()):
            return f"site {name!r}: 'us' must map candidates to numbers"
    return ""


def write_artifact(path: Path, key: DeviceKey, sites: dict[str, dict]) -> None:
    """Write the artifact atomically: a temporary file in the same folder, flushed and
    fsynced, renamed over ``path``, then the folder fsynced. Raises OSError."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": FORMAT, "version": VERSION, "key": key.as_dict(),
           "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "sites": dict(sorted(sites.items()))}
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


# ---- resolving the sites of a program ----------------------------------------------------------

def tune_site(site: Site, rounds: int = ROUNDS) -> tuple[str, dict[str, float], dict[str, str]]:
    """(winner, median microseconds per candidate, rejected candidate -> reason).

    Every candidate is checked first (the default too: a default that fails its own
    check leaves only the candidates that pass), then the passing ones are measured
    ``rounds`` times, interleaved. The winner is the fastest, except that the default
    stays unless another is more than ``KEEP_DEFAULT`` times faster. With no candidate
    left the winner is the default."""
    rejected: dict[str, str] = {}
    ok: list[str] = []
    for c in site.candidates:
        if site.check is not None:
            try:
                why = site.check(c)
            except Exception as e:  # noqa: BLE001 - a candidate that cannot run is rejected, never fatal
                why = f"{type(e).__name__}: {e}"
            if why:
                rejected[c] = str(why)
                continue
        ok.append(c)
    times: dict[str, list[float]] = {c: [] for c in ok}
    if site.measure is not None:
        for _ in range(max(1, rounds)):
            for c in list(times):
                try:
                    t = float(site.measure(c))
                except Exception as e:  # noqa: BLE001
                    rejected[c] = f"{type(e).__name__}: {e}"
                    del times[c]
                    continue
                if not t > 0 or t != t:
                    rejected[c] = f"measured {t!r} s"
                    del times[c]
                    continue
                times[c].append(t)
    us = {c: round(1e6 * statistics.median(v), 3) for c, v in times.items() if v}
    if not us:
        return site.default, us, rejected
    best = min(us, key=lambda c: (us[c], site.candidates.index(c)))
    if site.default in us and us[site.default] <= us[best] * KEEP_DEFAULT:
        best = site.default
    return best, us, rejected


def resolve(sites: Iterable[Site], key: DeviceKey, path: Path | None, policy: str = "reuse", *,
            budget_s: float = DEFAULT_BUDGET_S, clock: Callable[[], float] = time.monotonic,
            rounds: int = ROUNDS, prepare: Callable[[], object] | None = None) -> Resolution:
    """Choose a candidate for every site (see the module docstring for ``policy``).
    ``path`` None behaves as "off". Never raises for a bad or unwritable artifact: the
    defaults run and the Resolution says why. ``prepare`` (compiling the candidates, say)
    runs once before the timing budget's clock starts, only when sites will be timed;
    an error from it is left for the sites' checks to report."""
    if policy not in POLICIES:
        raise ValueError(f"kernel choice policy {policy!r} is not one of {', '.join(POLICIES)}")
    sites = list(sites)
    res = Resolution(path=path, policy=policy)
    if policy == "off" or path is None:
        res.status, res.reason = "off", "kernel choice off: default kernels"
        for s in sites:
            res.choice[s.key], res.source[s.key] = s.default, "default"
        return res
    status, reason, recorded = read_artifact(path, key)
    res.status, res.reason = status, reason
    keep: dict[str, dict] = dict(recorded) if status == "ok" else {}
    todo: list[Site] = []
    for s in sites:
        e = recorded.get(s.key) if policy != "force" else None
        if e is not None and e["winner"] in s.candidates:
            res.choice[s.key], res.source[s.key] = e["winner"], "artifact"
            res.timings_us[s.key] = dict(e.get("us", {}))      # as recorded (for reports)
            continue
        if e is not None:
            res.notes[s.key] = f"recorded winner {e['winner']!r} is no longer a candidate"
        todo.append(s)
    tuned: dict[str, dict] = {}
    if policy in ("auto", "force") and todo:
        if prepare is not None:
            t_prep = clock()
            try:
                prepare()
            except Exception:  # noqa: BLE001 - each candidate's check meets it again and rejects it
                pass
            res.prepare_s = round(clock() - t_prep, 3)
        t0 = clock()
        for s in sorted(todo, key=lambda s: -s.weight):
            if clock() - t0 > budget_s:
                res.notes.setdefault(s.key, "tuning budget spent")
                continue
            winner, us, rejected = tune_site(s, rounds)
            if rejected:
                res.notes[s.key] = "; ".join(f"{c} rejected: {why}" for c, why in rejected.items())
            if not us:          # nothing passed and ran: the default, nothing recorded (tried again next load)
                continue
            res.choice[s.key], res.source[s.key] = winner, "tuned"
            res.timings_us[s.key] = us
            entry = {"winner": winner, "us": us}
            if rejected:
                entry["rejected"] = rejected
            tuned[s.key] = entry
        res.seconds = round(clock() - t0, 3)
    for s in todo:
        if s.key not in res.choice:
            res.choice[s.key], res.source[s.key] = s.default, "default"
    if tuned:
        try:
            write_artifact(path, key, {**keep, **tuned})
            res.written = True
        except OSError as e:
            res.written = f"{type(e).__name__}: {e}"
    return res
