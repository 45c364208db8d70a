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
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from aotx.engine.errors import EngineError, ProtocolError
from aotx.engine.ipc import protocol as P


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
        self._reader_task = asyncio.get_running_loop().create_task(self._read_loop())

    # ---- connection --------------------------------------------------------

    @classmethod
    async def connect(cls, socket_path: str | os.PathLike[str] | None = None, *, spawn: bool = True,
                      engine_args: list[str] | None = None, client_name: str = "aotx",
                      on_spawn: Callable[[str], None] | None = None, timeout: float = 120.0) -> "EngineClient":
        """Connect to the engine at ``socket_path`` (default: paths.socket_path()).

        When none answers and ``spawn`` is true, start ``aotx serve`` in the background
        (its log goes to ``<data dir>/engine.log``), call ``on_spawn`` with a one-line
        notice, and wait up to ``timeout`` seconds for it to answer. Raises EngineError
        when no engine answers, ProtocolError on a protocol version mismatch.
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
        args = [sys.executable, "-m", "aotx.engine.cli", "serve", "--socket", str(sock), *(engine_args or [])]
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
        while True:
            await asyncio.sleep(0.05)
            try:
                return await cls._open(sock, client_name)
            except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError):
                pass
            code = proc.poll()
            if code is not None:
                # Another engine may have won the race for the socket: try it once more.
                try:
                    return await cls._open(sock, client_name)
                except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError):
                    tail = _tail(log)
                    raise EngineError(f"the engine exited with code {code} before answering: {tail} (details in {log})") from None
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
                                  messages: list[tuple[str, str]] | None = None,
                                  model: str = "") -> P.ConversationView:
        """A new conversation on ``model`` ("": the engine's default); ``messages``
        (role, text) are stored as its history without generating anything."""
        prior = [P.PriorMessage(role=r, text=t) for r, t in (messages or [])]
        r = await self._call(lambda i: P.CreateConversation(id=i, title=title, system_prompt=system_prompt,
                                                            sampling=sampling, messages=prior, model=model))
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

    async def unload_model(self, model: str) -> None:
        await self._call(lambda i: P.UnloadModel(id=i, model=model))

    async def switch_model(self, conv_id: str, model: str) -> P.ConversationView:
        """Run ``conv_id`` on ``model`` from its next message on (the history is kept)."""
        return (await self._call(lambda i: P.SwitchModel(id=i, conv_id=conv_id, model=model))).conversation

    async def submit(self, conv_id: str, text: str, *, attachments: list[P.Attachment] | None = None,
                     sampling: P.SamplingParams | None = None, raw: bool = False,
                     wait_durable: bool = True, model: str = "") -> AsyncIterator[P.Message]:
        """Submit a user message and iterate over its events (see the module docstring).

        The request id is the ``id`` of every event (use it with ``cancel(target=...)``).
        Raises ConnectionLost if the engine goes away mid-stream.
        """
        rid, q = self._new()
        try:
            await self._send(P.SubmitMessage(id=rid, conv_id=conv_id, text=text, attachments=attachments or [],
                                             sampling=sampling, raw=raw, model=model))
            final_seq = None
            while True:
                msg = await q.get()
                if msg is _CLOSED:
                    raise ConnectionLost("the engine closed the connection in the middle of a reply")
                yield msg
                if isinstance(msg, P.Error):
                    return
                if isinstance(msg, P.Committed):
                    if not wait_durable or not self.welcome.journal:  # no receipt will come without a journal
                        return
                    final_seq = msg.seq
                if isinstance(msg, P.Durable) and final_seq is not None and msg.receipt.last_seq >= final_seq:
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
    for line in reversed(lines):
        if line.startswith("aotx:"):
            return line[5:].strip()
    return lines[-1] if lines else "(empty log)"
