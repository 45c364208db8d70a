"""The refusal of a model load that does not fit: what it advises must work.

It advised `aotx unload` of the engine's default model, which `aotx unload` then refuses
("it stays loaded"). Now the models `aotx unload` can free are listed for it, and the
default is offered only as what --evict-idle or making the new model the default frees."""

from __future__ import annotations

from aotx.engine.runtime.catalog import Catalog
from aotx.engine.runtime.models import ModelSet


class Loaded:
    def __init__(self, name: str, nbytes: int, last_used: float) -> None:
        self.name, self.terms, self.last_used, self.default = name, (("weights", nbytes),), last_used, False

    def in_flight(self) -> int:
        return 0


def test_the_refusal_never_advises_unloading_the_default(tmp_path):
    ms = ModelSet(Catalog(tmp_path), total=300 << 20)
    ms.add(Loaded("SmolLM2", 200 << 20, 1.0), default=True)
    msg = str(ms.refusal("qwen", (("weights", 400 << 20),), estimated=True))
    assert "`aotx unload" not in msg and "no model loaded beside the default is idle" in msg
    assert "the default model SmolLM2 frees 200.0 MiB only if the engine runs with --evict-idle" in msg
    assert "`aotx stop`, then `aotx run --model qwen`" in msg
    ms.add(Loaded("tiny", 20 << 20, 2.0))
    msg = str(ms.refusal("qwen", (("weights", 400 << 20),), estimated=True))
    assert "idle models: tiny frees 20.0 MiB (`aotx unload NAME`" in msg and "SmolLM2 frees 200.0 MiB (" not in msg
