"""Residual add + RMSNorm kernel (qtool/cuda/rms_norm.py) against torch and a float64 reference: the sum
bit-identical to torch's half add, the normalized rows within float16 rounding, every output element written."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.helpers import gpu_ready, synced

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]


@pytest.mark.parametrize("rows,d", [(1, 4096), (3, 4096), (2048, 4096), (5, 8), (7, 520), (2, 11008)])
@pytest.mark.parametrize("with_y", [True, False])
def test_add_rms_norm_matches_torch_and_float64(rows, d, with_y):
    from qtool.cuda.rms_norm import add_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(rows * 7 + d)
    h = (torch.randn(rows, d, device="cuda", generator=gen) * 4).half()
    y = (torch.randn(rows, d, device="cuda", generator=gen) * 2).half() if with_y else None
    w = (torch.rand(d, device="cuda", generator=gen) * 2).half()
    out = torch.full((rows, d), float("nan"), dtype=torch.float16, device="cuda")
    hs, got = add_rms_norm(h, y, w, 1e-5, out=out)
    synced(got)
    assert got.data_ptr() == out.data_ptr() and bool(torch.isfinite(got).all()), "unwritten outputs"
    ref_h = h + y if with_y else h
    assert torch.equal(hs.view(torch.int16), ref_h.view(torch.int16)), "residual sum differs from torch's"
    x = ref_h.double()
    exact = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    err = (got.double() - exact).abs()
    assert bool((err <= exact.abs() * 2**-10 + 2**-24).all()), (
        f"beyond float16 rounding: {float(err.max()):.3e}"
    )
    torch_out = torch.nn.functional.rms_norm(ref_h, (d,), w, 1e-5)
    assert float((got.double() - torch_out.double()).abs().max()) <= float(exact.abs().max()) * 2**-9


def test_add_rms_norm_refuses_bad_input_in_one_line():
    from qtool.cuda.rms_norm import add_rms_norm

    h = torch.zeros(2, 12, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match=r"add_rms_norm: found h \[2, 12\]"):
        add_rms_norm(h, None, torch.zeros(12, dtype=torch.float16, device="cuda"), 1e-5)
    with pytest.raises(ValueError, match="y: found torch.float32"):
        add_rms_norm(
            h[:, :8].contiguous(),
            torch.zeros(2, 8, device="cuda"),
            torch.zeros(8, dtype=torch.float16, device="cuda"),
            1e-5,
        )
