"""The host side of QoQ's code producers (qtool/layouts/qoq/producers.py), on the CPU: how many blocks of a cluster
take a SwiGLU row, and the code positions the kernels compute from `perm` (kernels/qoq/act.cuh qoq_store8) against
the layer's column map `dest`, which the quantize kernel gathers through. H100/H200: 132 SMs."""

from __future__ import annotations

import pytest
import torch

from qtool.layouts.qoq import cuda as qoq
from qtool.layouts.qoq import producers
from tests.gpu.helpers import QoQFieldLayer

SMS = 132


@pytest.mark.parametrize(
    "rows,i,cluster",
    [
        (1, 11008, 8),
        (16, 11008, 8),
        (33, 11008, 8),  # 264 blocks: two a multiprocessor
        (34, 11008, 4),
        (64, 11008, 4),
        (66, 14336, 4),
        (67, 14336, 2),
        (132, 11008, 2),
        (133, 11008, 1),
        (300, 11008, 1),
        (1, 136, 1),  # 17 pieces: fewer than 64 for each of two blocks
        (1, 1024, 2),  # 128 pieces
        (1, 2048, 4),
        (1, 4096, 8),
    ],
)
def test_swiglu_cluster_keeps_every_block_resident_and_64_pieces_a_block(rows, i, cluster):
    assert producers.swiglu_cluster(rows, i, SMS) == cluster


def test_swiglu_cluster_stays_within_the_drivers_limit():
    assert producers.swiglu_cluster(16, 11008, SMS, limit=4) == 4
    assert producers.swiglu_cluster(16, 11008, SMS, limit=1) == 1


def _kernel_positions(k: int, kp: int, perm: int) -> torch.Tensor:
    """Byte position of column b in [0, kp) as qoq_store8 writes piece b // 8: the 4-bit order's even columns of the
    piece at 32 (p / 4) + 4 (p % 4) + j, its odd ones 16 bytes further; column order at 8p + j."""
    pos = torch.empty(kp, dtype=torch.int64)
    for p in range(kp // 8):
        for j in range(8):
            if perm:
                pos[8 * p + j] = 32 * (p // 4) + 4 * (p % 4) + j // 2 + 16 * (j % 2)
            else:
                pos[8 * p + j] = 8 * p + j
    return pos


@pytest.mark.parametrize("k", [136, 576, 4096])
@pytest.mark.parametrize("bits", [4, 8])
def test_computed_positions_are_the_layers_column_map(k, bits):
    """The producers write every byte of the code row exactly once, each column's code where the layer's `dest`
    puts it, and the padding past K elsewhere."""
    p = qoq.prepare(QoQFieldLayer(16, k, bits, None, False, generator=torch.Generator().manual_seed(k)))
    pos = _kernel_positions(k, p.kp, producers.code_order(p))
    assert torch.equal(torch.sort(pos).values, torch.arange(p.kp))
    assert torch.equal(pos[:k], p.dest.long())
