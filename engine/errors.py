"""The user-facing error family.

Every error a user can cause (a bad file, a bad flag, a refused request) is an
``AotxError``: its message names the bad value, the file and what to do, and the
CLI prints it as one line with exit code 2. ``assert`` stays for internal
invariants; anything else escaping is a bug.

``ErrorCode`` is the one list of the codes an engine's ``Error`` reply carries; the
engine, the client library, the gateway, the app and the test fake all use it.
"""

from __future__ import annotations

import argparse
import difflib
import enum
import re


class ErrorCode(enum.StrEnum):
    """The ``code`` of a protocol ``Error``: what kind of refusal or failure it is."""

    VERSION_MISMATCH = "version_mismatch"  # the client speaks another protocol version
    BAD_FRAME = "bad_frame"                # a frame that does not decode
    BAD_REQUEST = "bad_request"            # a field out of range, an unknown type, a bad value
    NOT_FOUND = "not_found"                # no such conversation or message
    NOT_READY = "not_ready"                # the model is loading or failed (reads still work)
    BUSY = "busy"                          # the conversation is generating, or a resource is full now
    TOO_LONG = "too_long"                  # does not fit the context or the journal's buffer, ever
    CANCELLED = "cancelled"
    INTERNAL = "internal"                  # a bug: the engine keeps running
    # an attachment that cannot be used (no route takes it, it is broken or over a limit, its
    # specialist does not fit the budget): the engine reports each (MediaInfo, route "refused")
    # and refuses the message, writing nothing; its refusal never goes into a prompt
    UNSUPPORTED_MEDIA = "unsupported_media"


class AotxError(Exception):
    """Base of every error meant for a user. ``str(err)`` is the whole message;
    ``code`` is the protocol code the engine answers it with."""

    exit_code = 2
    code: ErrorCode = ErrorCode.BAD_REQUEST


class UsageError(AotxError):
    """A command-line flag or argument is wrong (exit code 2)."""


class ModelError(AotxError):
    """A model file cannot be used: not GGUF, truncated, unsupported, mis-shaped."""


class TokenizerError(ModelError):
    """The GGUF's tokenizer metadata cannot be turned into a tokenizer."""


class TemplateError(AotxError):
    """The chat template failed to render (syntax error or ``raise_exception``)."""


class AdmissionError(AotxError):
    """A configuration or request does not fit the resource budget."""


class EngineError(AotxError):
    """The engine is unreachable, not ready, or refused the request (``code`` then says
    how, when the engine answered)."""

    def __init__(self, message: str, code: ErrorCode | str | None = None, *, engine_exit: int | None = None,
                 engine_message: str = ""):
        super().__init__(message)
        if code is not None:
            self.code = code
        # an engine this client started exited before answering: its exit code (2: it refused
        # its arguments) and its own one-line message
        self.engine_exit, self.engine_message = engine_exit, engine_message


class NotFound(AotxError):
    """No such conversation or message."""

    code = ErrorCode.NOT_FOUND


class Busy(AotxError):
    """The conversation is generating (cancel it first), or a resource is full now."""

    code = ErrorCode.BUSY


class NotReady(AotxError):
    """The model is loading or failed; reads still work."""

    code = ErrorCode.NOT_READY


class RequestError(AotxError):
    """An operation's field is out of range or of the wrong type (code bad_request)."""


class ProtocolError(AotxError):
    """A frame on the client protocol is malformed or of the wrong version."""

    code = ErrorCode.BAD_FRAME


class JournalError(AotxError):
    """The journal on disk cannot be read or written safely."""


class MediaError(AotxError):
    """An attachment cannot be decoded or the model's media profile cannot take it."""


class StorageError(AotxError):
    """A directory or file under the data dir cannot be created, read or written
    (read-only file system, permissions, a FIFO where a file should be)."""


def close_matches(name: str, names: list[str], n: int = 3) -> list[str]:
    """The names closest to ``name`` (case-insensitive; substrings first), for an error's
    "did you mean ...?" (the engine's model catalog and the gateway both name them)."""
    low = {x.lower(): x for x in names}
    subs = [x for x in names if name.lower() in x.lower() or x.lower() in name.lower()]
    fuzzy = [low[x] for x in difflib.get_close_matches(name.lower(), list(low), n=n, cutoff=0.5)]
    # a mistyped short form of a long name ("smolm2" for "SmolLM2-135M-Instruct.Q4_1"): its head
    head = {}
    for x in names:
        head.setdefault(x.lower()[:len(name) + 1], x)
    heads = [head[x] for x in difflib.get_close_matches(name.lower(), list(head), n=n, cutoff=0.8)] \
        if len(name) >= 4 else []
    return list(dict.fromkeys(subs + fuzzy + heads))[:n]


# ---- argparse messages in the user's words (aotx and aotx-chat) ----------------------------

def _choices_of(text: str) -> list[str]:
    return [c.strip().strip("'\"") for c in text.split(",") if c.strip()]


def _all_options(parser: "argparse.ArgumentParser") -> list[str]:
    """Every option string of ``parser`` and of its subcommands."""
    out: list[str] = []
    for action in parser._actions:
        out += [o for o in action.option_strings if o.startswith("--")]
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += _all_options(sub)
    return sorted(set(out))


def friendly_error(parser: "argparse.ArgumentParser", message: str) -> str:
    """argparse's message in the user's words: ``run: unknown command 'rnu'; did you
    mean 'run'?`` (no ``argument cmd:``), the subcommand named once (the caller prints
    the leading ``aotx:``)."""
    where = parser.prog[len("aotx "):].strip() if parser.prog.startswith("aotx ") else ""
    head = f"{where}: " if where else ""
    m = re.match(r"argument (\S+): invalid choice: '?([^']*?)'? \(choose from (.*)\)$", message)
    if m:
        name, bad, choices = m.group(1), m.group(2), _choices_of(m.group(3))
        close = difflib.get_close_matches(bad, choices, n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        if name.startswith("-"):
            return f"{head}{name} {bad!r} is not one of {', '.join(choices)}{hint}"
        what = "command" if not where else f"{where} command"
        return f"unknown {what} '{bad}'{hint} (choose from {', '.join(choices)})"
    m = re.match(r"unrecognized arguments: (.*)$", message)
    if m:
        first = m.group(1).split()[0]
        close = difflib.get_close_matches(first.split("=")[0], _all_options(parser), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close and first.startswith("-") else ""
        return f"{head}unknown argument {first}{hint} (see `{parser.prog} --help`)"
    m = re.match(r"argument (\S+): (.*)$", message)
    if m:  # the option's own message usually names it already
        name, rest = m.group(1), m.group(2)
        return f"{head}{rest}" if name.split("/")[0] in rest else f"{head}{name}: {rest}"
    return f"{head}{message}"
