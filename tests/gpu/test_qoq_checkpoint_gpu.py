"""A QoQ stories260K checkpoint gives the same perplexity on the GPU (fp16 activations, the qoq CUDA kernels) as on
the CPU (float32 torch reference), and the kernels ran; a packed layer's kernel output equals its reference forward
on the same fp16 input to fp16 rounding.

Checkpoints: rotate + SmoothAttention + KV4, then W4A8 progressive groups of 32 on the width-64 inputs and W4A8
per channel on down_proj (width 172, which groups of 32 do not divide); and W8A8 per channel. Tolerance: the GPU
quantizes fp16 activations where the CPU quantizes float32 ones, so a few 8-bit codes sit one step apart at rounding
ties; a wrong code, scale, zero point or epilogue term moves the perplexity far more than the 1% allowed."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from tests.gpu.helpers import gpu_ready, tinystories_perplexity

from conftest import STORIES, TINYSTORIES, write_recipe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready())),
    pytest.mark.skipif(
        gpu_ready() is None and torch.cuda.get_device_capability() != (9, 0),
        reason="qoq kernels need Hopper (wgmma)",
    ),
    pytest.mark.skipif(
        not STORIES.is_dir() or not TINYSTORIES.is_file(), reason="stories260K assets not found"
    ),
]

REL_TOL = 1e-2
STAGES = {
    "w4a8kv4": """
  - stage: rotate
  - stage: smooth_attention
  - stage: kv_cache
    bits: 4
  - stage: progressive
    bits: 4
    group_size: 32
    targets: {exclude: ["*.down_proj"]}
  - stage: progressive
    bits: 4
    group_size: null
    targets: {include: ["*.down_proj"]}
""",
    "w8a8": """
  - stage: progressive
    bits: 8
    group_size: null
""",
}


@pytest.fixture(scope="module", params=sorted(STAGES))
def checkpoint(request, tmp_path_factory):
    from click.testing import CliRunner

    from qtool.cli import cli

    tmp = tmp_path_factory.mktemp(f"qoq-gpu-{request.param}")
    text = (
        f"model: {STORIES}\ncalibration: {{source: {TINYSTORIES}, num_samples: 16, seq_len: 256}}\n"
        f"stages:{STAGES[request.param]}settings: {{device: cpu}}\noutput: {tmp / 'ckpt'}\n"
    )
    res = CliRunner().invoke(
        cli,
        ["quantize", str(write_recipe(tmp / "r.yaml", text)), "--no-eval", "--json"],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["quantized_linears"] == 35
    return tmp / "ckpt"


def test_qoq_checkpoint_perplexity_gpu_matches_cpu(checkpoint, monkeypatch):
    from qtool.layouts.qoq import cuda as qoq

    monkeypatch.setenv("QTOOL_KERNELS", "cuda")  # a fallback to the reference raises instead
    calls: Counter = Counter()
    linear = qoq.linear

    def counted(*a, **kw):
        calls["linear"] += 1
        return linear(*a, **kw)

    monkeypatch.setattr(qoq, "linear", counted)
    ref = tinystories_perplexity(checkpoint, "cpu", torch.float32)
    got = tinystories_perplexity(checkpoint, "cuda", torch.float16)
    assert calls["linear"] > 0, "no qoq layer ran the CUDA kernels"
    rel = abs(got["perplexity"] - ref["perplexity"]) / ref["perplexity"]
    print(
        f"\nqoq perplexity cpu fp32 {ref['perplexity']:.5f} cuda fp16 {got['perplexity']:.5f} rel {rel:.2e} "
        f"(cuda graphs {got.get('cuda_graphs')}, {got['windows']} windows)"
    )
    assert rel <= REL_TOL


def test_qoq_layers_kernel_equals_reference(checkpoint):
    import qtool
    from qtool.layouts.qoq.module import QoQLinear

    model = qtool.load(checkpoint, device="cuda", dtype=torch.float16)
    layers = [m for m in model.modules() if isinstance(m, QoQLinear)]
    assert layers
    g = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, ())))
    for layer in layers:
        for m in (1, 5, 77, 300):
            x = torch.randn(m, layer.in_features, device="cuda", generator=g).half()
            got = layer(x)
            torch.cuda.synchronize()
            ref = layer.reference_forward(x.float()).half()
            assert torch.isfinite(got).all()
            err = (got.float() - ref.float()).abs().max().item()
            # fp16 inputs quantize identically on both paths (x·r in float32 either way), so only the fp16 output
            # rounding of the same float32 value can differ.
            assert err <= 1e-3 * ref.float().abs().max().item() + 1e-6, (layer.extra_repr(), m, err)
