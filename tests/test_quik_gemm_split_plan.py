"""How many blocks the quik block-synchronous GEMM splits K into at decode sizes (qtool/layouts/quik/cuda.py gemm_split),
on the CPU. H100/H200: 132 SMs, two 64-token decode blocks per SM."""

from __future__ import annotations

import pytest

from qtool.layouts.quik import cuda as quik

SMS, PER_SM = 132, 2


@pytest.mark.parametrize(
    "n,steps,split",
    [
        (4096, 30 + 4, 8),  # 4096x4096, 256 outliers: 32 tiles, 8 shares of 4-5 stages fill one wave
        (11008, 30 + 4, 3),  # 86 tiles: a fourth share would start a second wave
        (4096, 79 + 14, 8),  # K = 11008, 896 outliers: the wave still caps it
        (128, 200, 16),  # one tile: capped at SPLIT_MAX
        (128, 7, 1),  # fewer than two shares of SPLIT_MIN_STAGES stages: no split
        (40000, 34, 1),  # 313 tiles already fill the GPU
    ],
)
def test_split_fills_one_wave_with_enough_stages_per_block(n, steps, split):
    tiles = -(-n // quik.ROWS)
    assert quik.gemm_split(tiles, steps, PER_SM, SMS) == split


def test_split_refused_where_the_kernel_cannot_split():
    # raw int32 sums and 256-token tiles have no split path; the check comes before any GPU work
    with pytest.raises(ValueError, match="split: found 2 for kernel ws"):
        quik.gemm(_fake_activations(300), _FakePrepared(), kernel="ws", split=2, out=_fake_out())


class _FakePrepared:
    out_features = 64
    bits = 4


def _fake_activations(m: int):
    import torch

    return quik.QuantizedActivations(
        torch.zeros(m, 128, dtype=torch.int8), torch.zeros(m, 0), torch.zeros(m), torch.zeros(m)
    )


def _fake_out():
    import torch

    return torch.empty(300, 64, dtype=torch.float16)
