"""Test helpers around the scripted engine (``tests.fakes.fake_engine``).

``make_app()`` builds a ChatApp wired to a FakeEngine (never a real engine),
``settle()`` waits until its workers and streams are done, ``until()`` waits (bounded)
for a condition, ``notice()`` and ``chips()`` read the input's notice line and the
attachment chips.
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


async def until(pilot, cond, tries: int = 150) -> None:
    """Wait until ``cond()`` holds: at most ``tries`` pauses of 20 ms, then fail."""
    for _ in range(tries):
        if cond():
            return
        await pilot.pause(0.02)
    raise AssertionError("condition not reached")


def notice(app) -> str:
    """The notice line above the input."""
    return str(app.query_one("#input-notice").render())


def chips(app) -> list[str]:
    """The names of the attachment chips waiting for the next message."""
    from aotx.app.widgets.chips import AttachmentBar

    return [a.name for a in app.query_one(AttachmentBar).attachments]
