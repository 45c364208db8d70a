"""Themes: the ``.tcss`` files in ``themes/``, switched at run time.

Every theme file is loaded with the app; its rules are scoped under
``.theme-NAME`` and the app carries exactly one such class. A theme file's first
line names the Textual base theme it pairs with (``/* textual-theme: NAME */``),
which colours built-in widgets (code highlighting, scrollbars). ``base.tcss`` holds
the layout shared by all themes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import aotx.themes

THEMES_DIR = Path(aotx.themes.__file__).parent
BASE = THEMES_DIR / "base.tcss"
_BASE_THEME = re.compile(r"/\*\s*textual-theme:\s*([\w-]+)\s*\*/")


@dataclass(frozen=True)
class Theme:
    name: str
    path: Path
    textual_theme: str


def discover(themes_dir: Path = THEMES_DIR) -> dict[str, Theme]:
    """name -> Theme for every ``*.tcss`` except base.tcss, sorted by name."""
    found = {}
    for p in sorted(themes_dir.glob("*.tcss")):
        if p.name == BASE.name:
            continue
        m = _BASE_THEME.search(p.read_text(encoding="utf-8")[:200])
        found[p.stem] = Theme(p.stem, p, m.group(1) if m else "textual-dark")
    return found


THEMES = discover()
CSS_PATHS = [BASE, *(t.path for t in THEMES.values())]
