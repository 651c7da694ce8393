"""Tensor-map inputs (qtool/cuda/tma.py) on the CPU: what the copy engine cannot address is refused with one
line naming the tensor's shape, strides and address, before any driver call."""

from __future__ import annotations

import pytest
import torch

from qtool.cuda import tma
from qtool.cuda.compile import CudaUnavailableError


def test_cpu_and_strided_tensors_are_not_usable():
    assert not tma.usable(torch.zeros(4, 64, dtype=torch.int8))  # not on a GPU
    assert not tma.usable(torch.zeros(4, 64, dtype=torch.int8).t())  # 2-D but columns strided
    assert not tma.usable(torch.zeros(64, dtype=torch.int8))  # 1-D


def test_tiled_refuses_in_one_line_naming_the_tensor():
    t = torch.zeros(3, 40, dtype=torch.float16)[:, 1:]
    with pytest.raises(CudaUnavailableError) as exc:
        tma.tiled(t, 128, 256, 128)
    msg = str(exc.value)
    assert "\n" not in msg
    assert "(3, 39)" in msg and "(40, 1)" in msg and "16-byte aligned" in msg


def test_padded_rows_extends_a_view_only_into_storage_it_owns():
    base = torch.arange(64 * 8, dtype=torch.int8).view(64, 8)
    v = tma.padded_rows(base[:5], 64)
    assert v.shape == (64, 8) and v.data_ptr() == base.data_ptr() and torch.equal(v, base)
    # a multiple already, or storage too short for the next multiple: the tensor itself
    assert tma.padded_rows(base, 64) is base
    assert tma.padded_rows(base[60:63], 64).shape == (3, 8)
    mid = tma.padded_rows(base[10:15], 16)
    assert mid.shape == (16, 8) and torch.equal(mid, base[10:26])
    # rows with a stride wider than the row: the last padded row needs only its own bytes
    wide = torch.zeros(34, 16, dtype=torch.int8)[:, :8]
    assert tma.padded_rows(wide[:3], 34).shape == (34, 8)
    assert tma.padded_rows(wide[1:3], 34).shape == (2, 8)
