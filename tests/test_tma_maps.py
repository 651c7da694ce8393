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
