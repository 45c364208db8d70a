"""Compiling the CPU kernels without making an engine's first reply wait for all of them.

Owns: setting ``parallel.PARALLEL`` (whether the multi-threaded kernels run yet), the table of kernels
that have a single-threaded twin (``TWINS``: the same tiles or jobs in the same order,
so the same numbers bit for bit, DESIGN.md's batch invariance), loading the threaded
ones from numba's on-disk cache, and compiling the ones the cache lacks in a background
process (``python -m aotx.engine.backend.cpu.warmup FILE``, niced) while the engine
already answers on the twins. Leaves the kernels to ``qdot.py``, ``attention.py`` and
``matmul.py``, compiling a model's single-threaded kernels ahead to
``model/warmup_ahead.py``, and when to start to ``aotx serve``.

Why: numba compiles a kernel at its first call and caches it on disk. On a fresh install
the threaded kernels (``prange`` regions, lowered through numba's parfor passes) took
most of the first start: 39 of 90 s of compilation on a 2-core machine for the default
model, their serial twins a fraction of that. An engine sets ``PARALLEL.ready = False``
before it loads, warms up and serves its first replies on the twins (one thread), and
``start_background`` brings the threaded kernels in: at once from the cache when a
previous start compiled them, else after the background process has.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from aotx.engine.backend.cpu.parallel import PARALLEL

log = logging.getLogger("aotx.warmup")

# (module, serial twin, threaded kernel): the threaded kernel takes the serial one's
# arguments, so its signatures are the twin's
TWINS: tuple[tuple[str, str, str], ...] = (
    ("aotx.engine.backend.cpu.qdot", "matmul_serial", "matmul"),
    ("aotx.engine.backend.cpu.attention", "_attention_serial", "_attention_parallel"),
    ("aotx.engine.backend.cpu.attention", "_attention_serial_f32", "_attention_parallel_f32"),
    ("aotx.engine.backend.cpu.matmul", "_gemm_float_serial", "_gemm_float_parallel"),
)


def pending() -> list[tuple[str, str, tuple]]:
    """(module, threaded kernel, signature) for every signature a serial twin compiled in
    this process that its threaded kernel has not."""
    out = []
    for mod, serial, threaded in TWINS:
        m = sys.modules.get(mod)
        if m is None:
            continue
        par = getattr(m, threaded)
        for sig in getattr(m, serial).signatures:
            if sig not in par.overloads:
                out.append((mod, threaded, sig))
    return out


def load_cached(jobs: list[tuple[str, str, tuple]]) -> list[tuple[str, str, tuple]]:
    """Load each job's kernel from numba's cache (what ``Dispatcher.compile`` does on a
    cache hit, without compiling on a miss). Returns the jobs the cache did not have."""
    from numba.core.compiler_lock import global_compiler_lock

    missing = []
    for mod, name, sig in jobs:
        disp = getattr(importlib.import_module(mod), name)
        with global_compiler_lock:
            if sig in disp.overloads:
                continue
            cres = disp._cache.load_overload(sig, disp.targetctx)
            if cres is None:
                missing.append((mod, name, sig))
                continue
            disp.targetctx.insert_user_function(cres.entry_point, cres.fndesc, [cres.library])
            disp.add_overload(cres)
    return missing


def compile_jobs(jobs: list[tuple[str, str, tuple]]) -> None:
    """Compile each job (numba writes it to its cache)."""
    for mod, name, sig in jobs:
        getattr(importlib.import_module(mod), name).compile(sig)


def bring_in(log_line: Callable[[str], None] = log.info) -> float:
    """Make the threaded kernels of this process's twins ready: from the cache, else
    compiled by a niced child process and then loaded (here, as a last resort). Sets
    ``PARALLEL.ready``; returns the seconds it took."""
    t0 = time.perf_counter()
    try:
        missing = load_cached(pending())
        if missing:
            log_line(f"compiling {len(missing)} multi-threaded kernel(s) in the background; replies run on one "
                     f"thread until then")
            with tempfile.NamedTemporaryFile("wb", suffix=".jobs", delete=False) as fh:
                pickle.dump(missing, fh)
            try:
                subprocess.run([sys.executable, "-m", "aotx.engine.backend.cpu.warmup", fh.name],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               timeout=1800, check=False)
            finally:
                os.unlink(fh.name)
            missing = load_cached(missing)
            if missing:  # the child could not (no cache directory, killed): compile here
                compile_jobs(missing)
        PARALLEL.ready = True
        took = time.perf_counter() - t0
        log_line(f"multi-threaded kernels ready in {took:.1f} s")
        return took
    except Exception:  # noqa: BLE001 - the serial twins keep working; nothing is lost
        log.exception("could not bring in the multi-threaded kernels; replies stay on one thread")
        return time.perf_counter() - t0


def start_background(log_line: Callable[[str], None] = log.info) -> threading.Thread:
    """``bring_in`` on a daemon thread (the engine keeps serving meanwhile)."""
    th = threading.Thread(target=bring_in, args=(log_line,), name="aotx-kernels", daemon=True)
    th.start()
    return th


def main(argv: list[str] | None = None) -> int:
    """The background compiler: compile the pickled jobs (threaded kernels) into numba's
    cache, at a low priority (the engine serves meanwhile)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        os.nice(10)
    except OSError:
        pass
    with open(argv[0], "rb") as fh:
        jobs = pickle.load(fh)
    compile_jobs(jobs)
    return 0




if __name__ == "__main__":
    sys.exit(main())
