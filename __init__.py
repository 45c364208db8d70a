"""AOTX: a terminal-first local assistant runtime.

One import package whose folders are the design card's rooms: ``aotx.engine``
(model, backends, runtime, state, journal, IPC), ``aotx.app`` (the Textual TUI),
``aotx.media`` (media profiles), ``aotx.themes`` and ``aotx.assets``.
"""

__version__ = "0.1.0"
