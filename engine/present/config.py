"""The user's defaults for the ``aotx`` commands, and shell completion.

Owns: the config file (TOML: ``config.toml`` in the platformdirs config dir, or in
``$AOTX_HOME`` when that is set, as tests set it) with the defaults people pass every
time: ``model``, ``device``, ``context``, ``slots``, ``theme`` and ``api_key_file``
(``aotx gateway``'s keys). Each is checked (type, range, the flag's choices) and becomes
the default of the flag of the same name on every command that has one (``aotx`` and
``aotx-chat``; the engine's flags on the commands that start or name an engine), so a
flag on the command line still wins. ``aotx config`` prints each setting's effective value and
where it came from (the command's default, the file); ``aotx completion bash|zsh|tcsh``
prints a completion script (shtab) for the whole command tree. A bad file is one line
naming the file and the key (exit 2). Leaves the commands to ``engine/cli/commands.py`` and ``app/main.py``.

    # ~/.config/aotx/config.toml
    model = "qwen2.5-coder-0.5b-instruct-q4_k_m"
    device = "cpu"
    context = 8192
    slots = 4
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from aotx.engine.errors import UsageError

#: key -> (its type, the flag's ``dest``); ranges and choices are the flags' own (checked by argparse)
KEYS: dict[str, tuple[type, str]] = {"model": (str, "model"), "device": (str, "device"), "context": (int, "context"),
                                     "slots": (int, "slots"), "theme": (str, "theme"),
                                     "api_key_file": (str, "api_key_file")}


#: keys that are engine flags: they apply to the commands with ``--device`` only (``aotx models
#: add-remote --context`` is a remote server's, not the engine's)
ENGINE_KEYS = frozenset({"model", "device", "context", "slots"})


def config_path() -> Path:
    """Where the config file is: ``$AOTX_HOME/config.toml``, else the platformdirs config dir's."""
    home = os.environ.get("AOTX_HOME")
    if home:
        return Path(home) / "config.toml"
    import platformdirs

    return Path(platformdirs.user_config_dir("aotx")) / "config.toml"


def load(path: Path | None = None) -> tuple[dict[str, Any], Path]:
    """(the file's settings, its path); {} when there is none. Raises UsageError naming
    the file and the key for a file that is not TOML, an unknown key or a wrong type."""
    import tomllib

    path = path or config_path()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}, path
    except OSError as e:
        raise UsageError(f"config file {path}: cannot be read ({e.strerror})") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"config file {path}: not TOML ({e})") from None
    for key, value in data.items():
        if key not in KEYS:
            raise UsageError(f"config file {path}: unknown key {key!r} (the keys are {', '.join(KEYS)})")
        want = KEYS[key][0]
        if isinstance(value, bool) or not isinstance(value, want):
            raise UsageError(f"config file {path}: {key} must be {'an integer' if want is int else 'a string'}, "
                             f"got {value!r}")
    return data, path


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = [parser]
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for p in a.choices.values():
                out.extend(_subparsers(p))
    return out


def apply(parser: argparse.ArgumentParser, settings: dict[str, Any], path: Path) -> None:
    """Make each setting the default of its flag on every (sub)command that has the flag.
    Raises UsageError for a value the flag refuses (a device or theme not among its choices,
    a number out of its range), naming the file."""
    for p in _subparsers(parser):
        engine = any(a.dest == "device" for a in p._actions)  # a command that starts or names an engine
        for a in p._actions:
            for key, (_, dest) in KEYS.items():
                if a.dest != dest or key not in settings or (key in ENGINE_KEYS and not engine):
                    continue
                value = settings[key]
                if a.choices is not None and value not in a.choices:
                    raise UsageError(f"config file {path}: {key} = {value!r} is not one of "
                                     f"{', '.join(map(str, a.choices))}")
                if callable(a.type) and not isinstance(value, str):
                    try:
                        value = a.type(str(value))
                    except (argparse.ArgumentTypeError, ValueError) as e:
                        raise UsageError(f"config file {path}: {key}: {e}") from None
                a.default = value


def show(parser: argparse.ArgumentParser, settings: dict[str, Any], path: Path, out=sys.stdout) -> None:
    """``aotx config``: each setting, its effective value and where it came from."""
    print(f"config file: {path}{'' if path.exists() else ' (none)'}", file=out)
    defaults: dict[str, Any] = {}
    for p in _subparsers(parser):
        engine = any(a.dest == "device" for a in p._actions)
        for a in p._actions:
            for key, (_, dest) in KEYS.items():
                if a.dest == dest and key not in defaults and (engine or key not in ENGINE_KEYS):
                    defaults[key] = a.default
    for key in KEYS:
        if key in settings:
            print(f"{key:<13} {settings[key]!s:<40} from {path}", file=out)
        else:
            shown = "(not set: the command's own default)" if defaults.get(key) is None else defaults[key]
            print(f"{key:<13} {shown!s:<40} default", file=out)


def completion(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script of ``aotx`` for ``shell`` (bash, zsh or tcsh), from shtab."""
    try:
        import shtab
    except ImportError:
        raise UsageError("shell completion needs shtab: pip install shtab") from None
    return shtab.complete(parser, shell=shell)
