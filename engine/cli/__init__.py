"""The ``aotx`` command line: front ends over the engine.

``commands`` (the parser and dispatch: ``aotx``'s entry point), ``client`` (commands that
talk to a running engine: run, status, stop, conversations), ``local`` (commands that read
files without an engine: journal, models on disk, export), ``models`` (``aotx models``),
``serve`` (``aotx serve``: the engine process), ``bench`` (``aotx bench``), ``pull``
(``aotx pull``), ``repl`` (the line REPL of ``aotx run`` at a terminal).
"""
