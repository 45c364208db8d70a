"""The user-facing error family.

Every error a user can cause (a bad file, a bad flag, a refused request) is an
``AotxError``: its message names the bad value, the file and what to do, and the
CLI prints it as one line with exit code 2. ``assert`` stays for internal
invariants; anything else escaping is a bug.
"""

from __future__ import annotations


class AotxError(Exception):
    """Base of every error meant for a user. ``str(err)`` is the whole message."""

    exit_code = 2


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
    """The engine is unreachable, not ready, or refused the request."""


class ProtocolError(AotxError):
    """A frame on the client protocol is malformed or of the wrong version."""


class JournalError(AotxError):
    """The journal on disk cannot be read or written safely."""


class MediaError(AotxError):
    """An attachment cannot be decoded or the model's media profile cannot take it."""


class StorageError(AotxError):
    """A directory or file under the data dir cannot be created, read or written
    (read-only file system, permissions, a FIFO where a file should be)."""
