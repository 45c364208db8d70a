"""A local stand-in for the Hugging Face Hub's file endpoints, for ``aotx pull`` tests.

It answers in the Hub's URL layout, as ``huggingface_hub`` expects it:

* ``HEAD|GET /{org}/{repo}/resolve/{revision}/{path}``: ``302`` to the file's CDN URL
  (absolute, as the Hub's LFS files are), with ``X-Repo-Commit``, ``X-Linked-Etag`` (the
  sha256 of an LFS file, quoted), ``X-Linked-Size`` and ``ETag``; ``404`` with
  ``X-Error-Code: EntryNotFound`` for an unknown file;
* ``HEAD|GET /cdn/{key}``: the bytes, honouring ``Range: bytes=a-b`` with ``206``.

Knobs for failures: ``drop_at`` (a byte offset: while set, every download body stops
there and the connection is closed mid-response, so a download makes no progress past it;
range reads from byte 0, the header reads, are served), ``ignore_range`` (while set, the
CDN ignores ``Range`` as some servers and proxies do: ``200`` and the whole file), and
``publish_sha`` (the sha256 the HEAD claims, to fake a checksum mismatch). ``log`` records
(method, path, Range header) of every request.
"""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    """``files``: ``"org/repo/path"`` -> bytes. Use as a context manager; ``endpoint`` is its base URL."""

    def __init__(self, files: dict[str, bytes], revision_commit: str = "0" * 40):
        self.files = dict(files)
        self.commit = revision_commit
        self.drop_at: int | None = None
        self.ignore_range = False
        self.publish_sha: dict[str, str] = {}
        self.log: list[tuple[str, str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._serve(head=True)

            def do_GET(self) -> None:
                self._serve(head=False)

            def _serve(self, head: bool) -> None:
                hub.log.append((self.command, self.path, self.headers.get("Range", "")))
                parts = self.path.split("?")[0].lstrip("/").split("/")
                if len(parts) >= 5 and parts[2] == "resolve":
                    key = "/".join(parts[:2] + parts[4:])
                    data = hub.files.get(key)
                    if data is None:
                        self.send_response(404)
                        self.send_header("X-Error-Code", "EntryNotFound")
                        self.send_header("X-Error-Message", "Entry not found")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    sha = hub.publish_sha.get(key, hashlib.sha256(data).hexdigest())
                    self.send_response(302)
                    self.send_header("Location", f"{hub.cdn}/cdn/{key}")
                    self.send_header("X-Repo-Commit", hub.commit)
                    self.send_header("X-Linked-Etag", f'"{sha}"')
                    self.send_header("X-Linked-Size", str(len(data)))
                    self.send_header("ETag", '"gitoid"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if parts[0] == "cdn":
                    data = hub.files.get("/".join(parts[1:]))
                    if data is None:
                        self.send_response(404)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    start, end = 0, len(data) - 1
                    rng = "" if hub.ignore_range else self.headers.get("Range", "")
                    if rng.startswith("bytes="):
                        a, _, b = rng[6:].partition("-")
                        start = int(a or 0)
                        end = min(int(b), len(data) - 1) if b else len(data) - 1
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    body = data[start:end + 1]
                    self.send_response(206 if rng else 200)
                    if rng:
                        self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                    self.send_header("Content-Length", str(len(body)))
                    self.send_header("Accept-Ranges", "bytes")
                    self.end_headers()
                    if head:
                        return
                    if hub.drop_at is not None and not rng.startswith("bytes=0-"):  # header reads pass
                        cut = max(0, hub.drop_at - start)
                        self.wfile.write(body[:cut])
                        self.wfile.flush()
                        self.close_connection = True
                        try:
                            import socket

                            self.connection.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass
                        return
                    self.wfile.write(body)
                    return
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        # the CDN is another host, as the Hub's is (huggingface_hub follows same-host redirects)
        self.cdn = f"http://localhost:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="fake-hub", daemon=True)

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def downloads(self) -> list[str]:
        """The Range headers of body requests to the CDN ('' for a whole-file GET)."""
        return [r for m, p, r in self.log if m == "GET" and p.startswith("/cdn/")]
