"""What the front ends show, shared by the TUI (``aotx.app``) and the CLI (``engine/cli``).

``format`` (words and glyphs for a message's position, notices, byte counts),
``export`` (a conversation as Markdown or JSON), ``paste`` (pasted text to file paths),
``attach`` (a file to a protocol ``Attachment``). Pure functions over protocol values: no
widgets, no sockets, no engine.
"""
