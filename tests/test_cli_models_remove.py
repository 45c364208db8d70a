"""``aotx models remove NAME`` of a remote model that the running engine has loaded.

Like ``ollama rm`` of a running model, the engine unloads it first, so that it is gone
from the engine as well as from the folder; while it generates the engine refuses and
nothing is removed. An in-process engine (the default model) on a socket, the remote
endpoint ``tests/fakes/openai_server.py``, the command line in this process.
"""

from __future__ import annotations

import asyncio

from aotx.engine import paths
from aotx.engine.cli.commands import main
from aotx.engine import protocol as P
from aotx.engine.runtime.catalog import RemoteSpec, write_remote
from tests.fakes.openai_server import FakeOpenAI


def test_bug_models_remove_of_a_loaded_remote_model_unloads_it_not_left_listed(engine_server, capsys):
    """The bug: the entry was deleted but the engine kept the model loaded and listed
    until `aotx unload`. Now: refused while it generates (entry kept, still loaded), then
    unloaded and removed, and the engine no longer lists it."""
    with FakeOpenAI(delay_s=0.3) as srv:
        h = engine_server(slots=2, context=256)
        entry = write_remote(paths.models_dir(), "cluster", RemoteSpec(url=srv.url, model="cluster"))
        remove = ["models", "remove", "cluster", "--socket", str(h.socket)]

        async def listed(c) -> dict[str, P.ModelInfo]:
            return {m.name: m for m in (await c.list_models()).models}

        async def go() -> None:
            c = await h.connect()
            try:
                await c.load_model("cluster")
                assert (await listed(c))["cluster"].loaded
                conv = await c.create_conversation(model="cluster")
                events = c.submit(conv.conv_id, "hi")
                async for ev in events:  # the reply has started: the model is generating
                    if isinstance(ev, P.Token):
                        break
                assert await asyncio.to_thread(main, remove) == 2
                err = capsys.readouterr().err
                assert "cluster is loaded in the running engine" in err and "generating" in err, err
                assert "nothing was removed" in err and len(err.strip().splitlines()) == 1
                assert entry.exists() and (await listed(c))["cluster"].loaded
                async for ev in events:  # let the reply end
                    pass
                assert await asyncio.to_thread(main, remove) == 0
                out = capsys.readouterr().out
                assert "removed remote model cluster" in out and "unloaded it from the running engine" in out
                assert not entry.exists() and "cluster" not in await listed(c)
            finally:
                await c.close()

        asyncio.run(go())
