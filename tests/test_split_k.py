"""qtool/cuda/split_k.py `split_buffers`, the split-K workspace every warp-specialized GEMM asks for, without a GPU:
no workspace for one part, the asked size, and no split where the workspace cannot grow (CUDA-graph capture)."""

from __future__ import annotations

from qtool.cuda import split_k


def test_split_buffers(monkeypatch):
    asked = []

    def workspace(dev, floats, tiles):
        asked.append((dev, floats, tiles))
        return None if floats > 10**6 else ("partials", "counters")

    monkeypatch.setattr(split_k, "workspace", workspace)
    assert split_k.split_buffers(0, 1, 8, 128, 64) == (1, None, None) and asked == []
    assert split_k.split_buffers(1, 3, 8, 128, 64) == (3, "partials", "counters")
    assert asked == [(1, 3 * 8 * 128 * 64, 8)]
    assert split_k.split_buffers(0, 4, 64, 128, 256) == (
        1,
        None,
        None,
    )  # it would have to grow during capture
