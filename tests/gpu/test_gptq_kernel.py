"""GPTQ's lazy-batch kernel (kernels/gptq/gptq.cu via qtool/quant/gptq.py) against the torch column loop on the same GPU:
codes, scales, zeros and the kept columns bit for bit, on odd and real shapes, every grid option the kernel takes."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.helpers import gpu_ready, synced

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]


def _problem(n: int, k: int, seed: int, dead: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=gen)
    x = torch.randn(2 * k + 3, k, device="cuda", generator=gen) * (
        torch.rand(k, device="cuda", generator=gen) + 0.1
    )
    if dead:
        x[:, :dead] = 0  # input channels that never fire: zero Hessian rows
    return w, x.T @ x


def _both(monkeypatch, w, h, spec, **kw):
    from qtool.cuda import gptq as gptq_cuda
    from qtool.quant.gptq import gptq_run

    calls = []
    real = gptq_cuda.columns
    monkeypatch.setattr(gptq_cuda, "columns", lambda *a: (calls.append(a[-3:-1]), real(*a))[1])
    monkeypatch.setenv("QTOOL_KERNELS", "auto")
    fused = gptq_run(w, h, spec, **kw)
    synced(fused.codes)
    assert calls, "the batch kernel did not run"
    monkeypatch.setenv("QTOOL_KERNELS", "reference")
    loop = gptq_run(w, h, spec, **kw)
    return fused, loop


CASES = [
    # n, k, bits, group, symmetric, options
    (37, 200, 4, 32, False, {}),  # dynamic groups: one segment per group, ragged last batch
    (300, 384, 3, 128, True, {"act_order": True, "static_groups": True}),
    (1, 96, 8, None, True, {}),
    (513, 256, 2, 64, False, {"keep_last": 16}),
    (64, 512, 4, 128, False, {"clip_ratios": [1.0, 0.9, 0.8]}),
    (33, 1024, 4, 32, False, {"block_size": 512}),  # a batch of 512 columns: shared memory above 48 KiB
    (4096, 4096, 4, 128, False, {"act_order": True, "static_groups": True}),  # Llama-2-7B q_proj
]


@pytest.mark.parametrize("n,k,bits,group,symmetric,options", CASES)
def test_batch_kernel_is_the_torch_loop_bit_for_bit(monkeypatch, n, k, bits, group, symmetric, options):
    from qtool.quant.grid import GridSpec

    w, h = _problem(n, k, seed=n * 31 + k, dead=3 if n < 100 else 0)
    spec = GridSpec(bits=bits, symmetric=symmetric, group_size=group)
    fused, loop = _both(monkeypatch, w, h, spec, **options)
    assert torch.equal(fused.codes, loop.codes), (
        f"codes differ in {int((fused.codes != loop.codes).sum())} places"
    )
    assert torch.equal(fused.scales, loop.scales) and torch.equal(fused.zeros, loop.zeros)
    assert torch.equal(fused.kept, loop.kept)
    assert int(fused.codes.min()) >= 0 and int(fused.codes.max()) <= spec.maxq


def test_columns_write_only_their_columns():
    from qtool.cuda import gptq as gptq_cuda

    n, bs, c0, c1 = 45, 96, 32, 64
    gen = torch.Generator(device="cuda").manual_seed(5)
    w1 = torch.randn(n, bs, device="cuda", generator=gen)
    a = torch.randn(bs, bs, device="cuda", generator=gen)
    hinv1 = torch.linalg.cholesky(a @ a.T + bs * torch.eye(bs, device="cuda"), upper=True)
    scales = torch.rand(n, 3, device="cuda", generator=gen) + 0.2
    zeros = torch.full((n, 3), 8.0, device="cuda")
    groups = (torch.arange(bs, device="cuda") // 32).to(torch.int32)
    q1 = torch.full_like(w1, float("nan"))
    err1 = torch.full_like(w1, float("nan"))
    before = w1.clone()
    gptq_cuda.columns(w1, q1, err1, hinv1, scales, zeros, groups, c0, c1, 15.0)
    synced(q1)
    assert bool(torch.isfinite(q1[:, c0:c1]).all()) and bool(torch.isfinite(err1[:, c0:c1]).all()), (
        "unwritten"
    )
    assert bool(torch.isnan(q1[:, :c0]).all() and torch.isnan(q1[:, c1:]).all()), "wrote outside its columns"
    assert bool(torch.isnan(err1[:, :c0]).all() and torch.isnan(err1[:, c1:]).all()), (
        "wrote outside its columns"
    )
    assert torch.equal(w1[:, :c1], before[:, :c1]), "changed columns it does not own"
    assert not torch.equal(w1[:, c1:], before[:, c1:]), "later columns got no error feedback"
    # The first column by hand, in float64: its code and its error's effect on the next column.
    s, z = scales[:, 1].double(), 8.0
    q = torch.clamp(torch.round(before[:, c0].double() / s) + z, 0, 15)
    assert torch.equal(q1[:, c0].double(), q)
    e = (before[:, c0].double() - s * (q - z)) / hinv1[c0, c0].double()
    assert torch.allclose(err1[:, c0].double(), e, rtol=1e-5, atol=1e-6)


def test_columns_refuse_bad_arguments_in_one_line():
    from qtool.cuda import gptq as gptq_cuda

    w1 = torch.zeros(4, 32, device="cuda")
    hinv1 = torch.eye(32, device="cuda")
    s = torch.ones(4, 1, device="cuda")
    groups = torch.zeros(32, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="q1 is torch.float16"):
        gptq_cuda.columns(w1, w1.half(), w1.clone(), hinv1, s, s, groups, 0, 32, 15.0)
    with pytest.raises(ValueError, match=r"columns \[8, 8\)"):
        gptq_cuda.columns(w1, w1.clone(), w1.clone(), hinv1, s, s, groups, 8, 8, 15.0)
    with pytest.raises(ValueError, match="group_of is torch.int64"):
        gptq_cuda.columns(w1, w1.clone(), w1.clone(), hinv1, s, s, groups.long(), 0, 32, 15.0)
