"""Tables that fit the console they are printed on, and never truncate a value.

A plain rich ``Table`` squeezed into 80 columns (or a pipe, which rich renders 80 wide) cuts every cell to
``…``. :class:`FitTable` instead lays the table out when it is rendered, for the width it gets:

1. **Columns by priority.** A column needs the width of its widest value; its header may wrap at spaces but
   no word of it is cut. Priority-0 columns are essential. The others are added by increasing priority
   (then left to right) while they fit; a column that does not fit is skipped, and no column of a later
   priority level is added after one was skipped. Columns keep their order. The dropped ones are named under
   the table (``more in --json: …``).
2. **Transposed**, when even the essential columns do not fit: one block per row, ``header  value`` lines,
   every column included; a value wider than the console folds onto the next line (nothing is cut).

Why not wrap cells instead: a wrapped number (``27.7`` / ``3``) misreads worse than a missing column, and the
JSON output (``--json``) already holds every value. Why keep a table at all at 80 columns: comparing rows
(policies) is what the table is for, and the transposed layout loses that, so it is the last resort.

Rendering is pure: :func:`plan` decides the layout (a function of the cells and the width), ``FitTable`` is a
rich renderable (print it on any console, or nest it), and :func:`render_text` returns the text without
printing — for ``--quiet`` modes, files and tests.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.table import Table
from rich.text import Text

GAP = 2  # cells between two columns: rich's padding of 1 on each side, collapsed, and the box's blank divider


@dataclass(frozen=True)
class Column:
    """One column: the row's ``key``, its ``header`` and how a value is written.

    ``format`` is a format string applied to ``row[key]`` (``"{:.2f}"``) or a function of the whole row (for a
    cell made of several fields); a missing or ``None`` value is written ``-``. ``priority`` 0 is essential
    (always shown, or the table turns); a higher number is dropped earlier."""

    key: str
    header: str
    format: str | Callable[[Mapping[str, Any]], str] = "{}"
    priority: int = 0
    justify: Literal["left", "right", "center"] = "right"
    style: Callable[[str], str] | None = None  # a rich style for a written value (e.g. red for "NO")

    def cell(self, row: Mapping[str, Any]) -> str:
        if callable(self.format):
            return self.format(row)
        value = row.get(self.key)
        return "-" if value is None else self.format.format(value)

    def min_width(self, cells: Sequence[str]) -> int:
        """Its widest value, or the longest word of its header if that is wider."""
        words = self.header.split() or [""]
        return max([cell_len(c) for c in cells] + [cell_len(w) for w in words])


@dataclass(frozen=True)
class Layout:
    """The columns (indices into the column list, in display order) shown at a width, and those left out;
    ``transposed``: one block per row, with every column."""

    shown: tuple[int, ...]
    dropped: tuple[int, ...]
    transposed: bool


def plan(columns: Sequence[Column], cells: Sequence[Sequence[str]], width: int) -> Layout:
    """The layout of ``cells`` (one list of strings per row, one string per column) at ``width`` (see the
    module docstring). Pure: the same inputs give the same layout."""
    widths = [col.min_width([row[i] for row in cells]) for i, col in enumerate(columns)]

    def fits(chosen: set[int]) -> bool:
        return sum(widths[i] for i in chosen) + GAP * (len(chosen) - 1) <= width

    shown = {i for i, col in enumerate(columns) if col.priority == 0}
    if not fits(shown):
        return Layout(tuple(range(len(columns))), (), transposed=True)
    for level in sorted({col.priority for col in columns} - {0}):
        skipped = False
        for i in (i for i, col in enumerate(columns) if col.priority == level):
            if fits(shown | {i}):
                shown.add(i)
            else:
                skipped = True
        if skipped:
            break
    return Layout(tuple(sorted(shown)), tuple(i for i in range(len(columns)) if i not in shown), transposed=False)


class FitTable:
    """A rich renderable: ``rows`` under ``columns``, laid out for the width it is rendered at (module
    docstring). ``more_hint`` names where the dropped columns are (``"--json"``); without it the note says
    they did not fit."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], columns: Sequence[Column], *, title: str | None = None,
                 more_hint: str | None = None) -> None:
        self.columns, self.title, self.more_hint = list(columns), title, more_hint
        self.cells = [[col.cell(row) for col in self.columns] for row in rows]

    def layout(self, width: int) -> Layout:
        return plan(self.columns, self.cells, width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        layout = self.layout(options.max_width)
        if layout.transposed:
            yield from self._blocks()
            return
        table = Table(title=Text(self.title) if self.title else None, box=box.SIMPLE_HEAD, show_edge=False,
                      pad_edge=False, collapse_padding=True)
        for i, width in self._widths(layout.shown, options.max_width).items():
            col = self.columns[i]
            table.add_column(Text(col.header), justify=col.justify, width=width, overflow="fold")
        for row in self.cells:  # Text: a value is never read as markup
            table.add_row(*(self._text(i, row[i]) for i in layout.shown))
        yield table
        if layout.dropped:
            names = ", ".join(self.columns[i].header for i in layout.dropped)
            yield Text(f"more in {self.more_hint}: {names}" if self.more_hint else f"not shown at this width: {names}",
                       style="dim")

    def _text(self, i: int, value: str) -> Text:
        style = self.columns[i].style
        return Text(value, style=style(value) if style else "")

    def _widths(self, shown: Sequence[int], width: int) -> dict[int, int]:
        """Fixed column widths (so rich never shrinks a column): each column's minimum, then the room left
        unwraps headers, the cheapest first (so as few headers as possible wrap)."""
        values = {i: [row[i] for row in self.cells] for i in shown}
        widths = {i: self.columns[i].min_width(values[i]) for i in shown}
        natural = {i: max(widths[i], cell_len(self.columns[i].header)) for i in shown}
        room = width - sum(widths.values()) - GAP * (len(widths) - 1)
        for i in sorted(shown, key=lambda i: (natural[i] - widths[i], i)):
            if natural[i] - widths[i] <= room:
                room -= natural[i] - widths[i]
                widths[i] = natural[i]
        return widths

    def _blocks(self) -> RenderResult:
        if self.title:
            yield Text(self.title, style="bold")
        for row in self.cells:
            block = Table.grid(padding=(0, 2))
            block.add_column(style="dim")
            block.add_column(overflow="fold")
            for col, value in zip(self.columns[1:], row[1:]):
                block.add_row(Text(col.header), self._text(self.columns.index(col), value))
            yield Text(f"\n{self.columns[0].header}: {row[0]}", style="bold", overflow="fold")
            yield block


class FitLine:
    """A one-line status (a training step): ``fields`` as ``(text, priority)``, joined by two spaces; at
    render time the fields of the highest priority numbers are dropped until the line fits the width (priority
    0 always stays). A rich renderable, like :class:`FitTable`."""

    def __init__(self, fields: Sequence[tuple[str, int]]) -> None:
        self.fields = list(fields)

    def text(self, width: int) -> str:
        kept = list(self.fields)
        for level in sorted({p for _, p in kept} - {0}, reverse=True):
            if cell_len("  ".join(t for t, _ in kept)) <= width:
                break
            kept = [(t, p) for t, p in kept if p != level]
        return "  ".join(t for t, _ in kept)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Text(self.text(options.max_width), overflow="fold")


def render_text(renderable: RenderableType, width: int = 80) -> str:
    """``renderable`` as plain text at ``width`` columns (no colour codes), without printing it."""
    console = Console(width=width, file=io.StringIO(), force_terminal=False, color_system=None)
    console.print(renderable)
    return console.file.getvalue()
