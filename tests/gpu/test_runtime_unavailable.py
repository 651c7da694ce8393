"""CPU-side behaviour of the GPU runtime (these run everywhere, GPU or not)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qtool.cuda import compile as cc


def test_package_imports_do_not_import_cupy():
    code = (
        "import sys; import qtool.cuda.compile, qtool.layouts.grouped_int.cuda, qtool.cuda.graphs, qtool.bench.command, "
        "qtool.layouts.grouped_int.module; print('cupy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_missing_cupy_is_one_line_naming_reference(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(cc.CudaUnavailableError) as exc:
        cc.require_cupy()
    msg = str(exc.value)
    assert "\n" not in msg and "cupy" in msg and "reference" in msg


def test_no_gpu_is_one_line_naming_reference(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(cc.CudaUnavailableError) as exc:
        cc.require_cupy()
    assert "\n" not in str(exc.value) and "reference" in str(exc.value)


def test_bad_kernel_mode_is_named(monkeypatch):
    from qtool.cuda.compile import kernel_mode

    monkeypatch.setenv("QTOOL_KERNELS", "fast")
    with pytest.raises(cc.CudaUnavailableError, match="QTOOL_KERNELS: found 'fast'"):
        kernel_mode()


def test_dispatch_rule():
    from qtool.layouts.grouped_int.cuda import choose_path, gemv_warps

    assert choose_path(1, torch.float16, 4, 128, 4096, 4096, hopper=False) == "gemv-fma"
    assert choose_path(1, torch.float16, 8, 128, 4096, 4096, hopper=False) == "gemv-fma"
    assert choose_path(1, torch.float16, 4, 128, 11008, 4096, hopper=False) == "gemv-fma"  # 344 pieces
    assert (
        choose_path(1, torch.float16, 8, 128, 11008, 4096, hopper=False) == "gemv"
    )  # 688 pieces: tensor-core kernel
    assert choose_path(1, torch.float16, 4, 128, 16384, 4096, hopper=False) == "gemv-fma"
    assert choose_path(1, torch.float16, 4, 128, 16512, 4096, hopper=False) == "gemv"
    assert choose_path(4, torch.float16, 4, 128, 4096, 4096, hopper=False) == "gemv"
    assert choose_path(32, torch.float16, 8, 32, 4096, 4096, hopper=False) == "gemv"
    assert choose_path(64, torch.float16, 4, 128, 4096, 4096, hopper=False) == "dequant+cublas"
    assert choose_path(2048, torch.float16, 4, 128, 4096, 4096, hopper=False) == "dequant+cublas"
    assert choose_path(1, torch.bfloat16, 4, 128, 4096, 4096, hopper=False) == "dequant+cublas"
    assert choose_path(1, torch.float16, 3, 128, 4096, 4096, hopper=False) == "reference"
    # a group smaller than one 16-byte load
    assert choose_path(1, torch.float16, 4, 16, 4096, 4096, hopper=False) == "reference"
    assert choose_path(8, torch.float16, 4, None, 1000, 4096, hopper=False) == "gemv"
    assert choose_path(1, torch.float16, 4, None, 1000, 4096, hopper=False) == "gemv-fma"
    assert choose_path(1, torch.float16, 4, 96, 4096, 4096, hopper=False) == "reference"  # not a power of two
    # Hopper: the wgmma kernel from MMA_MIN_M to MMA_MAX_M tokens (fp16, groups of >= 32 or per-channel)
    assert choose_path(16, torch.float16, 4, 128, 4096, 4096, hopper=True) == "gemv"
    assert choose_path(17, torch.float16, 4, 128, 4096, 4096, hopper=True) == "mma"
    assert choose_path(256, torch.float16, 8, None, 4096, 4096, hopper=True) == "mma"
    # then up to WS_MID_MAX_M tokens on layers of WS_MID_MIN_N or more outputs; dequantize + cuBLAS on narrower ones
    assert choose_path(257, torch.float16, 4, 128, 4096, 4096, hopper=True) == "mma"
    assert choose_path(257, torch.float16, 4, 128, 4096, 1024, hopper=True) == "dequant+cublas"
    assert choose_path(513, torch.float16, 4, 128, 4096, 4096, hopper=True) == "dequant+cublas"
    assert choose_path(64, torch.bfloat16, 4, 128, 4096, 4096, hopper=True) == "dequant+cublas"
    assert (
        choose_path(64, torch.float16, 8, 16, 4096, 4096, hopper=True) == "dequant+cublas"
    )  # groups below 32
    for n, nt, kp in [(4096, 1, 4096), (11008, 2, 4096), (17, 8, 128), (4096, 8, 11008)]:
        w = gemv_warps(n, nt, kp, 4, 132)
        assert 1 <= w <= 16 and w * nt * 4 * 32 * 4 <= 48 * 1024


def test_device_index_takes_the_ordinal_given():
    assert cc.device_index(torch.device("cuda", 3)) == 3


def test_f16_checks_are_one_line_errors_naming_the_tensor():
    with pytest.raises(
        ValueError, match=r"^x: found torch.float16 \[2, 8\] on cpu .*expected contiguous float16 on CUDA$"
    ):
        cc.check_f16("x", torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(
        ValueError,
        match=r"^out: found torch.float32 \[3\], expected contiguous 16-byte aligned float16 \[3\]$",
    ):
        cc.f16_out(torch.zeros(3), (3,), torch.device("cpu"), aligned=True)
    with pytest.raises(ValueError, match=r"expected contiguous float16 \[2, 4\]$"):
        cc.f16_out(torch.zeros(4, 2, dtype=torch.float16).t(), (2, 4), torch.device("cpu"))
    out = torch.zeros(2, 4, dtype=torch.float16)
    assert cc.f16_out(out, (2, 4), out.device) is out
    fresh = cc.f16_out(None, (2, 4), torch.device("cpu"))
    assert fresh.shape == (2, 4) and fresh.dtype == torch.float16
