"""A scripted OpenAI-compatible server for the failures a real one is hard to make fail on cue.

``/v1/chat/completions`` and ``/v1/completions`` stream server-sent events the way
OpenAI's API (and vLLM, llama-server) shape them: ``data: {chunk}`` lines with
``choices[0].delta.content`` (chat) or ``choices[0].text``, a last chunk with
``finish_reason``, a usage chunk, ``data: [DONE]``. ``mode`` picks the behaviour:

* ``ok``: ``words`` streamed one per event, ``delay_s`` apart;
* ``drop``: ``drop_after`` words, then the connection is closed mid-stream;
* ``status``: answer ``status`` (e.g. 429, 503) with an OpenAI error body and
  ``Retry-After: 0`` for the first ``fail_times`` requests, then behave as ``ok``;
* ``garbage``: ``200`` with an HTML page instead of an event stream;
* ``multiline``: as ``ok``, each event's JSON split over several ``data:`` lines (the
  SSE format joins them with newlines), with a comment line and an ``id:`` field between.

``requests`` keeps every request body (parsed JSON) with its arrival time
(``time.monotonic()``); ``headers`` their Authorization headers; ``peers`` the client's
(address, port) of each request (one kept-alive connection reuses a port).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeOpenAI:
    def __init__(self, words: list[str] | None = None, *, mode: str = "ok", delay_s: float = 0.0,
                 drop_after: int = 2, status: int = 503, fail_times: int = 1 << 30):
        self.words = words or ["Hello", " from", " the", " remote", " side", "."]
        self.mode = mode
        self.delay_s = delay_s
        self.drop_after = drop_after
        self.status = status
        self.fail_times = fail_times
        self.requests: list[tuple[float, dict]] = []
        self.headers: list[str] = []
        self.peers: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a) -> None:
                pass

            def do_GET(self) -> None:
                if self.path.rstrip("/") == "/v1/models":
                    body = json.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]}).encode()
                    self._send(200, body, "application/json")
                else:
                    self._send(404, b"{}", "application/json")

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                with fake._lock:
                    fake.requests.append((time.monotonic(), body))
                    fake.headers.append(self.headers.get("Authorization", ""))
                    fake.peers.append(self.client_address[:2])
                    count = len(fake.requests)
                chat = self.path.endswith("/chat/completions")
                if fake.mode == "status" and count <= fake.fail_times:
                    err = json.dumps({"error": {"message": f"the server is busy ({fake.status})", "type": "busy"}})
                    self._send(fake.status, err.encode(), "application/json", {"Retry-After": "0"})
                    return
                if fake.mode == "garbage":
                    self._send(200, b"<html><body>Gateway says hi</body></html>", "text/html")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                words = fake.words[:fake.drop_after] if fake.mode == "drop" else fake.words
                for w in words:
                    choice = {"index": 0, "delta": {"content": w}} if chat else {"index": 0, "text": w}
                    self._event({"id": "x", "object": "chat.completion.chunk", "choices": [choice]})
                    if fake.delay_s:
                        time.sleep(fake.delay_s)
                if fake.mode == "drop":
                    self.wfile.flush()
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                end = {"index": 0, "delta": {}, "finish_reason": "stop"} if chat else \
                    {"index": 0, "text": "", "finish_reason": "stop"}
                self._event({"id": "x", "choices": [end]})
                self._event({"id": "x", "choices": [], "usage": {"prompt_tokens": 7,
                                                                 "completion_tokens": len(words)}})
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")

            def _event(self, obj) -> None:
                if fake.mode == "multiline":  # pretty-printed: one data: line per line of JSON
                    lines = json.dumps(obj, indent=1).splitlines()
                    self._chunk(b": a comment\nid: 7\n" + b"".join(b"data: " + ln.encode() + b"\n" for ln in lines)
                                + b"\n")
                    return
                self._chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _send(self, status: int, body: bytes, ctype: str, headers: dict | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, name="fake-openai", daemon=True)

    def __enter__(self) -> "FakeOpenAI":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    """A TCP port nothing listens on (bound and released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
