"""The engine's socket server: a Unix domain socket speaking ``protocol.py``.

Owns: binding the socket (mode 0600) under an exclusive lock so two engines
cannot serve one path, replacing a stale socket left by a dead engine, accepting
connections within a limit, the handshake, reading frames defensively (a bad
length, garbage, an unknown type, wrong field types or a 2 GB length gets an
``Error`` reply or a closed connection, never a crash or a hang), and delivering
engine events to each connection in order. Leaves everything the requests mean
to the engine.

Connection limits. At most ``max_connections`` clients are connected at once
(default ``MAX_CONNECTIONS``, lowered to fit the process's file-descriptor
limit); one more is answered with an ``Error`` of code ``too_many_connections``
naming the limit, then closed, so it never holds a descriptor. The accept loop is
our own rather than asyncio's: when ``accept`` fails for lack of descriptors
(EMFILE, ENFILE) asyncio logs a traceback per attempt and stops accepting for a
second at a time; here one line per ``ACCEPT_LOG_INTERVAL_S`` says how many
failed, and a reserved descriptor is given up for a moment to accept the waiting
client and refuse it plainly, so the backlog never fills with clients nobody
answers. A client that connects and sends nothing is closed after
``HANDSHAKE_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import socket
import stat
import time
from pathlib import Path

from aotx.engine.errors import EngineError, ErrorCode, ProtocolError
from aotx.engine import protocol as P

log = logging.getLogger("aotx.server")

HANDSHAKE_TIMEOUT_S = 10.0
MAX_SOCKET_PATH = 107  # bytes in sockaddr_un.sun_path, less the terminating NUL (Linux)
MAX_CONNECTIONS = 256  # concurrent client connections (aotx-chat, aotx run, the gateway: one each)
FD_RESERVE = 128  # descriptors kept for the engine itself: model files, journal segments, capsules, logs
ACCEPT_LOG_INTERVAL_S = 10.0
REFUSE_READ_S = 1.0  # how long a refused client's hello is waited for, so the refusal reaches it
MAX_REFUSING = 32  # refused clients being answered at once; past that they are closed at once
_ACCEPT_BATCH = 64  # connections accepted per readiness event before yielding to the loop
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def fd_limit() -> int:
    """The soft RLIMIT_NOFILE (file descriptors this process may hold)."""
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_fd_limit(want: int = 1 << 16) -> int:
    """Raise the soft descriptor limit towards ``want`` (never above the hard limit),
    as servers do at start; returns the soft limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


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
        try:
            data = P.encode_frame(msg)
        except ProtocolError as e:  # an answer over the frame limit (a list of many conversations): say so
            data = P.encode_frame(P.Error(id=getattr(msg, "id", 0), code=ErrorCode.TOO_LONG, message=str(e)))
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
    """Accepts connections (at most ``max_connections`` at once) and posts their
    requests to ``engine.post(op, conn)``.

    ``welcome`` is a callable returning the ``Welcome`` message (model, device, ready).
    ``max_connections`` defaults to ``MAX_CONNECTIONS``, and is lowered to what the
    descriptor limit leaves after ``FD_RESERVE``."""

    def __init__(self, engine, sock_path: Path, welcome, lock: SocketLock | None = None,
                 max_connections: int | None = None):
        self.engine = engine
        self.path = Path(sock_path)
        self.welcome = welcome
        self.lock = lock or SocketLock(self.path)
        want = MAX_CONNECTIONS if max_connections is None else max_connections
        self.max_connections = max(1, min(want, fd_limit() - FD_RESERVE))
        self.n_clients = 0  # connections ever accepted (names them)
        self.active = 0  # connected now
        self.refused = 0  # refused for the limit, ever
        self._refusing = 0
        self._listen: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        self._conns: set[Connection] = set()  # greeted connections (told when the engine stops)
        self._reserve = -1  # a descriptor to give up when accept runs out of them
        self._accept_errors = 0  # since the last report
        self._accept_logged = -1e9
        self._refused_since = 0
        self._refuse_logged = -1e9
        self._paused = False

    async def start(self) -> None:
        if self.lock.fd < 0:
            self.lock.acquire()
        self._loop = asyncio.get_running_loop()
        self._listen = bind_socket(self.path)
        self._reserve = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._loop.add_reader(self._listen.fileno(), self._on_acceptable)
        log.info("accepting up to %d client connections", self.max_connections)

    async def close(self) -> None:
        """Stop accepting, tell every client the engine is stopping (a ``stopping`` Notice
        with id 0: a stop, not a crash), close every connection, remove the socket,
        release the lock."""
        if self._listen is not None:
            self._loop.remove_reader(self._listen.fileno())
            self._listen.close()
            self._listen = None
        bye = P.encode_frame(P.Notice(id=0, kind="stopping", resource="engine", message="the engine was stopped"))
        for conn in list(self._conns):
            conn._write(bye)
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2)
        if self._reserve >= 0:
            os.close(self._reserve)
            self._reserve = -1
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        self.lock.release()

    # ---- accepting ---------------------------------------------------------------

    def _on_acceptable(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                csock, _ = self._listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in _OUT_OF_FDS:
                    self._out_of_fds(e)
                else:
                    self._accept_failed(e)
                return
            csock.setblocking(False)
            if self.active >= self.max_connections:
                self._refuse(csock, f"too many connections: {self.active} clients are connected and the limit is "
                                    f"{self.max_connections}; close one (or wait) and try again")
                continue
            self.active += 1
            self.n_clients += 1
            t = self._loop.create_task(self._serve_socket(csock, self.n_clients))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    def _accept_failed(self, e: OSError) -> None:
        """Count a failed accept; log at most one line per ACCEPT_LOG_INTERVAL_S."""
        self._accept_errors += 1
        now = time.monotonic()
        if now - self._accept_logged >= ACCEPT_LOG_INTERVAL_S:
            log.warning("cannot accept client connections: %s (%d time(s) since the last report; %d clients "
                        "connected, limit %d)", e.strerror or e, self._accept_errors, self.active,
                        self.max_connections)
            self._accept_errors = 0
            self._accept_logged = now

    def _out_of_fds(self, e: OSError) -> None:
        """No descriptor for the waiting client: free the reserved one, accept and
        refuse the client plainly, take the reserve back. When even that fails, stop
        watching the socket for a moment (a ready socket nobody can accept from would
        otherwise spin the loop)."""
        self._accept_failed(e)
        if self._reserve >= 0:
            os.close(self._reserve)
            self._reserve = -1
            try:
                csock, _ = self._listen.accept()
            except OSError:
                csock = None
            if csock is not None:
                csock.setblocking(False)
                self._refuse(csock, "the engine has run out of file descriptors; try again in a moment", wait=False)
            try:
                self._reserve = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                pass
            if csock is not None:
                return
        if not self._paused and self._listen is not None:
            self._paused = True
            self._loop.remove_reader(self._listen.fileno())
            self._loop.call_later(0.1, self._resume_accepting)

    def _resume_accepting(self) -> None:
        self._paused = False
        if self._listen is not None:
            self._loop.add_reader(self._listen.fileno(), self._on_acceptable)
            self._on_acceptable()

    def _refuse(self, csock: socket.socket, message: str, wait: bool = True) -> None:
        """Answer one client with an Error (code ``too_many_connections``) and close it.

        The client sends its hello right after connecting; closing a Unix socket with
        unread data makes the client's next read fail with ECONNRESET before it sees
        the refusal, so the hello is read first: up to REFUSE_READ_S in a small task
        (at most MAX_REFUSING at once), or whatever already arrived when ``wait`` is
        false or too many are being refused."""
        self.refused += 1
        self._refused_since += 1
        now = time.monotonic()
        if now - self._refuse_logged >= ACCEPT_LOG_INTERVAL_S:
            log.warning("refused %d client connection(s) since the last report: %s", self._refused_since, message)
            self._refused_since = 0
            self._refuse_logged = now
        frame = P.encode_frame(P.Error(id=0, code="too_many_connections", message=message))
        if wait and self._refusing < MAX_REFUSING:
            self._refusing += 1
            t = self._loop.create_task(self._refuse_later(csock, frame))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
            return
        _drain_nowait(csock)
        try:
            csock.send(frame)
        except OSError:
            pass
        csock.close()

    async def _refuse_later(self, csock: socket.socket, frame: bytes) -> None:
        try:
            try:
                await asyncio.wait_for(self._loop.sock_recv(csock, 65536), REFUSE_READ_S)
            except (asyncio.TimeoutError, OSError):
                pass
            _drain_nowait(csock)
            try:
                csock.send(frame)
            except OSError:
                pass
        finally:
            self._refusing -= 1
            csock.close()

    async def _serve_socket(self, csock: socket.socket, number: int) -> None:
        try:
            try:
                reader, writer = await asyncio.open_unix_connection(sock=csock, limit=P.MAX_FRAME + 8)
            except OSError:
                csock.close()
                return
            await self._serve(reader, writer, number)
        finally:
            self.active -= 1

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        loop = asyncio.get_running_loop()
        conn = Connection(loop, writer, f"client-{number}")
        greeted = False
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
            conn.name = f"{hello.client or 'client'}-{number}"
            greeted = True
            self._conns.add(conn)
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
            self._conns.discard(conn)
            conn.closed = True
            self.engine.post_disconnect(conn)
            if greeted:
                log.info("client disconnected: %s", conn.name)
            try:
                await asyncio.wait_for(writer.drain(), 1)
            except (ConnectionError, RuntimeError, asyncio.TimeoutError, asyncio.CancelledError):
                pass
            writer.close()

    @staticmethod
    async def _read(reader: asyncio.StreamReader) -> P.Message:
        n = P.frame_length(await reader.readexactly(4))
        body = await reader.readexactly(n)
        return P.decode_payload(body)


def _drain_nowait(csock: socket.socket) -> None:
    """Read and drop what a client already sent (non-blocking, at most 1 MiB)."""
    try:
        for _ in range(16):
            if not csock.recv(65536):
                return
    except OSError:
        pass
