"""The driver structures behind programmatic dependent launches (qtool/cuda/dependent_launch.py) match the CUDA
ABI (cuda.h: CUlaunchAttribute is 72 bytes, its value at 8; CUlaunchConfig is 56 bytes with the stream at 32), and
tensor maps become the launch argument CuPy takes when the ordinary launch is used. CPU only: the launches
themselves are covered by the GPU tests."""

from __future__ import annotations

import ctypes

import numpy as np

from qtool.cuda import dependent_launch as dl
from qtool.cuda.tma import TensorMap


def test_launch_structures_match_the_driver_abi():
    assert ctypes.sizeof(dl._Attribute) == 72
    assert dl._Attribute.value.offset == 8
    assert ctypes.sizeof(dl._Config) == 56
    assert dl._Config.stream.offset == 32
    assert dl._Config.attrs.offset == 40
    assert dl._Config.num_attrs.offset == 48


def test_ordinary_launch_arguments_unwrap_tensor_maps():
    m = TensorMap(("key",))
    m.arg = object()
    x = np.int32(7)
    assert dl._plain((m, x)) == (m.arg, x)


def test_a_kernel_without_a_function_handle_falls_back():
    class NoHandle:
        pass

    saved = dict(dl._STATE)
    try:
        assert dl._function_handle(NoHandle()) is None
        assert not dl.available() and "NoHandle" in dl.fallback_reason()
    finally:
        dl._STATE.update(saved)
