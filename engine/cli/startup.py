"""What a starting engine tells the clients that wait for it: a progress file.

Owns: ``StartupProgress``, the callback ``aotx serve`` gives the model loader, which
writes ``<socket>.progress`` (JSON: the stage a person reads, such as "reading the
weights" or "compiling kernels", and, while kernels compile ahead in a child process,
that child's count in ``<socket>.kernels``: done, total, the kernel now). The socket
answers only once the engine is loaded, so a client that started an engine (aotx-chat,
``aotx run``) reads these files while it waits and shows a progress bar instead of a
silent minute. Both files are removed when the engine is loaded. Also the wait, before the
warm-up, for the child compiling kernels ahead (``backend/cpu/warmup.py``): the warm-up
then finds them in numba's cache instead of compiling them a second time.
Leaves reading the files to the client (``ipc/client.read_progress``), showing them to
the front ends.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path

log = logging.getLogger("aotx.serve")

# the loader reports a stage when it ENDS: what the engine does next, in a person's words
NEXT = {"open": "reading the weights", "resolve": "reading the weights", "weights": "reading the tokenizer",
        "tables": "reading the tokenizer", "tokenizer": "compiling kernels", "warm-up": "opening the journal"}
AHEAD_WAIT_S = 600.0  # at most this long for the child compiling ahead (then the warm-up compiles what is left)


def progress_paths(sock: Path) -> tuple[Path, Path]:
    """(``<socket>.progress``, ``<socket>.kernels``): ``paths.startup_progress_paths``."""
    from aotx.engine.paths import startup_progress_paths

    return startup_progress_paths(sock)


def write_json(path: Path, data: dict) -> None:
    """Replace ``path`` with ``data`` (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass  # progress is a courtesy: a read-only runtime dir must not stop the engine


class AheadWait:
    """A loader ``progress`` that only waits, before the warm-up, for the child compiling
    kernels ahead (a model loaded beside the default: no client reads a progress file)."""

    def __init__(self, ahead: subprocess.Popen | None) -> None:
        self.ahead = ahead

    def __call__(self, stage: str, seconds: float) -> None:
        if stage == "tokenizer" and self.ahead is not None:
            try:
                self.ahead.wait(AHEAD_WAIT_S)
            except subprocess.TimeoutExpired:
                pass


class StartupProgress:
    """The loader's ``progress(stage, seconds)``: a log line per stage, the progress file,
    and before the warm-up the wait for ``ahead`` (the child compiling kernels, or None)."""

    def __init__(self, sock: Path, ahead: subprocess.Popen | None = None) -> None:
        self.main, self.kernels = progress_paths(sock)
        self.ahead = ahead
        self.t0 = time.monotonic()
        write_json(self.main, {"stage": "opening the model file", "since": 0.0})

    def __call__(self, stage: str, seconds: float) -> None:
        log.info("load %-9s %.3f s", stage, seconds)
        nxt = NEXT.get(stage, "")
        if stage == "tokenizer" and self.ahead is None:
            nxt = "warming up"  # the kernels are in the cache (a later start): nothing to compile
        if nxt:
            write_json(self.main, {"stage": nxt, "since": round(time.monotonic() - self.t0, 1)})
        if stage == "tokenizer" and self.ahead is not None:  # the warm-up is next: its kernels come ahead
            import resource

            t0 = time.monotonic()
            try:
                self.ahead.wait(AHEAD_WAIT_S)
                cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
                log.info("kernels compiled ahead (first start): waited %.1f s for them, %.1f s of CPU in the child",
                         time.monotonic() - t0, cpu.ru_utime + cpu.ru_stime)
            except subprocess.TimeoutExpired:
                log.warning("the kernels compiled ahead took over %.0f s; the warm-up compiles what is left",
                            AHEAD_WAIT_S)
            write_json(self.main, {"stage": "warming up", "since": round(time.monotonic() - self.t0, 1)})

    def close(self) -> None:
        """Loaded (or failed): the files go; a child still compiling is left to finish (it
        only fills the cache)."""
        for p in (self.main, self.kernels):
            try:
                p.unlink()
            except OSError:
                pass
