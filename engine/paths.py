"""Where AOTX keeps its files: one root for everything it writes.

The root is the platformdirs user data dir for ``aotx``, or ``$AOTX_HOME`` when
set (tests always set it to a temp dir). Every other path derives from it here;
nothing else in the code base picks a directory on its own.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def data_dir() -> Path:
    """The root of every file AOTX writes: ``$AOTX_HOME`` or the platform data dir."""
    home = os.environ.get("AOTX_HOME")
    root = Path(home).expanduser() if home else Path(platformdirs.user_data_dir("aotx", appauthor=False))
    root.mkdir(parents=True, exist_ok=True)
    return root


def runtime_dir() -> Path:
    """Directory for the engine's socket and lock: under ``$AOTX_HOME`` when set,
    else the platform runtime dir (falling back to the data dir). Mode 0700."""
    if os.environ.get("AOTX_HOME"):
        d = data_dir() / "run"
    else:
        d = Path(platformdirs.user_runtime_dir("aotx", appauthor=False))
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        d = data_dir() / "run"
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


def models_dir() -> Path:
    """Folder scanned by ``aotx models`` for ``*.gguf`` files."""
    d = data_dir() / "models"
    d.mkdir(parents=True, exist_ok=True)
    return d


def journal_dir() -> Path:
    """Folder of the journal's segment files and checkpoints."""
    d = data_dir() / "journal"
    d.mkdir(parents=True, exist_ok=True)
    return d


def capsules_dir() -> Path:
    """Folder of execution-state capsules written for resume after a restart."""
    d = data_dir() / "capsules"
    d.mkdir(parents=True, exist_ok=True)
    return d


def cache_dir() -> Path:
    """Folder for compiled-kernel caches and other rebuildable files."""
    d = data_dir() / "cache"
    d.mkdir(parents=True, exist_ok=True)
    return d


def socket_path() -> Path:
    """Default Unix socket of the engine."""
    return runtime_dir() / "engine.sock"


def app_state_path() -> Path:
    """JSON file where the TUI remembers its theme and last conversation."""
    return data_dir() / "app_state.json"
