"""SwiGLU kernel (qtool/cuda/swiglu.py) against torch's F.silu(gate) * up: bit-identical on fresh random inputs,
every output element written."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.helpers import gpu_ready, synced

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]


@pytest.mark.parametrize(
    "lead,i", [((1, 1), 11008), ((4, 1), 11008), ((1, 2048), 11008), ((3,), 8), ((2, 5), 264)]
)
def test_swiglu_bit_identical_to_torch(lead, i):
    from qtool.cuda.swiglu import swiglu

    gen = torch.Generator(device="cuda").manual_seed(i + len(lead))
    gu = (torch.randn(*lead, 2 * i, device="cuda", generator=gen) * 5).half()
    out = torch.full((*lead, i), float("nan"), dtype=torch.float16, device="cuda")
    got = synced(swiglu(gu, out=out))
    gate, up = gu.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    assert bool(torch.isfinite(got).all()), "unwritten outputs"
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), (
        f"{int((got != ref).sum())} of {got.numel()} differ, max {float((got.float() - ref.float()).abs().max()):.3e}"
    )


def test_swiglu_refuses_bad_input_in_one_line():
    from qtool.cuda.swiglu import swiglu

    with pytest.raises(ValueError, match=r"gu: found torch.float16 \[2, 12\]"):
        swiglu(torch.zeros(2, 12, dtype=torch.float16, device="cuda"))
