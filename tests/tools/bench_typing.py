"""Keystroke-to-screen latency of the input while a long reply streams.

Runs ChatApp headless (Textual's run_test) against the scripted engine, which
streams a reply of ``--tokens`` tokens (Markdown with paragraphs, lists and code
blocks) at about ``--rate`` tokens/s, and types a key every ``--interval`` ms.
For each key it measures (1) until the input's text shows it and (2) until the
next screen update after that. It does the same with no reply streaming, as the
baseline. Prints p50/p99/max in milliseconds.

    python -m tests.tools.bench_typing [--tokens 10000] [--rate 1000]

Limits: headless, so "screen" means Textual composed the update for the
terminal, not that a terminal emulator drew it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import string
import tempfile
import time

from textual import events

PARAGRAPH = ("The **KV cache** keeps keys and values of past tokens, so decode reads them instead of "
             "recomputing; its size grows with context length and batch. ")
CODE = "```python\nfor i in range(10):\n    print(i * i)  # squares\n```\n\n"
LIST = "- prefill\n- decode\n- *verify*\n\n"


def long_reply(n_tokens: int, chars_per_token: int = 4) -> str:
    parts, size, i = [], 0, 0
    while size < n_tokens * chars_per_token:
        block = (PARAGRAPH * 3 + "\n\n", CODE, LIST)[i % 3]
        parts.append(block)
        size += len(block)
        i += 1
    return "".join(parts)[: n_tokens * chars_per_token]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def measure(app, pilot, n_keys: int, interval_s: float, while_streaming: bool) -> tuple[list, list]:
    text_ms, screen_ms = [], []
    displays: list[float] = []
    original = app._display

    def spy(screen, renderable):
        if renderable is not None:
            displays.append(time.perf_counter())
        return original(screen, renderable)

    app._display = spy
    try:
        for k in range(n_keys):
            if while_streaming and app.active is None:
                break
            key = string.ascii_lowercase[k % 26]
            before = len(app.chat_input.text)
            t0 = time.perf_counter()
            app._driver.send_message(events.Key(key, key))
            while len(app.chat_input.text) == before:
                await asyncio.sleep(0)
            t1 = time.perf_counter()
            text_ms.append((t1 - t0) * 1e3)
            deadline = t1 + 1.0
            while not any(d >= t1 for d in displays) and time.perf_counter() < deadline:
                await asyncio.sleep(0)
            t2 = next((d for d in displays if d >= t1), time.perf_counter())
            screen_ms.append((t2 - t0) * 1e3)
            displays.clear()
            await asyncio.sleep(interval_s)
    finally:
        app._display = original
    return text_ms, screen_ms


def report(label: str, text_ms: list[float], screen_ms: list[float]) -> None:
    for what, xs in (("input text", text_ms), ("screen update", screen_ms)):
        print(f"{label:<22} {what:<14} n={len(xs):<4} p50={statistics.median(xs):6.2f} ms  "
              f"p99={pct(xs, 99):6.2f} ms  max={max(xs):6.2f} ms")


async def run(n_tokens: int, rate: float, interval_ms: float, n_keys: int) -> None:
    from aotx.app.app import ChatApp
    from tests.fakes.fake_engine import FakeEngine

    text = long_reply(n_tokens)
    engine = FakeEngine(reply=lambda _t: text, token_delay=1.0 / rate)
    app = ChatApp(engine.connect, status_poll_s=0)
    async with app.run_test(size=(120, 40)) as pilot:
        await app.workers.wait_for_complete()
        await pilot.pause()
        idle = await measure(app, pilot, min(n_keys, 100), interval_ms / 1e3, while_streaming=False)
        app.chat_input.clear()
        app.chat_input.insert("Tell me everything about KV caches")
        await pilot.press("enter")
        while app.active is None or not app.active.accepted:
            await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        busy = await measure(app, pilot, n_keys, interval_ms / 1e3, while_streaming=True)
        while app.active is not None:
            await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - t0
        reply = app.messages()[-1]
        await pilot.pause()
    print(f"reply: {reply.n_tokens} tokens, {len(reply.text)} chars in {elapsed:.1f} s "
          f"({reply.n_tokens / elapsed:.0f} tokens/s), a key every {interval_ms:.0f} ms")
    report("idle", *idle)
    report("while streaming", *busy)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=10_000)
    p.add_argument("--rate", type=float, default=1000.0, help="tokens/s the fake engine aims for")
    p.add_argument("--interval", type=float, default=40.0, help="ms between keys")
    p.add_argument("--keys", type=int, default=100_000, help="at most this many keys while streaming")
    a = p.parse_args(argv)
    os.environ.setdefault("AOTX_HOME", tempfile.mkdtemp(prefix="aotx-bench-"))
    asyncio.run(run(a.tokens, a.rate, a.interval, a.keys))


if __name__ == "__main__":
    main()
