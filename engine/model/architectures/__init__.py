"""Architecture registry: ``general.architecture`` -> the module that describes it.

Each architecture is one readable module stating its tensors (``tensors(cfg)``) and its
block (``forward(b, cfg, w)``, calls on ``ops.ProgramBuilder``), checked against
llama.cpp's ``src/models/<arch>.cpp``; ``engine/model/transformer.py`` loads, traces and
runs any of them on any backend. Others join by adding a module and a line to ``REGISTRY``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from aotx.engine.errors import ModelError

REGISTRY = {name: f"aotx.engine.model.architectures.{name}"
            for name in ("gemma3", "gemma4", "lfm2", "llama", "olmoe", "phi3", "qwen2", "qwen3", "qwen35", "qwen35moe",
                         "qwen3moe", "qwen3next")}
REGISTRY["gpt-oss"] = "aotx.engine.model.architectures.gptoss"   # a module name cannot hold the dash


def get_architecture(name: str, path: str = "model") -> ModuleType:
    """The module for architecture ``name``. Raises ModelError listing what is supported."""
    mod = REGISTRY.get(name)
    if mod is None:
        raise ModelError(f"{path}: architecture {name!r} is not supported "
                         f"(supported: {', '.join(sorted(REGISTRY))})")
    return importlib.import_module(mod)


def build(cfg, gf, backend):
    """Load ``gf`` (config ``cfg``) onto ``backend`` with the module of ``cfg.arch``
    (``transformer.build``). Raises ModelError as that does."""
    from aotx.engine.model.transformer import build as build_model

    return build_model(cfg, gf, backend, get_architecture(cfg.arch, str(gf.path)))
