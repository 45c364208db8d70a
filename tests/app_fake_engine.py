"""Test helpers around the scripted engine (``tests.fakes.fake_engine``).

``make_app()`` builds a ChatApp wired to a FakeEngine (never a real engine) and
``settle()`` waits until its workers and streams are done.
"""

from __future__ import annotations

from aotx.app.app import ChatApp
from tests.fakes.fake_engine import FakeEngine, FakeEngineClient  # noqa: F401 - re-exported


def make_app(engine: FakeEngine | None = None, **kwargs) -> tuple[ChatApp, FakeEngine]:
    engine = engine or FakeEngine()
    kwargs.setdefault("status_poll_s", 0)
    return ChatApp(engine.connect, **kwargs), engine


async def settle(pilot, rounds: int = 3) -> None:
    """Let workers finish and the screen catch up."""
    for _ in range(rounds):
        await pilot.app.workers.wait_for_complete()
        await pilot.pause()
