"""The split-K workspace that kernels splitting K across blocks share on a device: float32 partial tiles and one
int32 counter per output tile. The kernels keep the counters at zero (the last block of a tile resets its own),
and they run in stream order, so no two split-K launches on one device overlap."""

from __future__ import annotations

import torch

_WORKSPACE: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def workspace(dev: int, floats: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Partials (at least `floats`) and zeroed counters (at least `tiles`), grown on demand; None when growing is
    needed during CUDA-graph capture (the caller then runs without splitting)."""
    ws = _WORKSPACE.get(dev)
    if ws is not None and ws[0].numel() >= floats and ws[1].numel() >= tiles:
        return ws
    if torch.cuda.is_current_stream_capturing():
        return None
    old_f = 0 if ws is None else ws[0].numel()
    old_t = 0 if ws is None else ws[1].numel()
    if ws is not None:
        torch.cuda.current_stream(dev).synchronize()  # the old buffers may still be in use by queued kernels
    ws = (
        torch.empty(max(floats, old_f), dtype=torch.float32, device=f"cuda:{dev}"),
        torch.zeros(max(tiles, old_t, 1024), dtype=torch.int32, device=f"cuda:{dev}"),
    )
    _WORKSPACE[dev] = ws
    return ws


def split_buffers(
    dev: int, split: int, tiles: int, rows: int, tn: int
) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """(split, partials, counters) for `tiles` output tiles of rows x tn split `split` ways; no split where the
    workspace cannot grow (during CUDA-graph capture)."""
    if split == 1:
        return 1, None, None
    bufs = workspace(dev, split * tiles * rows * tn, tiles)
    return (1, None, None) if bufs is None else (split, *bufs)


def counters(dev: int) -> torch.Tensor | None:
    """The device's tile counters (tests: all zero between launches)."""
    ws = _WORKSPACE.get(dev)
    return None if ws is None else ws[1]
