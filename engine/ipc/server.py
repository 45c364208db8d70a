"""The engine's socket server: a Unix domain socket speaking ``protocol.py``.

Owns: binding the socket (mode 0600) under an exclusive lock so two engines
cannot serve one path, replacing a stale socket left by a dead engine, the
handshake, reading frames defensively (a bad length, garbage, an unknown type,
wrong field types or a 2 GB length gets an ``Error`` reply or a closed
connection, never a crash or a hang), and delivering engine events to each
connection in order. Leaves everything the requests mean to the engine.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import socket
import stat
from pathlib import Path

from aotx.engine.errors import EngineError, ErrorCode, ProtocolError
from aotx.engine.ipc import protocol as P

log = logging.getLogger("aotx.server")

HANDSHAKE_TIMEOUT_S = 10.0
MAX_SOCKET_PATH = 107  # bytes in sockaddr_un.sun_path, less the terminating NUL (Linux)


class SocketLock:
    """An exclusive ``flock`` on ``<socket>.lock``: held for the engine's lifetime.

    Raises EngineError when another live engine holds it."""

    def __init__(self, sock_path: Path):
        self.path = Path(str(sock_path) + ".lock")
        self.fd = -1

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = -1
            raise EngineError(f"another engine is already serving {str(self.path)[:-5]}") from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, str(os.getpid()).encode())

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def bind_socket(path: Path) -> socket.socket:
    """Bind a listening Unix socket at ``path`` with mode 0600, replacing a stale file.

    Call with the SocketLock held: a file that exists then belongs to a dead engine
    (or is not a socket at all, which is refused)."""
    if path.exists() or path.is_symlink():
        st = path.lstat()
        if not stat.S_ISSOCK(st.st_mode):
            raise EngineError(f"{path} exists and is not a socket; remove it or choose --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
            probe.close()
            raise EngineError(f"an engine already answers on {path}")
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("replacing stale socket %s", path)
            path.unlink()
        finally:
            probe.close()
    if len(os.fsencode(str(path))) > MAX_SOCKET_PATH:
        raise EngineError(f"socket path {path} is {len(os.fsencode(str(path)))} bytes; Unix sockets allow "
                          f"{MAX_SOCKET_PATH}: choose a shorter --socket or AOTX_HOME")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        s.bind(str(path))
    except OSError as e:
        s.close()
        raise EngineError(f"cannot create the socket {path}: {e.strerror or e}") from None
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    s.listen(128)
    s.setblocking(False)
    return s


class Connection:
    """One client connection. ``send`` is thread-safe (the engine thread calls it)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, writer: asyncio.StreamWriter, name: str):
        self.loop = loop
        self.writer = writer
        self.name = name
        self.closed = False

    def send(self, msg: P.Message) -> None:
        if self.closed:
            return
        data = P.encode_frame(msg)
        try:
            self.loop.call_soon_threadsafe(self._write, data)
        except RuntimeError:  # loop closed
            self.closed = True

    def _write(self, data: bytes) -> None:
        if self.closed or self.writer.is_closing():
            return
        try:
            self.writer.write(data)
        except (ConnectionError, RuntimeError):
            self.closed = True


class Server:
    """Accepts connections and posts their requests to ``engine.post(op, conn)``.

    ``welcome`` is a callable returning the ``Welcome`` message (model, device, ready)."""

    def __init__(self, engine, sock_path: Path, welcome, lock: SocketLock | None = None):
        self.engine = engine
        self.path = Path(sock_path)
        self.welcome = welcome
        self.lock = lock or SocketLock(self.path)
        self.server: asyncio.AbstractServer | None = None
        self.n_clients = 0

    async def start(self) -> None:
        if self.lock.fd < 0:
            self.lock.acquire()
        sock = bind_socket(self.path)
        self.server = await asyncio.start_unix_server(self._serve, sock=sock, limit=P.MAX_FRAME + 8)

    async def close(self) -> None:
        if self.server:
            self.server.close()
            try:
                await asyncio.wait_for(self.server.wait_closed(), 2)
            except asyncio.TimeoutError:
                pass
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        self.lock.release()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        self.n_clients += 1
        conn = Connection(loop, writer, f"client-{self.n_clients}")
        try:
            try:
                hello = await asyncio.wait_for(self._read(reader), HANDSHAKE_TIMEOUT_S)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                return
            except ProtocolError as e:
                writer.write(P.encode_frame(P.Error(id=0, code=ErrorCode.BAD_FRAME, message=str(e))))
                return
            if not isinstance(hello, P.Hello):
                writer.write(P.encode_frame(P.Error(id=0, code=ErrorCode.BAD_REQUEST,
                                                    message="the first message must be hello")))
                return
            if hello.protocol != P.PROTOCOL_VERSION:
                writer.write(P.encode_frame(P.Error(
                    id=0, code=ErrorCode.VERSION_MISMATCH,
                    message=f"protocol version {hello.protocol} is not supported; this engine speaks version "
                            f"{P.PROTOCOL_VERSION} (upgrade the client or the engine so they match)")))
                return
            conn.name = f"{hello.client or 'client'}-{self.n_clients}"
            log.info("client connected: %s", conn.name)
            writer.write(P.encode_frame(self.welcome()))
            while True:
                try:
                    msg = await self._read(reader)
                except ProtocolError as e:
                    # the framing is intact only when the payload was read; a bad length closes
                    err = P.Error(id=0, code=ErrorCode.BAD_FRAME, message=str(e))
                    if "exceeds the limit" in str(e):
                        # written here, not through conn.send: that write would run after
                        # the close below marks the connection closed, and be dropped
                        writer.write(P.encode_frame(err))
                        break
                    conn.send(err)
                    continue
                if not isinstance(msg, P.OPERATIONS):
                    conn.send(P.Error(id=getattr(msg, "id", 0), code=ErrorCode.BAD_REQUEST,
                                      message=f"{type(msg).__name__} is not a request"))
                    continue
                self.engine.post(msg, conn)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            conn.closed = True
            self.engine.post_disconnect(conn)
            log.info("client disconnected: %s", conn.name)
            try:
                await writer.drain()
            except (ConnectionError, RuntimeError):
                pass
            writer.close()

    @staticmethod
    async def _read(reader: asyncio.StreamReader) -> P.Message:
        n = P.frame_length(await reader.readexactly(4))
        body = await reader.readexactly(n)
        return P.decode_payload(body)
