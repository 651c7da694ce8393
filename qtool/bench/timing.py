"""GPU timing for the bench: CUDA events around CUDA-graph replays of rotated work, median of many samples.

A sample is one replay of a graph that calls every rotated buffer set once, divided by the number of sets:
the GPU then runs the kernels back to back (no ~6 us Python launch gaps between them), and each call finds
its inputs outside L2 because the sets together exceed it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

Fns = Sequence[Callable[[], Any]]


class Timer(Protocol):
    def __call__(self, fns: Fns, warmup: int, iters: int) -> list[float]:
        """Per-call times in microseconds, one sample per iteration."""
        ...


class CudaTimer:
    """Times `fns` with CUDA events; captures them as one CUDA graph unless that fails (then a Python loop)."""

    def __init__(self, use_graphs: bool = True) -> None:
        self.use_graphs = use_graphs
        self.graph_failures: list[str] = []

    def __call__(self, fns: Fns, warmup: int, iters: int) -> list[float]:
        if not fns:
            raise ValueError("timer: found no functions to time, expected at least one")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(1, warmup)):
                for f in fns:
                    f()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        run: Callable[[], None]
        graph = None
        if self.use_graphs:
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for f in fns:
                        f()
                torch.cuda.synchronize()
                for _ in range(2):
                    graph.replay()
                torch.cuda.synchronize()
            except Exception as exc:  # some library call refused capture: time it eagerly
                self.graph_failures.append(f"{type(exc).__name__}: {exc}"[:200])
                graph = None
                torch.cuda.synchronize()
        if graph is not None:
            run = graph.replay
        else:

            def run() -> None:
                for f in fns:
                    f()

        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            starts[i].record()
            run()
            ends[i].record()
        torch.cuda.synchronize()
        samples = [s.elapsed_time(e) * 1000.0 / len(fns) for s, e in zip(starts, ends, strict=True)]
        del graph
        return samples
