#!/usr/bin/env python3
"""Do the CPU's recurrent kernels (and SwiGLU) of this checkout give the bits of an older
revision's? A check for rewrites that must not change a number (issue 35's speed work).

    PYTHONPATH=<checkout>.path:<checkout> .venv/bin/python -m tests.tools.recurrent_bits \\
        --rev 6463e06 [--model PATH.gguf ...]

1. Kernels: ``git show REV:engine/backend/cpu/recurrent.py`` (and ``ops.py``) loaded as
   modules beside this checkout's; ``delta_rows`` (one row per call and many, both key-head
   layouts, S a multiple of 4 or not, softplus's linear branch), ``conv_rows`` /
   ``conv_rows_par`` (segments, state, silu or not, strided input) and ``silu_mul`` /
   ``silu_mul_par`` (strided and contiguous) on random inputs, compared bit for bit.
2. Models (``--model``): the revision's tree (``git archive``) and this checkout each run,
   in a subprocess, a 512-row prefill (the chunked delta rule), a 70-row prefill on a second
   slot (the recurrence), six decode steps of both slots together and a 3-row segment; every
   logits row is compared bit for bit.
Prints one line per check and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def _old_module(rev: str, rel: str, name: str, tmp: Path):
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{rel}"], check=True, capture_output=True,
                         text=True).stdout
    path = tmp / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def check_delta(old, new, rng) -> bool:
    ok = True
    for Hk, H, S, N in ((16, 16, 128, 24), (2, 4, 16, 30), (4, 8, 32, 25), (2, 4, 6, 10), (3, 6, 7, 9)):
        def l2(x, S=S):
            y = x.reshape(x.shape[0], -1, S)
            return (y / np.linalg.norm(y, axis=-1, keepdims=True)).reshape(x.shape).astype(np.float32)
        q, k = (l2(rng.standard_normal((N, Hk * S)).astype(np.float32)) for _ in range(2))
        v = (3 * rng.standard_normal((N, H * S))).astype(np.float32)
        al, be = ((2 * rng.standard_normal((N, H))).astype(np.float32) for _ in range(2))
        al[0, 0] = 30.0
        a = (-0.6 + 0.15 * rng.standard_normal(H)).astype(np.float32)
        dtb = (-1 + 0.5 * rng.standard_normal(H)).astype(np.float32)
        for kmap in (np.arange(H) % Hk, np.arange(H) // (H // Hk)):
            M0 = (0.3 * rng.standard_normal((H, S, S))).astype(np.float32)
            (M1, o1), (M2, o2) = [(M0.copy(), np.zeros((N, H * S), np.float32)) for _ in range(2)]
            for t in range(N):
                old.delta_rows(q, k, v, al, be, a, dtb, M1, t, t + 1, kmap, 0.088, o1)
                new.delta_rows(q, k, v, al, be, a, dtb, M2, t, t + 1, kmap, 0.088, o2)
            old.delta_rows(q, k, v, al, be, a, dtb, M1, 1, N, kmap, 0.07, o1)
            new.delta_rows(q, k, v, al, be, a, dtb, M2, 1, N, kmap, 0.07, o2)
            ok &= _same(o1, o2) and _same(M1, M2)
    print(f"delta_rows: {'same bits' if ok else 'DIFFERENT'}")
    return ok


def check_conv(old, new, rng) -> bool:
    ok = True
    def one(x):
        return np.array([x], np.int64)

    for N, C, K in ((512, 6144, 4), (23, 12, 4), (5, 33, 3), (2, 64, 4), (1, 6144, 4), (40, 128, 2)):
        x = (2 * rng.standard_normal((N, C))).astype(np.float32)
        w = rng.standard_normal((C, K)).astype(np.float32)
        st0 = rng.standard_normal((3, K - 1, C)).astype(np.float32)
        for xs in (x, np.asfortranarray(x)):
            for silu in (True, False):
                for a, b, slot in ((0, N, 1), (0, min(2, N), 2), (min(2, N), N, 2)):
                    if b <= a:
                        continue
                    runs = []
                    for f in (old.conv_rows, new.conv_rows, new.conv_rows_par):
                        st, o = st0.copy(), np.zeros((N, C), np.float32)
                        f(xs, w, st, one(slot), one(a), one(b - a), silu, o)
                        runs.append((st, o))
                    ok &= all(_same(runs[0][1], r[1]) and _same(runs[0][0], r[0]) for r in runs[1:])
    print(f"conv_rows, conv_rows_par: {'same bits' if ok else 'DIFFERENT'}")
    return ok


def check_glu(old, new, rng) -> bool:
    ok = True
    for n, f in ((512, 3584), (17, 100), (20, 7)):
        big = (4 * rng.standard_normal((n, 2 * f))).astype(np.float32)
        for g, u in ((big[:, :f], big[:, f:]), (np.ascontiguousarray(big[:, :f]), np.ascontiguousarray(big[:, f:]))):
            outs = [np.empty((n, f), np.float32) for _ in range(3)]
            for fn, o in zip((old.silu_mul, new.silu_mul, new.silu_mul_par), outs):
                fn(g, u, o)
            ok &= _same(outs[0], outs[1]) and _same(outs[0], outs[2])
    print(f"silu_mul, silu_mul_par: {'same bits' if ok else 'DIFFERENT'}")
    return ok


LOGITS = r'''
import sys, numpy as np
from aotx.engine.model.loader import load_model
from aotx.engine.model.batch import Segment
lm = load_model(sys.argv[1], device="cpu")
ids = np.random.default_rng(0).integers(0, 5000, 600).astype(np.int32)
kv = lm.model.new_kv_cache(2, 700)
res = [lm.model.forward(ids[:512], [Segment(0, 0, 512)], kv), lm.model.forward(ids[:70], [Segment(1, 0, 70)], kv)]
for i in range(6):
    res.append(lm.model.forward(ids[512 + i:513 + i].repeat(2), [Segment(0, 512 + i, 1), Segment(1, 70 + i, 1)], kv))
res.append(lm.model.forward(ids[520:523], [Segment(0, 518, 3)], kv))
np.savez(sys.argv[2], *res)
'''


def check_model(rev: str, model: str, tmp: Path) -> bool:
    tree = tmp / "tree"
    if not tree.is_dir():
        tree.mkdir()
        arch = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=arch, check=True)
        (tmp / "tree.path").mkdir()
        (tmp / "tree.path" / "aotx").symlink_to(tree)
    outs = []
    for label, root in (("old", tree), ("new", ROOT)):
        out = tmp / f"{label}-{Path(model).stem}.npz"
        env = dict(os.environ, PYTHONPATH=f"{root.parent / (root.name + '.path')}:{root}")
        subprocess.run([sys.executable, "-c", LOGITS, model, str(out)], check=True, env=env, cwd=str(tmp))
        outs.append(np.load(out))
    ok = all(_same(outs[0][k], outs[1][k]) for k in outs[0].files)
    print(f"{model}: {len(outs[0].files)} forwards' logits {'same bits' if ok else 'DIFFERENT'}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="the revision to compare with (e.g. the commit before a rewrite)")
    ap.add_argument("--model", action="append", default=[], help="a GGUF to compare whole forwards on")
    a = ap.parse_args()
    from aotx.engine.backend.cpu import ops as new_ops
    from aotx.engine.backend.cpu import recurrent as new_rec

    rng = np.random.default_rng(35)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        old_rec = _old_module(a.rev, "engine/backend/cpu/recurrent.py", "old_recurrent", tmp)
        old_ops = _old_module(a.rev, "engine/backend/cpu/ops.py", "old_ops", tmp)
        ok = check_delta(old_rec, new_rec, rng) & check_conv(old_rec, new_rec, rng) & check_glu(old_ops, new_ops, rng)
        for m in a.model:
            ok &= check_model(a.rev, m, tmp)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
