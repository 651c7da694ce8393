"""The decode step's fused kernels (RMSNorm, rotary + cache write, SwiGLU) start as programmatic
dependents of the kernel ahead, like the projections between them: each may be resident while the one ahead
still runs, so its reads of that kernel's outputs must wait and go through coherent loads. Whole blocks of the
bench decoder, chained through their outputs and the KV cache, must give the bits of ordinary launches eagerly
and replayed from a CUDA graph, with quantized projections (themselves dependents) and with cuBLAS ones (an
ordinary launch ahead of each fused kernel)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu.helpers import dependent_chain_runs, gpu_ready

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]


@pytest.mark.parametrize("weights", ["w4", "fp16"])
@pytest.mark.parametrize("batch,tokens", [(1, 1), (2, 1), (1, 5)])
def test_decoder_blocks_give_the_bits_of_ordinary_launches(weights, batch, tokens):
    from qtool.bench import e2e

    seed = int.from_bytes(os.urandom(4), "little")
    dev = torch.device("cuda", torch.cuda.current_device())
    # GQA (8 query heads on 4 key/value heads) and an intermediate width that is not a multiple of 128
    d = e2e.Dims(hidden=512, intermediate=1376, layers=3, heads=8, kv_heads=4, vocab=1000)
    gen = torch.Generator(device=dev).manual_seed(seed)
    torch.manual_seed(seed)
    make = e2e.quant_linear(dev, 4, 128, gen) if weights == "w4" else e2e.fp16_linear(dev)
    model = e2e.Decoder(d, make, dev).eval()
    blk = model.blocks[0]
    assert blk.fused_norm and blk.fused_rope and blk.fused_swiglu
    length = 16
    tables = model.rope_tables(length, dev)
    caches = [
        (
            torch.randn(batch, d.kv_heads, length, d.head_dim, device=dev, generator=gen).half(),
            torch.randn(batch, d.kv_heads, length, d.head_dim, device=dev, generator=gen).half(),
        )
        for _ in range(d.layers)
    ]
    x = torch.randn(batch, tokens, d.hidden, device=dev, generator=gen).half()
    if tokens == 1:  # a decode step at position 9 of the cache, attending as the benches time it (span)
        pos, span = torch.tensor([9], device=dev), 10
    else:  # a prefill from position 0
        pos, span = torch.arange(tokens, device=dev), None

    def chain() -> torch.Tensor:
        h, y = x, None
        for b, (kc, vc) in zip(model.blocks, caches, strict=True):
            h, y = b(h, y, tables, (kc, vc), pos, tokens == 1, None, span)
        # the caches are part of the result: the rotary kernel writes them, attention reads them
        return torch.cat(
            [h.flatten(), y.flatten()] + [c[:, :, : tokens + 9].flatten() for kv in caches for c in kv]
        )

    with torch.inference_mode():
        plain, outs = dependent_chain_runs(chain)
    n = batch * tokens * d.hidden
    assert bool(torch.isfinite(plain).all()) and float(plain[n : 2 * n].abs().amax()) > 0, f"seed {seed}"
    for i, y in enumerate(outs):
        assert torch.equal(y, plain), f"seed {seed}, run {i}: {int((y != plain).sum())} elements differ"
