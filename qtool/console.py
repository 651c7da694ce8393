"""Human output: rich progress bars on a terminal, plain log lines otherwise; quiet/verbose/json modes.

Logs and progress go to stderr so that stdout carries only results (a table, or JSON with --json).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

T = TypeVar("T")


class Reporter:
    def __init__(self, quiet: bool = False, verbose: bool = False, json_mode: bool = False) -> None:
        self.quiet = quiet or json_mode
        self.verbose = verbose and not self.quiet
        self.json_mode = json_mode
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)
        self.out = Console(highlight=False)
        self._t0 = time.perf_counter()

    def log(self, message: str) -> None:
        if not self.quiet:
            self.err.print(f"[dim]{time.perf_counter() - self._t0:7.1f}s[/dim] {message}", markup=True)

    def debug(self, message: str) -> None:
        if self.verbose:
            self.log(message)

    def track(self, items: Iterable[T], total: int, description: str) -> Iterator[T]:
        if self.quiet:
            yield from items
            return
        if sys.stderr.isatty():
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=self.err, transient=False) as progress:
                task = progress.add_task(description, total=total)
                for item in items:
                    yield item
                    progress.advance(task)
            return
        # Not a terminal (CI logs): about ten plain lines per task.
        step = max(1, -(-total // 10))
        for n, item in enumerate(items, 1):
            yield item
            if n % step == 0 or n == total:
                self.log(f"{description}: {n}/{total}")
