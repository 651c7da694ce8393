"""Keep what the reference path derives from packed tensors for the length of an evaluation.

On CPU a quantized linear runs the torch reference: it dequantizes its weight (grouped_int) or converts its codes
to a float matmul operand (quik) on every forward. Inside `reference_cache(model)` each such module keeps those
operands after the first forward, so evaluating a packed model costs about what the float model costs; they are
dropped when the block ends. Activations are still quantized per call, so results are unchanged bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def reference_cache(model: nn.Module) -> Iterator[int]:
    """Within the block, quantized modules (those with a `reference_cache` attribute) cache their reference-path
    operands; yields how many modules do."""
    modules = [m for m in model.modules() if hasattr(m, "reference_cache")]
    for m in modules:
        m.reference_cache = {}
    try:
        yield len(modules)
    finally:
        for m in modules:
            m.reference_cache = None
