"""Chat templates rendered in worker processes whose memory and CPU the OS bounds.

Owns: ``TemplateWorkers``, a small pool of persistent worker processes that render
chat templates, and the worker's loop (``python -m aotx.engine.model.template_worker``).
A chat template comes from a model file, so it is code a stranger wrote; the
sandbox's checks (``template_sandbox.py``) bound what they can see, but a width
given as an argument (``"{:>{}}".format("x", N)``, ``"%*s" % (N, "x")``) or a long
loop inside a built-in (``lipsum(300000)``) runs in C or in library code between
two checkpoints. In a worker process those are bounded by the operating system:

* memory: ``RLIMIT_AS`` of the worker's size at start plus ``as_headroom`` bytes (an
  allocation past it fails: the render is refused and the worker replaced);
* CPU: ``RLIMIT_CPU`` set before each render to the CPU the worker has used plus the
  render's budget plus ``CPU_SLACK_S`` (whole seconds; SIGXCPU ends the worker);
* time: a worker that has not answered in ``wall_seconds(budget)`` is killed.

The engine's own memory never holds what a hostile template builds, so it stays at
its level after every refusal, and a render runs on another core than the tick.
A worker lives on between renders (each render is one round trip of a few hundred
microseconds, see the closing note); a breach ends it and the next render starts a
fresh one. Leaves to others: the template's meaning, its errors and the in-process
sandbox (``chat_template.py``, ``template_sandbox.py``), when to render (the
runtime's preparation stage, which routes its model's template here).

Messages between the engine and a worker are length-prefixed MessagePack (a
request: the template's source and name, its variables, the budget; a reply: the
text, or an error line): nothing a worker sends is ever executed by the engine.
"""

from __future__ import annotations

import os
import select
import signal
import struct
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import msgspec

import aotx
from aotx.engine.errors import TemplateError
from aotx.engine.model.chat_template import ChatTemplate, WorkersUnavailable
from aotx.engine.model.template_sandbox import RenderBudget

AS_HEADROOM = 512 << 20  # bytes a render may add to the worker's address space (a render within the
# sandbox's 32 Mi characters needs well under it)
CPU_SLACK_S = 1  # the OS's CPU limit is the budget plus this
MAX_WORKERS = 2  # the preparation stage's workers: one render each at a time
_LEN = struct.Struct("<I")
_encoder = msgspec.msgpack.Encoder()


def wall_seconds(budget: RenderBudget) -> float:
    """How long the engine waits for a worker's answer before killing it: the CPU
    budget with room for a busy machine (a render that waits its turn for a core)."""
    return max(30.0, budget.cpu_seconds * 10)


class _Worker:
    """One worker process and its pipes (used by one thread at a time)."""

    def __init__(self, as_headroom: int):
        env = dict(os.environ)
        root = str(Path(aotx.__file__).parent.parent)  # the folder holding the ``aotx`` package, as imported
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["AOTX_TEMPLATE_AS_HEADROOM"] = str(as_headroom)
        self.proc = subprocess.Popen([sys.executable, "-m", "aotx.engine.model.template_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, close_fds=True)
        self.renders = 0

    def call(self, data: bytes, timeout: float) -> dict[str, Any]:
        """Send an encoded request and wait up to ``timeout`` seconds for the reply.
        Raises ``_Died`` (the process ended or was killed for the timeout)."""
        try:
            self.proc.stdin.write(_LEN.pack(len(data)) + data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise _Died(self._ended()) from None
        head = self._read(_LEN.size, timeout)
        (n,) = _LEN.unpack(head)
        return msgspec.msgpack.decode(self._read(n, timeout))

    def _read(self, n: int, timeout: float) -> bytes:
        import time

        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        parts, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                self.kill()
                raise _Died(f"it did not finish within {timeout:g} s")
            b = os.read(fd, min(n - got, 1 << 20))
            if not b:
                raise _Died(self._ended())
            parts.append(b)
            got += len(b)
        return b"".join(parts)

    def _ended(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            return "its worker stopped answering"
        if code == -signal.SIGXCPU or code == -signal.SIGKILL:
            return "the operating system stopped it for its CPU time"
        if code < 0:
            return f"its worker was ended by signal {signal.Signals(-code).name}"
        return f"its worker exited with status {code}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class _Died(Exception):
    pass




class TemplateWorkers:
    """A pool of up to ``max_workers`` template worker processes.

    ``render(source, name, variables, budget)`` renders on an idle worker (starting
    one when none is idle) and returns the text, or raises ``TemplateError`` as
    ``ChatTemplate.render`` does, and also when the OS stopped the worker (memory,
    CPU) or it did not answer in time; a worker that breached is never reused.
    Thread-safe: each calling thread gets a worker of its own. ``close()`` ends them."""

    def __init__(self, max_workers: int = MAX_WORKERS, as_headroom: int = AS_HEADROOM):
        self.max_workers = max_workers
        self.as_headroom = as_headroom
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._cond = threading.Condition()
        self.started = 0  # worker processes started (for tests and status)
        self.replaced = 0  # workers ended by a breach
        self._finalizer = weakref.finalize(self, _kill_all, self._all)

    def warm(self) -> None:
        """Start one worker now (its imports run meanwhile), so the first render does not wait."""
        with self._cond:
            if not self._all:
                try:
                    w = _Worker(self.as_headroom)
                except OSError:
                    return  # the first render says why
                self._all.add(w)
                self._idle.append(w)
                self.started += 1

    def _checkout(self) -> _Worker:
        with self._cond:
            while True:
                while not self._idle and len(self._all) >= self.max_workers:
                    self._cond.wait()
                if not self._idle:
                    break
                w = self._idle.pop()
                if w.proc.poll() is None:
                    return w
                self._all.discard(w)  # it ended while idle (killed from outside): start another
                w.kill()
            try:
                w = _Worker(self.as_headroom)
            except OSError as e:
                raise WorkersUnavailable(f"cannot start a template worker ({sys.executable}): {e}") from None
            self._all.add(w)
            self.started += 1
            return w

    def _checkin(self, w: _Worker, ok: bool) -> None:
        with self._cond:
            if ok:
                self._idle.append(w)
            else:
                self._all.discard(w)
                self.replaced += 1
            self._cond.notify()
        if not ok:
            w.kill()

    def render(self, source: str, name: str, variables: dict[str, Any], budget: RenderBudget) -> str:
        try:
            request = _encoder.encode({"source": source, "name": name, "vars": variables,
                                       "cpu": budget.cpu_seconds, "chars": budget.max_chars})
        except (TypeError, ValueError, msgspec.EncodeError) as e:
            raise TemplateError(f"{name}: the messages cannot be passed to the template worker: {e}") from None
        w = self._checkout()  # alive when taken: a death from here on is this render's doing
        try:
            reply = w.call(request, wall_seconds(budget))
        except _Died as e:
            self._checkin(w, False)
            raise TemplateError(f"{name} was stopped: {e}; a chat template that does this is broken or "
                                "hostile: use another model file (or `aotx run --raw`)") from None
        w.renders += 1
        if "text" in reply:
            self._checkin(w, True)
            return reply["text"]
        self._checkin(w, not reply.get("fatal"))
        raise TemplateError(reply.get("error", "the template worker failed"))

    def close(self) -> None:
        self._finalizer()


def _kill_all(workers: set[_Worker]) -> None:
    for w in list(workers):
        w.kill()
    workers.clear()


_shared: TemplateWorkers | None = None
_shared_lock = threading.Lock()


def shared_workers() -> TemplateWorkers:
    """The process's pool (made on first use): every model's template in an engine
    process renders through it, so workers are started once per process."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = TemplateWorkers()
        return _shared


# ---- the worker process ------------------------------------------------------------------------

def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _read_exact(fd: int, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        b = os.read(fd, n - got)
        if not b:
            return None
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def _write(fd: int, data: bytes) -> None:
    view = memoryview(_LEN.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def main() -> None:
    """The worker: read requests from stdin, render, write replies to stdout, until
    stdin closes (the engine went away). Memory and CPU are limited by the OS."""
    import resource

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine's Ctrl+C is the engine's to handle
    headroom = int(os.environ.get("AOTX_TEMPLATE_AS_HEADROOM", AS_HEADROOM))
    ChatTemplate("{{ 1 }}").render([])  # jinja2 and the sandbox loaded before the limit is measured
    limit = _vm_size() + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    templates: dict[tuple[str, str], ChatTemplate] = {}
    fin, fout = sys.stdin.buffer.fileno(), os.dup(sys.stdout.buffer.fileno())
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.buffer.fileno())  # a stray print never garbles a reply
    while True:
        head = _read_exact(fin, _LEN.size)
        if head is None:
            return
        body = _read_exact(fin, _LEN.unpack(head)[0])
        if body is None:
            return
        req = msgspec.msgpack.decode(body)
        try:
            key = (req["source"], req["name"])
            t = templates.get(key)
            if t is None:
                if len(templates) >= 8:
                    templates.clear()
                t = templates[key] = ChatTemplate(req["source"], name=req["name"])
            r = resource.getrusage(resource.RUSAGE_SELF)
            soft = int(r.ru_utime + r.ru_stime + req["cpu"]) + 1 + CPU_SLACK_S
            resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))
            text = t.render_here(req["vars"], RenderBudget(req["cpu"], req["chars"], yield_gil=False))
            reply: dict[str, Any] = {"text": text}
        except TemplateError as e:
            reply = {"error": str(e)}
        except MemoryError:
            reply = {"error": f"{req.get('name', 'the chat template')} was stopped: the operating system refused "
                     f"it more than {headroom >> 20} MiB of memory; a chat template that does this is broken or "
                     "hostile: use another model file (or `aotx run --raw`)", "fatal": True}
        except Exception as e:  # noqa: BLE001 - a bug reaches the engine as a line, not as a dead worker
            reply = {"error": f"internal error in the template worker: {type(e).__name__}: {e}", "fatal": True}
        try:
            data = _encoder.encode(reply)
        except MemoryError:  # the text fit the limits, but not twice in the worker's memory
            reply = {"error": f"{req.get('name', 'the chat template')} was stopped: its output does not fit the "
                     f"{headroom >> 20} MiB of memory a render may use; a chat template that does this is broken "
                     "or hostile: use another model file (or `aotx run --raw`)", "fatal": True}
            data = _encoder.encode(reply)
        _write(fout, data)
        if reply.get("fatal"):
            return


if __name__ == "__main__":
    main()
