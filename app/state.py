"""What the app remembers between runs: theme and last open conversation.

Owns: reading and writing ``paths.app_state_path()`` (JSON, mode 0600). Writes go to a
temporary file, are fsynced, then renamed over the old one, so a crash leaves
either the old or the new state. A missing or corrupt file means defaults.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from aotx.engine import paths


@dataclass(frozen=True)
class AppState:
    theme: str = "dark"
    last_conversation: str | None = None


def load_state(path: Path | None = None) -> AppState:
    path = path or paths.app_state_path()
    try:
        data = json.loads(path.read_text())
        fields = AppState.__dataclass_fields__
        return AppState(**{k: v for k, v in data.items() if k in fields})
    except (OSError, ValueError, TypeError):
        return AppState()


def save_state(state: AppState, path: Path | None = None) -> None:
    """Write the state; the file is the user's alone (0600, as everything in the data dir:
    ``aotx serve`` would otherwise tighten it and say so at every start)."""
    path = path or paths.app_state_path()
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a left-over tmp file keeps its old mode through O_CREAT
    with os.fdopen(fd, "w") as fh:
        json.dump(asdict(state), fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def update_state(**changes) -> AppState:
    """Load, change and save in one step; returns the new state."""
    state = replace(load_state(), **changes)
    save_state(state)
    return state
