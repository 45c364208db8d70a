"""Chat template: messages -> prompt text -> prompt token ids.

Owns: rendering the GGUF's ``tokenizer.chat_template`` (Jinja2, sandboxed) the
way Hugging Face ``transformers`` does (``apply_chat_template``: the
``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks``, the
``loopcontrols`` extension, ``raise_exception``, ``strftime_now`` and a
``tojson`` filter that does not HTML-escape; see the HF chat templating docs),
a fallback when the file has no template (see FALLBACKS), and ``encode_chat``: the whole
prompt path with the guarantee that message *content* can never turn into
control tokens. Leaves to others: the vocabulary (``tokenizer.py``) and when to
stop (``termination.py``).

Prompt-injection rule. The template's own markup (``<|im_start|>`` ...) must
become single special ids, but a user typing ``<|im_start|>`` must get plain
text tokens. ``encode_chat`` renders twice: once as is (the prompt text), once
with every message's content (strings, and the ``text`` of list-of-parts
content) wrapped in two private-use marker characters placed inside its
leading/trailing whitespace so ``trim``/``strip`` in a template behaves the
same. If the marked render minus the markers equals the plain render, the
markers give the exact character spans of content; otherwise (a template that
transforms content) each content string is located verbatim in the text. The
text is then tokenized with special-token parsing everywhere *except* inside
those spans (``Tokenizer.encode(..., plain_spans=...)``); splitting happens only
at special tokens, exactly as llama.cpp splits, so ids are unchanged whenever
the content holds no special-token text. Content holding special-token text
that cannot be located raises ``TemplateError`` rather than risk injection.

BOS rule. The tokenizer's BOS (when ``add_bos``) is added unless the rendered
text already starts with the BOS token's text as template markup (its first
token is then the BOS id), so a prompt never starts with two BOS tokens.
EOS is never appended to a prompt.
"""

from __future__ import annotations

import json
import logging
import re
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from aotx.engine.errors import TemplateError
from aotx.engine.model.template_sandbox import RenderBudget
from aotx.engine.model.tokenizer import Tokenizer

log = logging.getLogger("aotx.model")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML: the fallback for a GGUF without ``tokenizer.chat_template`` whose vocabulary is
not Gemma's (the template llama.cpp falls back to)."""

GEMMA_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)
"""Gemma 3 instruct's own template (the ``chat_template`` of Google's gemma-3 ``-it``
tokenizer_config.json; a copy with its source is in tests/data/refs/templates/): the fallback
for a GGUF without a template whose vocabulary has Gemma's ``<start_of_turn>`` and
``<end_of_turn>`` (Gemma base files such as Gemma 3 270M). A system message folds into the
first user turn."""

FALLBACKS = {"gemma": GEMMA_TEMPLATE, "chatml": CHATML_TEMPLATE}
"""Which template a file without ``tokenizer.chat_template`` gets: ``"gemma"`` when its
vocabulary holds ``<start_of_turn>`` and ``<end_of_turn>``, else ``"chatml"``."""

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use markers around message content
_MARKERS = re.compile("[\ue000\ue001]")


class _TemplateRaised(Exception):
    """``raise_exception(...)`` inside a template."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """HF's ``tojson``: plain ``json.dumps`` (no HTML escaping, unicode kept)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _make_env() -> Any:
    from aotx.engine.model.template_sandbox import make_environment

    return make_environment(filters={"tojson": _tojson},
                            globals_={"raise_exception": _raise_exception, "strftime_now": _strftime_now})


def _template_line(tb: Any) -> int | None:
    """The template line of the innermost template frame in a traceback (Jinja
    rewrites frames so that template code reports ``<template>`` and its line)."""
    line = None
    for frame, lineno in traceback.walk_tb(tb):
        if frame.f_code.co_filename == "<template>":
            line = lineno
    return line


class WorkersUnavailable(Exception):
    """No template worker process can be started (``template_worker.py``): the template
    renders in the calling thread, bounded by the sandbox's checks only."""


class ChatTemplate:
    """A compiled chat template.

    ``ChatTemplate(source)`` compiles (TemplateError with the line on a syntax
    error); ``ChatTemplate.from_metadata(meta)`` takes ``tokenizer.chat_template``
    or, only when that is absent or empty, a fallback (``FALLBACKS``; ``is_fallback``
    is then True and ``fallback`` names it). ``name`` says which template it is in
    messages (``"tokenizer.chat_template of 'SmolLM2 135M Instruct'"``).

    Every render runs inside a ``RenderBudget`` (``template_sandbox.py``): CPU
    time and the size of what it builds. A template that passes it is refused
    with a TemplateError naming the template and the limit.
    """

    def __init__(self, source: str, *, is_fallback: bool = False, fallback: str | None = None,
                 name: str = "") -> None:
        import jinja2

        from aotx.engine.model.template_sandbox import compile_template

        self.source = source
        self.is_fallback = is_fallback or fallback is not None
        self.fallback = fallback if fallback is not None else ("chatml" if is_fallback else None)
        self.name = name or (f"the built-in {self.fallback} template" if self.fallback else "the chat template")
        self._env = _make_env()
        #: where renders run: None in this thread; a ``template_worker.TemplateWorkers`` pool
        #: (the engine's preparation stage sets it) in worker processes the OS bounds
        self.workers: Any = None
        try:
            self._template = compile_template(self._env, source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from None
        except RecursionError:
            raise TemplateError(f"{self.name} is nested too deeply to compile") from None

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "ChatTemplate":
        """The GGUF's template or, when the file has none, a fallback (``FALLBACKS``:
        Gemma's for a Gemma vocabulary, ChatML otherwise), said once in the log."""
        src = meta.get("tokenizer.chat_template")
        model = meta.get("general.name")
        if isinstance(src, str) and src.strip():
            return cls(src, name=f"tokenizer.chat_template of {model!r}" if isinstance(model, str) and model
                       else "the model's tokenizer.chat_template")
        tokens = meta.get("tokenizer.ggml.tokens") or ()
        name = "gemma" if {"<start_of_turn>", "<end_of_turn>"} <= set(tokens) else "chatml"
        log.warning("%s has no tokenizer.chat_template; using the %s fallback template",
                    meta.get("general.name") or "the model", name)
        return cls(FALLBACKS[name], fallback=name)

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               bos_token: str = "", eos_token: str = "", budget: RenderBudget | None = None, **extra: Any) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) to prompt text.

        ``extra`` goes to the template as further variables (``tools``,
        ``documents``, ``enable_thinking``, ...); ``budget`` bounds the render
        (default ``DEFAULT_BUDGET``: 2 s of CPU, 32 Mi characters). Raises
        TemplateError naming the template line and the message on any error
        during rendering, including the template's own ``raise_exception``, and
        naming the template and the limit when it passes its budget.
        """
        from aotx.engine.model.template_sandbox import DEFAULT_BUDGET

        variables = dict(messages=list(messages), add_generation_prompt=add_generation_prompt,
                         bos_token=bos_token, eos_token=eos_token, **extra)
        if self.workers is not None:
            try:
                return self.workers.render(self.source, self.name, variables, budget or DEFAULT_BUDGET)
            except WorkersUnavailable as e:
                log.warning("%s; rendering %s in the engine, bounded by the sandbox's checks only", e, self.name)
                self.workers = None
        return self.render_here(variables, budget or DEFAULT_BUDGET)

    def render_here(self, variables: dict[str, Any], budget: RenderBudget) -> str:
        """``render`` in this thread, with the template's ``variables`` given whole."""
        import jinja2

        from aotx.engine.model.template_sandbox import BudgetExceeded, render

        try:
            text = render(self._env, self._template, budget, variables)
            text.encode()  # a lone surrogate ("\ud800", "%c"|format(0xdc00)) can reach no tokenizer or peer
            return text
        except UnicodeEncodeError as e:
            raise TemplateError(f"{self.name} produced text that is not valid Unicode (a lone surrogate at character "
                                f"{e.start}); a chat template that does this is broken or hostile: use another "
                                "model file (or `aotx run --raw`)") from None
        except BudgetExceeded as e:
            raise TemplateError(f"{self.name} was stopped: {e}; a chat template that does this is broken or "
                                f"hostile: use another model file (or `aotx run --raw`)") from None
        except _TemplateRaised as e:
            line = _template_line(e.__traceback__)
            where = f" at line {line}" if line else ""
            raise TemplateError(f"chat template refused the messages{where}: {e}") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
                ZeroDivisionError, OverflowError, RecursionError) as e:
            line = _template_line(e.__traceback__)
            where = f" at line {line}" if line else ""
            msg = getattr(e, "message", None) or str(e)
            raise TemplateError(f"chat template failed{where}: {type(e).__name__}: {msg}") from None


def _wrap(s: str) -> str:
    core = s.strip()
    if not core:
        return s
    lead = s[: len(s) - len(s.lstrip())]
    trail = s[len(s.rstrip()):]
    return lead + _OPEN + core + _CLOSE + trail


def _content_strings(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    out = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, str):
            out.append(c)
        elif isinstance(c, list):
            out.extend(p["text"] for p in c if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return out


def _marked_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        m2 = dict(m)
        c = m.get("content")
        if isinstance(c, str):
            m2["content"] = _wrap(c)
        elif isinstance(c, list):
            m2["content"] = [dict(p, text=_wrap(p["text"]))
                             if isinstance(p, Mapping) and isinstance(p.get("text"), str) else p for p in c]
        out.append(m2)
    return out


def _spans_from_markers(marked: str) -> tuple[str, list[tuple[int, int]]] | None:
    """Strip the markers; return (text, content spans), or None if unbalanced.
    (One regex scan: a long prompt is not walked character by character in Python.)"""
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    n, pos, start = 0, 0, -1
    for m in _MARKERS.finditer(marked):
        seg = marked[pos:m.start()]
        pieces.append(seg)
        n += len(seg)
        pos = m.end()
        if m.group() == _OPEN:
            if start >= 0:
                return None
            start = n
        else:
            if start < 0:
                return None
            spans.append((start, n))
            start = -1
    if start >= 0:
        return None
    pieces.append(marked[pos:])
    return "".join(pieces), spans


def content_spans(template: ChatTemplate, messages: Sequence[Mapping[str, Any]], text: str,
                  special_texts: Sequence[str], **render_kw: Any) -> list[tuple[int, int]]:
    """Character spans of ``text`` (the plain render) that came from message
    content. Raises TemplateError when a content string that holds special-token
    text cannot be located (see the module docstring)."""
    contents = _content_strings(messages)
    if not any(_OPEN in c or _CLOSE in c for c in contents):
        try:
            marked = template.render(_marked_messages(messages), **render_kw)
        except TemplateError:
            marked = None
        parsed = _spans_from_markers(marked) if marked is not None else None
        if parsed is not None and parsed[0] == text:
            return parsed[1]
    spans: list[tuple[int, int]] = []
    pos = 0
    for i, c in enumerate(contents):
        core = c.strip()
        if not core:
            continue
        at = text.find(core, pos)
        if at < 0:
            at = text.find(core)
        if at >= 0:
            spans.append((at, at + len(core)))
            pos = at + len(core)
        elif any(s in c for s in special_texts):
            raise TemplateError(f"the chat template transforms message content, so AOTX cannot keep the "
                                f"special-token text in content #{i + 1} as plain text; remove the token "
                                f"text from the message")
    return spans


def encode_chat(tokenizer: Tokenizer, template: ChatTemplate, messages: Sequence[Mapping[str, Any]], *,
                add_generation_prompt: bool = True, continue_final: bool = False,
                check: Callable[[str], None] | None = None, **extra: Any) -> list[int]:
    """Prompt token ids for ``messages``: render (with ``bos_token``/``eos_token``
    set to the vocabulary's texts), tokenize the template's markup with special
    tokens parsed and message content as plain text, add BOS per the BOS rule in
    the module docstring. ``continue_final``: the last message is an assistant's
    prefill the reply continues: rendered as a finished turn (no generation prompt)
    and cut where its text ends, so its end-of-turn markup is gone whatever the
    template writes there (its trailing whitespace goes too). ``check(text)`` sees the
    rendered text before anything else is done with it (a size floor: it raises to
    refuse). Raises TemplateError, or what ``check`` raises."""
    bos_text = tokenizer.token_to_piece(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos_text = tokenizer.token_to_piece(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    kw = dict(add_generation_prompt=add_generation_prompt and not continue_final, bos_token=bos_text,
              eos_token=eos_text, **extra)
    text = template.render(messages, **kw)
    if check is not None:
        check(text)
    spans = content_spans(template, messages, text, tokenizer.special_texts, **kw)
    if continue_final:
        cut = _prefill_end(text, spans, messages[-1].get("content"))
        text, spans = text[:cut], [(a, min(b, cut)) for a, b in spans if a < cut]
    ids = tokenizer.encode(text, parse_special=True, plain_spans=spans)
    if tokenizer.add_bos and tokenizer.bos_id is not None and not (ids and ids[0] == tokenizer.bos_id):
        ids.insert(0, tokenizer.bos_id)
    return ids


def _prefill_end(text: str, spans: list[tuple[int, int]], prefill: Any) -> int:
    """Where the final assistant message's text ends in the rendered ``text``: the end of
    the last content span when it holds that text, else of its last occurrence. Raises
    TemplateError when the render does not show it (a template that drops or rewrites it)."""
    core = prefill.strip() if isinstance(prefill, str) else ""
    if not core:
        raise TemplateError("the assistant prefill to continue is empty")
    if spans and text[spans[-1][0]:spans[-1][1]] == core:
        return spans[-1][1]
    at = text.rfind(core)
    if at < 0:
        raise TemplateError("the chat template does not show the final assistant message's text, so the reply "
                            "cannot continue it; send the conversation without the assistant prefill")
    return at + len(core)
