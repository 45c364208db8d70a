"""The Jinja2 sandbox chat templates render in, with a time and size budget.

Owns: the environment ``chat_template.py`` compiles templates in (Hugging Face's
``ImmutableSandboxedEnvironment`` setup) and the budget that bounds one render:
CPU seconds of the rendering thread, and the length of any string or list the
template builds (its output included). A chat template comes from a model file,
so it is input a stranger wrote: ``{% for i in range(100000) %}{% for j in
range(100000) %}{% endfor %}{% endfor %}`` is a valid template that never ends,
and ``{{ 'x' * 10**12 }}`` one that exhausts memory. Leaves to others: what the
template means and the prompt-injection rule (``chat_template.py``), and running
renders off the engine's tick thread (the runtime's preparation stage).

How the budget is enforced, without killing threads. Every way a template can do
unbounded work passes through a checkpoint:

* loops: every ``{% for %}`` iterable is wrapped (a rewrite of the parsed
  template) in ``budget_iter``, a checkpoint every 8 items;
* recursion (macros, ``loop(...)``) and method calls go through the sandbox's
  ``call``, which checks the clock and the size of what the call returned;
* strings and lists are made bigger only by operators (``+``, ``*``, ``**``,
  ``%``: intercepted and checked before they run), ``~`` (its result checked),
  filters and methods (sizes estimated before the known amplifiers run:
  ``center``, ``ljust``, ``replace``, ``join``, ``indent``, ``format`` widths,
  ``batch``; every result checked), and output (counted as it is generated).

A checkpoint reads the clock every 32nd time. So a render exceeds its budget by
at most a few bounded steps and then raises
``BudgetExceeded``. Time is ``time.thread_time()``: CPU time of the rendering
thread, so a render on a busy machine is not refused for waiting its turn.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

DEFAULT_CPU_SECONDS = 2.0
DEFAULT_MAX_CHARS = 32 << 20  # twice the protocol's largest frame: any message fits, twice
YIELD_EVERY_S = 0.002  # of the render thread's CPU time
YIELD_S = 0.001
_MAX_INT_BITS = 1 << 20
_MAX_JSON_INDENT = 1024
_WIDTH = re.compile(r"\d{7,}")  # a width or precision of a million or more in a format string
_NESTED_SPEC = re.compile(r"\{[^{}]*:[^{}]*\{")  # str.format: a width or precision given as an argument
_STAR_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\*|\d*\.\*)")  # %-format: a "*" width or precision
_LIPSUM_CHARS = 16  # at most, per word lipsum() writes (a word, a space, punctuation, markup)


@dataclass(frozen=True)
class RenderBudget:
    """Limits of one render: ``cpu_seconds`` of the rendering thread's CPU time, and
    ``max_chars``: the longest string (in characters) or list (in items) the
    template may build, its whole output included."""

    cpu_seconds: float = DEFAULT_CPU_SECONDS
    max_chars: int = DEFAULT_MAX_CHARS
    yield_gil: bool = True  # sleep now and then so a thread of the engine gets the GIL (not in a worker)


DEFAULT_BUDGET = RenderBudget()


class BudgetExceeded(Exception):
    """A render went over its budget; the message says which limit and how."""


class _NotRendering(Exception):
    """A filter called outside ``render`` (Jinja's compile-time constant folding)."""


class _Meter:
    __slots__ = ("budget", "deadline", "chars", "n", "next_yield")

    def __init__(self, budget: RenderBudget) -> None:
        self.budget = budget
        now = time.thread_time()
        self.deadline = now + budget.cpu_seconds
        self.next_yield = now + YIELD_EVERY_S if budget.yield_gil else float("inf")
        self.chars = 0  # output so far
        self.n = 0

    def tick(self) -> None:
        """A checkpoint: reads the clock at every 32nd (the clock costs a system call);
        every YIELD_EVERY_S of CPU the render sleeps YIELD_S, handing the GIL to the
        engine's tick thread (a render is pure Python: without this a long one would
        take half of every tick's Python time)."""
        self.n += 1
        if self.n & 31:
            return
        now = time.thread_time()
        if now > self.deadline:
            raise BudgetExceeded(f"it ran for more than {self.budget.cpu_seconds:g} s of CPU time")
        if now > self.next_yield:
            time.sleep(YIELD_S)
            self.next_yield = now + YIELD_EVERY_S

    def need(self, n: int, what: str) -> None:
        """Refuse before building something of ``n`` characters or items."""
        if n > self.budget.max_chars:
            raise BudgetExceeded(f"it tried to build {what} of {n:,} characters or items (the limit is "
                                 f"{self.budget.max_chars:,})")

    def check(self, value: Any, what: str = "a value") -> Any:
        if isinstance(value, (str, list, tuple, dict, bytes)):
            self.need(len(value), what)
        return value

    def output(self, chunk: str) -> None:
        self.chars += len(chunk)
        if self.chars > self.budget.max_chars:
            raise BudgetExceeded(f"its output passed {self.budget.max_chars:,} characters")
        self.tick()


def _widths(fmt: Any, m: _Meter, args: Any = ()) -> None:
    """Refuse a format string whose literal widths, or whose widths given as arguments
    (``"{:>{}}".format(s, n)``, ``"%*s" % (n, s)``), pass the size limit."""
    if not isinstance(fmt, str):
        return
    for w in _WIDTH.findall(fmt):
        m.need(int(w), "a formatted field")
    if _NESTED_SPEC.search(fmt) or _STAR_SPEC.search(fmt):
        values = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, (list, tuple)) \
            else [args]
        for v in values:
            if isinstance(v, int) and not isinstance(v, bool):
                m.need(v, "a formatted field (a width given as an argument)")


def _replace_size(s: Any, old: Any, new: Any) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)) or len(new) <= len(old):
        return 0
    n = s.count(old) if old else len(s) + 1
    return len(s) + n * (len(new) - len(old))


def _join_size(sep: Any, items: Any) -> int:
    if not isinstance(items, (list, tuple)):
        return 0
    total = sum(len(x) for x in items if isinstance(x, str))
    return total + len(sep if isinstance(sep, str) else "") * max(0, len(items) - 1)


def _int_arg(args: tuple, kwargs: dict, i: int, name: str) -> int:
    v = args[i] if len(args) > i else kwargs.get(name, 0)
    return v if isinstance(v, int) else 0


def _precheck_str_method(m: _Meter, s: str, name: str, args: tuple, kwargs: dict) -> None:
    if name in ("center", "ljust", "rjust", "zfill"):
        m.need(_int_arg(args, kwargs, 0, "width"), f"a string (str.{name})")
    elif name == "replace" and len(args) >= 2:
        m.need(_replace_size(s, args[0], args[1]), "a string (str.replace)")
    elif name == "join" and args:
        m.need(_join_size(s, args[0]), "a string (str.join)")
    elif name == "expandtabs":
        m.need(len(s) + s.count("\t") * _int_arg(args, kwargs, 0, "tabsize"), "a string (str.expandtabs)")
    elif name in ("format", "format_map"):
        _widths(s, m, list(args) + list(kwargs.values()) if name == "format" else (args[0] if args else ()))


def _precheck_filter(m: _Meter, name: str, args: tuple, kwargs: dict) -> None:
    """Size estimates for the built-in filters that can make their output much
    larger than their input (``args[0]`` is the filtered value)."""
    v = args[0] if args else None
    if name == "center":
        m.need(_int_arg(args, kwargs, 1, "width"), "a string (|center)")
    elif name == "indent" and isinstance(v, str):
        w = args[1] if len(args) > 1 else kwargs.get("width", 4)
        per_line = len(w) if isinstance(w, str) else w if isinstance(w, int) else 0
        m.need(len(v) + per_line * (v.count("\n") + 1), "a string (|indent)")
    elif name == "replace" and len(args) >= 3:
        m.need(_replace_size(v, args[1], args[2]), "a string (|replace)")
    elif name == "join" and isinstance(v, (list, tuple)):
        m.need(_join_size(args[1] if len(args) > 1 else kwargs.get("d", ""), v), "a string (|join)")
    elif name == "format":
        _widths(v, m, list(args[1:]) + list(kwargs.values()))
    elif name in ("batch", "slice"):
        m.need(_int_arg(args, kwargs, 1, "linecount" if name == "batch" else "slices"), f"a list (|{name})")
    elif name == "tojson":
        indent = kwargs.get("indent", args[2] if len(args) > 2 else None)
        if isinstance(indent, int) and indent > _MAX_JSON_INDENT:
            raise BudgetExceeded(f"it asked |tojson for an indent of {indent:,} (the limit is {_MAX_JSON_INDENT})")
    elif name == "wordwrap":
        m.need(len(v) * 2 if isinstance(v, str) else 0, "a string (|wordwrap)")


def _budgeted_filter(env: Any, name: str, f: Any) -> Any:
    @functools.wraps(f)  # keeps jinja_pass_arg (pass_context/pass_environment)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        m = env.meter()
        if m is None:
            # Only inside a budgeted render. Jinja folds a filter over literals when it
            # compiles ({{ 'a'|center(10**10) }} would run at model load, outside any
            # budget); an exception here makes it leave the call for render time.
            raise _NotRendering(name)
        m.tick()
        # pass_context/pass_eval_context/pass_environment filters get that object first
        value_args = args[1:] if getattr(f, "jinja_pass_arg", None) is not None else args
        _precheck_filter(m, name, value_args, kwargs)
        return m.check(f(*args, **kwargs), f"a value (|{name})")

    return wrapper


def _budgeted_lipsum(env: Any, lipsum: Any) -> Any:
    """Jinja's ``lipsum(n=5, html=True, min=20, max=100)``, refused before it runs when
    its ``n`` paragraphs of up to ``max`` words could pass the size limit (it runs as
    one library call, between two of the budget's checkpoints)."""

    @functools.wraps(lipsum)
    def wrapper(n: Any = 5, html: Any = True, min: Any = 20, max: Any = 100) -> Any:  # noqa: A002 - jinja's names
        m = env.meter()
        if m is not None and isinstance(n, int) and isinstance(max, int):
            m.need(n * max * _LIPSUM_CHARS, f"a string (lipsum of {n:,} paragraphs)")
        return lipsum(n, html, min, max)

    return wrapper


def make_environment(filters: dict[str, Any] | None = None, globals_: dict[str, Any] | None = None) -> Any:
    """A fresh budgeted sandbox configured as Hugging Face's ``apply_chat_template``
    configures its own (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, the
    ``generation`` tag), with ``filters`` and ``globals_`` added (``chat_template.py``
    passes HF's ``tojson``, ``raise_exception`` and ``strftime_now``). Every filter
    is wrapped in the budget's checks."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker):
        renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    class BudgetedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["+", "*", "**", "%"])

        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self._local = threading.local()

        def meter(self) -> _Meter | None:
            return getattr(self._local, "meter", None)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            m = __self.meter()
            if m is None:
                return super().call(__context, __obj, *args, **kwargs)
            m.tick()
            owner = getattr(__obj, "__self__", None)
            if owner is None:  # the sandbox wraps str.format in a function of its own
                owner = getattr(getattr(__obj, "__wrapped__", None), "__self__", None)
            if isinstance(owner, str):
                _precheck_str_method(m, owner, getattr(__obj, "__name__", ""), args, kwargs)
            return m.check(super().call(__context, __obj, *args, **kwargs), "a value")

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            m = getattr(self._local, "meter", None)
            if m is None:
                return self.binop_table[operator](left, right)
            if operator == "+" and type(left) is str and type(right) is str:  # the common case, exact
                if len(left) + len(right) > m.budget.max_chars:
                    m.need(len(left) + len(right), "a string (operator +)")
                return left + right
            m.tick()
            _precheck_binop(m, operator, left, right)
            return m.check(self.binop_table[operator](left, right), f"a value (operator {operator})")

        def budget_iter(self, iterable: Any) -> Any:
            """The iterable of every ``{% for %}``: a checkpoint every 8 items."""
            m = self.meter()
            if m is None:
                yield from iterable
                return
            for i, item in enumerate(iterable):
                if not i & 7:
                    m.tick()
                yield item

        def budget_str(self, value: Any) -> Any:
            """The result of every ``~`` concatenation."""
            m = self.meter()
            return value if m is None else m.check(value, "a string (operator ~)")

    env = BudgetedSandbox(trim_blocks=True, lstrip_blocks=True,
                          extensions=[jinja2.ext.loopcontrols, _Generation])
    env.filters.update(filters or {})
    env.globals.update(globals_ or {})
    lipsum = env.globals.get("lipsum")
    if lipsum is not None:
        env.globals["lipsum"] = _budgeted_lipsum(env, lipsum)
    for name, f in list(env.filters.items()):
        env.filters[name] = _budgeted_filter(env, name, f)
    return env


def _precheck_binop(m: _Meter, op: str, a: Any, b: Any) -> None:
    seq = (str, list, tuple)
    if op == "+":
        if isinstance(a, seq) and isinstance(b, seq):
            m.need(len(a) + len(b), "a value (operator +)")
    elif op == "*":
        if isinstance(a, seq) and isinstance(b, int):
            m.need(len(a) * max(0, b), "a value (operator *)")
        elif isinstance(b, seq) and isinstance(a, int):
            m.need(len(b) * max(0, a), "a value (operator *)")
        elif isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > _MAX_INT_BITS:
            raise BudgetExceeded(f"it tried to multiply integers of more than {_MAX_INT_BITS:,} bits")
    elif op == "**":
        if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1 and \
                b * a.bit_length() > _MAX_INT_BITS:
            raise BudgetExceeded(f"it tried to compute an integer power of more than {_MAX_INT_BITS:,} bits")
    elif op == "%" and isinstance(a, str):
        _widths(a, m, b)


def compile_template(env: Any, source: str) -> Any:
    """Parse ``source`` in ``env`` (a ``make_environment()`` sandbox), wrap every
    loop's iterable in ``budget_iter`` and every ``~`` in ``budget_str``, and
    compile it. Raises ``jinja2.TemplateSyntaxError``."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    class _Checkpoints(NodeTransformer):
        def visit_For(self, node: Any) -> Any:
            node = self.generic_visit(node)
            node.iter = nodes.Call(nodes.EnvironmentAttribute("budget_iter"), [node.iter], [], None, None,
                                   lineno=node.lineno)
            return node

        def visit_Concat(self, node: Any) -> Any:
            node = self.generic_visit(node)
            return nodes.Call(nodes.EnvironmentAttribute("budget_str"), [node], [], None, None, lineno=node.lineno)

    tree = _Checkpoints().visit(env.parse(source))
    return env.template_class.from_code(env, env.compile(tree), env.make_globals(None), None)


def render(env: Any, template: Any, budget: RenderBudget, variables: dict[str, Any]) -> str:
    """Render ``template`` (from ``compile_template(env, ...)``) with ``variables``
    inside ``budget`` on the calling thread. Raises ``BudgetExceeded`` when a limit
    is passed, and whatever the template raises otherwise."""
    m = _Meter(budget)
    prev = env.meter()
    env._local.meter = m
    try:
        out: list[str] = []
        for chunk in template.generate(**variables):
            m.output(chunk)
            out.append(chunk)
        return "".join(out)
    finally:
        env._local.meter = prev
