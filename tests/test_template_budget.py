"""Hostile chat templates are stopped by the render budget: each is refused with a
TemplateError naming the template and the limit it passed, after bounded time and
memory, and ordinary templates render exactly as before (the llama.cpp references in test_chat_template.py).
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from aotx.engine.errors import TemplateError
from aotx.engine.model.chat_template import ChatTemplate
from aotx.engine.model.template_sandbox import RenderBudget

NAME = "tokenizer.chat_template of 'Evil 1B'"
FAST = RenderBudget(cpu_seconds=0.3, max_chars=1 << 20)
MSGS = [{"role": "user", "content": "hello " * 1000}]

# id -> (template, regex of the limit named). "cpu": stopped by time; others by size.
HOSTILE = {
    # the template of the report: 10^10 empty iterations
    "nested-range": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "cpu"),
    "nested-content-loops": ("{% for c in messages[0]['content'] %}{% for d in messages[0]['content'] %}"
                             "{% endfor %}{% endfor %}", "cpu"),
    "exponential-macro": ("{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% else %}x{% endif %}{% endmacro %}"
                          "{{ f(60) }}", "cpu"),
    "recursive-loop": ("{% for x in range(2) recursive %}{% for y in range(100000) %}{% endfor %}"
                       "{{ loop(range(2)) }}{% endfor %}", r"cpu|RecursionError"),
    "string-times-huge": ("{{ 'x' * 10**12 }}", r"operator \*\) of 1,000,000,000,000"),
    "list-times-huge": ("{{ ([1] * 100000) * 100000 }}", r"operator \*\) of 10,000,000,000"),
    "doubling-tilde": ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}", r"operator ~\)"),
    "doubling-plus": ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
                      "{% endfor %}", r"operator \+\)"),
    "integer-power": ("{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n ** 2 %}"
                      "{% endfor %}", r"integer power|multiply integers"),
    "center-filter": ("{{ 'a'|center(10**10) }}", r"\|center\) of 10,000,000,000"),
    "ljust-method": ("{{ 'a'.ljust(10**10) }}", r"str\.ljust\) of 10,000,000,000"),
    "percent-width": ("{{ '%1000000000d' % 1 }}", r"formatted field of 1,000,000,000"),
    "format-width": ("{{ '{:>1000000000}'.format(1) }}", r"formatted field of 1,000,000,000"),
    "replace-doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                         "{% set ns.s = ns.s|replace('a', 'aa') %}{% endfor %}", r"\|replace\)"),
    "batch-fill": ("{{ [1]|batch(10**10, 'x')|list }}", r"\|batch\) of 10,000,000,000"),
    "indent-huge": ("{{ messages[0]['content']|indent(10**9) }}", r"\|indent\)"),
    "join-huge": ("{{ ([messages[0]['content']] * 1000)|join }}", r"\|join\) of 6,000,000"),
    "tojson-indent": ("{{ messages|tojson(indent=10**9) }}", r"indent of 1,000,000,000"),
    "output-flood": ("{% for i in range(100000) %}{{ messages[0]['content'] }}{% endfor %}", r"output passed"),
}


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_hostile_template_is_refused_naming_template_and_limit(case):
    src, limit = HOSTILE[case]
    t0 = time.process_time()
    with pytest.raises(TemplateError) as ei:
        ChatTemplate(src, name=NAME).render(MSGS, budget=FAST)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    if limit == "cpu":
        assert msg.startswith(NAME) and "more than 0.3 s of CPU time" in msg, msg
    elif "RecursionError" in limit:
        assert re.search(r"0\.3 s of CPU time|RecursionError", msg), msg
    else:
        assert msg.startswith(NAME) and re.search(limit, msg), f"{limit!r} not in {msg!r}"
    # bounded: the process did not spend much more than the budget (generous for CI)
    assert time.process_time() - t0 < 10, msg


def test_default_budget_stops_the_reported_template():
    """Regression: the template of the report hung the engine
    forever; with no budget given, the default (2 s of CPU) stops it."""
    src = HOSTILE["nested-range"][0]
    t = ChatTemplate.from_metadata({"tokenizer.chat_template": src, "general.name": "Evil 1B"})
    assert t.name == NAME
    with pytest.raises(TemplateError, match=r"^tokenizer\.chat_template of 'Evil 1B' was stopped: it ran for more "
                                            r"than 2 s of CPU time"):
        t.render(MSGS)


def test_budget_is_per_thread_cpu_time():
    """Two renders at once on two threads each get their own budget: a hostile one
    is stopped while a normal one on another thread completes with its output."""
    evil = ChatTemplate(HOSTILE["nested-range"][0], name=NAME)
    good = ChatTemplate("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
    errors: list[str] = []

    def run_evil() -> None:
        try:
            evil.render(MSGS, budget=FAST)
        except TemplateError as e:
            errors.append(str(e))

    th = threading.Thread(target=run_evil)
    th.start()
    out = good.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], budget=FAST)
    th.join(30)
    assert out == "[user] hi[assistant] yo"
    assert not th.is_alive() and len(errors) == 1 and "CPU time" in errors[0]


@pytest.mark.parametrize("src,expected", [
    ("{{ 'ab' * 3 }}", "ababab"),
    ("{{ ('%5d' % 42) ~ '|' ~ '{:>4}'.format('x') }}", "   42|   x"),
    ("{{ 'a'|center(5) }}|{{ 'b'.ljust(3) }}|", "  a  |b  |"),
    ("{{ [1, 2] * 2 }} {{ 2 ** 10 }} {{ 'x,y'|replace(',', ', ') }}", "[1, 2, 1, 2] 1024 x, y"),
    ("{% for i in range(3) %}{{ loop.index }}/{{ loop.length }}{% if not loop.last %},{% endif %}{% endfor %}",
     "1/3,2/3,3/3"),
    ("{% for x in [] %}a{% else %}empty{% endfor %}", "empty"),
    ("{{ messages|map(attribute='role')|join('+') }} {{ {'a': 1}|tojson }}", "user+assistant {\"a\": 1}"),
], ids=["mul", "formats", "pad", "ops", "loop-vars", "for-else", "filters"])
def test_budgeted_operations_give_jinja_results(src, expected):
    """The checkpoints change no result: loop variables, for/else, formatting and
    filters behave as in plain Jinja."""
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert ChatTemplate(src).render(msgs, budget=FAST) == expected


def test_filters_over_literals_are_not_run_when_the_template_compiles():
    """Jinja folds constant expressions while compiling: ``{{ 'a'|center(200000000) }}``
    allocated its 200 MB string at model load, outside any budget. It runs at render
    time now, where the budget refuses it."""
    import tracemalloc

    tracemalloc.start()
    try:
        t = ChatTemplate("{{ 'a'|center(200000000) }}{{ 'x'|upper }}", name=NAME)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20, peak
    with pytest.raises(TemplateError, match=r"\|center\) of 200,000,000"):
        t.render(MSGS, budget=FAST)
    assert ChatTemplate("{{ 'ab'|upper }}{{ [3, 1]|sort|join(',') }}").render([]) == "AB1,3"


def test_template_nested_too_deeply_to_compile_is_a_template_error():
    with pytest.raises(TemplateError, match=r"nested too deeply to compile"):
        ChatTemplate("{{" + "(" * 5000 + "1" + ")" * 5000 + "}}", name=NAME)
