#!/usr/bin/env python3
"""Two AOTX trees back to back through the same engine-path harness: an older commit
(e.g. main before issue 16 landed: the small/large split, BLAS prefill) against this
checkout (the batch-invariant CPU kernels), on one model, in alternating runs.

The old tree is ``git archive``d into a temporary directory (the repository is not
changed) and imported instead of this checkout through PYTHONPATH (the editable
install's finder comes after the path); THIS checkout's ``engine/cli/bench.py`` is copied
into it, so both trees are measured by the same code (``bench_engine_path``: prefill and
decode as ``aotx run --json`` reports them, from an engine built as ``aotx serve``
builds it, and the model alone). Each tree first runs once small to fill its numba
cache (compiling is not measured). Prints one table of medians and new/old ratios, and
the JSON of every run with ``--json``. The machine's load distorts both alike only
roughly: compare the CPU ms per token columns too, and run on a quiet machine::

    .venv/bin/python tests/tools/bench_ab.py --old 35efe8c [--model PATH] [--quick] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RUN = """
import json, sys
from aotx.engine.cli.bench_path import bench_engine_path
sizes = tuple(int(s) for s in sys.argv[2].split(","))
r = bench_engine_path(sys.argv[1] or None, "cpu", sizes, int(sys.argv[3]), int(sys.argv[4]))
import aotx
r["tree"] = aotx.__file__
print(json.dumps(r, default=str))
"""


def _extract(commit: str, dest: Path) -> Path:
    """The tree of ``commit`` as an importable ``aotx`` package under ``dest``."""
    pkg = dest / "aotx"
    pkg.mkdir(parents=True)
    tar = dest / "tree.tar"
    with open(tar, "wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", commit], stdout=f, check=True)
    with tarfile.open(tar) as t:
        t.extractall(pkg)
    tar.unlink()
    for rel in ("engine/cli/bench.py", "engine/cli/bench_path.py"):    # this checkout's harness in both
        (pkg / rel).write_bytes((ROOT / rel).read_bytes())
    return dest


def _run(path_root: Path | None, model: str, sizes, dec: int, repeats: int) -> dict:
    env = dict(os.environ)
    if path_root is not None:
        env["PYTHONPATH"] = str(path_root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    res = subprocess.run([sys.executable, "-c", RUN, model or "", ",".join(map(str, sizes)), str(dec), str(repeats)],
                         capture_output=True, text=True, env=env, timeout=3600)
    if res.returncode != 0:
        raise SystemExit(f"bench_ab: a run failed ({'old' if path_root else 'new'} tree):\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _rows(r: dict) -> dict[str, tuple[float, float]]:
    """measure -> (tokens/s, CPU ms per token) of one run."""
    out = {}
    for n, p in r["prefill"].items():
        out[f"engine prefill {n}"] = (p["prompt_tokens_per_s"], p["cpu_ms_per_token"])
    for mode, d in r["decode"].items():
        out[f"engine decode spec {mode}"] = (d["decode_tokens_per_s"], d["cpu_ms_per_token"])
    mo = r["model_alone"]
    for n, v in mo["prefill_tok_s"].items():
        out[f"model alone prefill {n}"] = (v, float("nan"))
    out["model alone decode"] = (mo["decode_tok_s"], float("nan"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the older commit (e.g. 35efe8c: main just before issue 16 landed)")
    ap.add_argument("--model", default="", help="GGUF path (default: the default model)")
    ap.add_argument("--quick", action="store_true", help="sizes 128,512, 32 decode tokens, 1 repeat")
    ap.add_argument("--rounds", type=int, default=2, help="old/new alternations (default 2)")
    ap.add_argument("--json", action="store_true", help="also print every run's JSON")
    a = ap.parse_args()
    sizes = (128, 512) if a.quick else (128, 512, 1024)
    dec, repeats = (32, 1) if a.quick else (128, 3)
    with tempfile.TemporaryDirectory(prefix="aotx-ab-") as tmp:
        old_root = _extract(a.old, Path(tmp))
        for root in (old_root, None):                   # fill each tree's numba cache, not measured
            _run(root, a.model, (16,), 4, 1)
        runs: dict[str, list[dict]] = {"old": [], "new": []}
        for _ in range(a.rounds):
            runs["old"].append(_run(old_root, a.model, sizes, dec, repeats))
            runs["new"].append(_run(None, a.model, sizes, dec, repeats))
    if a.json:
        print(json.dumps(runs, default=str))
    med = {k: {} for k in runs}
    for k, rs in runs.items():
        rows = [_rows(r) for r in rs]
        for name in rows[0]:
            med[k][name] = (statistics.median(x[name][0] for x in rows), statistics.median(x[name][1] for x in rows))
    print(f"old {a.old} ({runs['old'][0]['config'].get('numerics') or 'split path'}) vs new "
          f"({runs['new'][0]['config'].get('numerics')}), {a.rounds} rounds, medians; load distorts both")
    print(f"{'measure':<28} {'old tok/s':>10} {'new tok/s':>10} {'new/old':>8} {'old cpu ms/t':>13} {'new cpu ms/t':>13}")
    for name, (nv, nc) in med["new"].items():
        ov, oc = med["old"].get(name, (float("nan"), float("nan")))
        ratio = f"{nv / ov:.2f}x" if ov else "-"
        print(f"{name:<28} {ov:>10.1f} {nv:>10.1f} {ratio:>8} {oc:>13.3f} {nc:>13.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
