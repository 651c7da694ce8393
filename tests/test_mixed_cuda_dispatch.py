"""The CPU side of the mixed-2-4-16 kernels' dispatch (qtool/cuda/mixed.py): the per-block table the kernels read,
which layers and calls they take, and the reference forward still used without a GPU."""

from __future__ import annotations

import pytest
import torch

from qtool.cuda import mixed


def _decode(info: int) -> tuple[int, int, list[int]]:
    info &= 0xFFFFFFFF
    return info & 0xFFFF, (info >> 16) & 7, [(info >> (24 + 2 * i)) & 3 for i in range(4)]


def test_block_info_ranks_counts_and_stripe_order():
    bits = torch.tensor([4, 2, 2, 2, 2, 2, 4, 2, 4, 4, 4, 4, 2, 2, 2, 2, 2, 4, 2, 4], dtype=torch.uint8)
    info, block4 = mixed.block_info(bits)
    assert info.dtype == torch.int32 and not block4
    assert [_decode(int(v)) for v in info] == [
        (0, 1, [1, 2, 3, 0]), (1, 1, [0, 1, 3, 2]), (2, 4, [0, 1, 2, 3]), (6, 0, [0, 1, 2, 3]), (6, 2, [0, 2, 1, 3])]
    _, block4 = mixed.block_info(torch.tensor([2, 4, 2, 2, 2, 2, 2, 4], dtype=torch.uint8))
    assert block4


def test_paths_and_unsupported_layers():
    assert mixed.choose_path(1, torch.float16, 16, 4096) == "gemv"
    assert mixed.choose_path(16, torch.float16, 16, 4096) == "gemv"
    assert mixed.choose_path(17, torch.float16, 16, 4096) == "dequant+cublas"
    assert mixed.choose_path(1, torch.bfloat16, 16, 4096) == "reference"
    assert mixed.choose_path(1, torch.float16, 32, 4096) == "reference"
    assert mixed.unsupported_reason(16, 4096) is None
    assert "multiple of 64" in mixed.unsupported_reason(16, 4112)
    assert "cover 16" in mixed.unsupported_reason(8, 4096)
    assert [mixed.token_slots(m) for m in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert mixed.gemv_warps(4096, 4) == 2 and mixed.gemv_warps(11008, 4) == 4 and mixed.gemv_warps(64, 8) == 1
    assert mixed.use_pipe(8192, 1, 2, True) and not mixed.use_pipe(8192, 1, 2, False)
    assert mixed.outlier_mode("spmv") == "spmv" and mixed.outlier_mode() == mixed.OUTLIERS
    with pytest.raises(ValueError, match="outliers: found 'both'"):
        mixed.outlier_mode("both")
    with pytest.raises(ValueError, match="pipe: found True for 2 token slots"):
        mixed.use_pipe(8192, 2, 2, True)
