"""The model picker (Ctrl+O, and from F4): every installed model, choose the conversation's.

Owns: the table of models the engine lists (``ListModels``: name, size, architecture,
quantization, context, loaded or not, what it needs in memory; remote endpoints too)
and the choice. Dismisses with the chosen model's name, or None. Leaves the switch
(``SwitchModel``: the history is kept, the new model reads it again) to the app.

The table fits the dialog's width (``fit_columns``): at 120 columns and more every column
shows; narrower, the name column shrinks (its names end in an ellipsis) and the least
useful columns go first: architecture, quantization (both usually in the name), what it
needs, context, size. The name and whether a model is loaded stay.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from aotx.engine.present.format import ellipsize
from aotx.engine import protocol as P
from aotx.engine.units import fmt_bytes

COLUMNS = ("model", "size", "arch", "quant", "context", "needs", "")
DROP_ORDER = ("arch", "quant", "needs", "context", "size")  # the least useful column first
MIN_NAME = 24  # the name column is not cut narrower than this while a column can go instead
CELL_PADDING = 1  # DataTable's default, each side of a cell


def model_row(m: P.ModelInfo, current: str) -> tuple[str, ...]:
    """The table cells of one model (pure: tested without a screen). "context": what the
    engine serves it with (a loaded model's slots' length, or what one not loaded would get
    here: its trained context capped at the engine's), else (an engine that does not say)
    the file's trained context."""
    mark = "▸" if m.name == current else " "
    state = "unusable" if m.error else ("loaded" if m.loaded else "")
    return (f"{mark} {m.name}", fmt_bytes(m.size_bytes) if m.size_bytes else ("remote" if m.kind == "remote" else "-"),
            m.arch or "-", m.quant or "-", str(m.n_ctx or m.n_ctx_train or "-"),
            fmt_bytes(m.needs_bytes) if m.needs_bytes else "-", state)


def fit_columns(rows: list[tuple[str, ...]], width: int) -> tuple[list[int], int]:
    """The columns (indices into ``COLUMNS``, in order) that fit ``rows`` into ``width``
    cells, and the name column's width (at most its longest cell; cells cut to it end in
    an ellipsis). Pure: tested without a screen."""
    pad = 2 * CELL_PADDING
    widths = [max([len(COLUMNS[i])] + [len(r[i]) for r in rows]) for i in range(len(COLUMNS))]
    keep = list(range(len(COLUMNS)))

    def room() -> int:
        return width - sum(widths[i] + pad for i in keep if i) - pad

    for name in DROP_ORDER:
        if room() >= min(widths[0], MIN_NAME):
            break
        keep.remove(COLUMNS.index(name))
    return keep, max(1, min(widths[0], room()))


class ModelTable(DataTable):
    """The picker's table: it lays its columns out again for its width when that changes."""

    def on_resize(self) -> None:
        self.screen.fill_table()


class ModelPicker(ModalScreen[str | None]):
    """``models``: the engine's list; ``current``: the open conversation's model."""

    BINDINGS = [Binding("escape", "dismiss_none", "Close")]

    def __init__(self, models: list[P.ModelInfo], current: str) -> None:
        super().__init__()
        self.models = [m for m in models]
        self.current = current
        self._fit: tuple[tuple[int, ...], int] | None = None  # the columns and name width laid out

    def compose(self) -> ComposeResult:
        with Vertical(id="model-box", classes="dialog"):
            yield Static("Model of this conversation", classes="dialog-title")
            yield ModelTable(id="model-table", cursor_type="row", zebra_stripes=True)
            # two lines at 80 columns (a longer note was cut off there, its last line under the border)
            yield Static("Enter: the next message runs on it (it reads the history again; the old model's "
                         "state is kept). Esc keeps the current one.", classes="dialog-note")

    def on_mount(self) -> None:
        self.fill_table()
        self.query_one(DataTable).focus()

    def fill_table(self) -> None:
        """(Re)build the table for its width; the cursor stays on its model."""
        table = self.query_one(DataTable)
        # the vertical scrollbar's columns are kept free: the table may need one
        width = table.size.width - table.styles.scrollbar_size_vertical
        if width <= 0:
            width = 10_000  # not laid out yet: all columns, the resize fits them
        rows = [model_row(m, self.current) for m in self.models]
        keep, name_width = fit_columns(rows, width)
        fit = (tuple(keep), name_width)
        if self._fit == fit:
            return
        self._fit = fit
        at = table.cursor_row if table.row_count else next(
            (i for i, m in enumerate(self.models) if m.name == self.current), 0)
        table.clear(columns=True)
        for i in keep:
            table.add_column(COLUMNS[i], width=name_width if i == 0 else None, key=COLUMNS[i] or "state")
        for m, row in zip(self.models, rows):
            table.add_row(*(ellipsize(row[i], name_width) if i == 0 else row[i] for i in keep), key=m.name)
        table.move_cursor(row=at)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        name = event.row_key.value
        m = next((m for m in self.models if m.name == name), None)
        if m is not None and m.error:
            self.notify(f"{m.name} cannot be used: {m.error}", severity="error")
            return
        self.dismiss(name)

    def action_dismiss_none(self) -> None:
        self.dismiss(None)
