"""Architecture registry: ``general.architecture`` -> the module that runs it.

Each architecture is one readable module exposing ``build(config, gguf_file, backend)``
that checks the tensors and returns a model object with ``forward`` and
``new_kv_cache``. Others join by adding a line to ``REGISTRY``.
"""

from __future__ import annotations

from types import ModuleType

from aotx.engine.errors import ModelError


def _llama() -> ModuleType:
    from aotx.engine.model.architectures import llama

    return llama


REGISTRY = {"llama": _llama}


def get_architecture(name: str, path: str = "model") -> ModuleType:
    """The module for architecture ``name``. Raises ModelError listing what is supported."""
    loader = REGISTRY.get(name)
    if loader is None:
        raise ModelError(f"{path}: architecture {name!r} is not supported "
                         f"(supported: {', '.join(sorted(REGISTRY))})")
    return loader()
