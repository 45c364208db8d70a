"""Teacher-forced comparison of a forward pass with llama.cpp's reference logits: the
acceptance rule for a real architecture, in one function.

``compare(forward, ref)`` feeds every reference token sequence through ``forward`` at once
(teacher-forced: the reference tokens, not the model's own choices), and at each compared
position checks two things against llama.cpp's numbers:

* wherever the reference gap between its top-two logits is at least ``gap_strict`` (0.5),
  the argmax of ``forward``'s logits must be the reference top-1;
* the mean absolute difference between ``forward``'s logits and the reference ones, over the
  reference top-``k`` ids (5) of every compared position, must be at most ``mad_max`` (0.5).

``ref`` is a loaded reference file or its path, in either of the two forms made by
``tests/tools/make_refs.py``:

* a tiny file's (``tests/data/refs/tiny/<name>.json``): ``prompts[i].token_ids`` and, for
  every position, ``top`` ([[id, logit] x 10]) and ``gap``; every position is compared;
* a real file's chat references (``tests/data/refs/<model>/chat_refs.json``, the format of
  ``smollm2/chat_refs.json``): ``results[i].prompt_token_ids + completion_token_ids``,
  ``greedy_step_top5`` and ``greedy_step_top1_minus_top2_logit``; the positions from the last
  prompt token on (the ones that predict each completion token) are compared.

``forward(ids)`` takes ``(n,) int32`` token ids (position 0 first, a fresh context) and
returns ``(n, vocab) float32`` logits for every position. ``model_forward(loaded_model)``
makes one from a ``LoadedModel`` (the runtime's ``forward`` with one all-logits segment).

``compare`` returns a ``Report`` (numbers per case and overall, ``ok``) and raises nothing;
``report.check()`` raises AssertionError naming every failure. It never runs llama.cpp.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

GAP_STRICT = 0.5
MAD_MAX = 0.5

Forward = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Case:
    """One teacher-forced sequence: ``ids``; compared rows ``first_row ...`` with, for
    each, the reference top-k ``top`` ([(id, logit)], best first) and top-two ``gap``."""

    name: str
    ids: tuple[int, ...]
    first_row: int
    top: tuple[tuple[tuple[int, float], ...], ...]
    gap: tuple[float, ...]


@dataclass
class CaseResult:
    name: str
    n_rows: int                 # positions compared
    n_strict: int               # of them, where the reference gap >= gap_strict
    mismatches: list[dict[str, Any]] = field(default_factory=list)  # strict rows whose argmax differs
    mad: float = 0.0            # mean |ours - ref| over the reference top-k of every row
    max_abs: float = 0.0        # largest |ours - ref| on those ids
    argmax_agree: float = 0.0   # fraction of all compared rows whose argmax is the reference top-1


@dataclass
class Report:
    cases: list[CaseResult]
    mad: float                  # over every compared (row, id) pair of every case
    gap_strict: float
    mad_max: float

    @property
    def ok(self) -> bool:
        return self.mad <= self.mad_max and not any(c.mismatches for c in self.cases)

    def summary(self) -> str:
        lines = [f"mean |logit diff| on the reference top-k: {self.mad:.4f} (max {self.mad_max})"]
        for c in self.cases:
            lines.append(f"  {c.name}: {c.n_rows} rows, mad {c.mad:.4f}, max {c.max_abs:.3f}, argmax agrees "
                         f"{c.argmax_agree:.0%}, {len(c.mismatches)}/{c.n_strict} strict-row mismatches")
        return "\n".join(lines)

    def check(self) -> None:
        """Raise AssertionError naming every failure (strict-row argmax mismatches, and the
        mean absolute difference if above the bound)."""
        problems = []
        for c in self.cases:
            for m in c.mismatches[:5]:
                problems.append(f"{c.name} row {m['row']}: argmax {m['ours']} but llama.cpp's top-1 is {m['ref']} "
                                f"(reference gap {m['gap']:.3f}; our logit for it {m['ours_logit_of_ref']:.3f})")
            if len(c.mismatches) > 5:
                problems.append(f"{c.name}: {len(c.mismatches) - 5} more mismatching rows")
        if self.mad > self.mad_max:
            problems.append(f"mean |logit diff| on the reference top-k = {self.mad:.4f} > {self.mad_max}")
        if problems:
            raise AssertionError("teacher-forced comparison with llama.cpp failed:\n" + "\n".join(problems)
                                 + "\n" + self.summary())


def load(ref: dict | str | Path) -> dict:
    if isinstance(ref, dict):
        return ref
    return json.loads(Path(ref).read_text(encoding="utf-8"))


def cases(ref: dict | str | Path, k: int = 5) -> list[Case]:
    """The teacher-forced cases of a reference file (either form), top-k per row."""
    ref = load(ref)
    out = []
    if "prompts" in ref:
        for p in ref["prompts"]:
            top = tuple(tuple((int(i), float(v)) for i, v in row[:k]) for row in p["top"])
            out.append(Case(p["name"], tuple(p["token_ids"]), int(p.get("first_row", 0)), top,
                            tuple(float(g) for g in p["gap"])))
    elif "results" in ref:
        for r in ref["results"]:
            prompt, completion = r["prompt_token_ids"], r["completion_token_ids"]
            steps = min(len(completion), len(r["greedy_step_top5"]))
            # the row that predicts completion[i] is len(prompt) - 1 + i: feed prompt + completion[:steps - 1]
            ids = tuple(prompt) + tuple(completion[:max(steps - 1, 0)])
            top = tuple(tuple((int(i), float(v)) for i, v in row[:k]) for row in r["greedy_step_top5"][:steps])
            gap = tuple(float(g) for g in r["greedy_step_top1_minus_top2_logit"][:steps])
            out.append(Case(r["name"], ids, len(prompt) - 1, top, gap))
    else:
        raise ValueError("not a reference file: no 'prompts' and no 'results'")
    return out


def compare(forward: Forward, ref: dict | str | Path, *, names: Iterable[str] | None = None,
            gap_strict: float = GAP_STRICT, mad_max: float = MAD_MAX, k: int = 5) -> Report:
    """Run ``forward`` on every case of ``ref`` (or those in ``names``) and compare; see
    the module docstring. Returns the numbers; ``Report.check()`` asserts."""
    wanted = set(names) if names is not None else None
    results = []
    all_diffs: list[float] = []
    for case in cases(ref, k):
        if wanted is not None and case.name not in wanted:
            continue
        logits = np.asarray(forward(np.asarray(case.ids, np.int32)), np.float64)
        n = len(case.top)
        if logits.shape[0] < case.first_row + n:
            raise ValueError(f"{case.name}: forward gave {logits.shape[0]} rows for {len(case.ids)} tokens")
        rows = logits[case.first_row:case.first_row + n]
        res = CaseResult(case.name, n, 0)
        diffs = []
        agree = 0
        for r, (row, top, gap) in enumerate(zip(rows, case.top, case.gap)):
            ours = int(np.argmax(row))
            ref_top1 = top[0][0]
            agree += ours == ref_top1
            diffs.extend(abs(float(row[i]) - v) for i, v in top)
            if gap >= gap_strict:
                res.n_strict += 1
                if ours != ref_top1:
                    res.mismatches.append({"row": case.first_row + r, "ours": ours, "ref": ref_top1, "gap": gap,
                                           "ours_logit_of_ref": float(row[ref_top1])})
        res.mad = float(np.mean(diffs)) if diffs else 0.0
        res.max_abs = float(np.max(diffs)) if diffs else 0.0
        res.argmax_agree = agree / n if n else 1.0
        all_diffs.extend(diffs)
        results.append(res)
    if not results:
        raise ValueError("no reference case compared")
    return Report(results, float(np.mean(all_diffs)), gap_strict, mad_max)


def model_forward(loaded_model: Any) -> Forward:
    """A ``forward(ids) -> (n, vocab)`` over a ``LoadedModel`` (``loader.load_model``):
    a fresh one-slot KV cache per call, the whole sequence as one all-logits segment."""
    from aotx.engine.model.batch import Segment

    model = loaded_model.model if hasattr(loaded_model, "model") else loaded_model

    def forward(ids: np.ndarray) -> np.ndarray:
        kv = model.new_kv_cache(1, len(ids) + 1)
        return model.forward(np.asarray(ids, np.int32), [Segment(0, 0, len(ids), all_logits=True)], kv)

    return forward
