"""Ring depth of the quik warp-specialized GEMMs (qtool/layouts/quik/cuda.py ws_rings, ws_stages, wsp_epilogue_bytes), on
the CPU: which depth a layer gets, that every depth fits a block's shared memory with its epilogue buffers, and
the one-line refusal of a depth that was not built."""

from __future__ import annotations

import pytest

from qtool.layouts.quik import cuda as quik


@pytest.mark.parametrize(
    "kt,ko,stages",
    [
        (30, 256, 4),  # 4096 x 4096, 256 outliers: 30 + 8 stages per tile
        (79, 896, 5),  # 11008 x 4096, 896 outliers: 79 + 28 stages, long tiles take the fifth stage
        (32, 0, 4),
        (64, 0, 5),  # 8192 columns, no outliers: at the threshold
    ],
)
def test_four_bit_persistent_ring_deepens_for_long_tiles(kt, ko, stages):
    steps = kt + ko // quik.WS_OUTLIER_COLUMNS[4]
    assert quik.ws_stages("wsp", 4, 256, steps) == stages


def test_eight_bit_and_unpersistent_kernels_have_one_ring():
    assert quik.ws_rings("wsp", 8, 256) == (quik.WSP_TILES[256],)
    assert quik.ws_rings("ws", 4, 256) == (quik.WS_TILES[256],)
    assert quik.ws_stages("wsp", 8, 256, 500) == quik.WSP_TILES[256]


@pytest.mark.parametrize("bits", [4, 8])
def test_every_ring_fits_with_at_least_two_epilogue_buffers(bits):
    for tn in quik.WSP_TILES:
        for stages in quik.ws_rings("wsp", bits, tn):
            epi = quik.wsp_epilogue_bytes(tn, bits, stages)
            assert epi >= 2 * 8192, (tn, stages)
            # the kernel's static arrays (s_x and z_x + h s_x for two tiles, the ring's barriers) take < 5 KB
            assert stages * quik.ws_stage_bytes(tn, bits) + epi + 1024 + 5 * 1024 <= quik.SMEM_BLOCK_MAX


def test_ring_depth_refused_where_not_built():
    import torch

    a = quik.QuantizedActivations(
        torch.zeros(300, 128, dtype=torch.int8), torch.zeros(300, 0), torch.zeros(300), torch.zeros(300)
    )
    with pytest.raises(ValueError, match="stages: found 4 for kernel sync"):
        quik.gemm(a, _FakePrepared(), kernel="sync", stages=4, out=torch.empty(300, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"tokens: found 64 for kernel wsp"):
        quik.ws_rings("wsp", 4, 64)


class _FakePrepared:
    out_features = 64
    bits = 4
