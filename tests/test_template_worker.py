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


@pytest.mark.parametrize("source", ['{{ "a\\ud800b" }}', '{{ "x%c"|format(56320) }}'])
def test_a_template_whose_output_is_not_valid_unicode_is_refused_naming_it_and_its_worker_lives_on(pool, source):
    """A lone surrogate in the output could not be sent back: the worker died (exit status 1)
    and the message said the template "was stopped" for no stated reason, after a second
    render on a fresh worker; in the engine itself, it reached the tokenizer."""
    t = ChatTemplate(source, name="odd")
    t.workers = pool
    ok = ChatTemplate(CHATML_TEMPLATE)
    ok.workers = pool
    ok.render(MSGS)
    started, replaced = pool.started, pool.replaced
    with pytest.raises(TemplateError, match=r"odd produced text that is not valid Unicode \(a lone surrogate at "
                                            r"character 1\)"):
        t.render(MSGS)
    assert (pool.started, pool.replaced) == (started, replaced)
    t.workers = None
    with pytest.raises(TemplateError, match="odd produced text that is not valid Unicode"):
        t.render(MSGS)


def test_a_template_that_ends_its_worker_is_rendered_once_not_twice(pool):
    """A worker that died in the middle of a render was taken for one that had died while
    idle, and the render ran again on a fresh worker: every hostile template cost twice
    its CPU limit (and a second worker start)."""
    ok = ChatTemplate(CHATML_TEMPLATE)
    ok.workers = pool
    ok.render(MSGS)  # an idle worker that has rendered before
    t = ChatTemplate(CPU_HOG, name="slow")
    t.workers = pool
    started, replaced = pool.started, pool.replaced
    with pytest.raises(TemplateError, match="slow was stopped: the operating system stopped it for its CPU time"):
        t.render(MSGS, budget=RenderBudget(cpu_seconds=0.5))
    assert (pool.started, pool.replaced) == (started, replaced + 1)


@pytest.fixture(scope="module")
def verbose_lm(tiny_gguf, tmp_path_factory):
    """A tiny llama whose template writes as many characters as a message's digits say."""
    from aotx.engine.model.loader import load_model

    template = ('{% for m in messages %}<|{{ m.role }}|>{{ m.content }}'
                '{{ "x" * (m.content|int) if m.content is number or m.content.isdigit() else "" }}{% endfor %}')
    p = tiny_gguf.write_tiny_llama(tmp_path_factory.mktemp("verbose") / "verbose.gguf", context_length=1024,
                                   metadata={"tokenizer.chat_template": template, "general.name": "Verbose Tiny"})
    return load_model(p, device="cpu")


def _refusals(lm, texts: list[str]) -> tuple[list[P.Error], list[float], list[float]]:
    """Each text sent as a message of one conversation: the refusals, how long each took,
    the process's RSS (MiB) after each."""
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store

    store = open_store(None)
    eng = Engine(lm, store, n_slots=1, n_ctx=512, prefill_chunk=64, device="cpu")
    eng.start()
    errors, times, levels = [], [], []
    try:
        s = EventSink()
        eng.post(P.CreateConversation(id=1, title="t"), s)
        conv = s.wait(30).conversation.conv_id
        for i, text in enumerate(texts):
            s = EventSink()
            t0 = time.monotonic()
            eng.post(P.SubmitMessage(id=2 + i, conv_id=conv, text=text), s)
            errors.append(s.wait(120))
            times.append(time.monotonic() - t0)
            levels.append(rss_mib())
    finally:
        eng.stop()
        store.close()
    return errors, times, levels


def test_a_template_output_that_cannot_fit_the_context_is_refused_before_it_is_tokenized(verbose_lm):
    """A template may write up to 32 Mi characters, which no context holds: the engine
    tokenized them all anyway (97 s of CPU for 30 M characters on the default model).
    The size floor that refuses a long message before its tokenization now applies to
    the prompt the template made too."""
    from aotx.engine.runtime.prepare import longest_piece

    n = 2 * 512 * longest_piece(verbose_lm.tokenizer)  # past the floor, within what a render may write
    errors, times, _ = _refusals(verbose_lm, [str(n)])
    [err] = errors
    assert isinstance(err, P.Error) and err.code == ErrorCode.TOO_LONG, err
    assert "the prompt the chat template made is" in err.message and "characters, at least" in err.message
    assert "\n" not in err.message and times[0] < 10


def test_a_template_writing_far_more_than_the_context_holds_is_stopped_in_its_worker(verbose_lm):
    """30 M characters crossed from the worker to the engine for each message and the
    engine's RSS kept growing (440 -> 503 -> 589 -> 644 -> 672 MB on the default model,
    after the prompt was no longer tokenized): a render may now write only what a prompt
    that fits the context could need, and what it writes stays in its worker."""
    errors, times, levels = _refusals(verbose_lm, ["1"] + ["30000000"] * 4)
    for err in errors[1:]:
        assert isinstance(err, P.Error) and err.code == ErrorCode.BAD_REQUEST, err
        assert "Verbose Tiny' was stopped: it" in err.message and "1,048,576" in err.message
        assert "\n" not in err.message
    assert max(times[1:]) < 10
    assert max(levels[1:]) - levels[1] < 16, levels
