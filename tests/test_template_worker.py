"""Chat templates render where the operating system bounds their memory and CPU.

A chat template is code from a model file. The sandbox's checks bound what they see,
but a width given as an argument (``"{:>{}}".format("x", N)``, ``"%*s" % (N, "x")``,
``"%*s"|format(N, "x")``) or ``lipsum(300000, ...)`` used to run in C or library code
between two checkpoints, in the engine: it peaked at 6.3 GB, kept about 950 MB per
refused message, and ran 51 s of CPU against a 2 s budget. Now those are refused by
the sandbox before they run, and a template that gets past every check is rendered
in a worker process with ``RLIMIT_AS`` and ``RLIMIT_CPU``: it is stopped by the OS,
the worker is replaced, and the engine's memory stays at its level.
"""

from __future__ import annotations

import resource
import time

import pytest

from aotx.engine import protocol as P
from aotx.engine.errors import ErrorCode, TemplateError
from aotx.engine.model.chat_template import CHATML_TEMPLATE, ChatTemplate, encode_chat
from aotx.engine.model.gguf_file import GGUFFile
from aotx.engine.model.template_sandbox import RenderBudget
from aotx.engine.model.template_worker import TemplateWorkers
from aotx.engine.model.tokenizer import Tokenizer
from tests.fakes.sink import EventSink

N = 4_000_000_000
ISSUE_CASES = {
    "str.format width argument": '{{ "{:>{}}".format("x", %d) }}' % N,
    "% with a * width": '{{ "%%*s" %% (%d, "x") }}' % N,
    "|format with a * width": '{{ "%%*s"|format(%d, "x") }}' % N,
    "lipsum of 300000 paragraphs": "{{ lipsum(300000, false, 20, 100) }}",
}
# past every check of the sandbox: three lists of 30 M items, each under the size limit
MEMORY_HOG = ('{% set a = ("x" * 30000000)|list %}{% set b = ("y" * 30000000)|list %}'
              '{% set c = ("z" * 30000000)|list %}{{ a|length + b|length + c|length }}')
# one library call (textwrap) over 15 M characters: no checkpoint inside it
CPU_HOG = '{{ ("word " * 3000000)|wordwrap(5)|length }}'
MSGS = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 20} for i in range(10)]


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@pytest.fixture(scope="module")
def pool():
    p = TemplateWorkers()
    yield p
    p.close()


@pytest.mark.parametrize("case", list(ISSUE_CASES))
def test_widths_given_as_arguments_and_lipsum_are_refused_before_they_run(case):
    """Each used to bypass the 2 s and 32 Mi-character limits in the engine itself."""
    t = ChatTemplate(ISSUE_CASES[case], name="hostile")
    before = rss_mib()
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match="hostile was stopped: it tried to build"):
        t.render(MSGS)
    assert time.monotonic() - t0 < 2 and rss_mib() - before < 32


@pytest.mark.parametrize("case", list(ISSUE_CASES))
def test_the_issue_cases_are_refused_in_a_worker_too(pool, case):
    t = ChatTemplate(ISSUE_CASES[case], name="hostile")
    t.workers = pool
    with pytest.raises(TemplateError, match="hostile was stopped"):
        t.render(MSGS)


def test_a_template_past_every_check_is_stopped_by_the_os_memory_limit_and_the_engine_stays_small(pool):
    """Three 30 M-item lists pass every size check (about 720 MB in the engine, before):
    the worker's RLIMIT_AS refuses them; the engine's RSS does not move; the worker is
    replaced and the next render works."""
    t = ChatTemplate(MEMORY_HOG, name="hog")
    t.workers = pool
    ok = ChatTemplate(CHATML_TEMPLATE)
    ok.workers = pool
    ok.render(MSGS)
    before, replaced = rss_mib(), pool.replaced
    for _ in range(2):
        with pytest.raises(TemplateError, match="operating system refused it more than 512 MiB of memory"):
            t.render(MSGS)
    assert pool.replaced == replaced + 2
    assert rss_mib() - before < 32, (before, rss_mib())
    assert ok.render(MSGS) == ChatTemplate(CHATML_TEMPLATE).render(MSGS)


def test_a_template_stalling_inside_one_library_call_is_stopped_by_the_os_cpu_limit(pool):
    """A single call runs past the sandbox's CPU checkpoints; RLIMIT_CPU ends the worker."""
    t = ChatTemplate(CPU_HOG, name="slow")
    t.workers = pool
    t0 = time.monotonic()
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with pytest.raises(TemplateError, match="slow was stopped: the operating system stopped it for its CPU time"):
        t.render(MSGS, budget=RenderBudget(cpu_seconds=0.5))
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
    assert used < 4, used  # the budget (0.5 s) and the slack, not the call's full run
    assert time.monotonic() - t0 < 60


def test_templates_render_the_same_in_a_worker_and_the_round_trip_is_short(pool, default_model_path, capsys):
    meta = GGUFFile.open(default_model_path).metadata
    tok, tmpl = Tokenizer.from_metadata(meta), ChatTemplate.from_metadata(meta)
    here = [encode_chat(tok, tmpl, MSGS[:k]) for k in range(1, 8)]
    tmpl.workers = pool
    there = [encode_chat(tok, tmpl, MSGS[:k]) for k in range(1, 8)]
    assert here == there
    times = {}
    for mode in ("in-process", "worker"):
        tmpl.workers = pool if mode == "worker" else None
        tmpl.render(MSGS)
        ws = []
        for _ in range(100):
            a = time.perf_counter()
            tmpl.render(MSGS)
            ws.append(time.perf_counter() - a)
        times[mode] = sorted(ws)[50] * 1e3
    with capsys.disabled():
        print(f"\n[template worker] median render of 10 messages: in-process {times['in-process']:.3f} ms, "
              f"in a worker {times['worker']:.3f} ms (a message renders twice: ~{2 * (times['worker'] - times['in-process']):.2f} ms more)")
    assert times["worker"] < times["in-process"] + 20


@pytest.fixture(scope="module")
def hostile_lm(tiny_gguf, tmp_path_factory):
    from aotx.engine.model.loader import load_model

    template = ('{% set w = 4000000000 %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}'
                '{{ "{:>{}}".format("", w) if m.content == "grow" else "" }}{% endfor %}')
    p = tiny_gguf.write_tiny_llama(tmp_path_factory.mktemp("hostile") / "evil.gguf", context_length=1024,
                                   metadata={"tokenizer.chat_template": template, "general.name": "Evil Tiny"})
    return load_model(p, device="cpu")


def test_the_engine_refuses_a_growing_template_each_time_and_keeps_its_memory(hostile_lm):
    """Each refused message used to leave ~950 MB in the engine (410 -> 1,364 -> 2,318 ->
    3,272 MB); now every refusal is one line and the engine's RSS stays at its level."""
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store

    store = open_store(None)
    eng = Engine(hostile_lm, store, n_slots=1, n_ctx=512, prefill_chunk=64, device="cpu")
    eng.start()
    try:
        s = EventSink()
        eng.post(P.CreateConversation(id=1, title="t"), s)
        conv = s.wait(30).conversation.conv_id
        levels = []
        for i in range(4):
            s = EventSink()
            eng.post(P.SubmitMessage(id=2 + i, conv_id=conv, text="grow"), s)
            err = s.wait(60)
            assert isinstance(err, P.Error) and err.code == ErrorCode.BAD_REQUEST, s.events
            assert "was stopped" in err.message and "\n" not in err.message
            levels.append(rss_mib())
        assert max(levels) - levels[0] < 32, levels
    finally:
        eng.stop()
        store.close()
