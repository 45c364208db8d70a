"""API keys of the gateway: the key file, generation on first start, checking.

Owns: reading a key file (one key per line; blank lines and ``#`` comments
skipped), generating ``<data dir>/gateway/api_keys`` with one random key on its first line
(then a comment; mode 0600, written and fsynced, directory fsynced) when no key
file is given, and
checking a bearer token against every key in constant time. Leaves HTTP to
``limits.py`` and ``server.py``.

A key is identified to the rest of the gateway by a short fingerprint (the first
12 hex digits of its SHA-256), never by the key itself, so logs and the
per-key concurrency table hold no secrets.

A key line may carry options after the key, separated by spaces: ``allow-files=DIR``
(``:``-separated directories, repeatable) lets that key's requests attach server files
under those directories (``file://`` image URLs); no key may read any file otherwise.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from aotx.engine.errors import UsageError

KEY_PREFIX = "sk-aotx-"


def default_key_path() -> Path:
    from aotx.engine import paths

    return paths.data_dir() / "gateway" / "api_keys"


def generate_key_file(path: Path) -> str:
    """Create ``path`` (mode 0600, exclusive) holding one new key; return the key."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # the key is the first line, so `head -1 api_keys` gives it; the comment follows it
        os.write(fd, (f"{key}\n# AOTX gateway API keys above, one per line (send as 'Authorization: Bearer "
                      f"<key>'); lines starting with # are comments\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return key


def read_key_file(path: Path) -> list[str]:
    """The keys in ``path``. Raises UsageError when it is unreadable, empty or
    readable by other users (it holds secrets: chmod 600 it)."""
    try:
        st = path.stat()
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"API key file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"API key file {path} cannot be read: {e}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UsageError(f"API key file {path} is readable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                         f"run `chmod 600 {path}`")
    keys = [ln.split()[0] for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    key_options(text, path)  # checks every option
    if not keys:
        raise UsageError(f"API key file {path} holds no key (one key per line, '#' starts a comment)")
    short = [k for k in keys if len(k) < 16]
    if short:
        raise UsageError(f"API key file {path} has a key of {len(short[0])} characters; use at least 16")
    return keys


def key_options(text: str, path: Path | str = "the key file") -> dict[str, tuple[Path, ...]]:
    """key -> the directories it may read files under (``allow-files=``), for the keys
    that have any. Raises UsageError naming an unknown option or a directory that does
    not exist."""
    out: dict[str, tuple[Path, ...]] = {}
    for n, ln in enumerate(text.splitlines(), 1):
        words = ln.split()
        if not words or words[0].startswith("#"):
            continue
        roots: list[Path] = []
        for opt in words[1:]:
            name, eq, value = opt.partition("=")
            if name != "allow-files" or not eq or not value:
                raise UsageError(f"API key file {path}, line {n}: unknown option {opt!r} after the key (the one "
                                 "option is allow-files=DIR[:DIR...]; a key has no spaces)")
            for d in value.split(":"):
                p = Path(d).expanduser()
                if not p.is_dir():
                    raise UsageError(f"API key file {path}, line {n}: allow-files={d}: no such directory")
                roots.append(p.resolve())
        if roots:
            out[words[0]] = tuple(roots)
    return out


def load_or_create(path: str | os.PathLike[str] | None) -> tuple[list[str], Path, bool]:
    """Keys from ``path``, or from the default file, created on first start.

    Returns (keys, the file, whether it was just created)."""
    if path is not None:
        p = Path(path).expanduser()
        return read_key_file(p), p, False
    p = default_key_path()
    if not p.exists():
        try:
            generate_key_file(p)
            return read_key_file(p), p, True
        except FileExistsError:  # another gateway created it between the check and the open
            pass
    return read_key_file(p), p, False


class KeyRing:
    """Constant-time bearer-key check: every key is compared (``hmac.compare_digest``
    on SHA-256 digests, so lengths never leak) and no comparison short-circuits."""

    def __init__(self, keys: list[str], file_roots: dict[str, tuple[Path, ...]] | None = None):
        if not keys:
            raise ValueError("a KeyRing needs at least one key")
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]
        self._roots = {hashlib.sha256(k.encode()).hexdigest()[:12]: tuple(v) for k, v in (file_roots or {}).items()}

    def file_roots(self, fingerprint: str) -> tuple[Path, ...]:
        """The directories the key of ``fingerprint`` may read files under (none: no file)."""
        return self._roots.get(fingerprint, ())

    def check(self, authorization: str | None) -> str | None:
        """The fingerprint of the key in an ``Authorization: Bearer <key>`` header, or None."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        d = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        found = None
        for kd in self._digests:
            if hmac.compare_digest(d, kd):
                found = kd
        return found.hex()[:12] if found is not None else None
