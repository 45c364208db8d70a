"""The async client library of the engine's local socket.

Owns: connecting (and starting an engine in the background when none answers),
the handshake, multiplexing requests over one connection by request id, and the
typed helpers every client uses (``aotx run``, ``aotx-chat``, the gateway).
Leaves to others: the engine (``server.py``) and what events mean (runtime).

Events of a submitted message arrive through ``submit()`` as an async iterator of
protocol messages (``Accepted``, ``Token``, ``Notice``, ``Durable``,
``Committed``, ``Error``); the iterator ends after ``Committed`` (and the durable
receipt that follows it, when ``wait_durable``) or an ``Error``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from aotx.engine.errors import AotxError, EngineError, ProtocolError
from aotx.engine import protocol as P


class ConnectionLost(EngineError):
    """The engine closed the connection (it stopped or crashed)."""


_CLOSED = object()


class EngineClient:
    """One connection to the engine. Create with ``await EngineClient.connect(...)``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, welcome: P.Welcome,
                 socket_path: Path):
        self._reader = reader
        self._writer = writer
        self.welcome = welcome
        self.socket_path = socket_path
        self._ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue] = {}
        self._closed = False
        # the engine said it was stopped (``aotx stop``, SIGTERM) before closing the connection:
        # a stop, not a crash; a client then waits for its user before starting another
        self.stopped = False
        self._reader_task = asyncio.get_running_loop().create_task(self._read_loop())

    # ---- connection --------------------------------------------------------

    @classmethod
    async def connect(cls, socket_path: str | os.PathLike[str] | None = None, *, spawn: bool = True,
                      engine_args: list[str] | None = None, client_name: str = "aotx",
                      on_spawn: Callable[[str], None] | None = None, timeout: float = 600.0,
                      on_progress: Callable[[dict], None] | None = None) -> "EngineClient":
        """Connect to the engine at ``socket_path`` (default: paths.socket_path()).

        When none answers and ``spawn`` is true, start ``aotx serve`` in the background
        (its log goes to ``<data dir>/engine.log``), call ``on_spawn`` with a one-line
        notice, and wait up to ``timeout`` seconds for it to answer, telling
        ``on_progress`` what it says while it loads (``read_progress``: a first start
        compiles its kernels). Raises EngineError when no engine answers, ProtocolError
        on a protocol version mismatch.
        """
        from aotx.engine import paths

        sock = Path(socket_path) if socket_path else paths.socket_path()
        if len(os.fsencode(str(sock))) > 107:
            raise EngineError(f"socket path {sock} is longer than the 107 bytes Unix sockets allow: choose a "
                              f"shorter --socket or AOTX_HOME")
        try:
            return await cls._open(sock, client_name)
        except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError):
            if not spawn:
                raise EngineError(f"no engine answers on {sock}; start one with `aotx serve`") from None
        log = paths.data_dir() / "engine.log"
        args = [sys.executable, "-m", "aotx.engine.cli.commands", "serve", "--socket", str(sock), *(engine_args or [])]
        try:  # the engine's log is private (0600), like everything in the data dir
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError as e:  # a read-only or foreign data dir: one line, not a traceback
            raise EngineError(f"cannot start an engine: cannot write its log {log}: "
                              f"{(e.strerror or str(e)).lower()} (check the data dir's owner and mode, or set "
                              "AOTX_HOME)") from None
        with os.fdopen(fd, "ab") as fh:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=fh, stderr=fh, start_new_session=True)
        if on_spawn:
            on_spawn(f"started an engine in the background (pid {proc.pid}, log {log})")
        deadline = time.monotonic() + timeout
        winner = False              # another engine won the race for the socket: wait for it instead
        said: dict = {}
        while True:
            await asyncio.sleep(0.05)
            if on_progress is not None:
                now = read_progress(sock)
                if now and now != said:
                    said = now
                    on_progress(now)
            try:
                client = await cls._open(sock, client_name)
            except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError):
                pass
            else:
                if on_spawn:            # what the engine it started said while loading (its log is out of sight)
                    for line in client.welcome.notices:
                        on_spawn(f"engine: {line}")
                return client
            code = None if winner else proc.poll()
            if winner and not _socket_lock_held(sock):
                raise EngineError(f"the engine that was starting on {sock} stopped before answering "
                                  f"(log: {log})")
            if code is not None:
                # Another engine may have won the race for the socket (several clients started
                # one at once): while it holds the socket's lock it is loading; wait for it.
                try:
                    return await cls._open(sock, client_name)
                except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError):
                    if _socket_lock_held(sock):
                        winner = True
                        continue
                    tail = _tail(log)
                    raise EngineError(f"the engine exited with code {code} before answering: {tail} (details in {log})",
                                      engine_exit=code, engine_message=tail) from None
            if time.monotonic() > deadline:
                raise EngineError(f"the engine did not answer on {sock} within {timeout:.0f} s (log: {log})")

    @classmethod
    async def _open(cls, sock: Path, client_name: str) -> "EngineClient":
        reader, writer = await asyncio.open_unix_connection(str(sock), limit=P.MAX_FRAME + 8)
        writer.write(P.encode_frame(P.Hello(protocol=P.PROTOCOL_VERSION, client=client_name)))
        await writer.drain()
        try:
            msg = await asyncio.wait_for(_read_frame(reader), 30)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError):
            writer.close()
            raise ConnectionRefusedError("no handshake") from None
        if isinstance(msg, P.Error):
            writer.close()
            raise ProtocolError(f"the engine refused the connection: {msg.message}")
        if not isinstance(msg, P.Welcome):
            writer.close()
            raise ProtocolError(f"unexpected handshake reply {type(msg).__name__}")
        return cls(reader, writer, msg, sock)

    async def close(self) -> None:
        """Close the connection; pending requests end with ConnectionLost."""
        self._closed = True
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except Exception:  # noqa: BLE001 - already gone
            pass
        self._reader_task.cancel()

    @property
    def closed(self) -> bool:
        return self._closed

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await _read_frame(self._reader)
                if isinstance(msg, P.Notice) and msg.id == 0 and msg.kind == "stopping":
                    self.stopped = True
                    continue
                q = self._queues.get(getattr(msg, "id", -1))
                if q is not None:
                    q.put_nowait(msg)
        except (asyncio.IncompleteReadError, ConnectionError, ProtocolError, asyncio.CancelledError):
            pass
        finally:
            self._closed = True
            for q in self._queues.values():
                q.put_nowait(_CLOSED)

    # ---- requests ----------------------------------------------------------

    def _new(self) -> tuple[int, asyncio.Queue]:
        if self._closed:
            raise ConnectionLost("the connection to the engine is closed")
        rid = next(self._ids)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        return rid, q

    async def _send(self, msg: P.Message) -> None:
        try:
            self._writer.write(P.encode_frame(msg))
            await self._writer.drain()
        except (ConnectionError, RuntimeError) as e:
            raise ConnectionLost(f"the engine connection broke: {e}") from None

    async def _call(self, make: Callable[[int], P.Message]):
        rid, q = self._new()
        try:
            await self._send(make(rid))
            msg = await q.get()
            if msg is _CLOSED:
                raise ConnectionLost("the engine closed the connection")
            if isinstance(msg, P.Error):
                raise EngineError(msg.message, msg.code)  # not_found, busy, not_ready, ...
            return msg
        finally:
            self._queues.pop(rid, None)

    async def create_conversation(self, title: str = "", system_prompt: str | None = None,
                                  sampling: P.SamplingParams | None = None,
                                  messages: list[tuple] | None = None,
                                  model: str = "", origin: str = "", context: str = "") -> P.ConversationView:
        """A new conversation on ``model`` ("": the engine's default) under context policy
        ``context`` ("": the engine's); ``messages`` (role, text[, meta]) are stored as its
        history without generating anything (``PriorMessage``)."""
        prior = [P.PriorMessage(role=m[0], text=m[1], meta=dict(m[2]) if len(m) > 2 and m[2] else {})
                 for m in (messages or [])]
        r = await self._call(lambda i: P.CreateConversation(id=i, title=title, system_prompt=system_prompt,
                                                            sampling=sampling, messages=prior, model=model,
                                                            origin=origin, context=context))
        return r.conversation

    async def list_conversations(self) -> list[P.ConversationView]:
        return (await self._call(lambda i: P.ListConversations(id=i))).conversations

    async def show(self, conv_id: str) -> P.ConversationView:
        return (await self._call(lambda i: P.ShowConversation(id=i, conv_id=conv_id))).conversation

    async def delete(self, conv_id: str) -> None:
        await self._call(lambda i: P.DeleteConversation(id=i, conv_id=conv_id))

    async def rename(self, conv_id: str, title: str) -> None:
        await self._call(lambda i: P.RenameConversation(id=i, conv_id=conv_id, title=title))

    async def update(self, conv_id: str, system_prompt: str | None = None,
                     sampling: P.SamplingParams | None = None) -> None:
        await self._call(lambda i: P.UpdateConversation(id=i, conv_id=conv_id, system_prompt=system_prompt,
                                                        sampling=sampling))

    async def truncate(self, conv_id: str, msg_id: str) -> None:
        """Drop ``msg_id`` and every later message of the conversation (edit, retry)."""
        await self._call(lambda i: P.TruncateConversation(id=i, conv_id=conv_id, msg_id=msg_id))

    async def fork(self, conv_id: str, at_msg_id: str = "") -> P.ConversationView:
        """A new conversation sharing ``conv_id``'s messages up to ``at_msg_id``."""
        return (await self._call(lambda i: P.ForkConversation(id=i, conv_id=conv_id, at_msg_id=at_msg_id))).conversation

    async def cancel(self, target: int = 0, conv_id: str = "") -> None:
        await self._call(lambda i: P.Cancel(id=i, target=target, conv_id=conv_id))

    async def status(self) -> P.StatusReply:
        return await self._call(lambda i: P.Status(id=i))

    async def list_models(self) -> P.ModelList:
        """Every installed model (files and remote endpoints) and which are loaded."""
        return await self._call(lambda i: P.ListModels(id=i))

    async def load_model(self, model: str, *, evict_idle: bool = False,
                         on_notice: Callable[[P.Notice], None] | None = None) -> P.ModelLoaded:
        """Load ``model`` beside the others (``on_notice`` sees the loading notices).
        Raises EngineError (code busy with the numbers when it does not fit)."""
        rid, q = self._new()
        try:
            await self._send(P.LoadModel(id=rid, model=model, evict_idle=evict_idle))
            while True:
                msg = await q.get()
                if msg is _CLOSED:
                    raise ConnectionLost("the engine closed the connection")
                if isinstance(msg, P.Notice):
                    if on_notice is not None:
                        on_notice(msg)
                    continue
                if isinstance(msg, P.Error):
                    raise EngineError(msg.message, msg.code)
                return msg
        finally:
            self._queues.pop(rid, None)

    async def count_tokens(self, messages: list[P.PriorMessage], *, system_prompt: str | None = None,
                           tools: list[dict] | None = None, prefill: str = "", model: str = "") -> int:
        """The prompt's token count for ``messages`` (``CountTokens``; the model is loaded
        when it is not). Raises EngineError (bad_request for a template that refuses them)."""
        rid, q = self._new()
        try:
            await self._send(P.CountTokens(id=rid, messages=messages, system_prompt=system_prompt,
                                           tools=tools or [], prefill=prefill, model=model))
            while True:
                msg = await q.get()
                if msg is _CLOSED:
                    raise ConnectionLost("the engine closed the connection")
                if isinstance(msg, P.Notice):  # loading the model
                    continue
                if isinstance(msg, P.Error):
                    raise EngineError(msg.message, msg.code)
                return msg.n_tokens
        finally:
            self._queues.pop(rid, None)

    async def _call_loading(self, make: Callable[[int], P.Message]):
        """``_call`` for an operation that may load its model first (its Notices skipped)."""
        rid, q = self._new()
        try:
            await self._send(make(rid))
            while True:
                msg = await q.get()
                if msg is _CLOSED:
                    raise ConnectionLost("the engine closed the connection")
                if isinstance(msg, P.Notice):
                    continue
                if isinstance(msg, P.Error):
                    raise EngineError(msg.message, msg.code)
                return msg
        finally:
            self._queues.pop(rid, None)

    async def embed(self, texts: list[str], *, model: str = "", pooling: str = "mean", normalize: bool = True,
                    truncate: bool = False) -> P.Embeddings:
        """One embedding per text (``Embed``; the model is loaded when it is not). Raises
        EngineError (bad_request naming the text for one past the context)."""
        return await self._call_loading(lambda i: P.Embed(id=i, texts=texts, model=model, pooling=pooling,
                                                          normalize=normalize, truncate=truncate))

    async def tokenize(self, text: str, *, model: str = "", add_special: bool = False,
                       parse_special: bool = False) -> P.TokenList:
        return await self._call_loading(lambda i: P.Tokenize(id=i, text=text, model=model, add_special=add_special,
                                                             parse_special=parse_special))

    async def detokenize(self, ids: list[int], *, model: str = "") -> P.Detokenized:
        return await self._call_loading(lambda i: P.Detokenize(id=i, ids=ids, model=model))

    async def unload_model(self, model: str) -> None:
        await self._call(lambda i: P.UnloadModel(id=i, model=model))

    async def switch_model(self, conv_id: str, model: str) -> P.ConversationView:
        """Run ``conv_id`` on ``model`` from its next message on (the history is kept)."""
        return (await self._call(lambda i: P.SwitchModel(id=i, conv_id=conv_id, model=model))).conversation

    async def set_context(self, conv_id: str, policy: str) -> P.ConversationView:
        """Run ``conv_id`` under context policy ``policy`` (rolling, middle, stop; "": the
        engine's) from its next message on."""
        return (await self._call(lambda i: P.SetContextPolicy(id=i, conv_id=conv_id, policy=policy))).conversation

    async def submit(self, conv_id: str, text: str, *, attachments: list[P.Attachment] | None = None,
                     sampling: P.SamplingParams | None = None, raw: bool = False,
                     wait_durable: bool = True, model: str = "", **fields) -> AsyncIterator[P.Message]:
        """Submit a user message and iterate over its events (see the module docstring).

        ``fields``: the other ``SubmitMessage`` fields (role, meta, tools, constraint,
        logprobs, n, strict_media). With ``n`` > 1 the events of every choice come
        (each carries its ``choice``) and the iterator ends after the last choice's.
        The request id is the ``id`` of every event (use it with ``cancel(target=...)``).
        Raises ConnectionLost if the engine goes away mid-stream.
        """
        rid, q = self._new()
        n = int(fields.get("n", 1) or 1)
        try:
            await self._send(P.SubmitMessage(id=rid, conv_id=conv_id, text=text, attachments=attachments or [],
                                             sampling=sampling, raw=raw, model=model, **fields))
            final_seq: dict[int, int] = {}
            done: set[int] = set()
            while True:
                msg = await q.get()
                if msg is _CLOSED:
                    raise ConnectionLost("the engine closed the connection in the middle of a reply")
                yield msg
                if isinstance(msg, P.Error):
                    return
                if isinstance(msg, P.Committed):
                    if not wait_durable or not self.welcome.journal:  # no receipt will come without a journal
                        done.add(msg.choice)
                    else:
                        final_seq[msg.choice] = msg.seq
                if isinstance(msg, P.Durable) and final_seq.get(msg.choice, 1 << 62) <= msg.receipt.last_seq:
                    done.add(msg.choice)
                if isinstance(msg, P.Durable) and msg.choice == 0:  # one receipt covers every choice before it
                    done.update(c for c, s in final_seq.items() if s <= msg.receipt.last_seq)
                if len(done) >= n:
                    return
        finally:
            self._queues.pop(rid, None)


async def _read_frame(reader: asyncio.StreamReader) -> P.Message:
    n = P.frame_length(await reader.readexactly(4))
    return P.decode_payload(await reader.readexactly(n))


def _tail(path: Path, n: int = 4000) -> str:
    """The engine's last error line from its log (the line starting with "aotx:"), or its last line."""
    try:
        lines = path.read_bytes()[-n:].decode("utf-8", "replace").strip().splitlines()
    except OSError:
        return "(no log)"
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("aotx:"):
            head = lines[i][5:].strip()
            if head.endswith(":"):      # a refusal that lists its items on the lines after it
                items = [ln.strip() for ln in lines[i + 1:] if ln.strip() and not ln.startswith("aotx:")][:6]
                head = f"{head} {'; '.join(items)}" if items else head.rstrip(":")
            return head
    return lines[-1] if lines else "(empty log)"


class CancelOnSignal:
    """While a reply streams: Ctrl-C (SIGINT), SIGTERM (``kill``, ``timeout``) and SIGHUP
    (the terminal closed) cancel it, as soon as its request id is known (``accepted``).
    A killed ``aotx run`` must not leave the engine writing, and journaling as complete,
    a reply nobody reads. ``exit_code`` is 128 + the signal's number (130, 143, 129),
    0 when none came. After SIGHUP the terminal is gone: standard output and error go to
    /dev/null so the last writes cannot fail. A second SIGTERM or SIGHUP exits at once, with
    the first one's code. Once the reply has ended and only its receipt is awaited
    (``waiting_for_receipt``), a signal stops the wait at once: the engine keeps the reply.
    kill -9 cannot be caught: the engine then finishes the reply (as for a dead aotx-chat)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, loop: asyncio.AbstractEventLoop, cancel) -> None:
        self._loop, self._cancel = loop, cancel  # cancel(request id) -> awaitable
        self.signum = 0
        self._rid = 0
        self._installed: list[int] = []
        self._stop_waiting = None  # the reply ended: called on a signal to stop waiting for its receipt

    def __enter__(self) -> "CancelOnSignal":
        for sig in self.SIGNALS:
            try:
                self._loop.add_signal_handler(sig, self._on_signal, sig)
                self._installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread (tests)
                pass
        return self

    def __exit__(self, *exc) -> None:
        first = self.signum if self.signum in (signal.SIGTERM, signal.SIGHUP) else 0
        for sig in self._installed:
            try:
                self._loop.remove_signal_handler(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                continue
            if first and sig != signal.SIGINT:
                # the process is on its way out with the first signal's code: a second signal
                # arriving after the reply ended must not kill it by the default action (SIGHUP's
                # is death: exit -1 instead of 143, a flaky test_a_second_signal_keeps_the_first_ones_
                # exit_code). Ignored, not a Python handler: the interpreter's shutdown resets Python
                # handlers to the default before it ends, and leaves SIG_IGN alone.
                signal.signal(sig, signal.SIG_IGN)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum else 0

    def waiting_for_receipt(self, stop) -> None:
        """The reply has ended; from now on a signal calls ``stop()`` (which ends the wait
        for its receipt) instead of cancelling a reply that is no longer running."""
        self._stop_waiting = stop

    @property
    def stopped_waiting(self) -> bool:
        return bool(self.signum) and self._stop_waiting is not None

    def accepted(self, rid: int) -> None:
        self._rid = rid
        if self.signum:  # the signal came before the engine accepted the message
            self._loop.create_task(self._cancel_quietly())

    def _on_signal(self, sig: int) -> None:
        if sig != signal.SIGINT and self.signum in (signal.SIGTERM, signal.SIGHUP):
            os._exit(128 + self.signum)   # the first signal decides the exit code
        if self.signum not in (signal.SIGTERM, signal.SIGHUP):
            self.signum = sig
        if sig == signal.SIGHUP:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os.close(devnull)
        if self._stop_waiting is not None:
            self._stop_waiting()
        elif self._rid:
            self._loop.create_task(self._cancel_quietly())

    async def _cancel_quietly(self) -> None:
        try:
            await self._cancel(self._rid)
        except AotxError:  # the reply already ended, or the engine went away
            pass


def read_progress(sock: Path) -> dict:
    """What an engine starting on ``sock`` says now (``paths.startup_progress_paths``):
    {"stage": ..., and while kernels compile ahead "done", "total", "detail"}; {} when it
    says nothing."""
    import json

    from aotx.engine.paths import startup_progress_paths

    out: dict = {}
    for p in startup_progress_paths(sock):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(d, dict):
            if "done" in d and out.get("stage") not in (None, "compiling kernels"):
                continue  # the count of kernels compiled ahead outlives its stage: said only then
            out.update(d)
    return out


def _socket_lock_held(sock: Path) -> bool:
    """Whether the engine whose pid ``<socket>.lock`` holds (ipc.server.SocketLock writes
    it once it has the lock) is alive: one that is starting, or serving. Reads the file
    only: taking the lock, even shared, could make a starting engine fail."""
    try:
        pid = int(Path(str(sock) + ".lock").read_text().strip() or 0)
    except (OSError, ValueError):
        return False
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:       # alive, another user's (the data dir is private: unlikely)
        return True
    return True


def model_label(ref: str) -> str:
    """A ``model_ref`` as a person reads it: a file's name without ``.gguf``, a name as is."""
    return Path(ref).stem if ref.endswith(".gguf") else ref


def model_ref(arg: str | None) -> str:
    """``--model`` as the engine should read it: a name as given, a path made absolute
    (the engine runs in another directory)."""
    if not arg:
        return ""
    p = Path(arg).expanduser()
    return str(p.resolve()) if p.is_file() or (("/" in arg or arg.endswith(".gguf")) and p.exists()) else arg
