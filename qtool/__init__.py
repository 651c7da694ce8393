"""qtool: quantize Hugging Face causal LMs into packed checkpoints."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "load"]


def load(path, device: str = "cpu", dtype=None, verify: bool = True):
    """Load a packed qtool checkpoint; quantized linears execute the packed layout (see qtool.checkpoint.loader)."""
    from qtool.checkpoint.loader import load_checkpoint

    return load_checkpoint(path, device=device, dtype=dtype, verify=verify)
