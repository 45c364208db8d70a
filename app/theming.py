"""Themes: AOTX's own ``.tcss`` themes in ``themes/`` and Textual's built-in themes.

Every theme file is loaded with the app; its rules are scoped under
``.theme-NAME`` and the app carries exactly one such class. A theme file's first
line names the Textual base theme it pairs with (``/* textual-theme: NAME */``),
which colours built-in widgets (code highlighting, scrollbars). ``base.tcss`` holds
the layout shared by all themes and colours every AOTX widget from theme variables
(``$success``, ``$warning``, ``$error``, ``$panel``...), so each of Textual's built-in
themes (nord, gruvbox, tokyo-night, dracula, catppuccin, solarized, ...) is a full
AOTX theme too, under its own name. F6 cycles AOTX's themes first, then Textual's;
Textual's own "Change theme" palette command works the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from textual.theme import BUILTIN_THEMES

import aotx.themes

THEMES_DIR = Path(aotx.themes.__file__).parent
BASE = THEMES_DIR / "base.tcss"
_BASE_THEME = re.compile(r"/\*\s*textual-theme:\s*([\w-]+)\s*\*/")


@dataclass(frozen=True)
class Theme:
    name: str
    path: Path | None  # None: one of Textual's built-in themes, coloured by base.tcss
    textual_theme: str  # the Textual theme it pairs with (its base colours)

    @property
    def css_class(self) -> str:
        return f"theme-{self.name}" if self.path is not None else "theme-textual"

    @property
    def registered_name(self) -> str:
        """The name the app gives it in Textual's theme list (the palette's "Change theme"):
        ``aotx-dark`` for AOTX's own themes, a built-in theme's own name otherwise."""
        return f"aotx-{self.name}" if self.path is not None else self.textual_theme


def textual_themes() -> list:
    """Textual ``Theme`` objects for AOTX's own themes (their paired theme's colours under
    ``aotx-NAME``), so the command palette lists them beside Textual's."""
    from dataclasses import replace

    return [replace(BUILTIN_THEMES[t.textual_theme], name=t.registered_name)
            for t in THEMES.values() if t.path is not None and t.textual_theme in BUILTIN_THEMES]


def discover(themes_dir: Path = THEMES_DIR) -> dict[str, Theme]:
    """name -> Theme for every ``*.tcss`` except base.tcss (sorted by name), then
    Textual's built-in themes that no AOTX theme already pairs with."""
    found = {}
    for p in sorted(themes_dir.glob("*.tcss")):
        if p.name == BASE.name:
            continue
        m = _BASE_THEME.search(p.read_text(encoding="utf-8")[:200])
        found[p.stem] = Theme(p.stem, p, m.group(1) if m else "textual-dark")
    paired = {t.textual_theme for t in found.values()}
    for name in BUILTIN_THEMES:
        if name not in paired and name not in found:
            found[name] = Theme(name, None, name)
    return found


def theme_for_textual(textual_name: str) -> str | None:
    """The AOTX theme name for a Textual theme name (``aotx-dark``, its pair, or itself)."""
    for t in THEMES.values():
        if textual_name in (t.registered_name, t.textual_theme):
            return t.name
    return None


THEMES = discover()
CSS_PATHS = [BASE, *(t.path for t in THEMES.values() if t.path is not None)]
