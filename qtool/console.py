"""Human output: rich progress bars on a terminal, plain log lines otherwise; quiet/verbose/json modes.

Logs and progress go to stderr so that stdout carries only results (a table, or JSON with --json).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

T = TypeVar("T")


class Reporter:
    def __init__(self, quiet: bool = False, verbose: bool = False, json_mode: bool = False) -> None:
        # --json changes stdout only: progress and log lines stay on stderr, so a CI job that keeps the JSON shows
        # what the run is doing; -q silences them.
        self.quiet = quiet
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
            with Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self.err,
                transient=False,
            ) as progress:
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

    def blocks(self, total: int, start: int, description: str, device=None) -> BlockProgress:
        """Progress over decoder blocks `start`..`total`: a bar with elapsed and remaining time and the peak
        memory so far on a terminal, one plain line per block otherwise."""
        return BlockProgress(self, total, start, description, device)


def process_age() -> float | None:
    """Seconds since this process started (Linux), None where /proc does not say: what starting the interpreter
    and importing the libraries took before `qtool` ran its first line of work."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_mb() -> float:
    """This process's peak resident set in MB. VmHWM, not getrusage: Linux carries the high-water mark of the
    process that forked this one over the exec into ru_maxrss (a child of a large process reports its size)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_memory(device=None) -> str:
    """Peak host memory of this process so far, and of the GPU when the compute device is one."""
    text = f"peak RSS {peak_rss_mb():.0f} MB"
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        text += f", GPU {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MB"
    return text


class BlockProgress:
    def __init__(self, reporter: Reporter, total: int, start: int, description: str, device) -> None:
        self.reporter, self.total, self.start, self.description, self.device = (
            reporter,
            total,
            start,
            description,
            device,
        )
        self.t0 = time.perf_counter()
        self.progress = None
        if reporter.quiet:
            return
        if sys.stderr.isatty():
            self.progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("left"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[memory]}"),
                console=reporter.err,
                transient=False,
            )
            self.progress.start()
            self.task = self.progress.add_task(description, total=total, completed=start, memory="")

    def advance(self, done: int) -> None:
        if self.reporter.quiet:
            return
        memory = peak_memory(self.device)
        if self.progress is not None:
            self.progress.update(self.task, completed=done, memory=memory)
            return
        elapsed = time.perf_counter() - self.t0
        left = elapsed / (done - self.start) * (self.total - done)
        self.reporter.log(
            f"{self.description}: {done}/{self.total}, {elapsed:.1f} s elapsed, ~{left:.0f} s left, {memory}"
        )

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
