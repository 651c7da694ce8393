"""The bench's tables: rich tables on stdout (styled on a terminal, plain text otherwise), and the same tables
rendered to a string for tests and logs."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterable, Sequence

import click
from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

# Wide enough that a file or pipe gets each table row on one line (rich assumes 80 columns off a terminal).
PLAIN_WIDTH = 240


def table(
    title: str | None,
    columns: Sequence[str],
    rows: Iterable[Sequence[str]],
    caption: str | None = None,
    left: int = 1,
    left_last: int = 0,
) -> RenderableType:
    """A table whose first `left` and last `left_last` columns are left-aligned text and the rest right-aligned
    numbers; the title above it and the caption below it as lines of their own (rich would wrap them to the
    table's width)."""
    t = Table(box=box.SIMPLE, pad_edge=False)
    n = len(columns)
    for i, c in enumerate(columns):
        text = i < left or i >= n - left_last
        t.add_column(c, justify="left" if text else "right", no_wrap=i < left)
    for r in rows:
        t.add_row(*r)
    parts: list[RenderableType] = [Text(title, style="bold")] if title else []
    parts.append(t)
    if caption:
        parts.append(Text(caption, style="dim"))
    return Group(*parts)


def _items(parts: Iterable[RenderableType | str]) -> list[RenderableType]:
    # plain strings are text, never rich markup: a "[...]" in a device name or an error stays as it is
    return [Text(p) if isinstance(p, str) else p for p in parts]


def render(parts: Iterable[RenderableType | str], width: int = PLAIN_WIDTH) -> str:
    """The parts as plain text (no styles), one after another."""
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False, highlight=False)
    for p in _items(parts):
        console.print(p)
    # rich pads every row to the table's width
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()).strip("\n")


def echo(parts: Iterable[RenderableType | str]) -> None:
    """Print the parts on stdout: styled to the terminal's width on one, plain and wide otherwise."""
    if not sys.stdout.isatty():
        click.echo(render(parts))
        return
    console = Console(highlight=False)
    for p in _items(parts):
        console.print(p)


def num(v: float | None, spec: str, suffix: str = "") -> str:
    """A number formatted by `spec`, or '-' when it was not measured."""
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return format(v, spec) + suffix
