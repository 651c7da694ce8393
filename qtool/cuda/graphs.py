"""CUDA-graph capture of a fixed-shape step (single-token decode with a static KV cache, or a fixed prefill).

A decode step of a 7B model issues hundreds of kernels; launched one by one from Python each costs ~6 us of
host time, more than many of the kernels take on the GPU. Captured once and replayed, the step costs one launch.
The captured function must only read its inputs from the static tensors given here (copy new values in with
`__call__`), keep every other tensor it touches alive, and not synchronize with the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class GraphedStep:
    """`fn(*static_inputs)` captured as one CUDA graph; calling copies inputs in and replays."""

    def __init__(
        self,
        fn: Callable[..., Any],
        example_inputs: Sequence[torch.Tensor],
        warmup: int = 2,
        pool: Any | None = None,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("GraphedStep: found no CUDA device, expected one (CUDA graphs are GPU-only)")
        for i, t in enumerate(example_inputs):
            if not t.is_cuda:
                raise ValueError(f"example_inputs[{i}]: found device {t.device}, expected a CUDA tensor")
        self.fn = fn
        self.static_inputs = [t.clone() for t in example_inputs]
        # Warm-up on a side stream compiles kernels, creates cuBLAS handles and fills allocator pools, none of
        # which may happen during capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn(*self.static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.static_output = fn(*self.static_inputs)
        torch.cuda.synchronize()

    def replay(self) -> Any:
        self.graph.replay()
        return self.static_output

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if len(inputs) != len(self.static_inputs):
            raise ValueError(f"GraphedStep: found {len(inputs)} inputs, expected {len(self.static_inputs)}")
        for i, (dst, src) in enumerate(zip(self.static_inputs, inputs, strict=True)):
            if src.shape != dst.shape:
                raise ValueError(
                    f"input {i}: found shape {list(src.shape)}, expected {list(dst.shape)} (captured)"
                )
            dst.copy_(src)
        return self.replay()
