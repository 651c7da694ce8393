"""Decode-step attention kernel (qtool/cuda/decode_attention.py) against a float64 reference and torch's
scaled_dot_product_attention with the `arange(L) <= pos` mask: within float16 rounding, every output written."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.helpers import gpu_ready, rel_err, synced

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]


@pytest.mark.parametrize(
    "b,h,kvh,length,d",
    [
        (1, 32, 32, 128, 128),  # Llama-2-7B, context 128
        (3, 32, 8, 200, 128),  # grouped-query attention, a batch, L not a multiple of the warps
        (2, 6, 2, 37, 64),
        (1, 4, 4, 1, 32),  # a one-position cache
        (2, 3, 1, 300, 96),
    ],
)
def test_decode_attention_matches_reference(b, h, kvh, length, d):
    from qtool.cuda.decode_attention import decode_attention

    gen = torch.Generator(device="cuda").manual_seed(b * 100 + h + length)
    q = torch.randn(b, h, 1, d, device="cuda", generator=gen).half()
    kc = (torch.randn(b, kvh, length, d, device="cuda", generator=gen) * 2).half()
    vc = torch.randn(b, kvh, length, d, device="cuda", generator=gen).half()
    for p in sorted({0, length // 2, length - 1, length + 5}):
        pos = torch.tensor([p], device="cuda")
        out = torch.full((b, 1, h, d), float("nan"), dtype=torch.float16, device="cuda")
        got = synced(decode_attention(q, kc, vc, pos, out=out))
        assert bool(torch.isfinite(got).all()), f"unwritten outputs (pos {p})"
        n = min(p + 1, length)
        k64 = kc.double().repeat_interleave(h // kvh, dim=1)[:, :, :n]
        v64 = vc.double().repeat_interleave(h // kvh, dim=1)[:, :, :n]
        att = torch.softmax(q.double() @ k64.transpose(-1, -2) / d**0.5, dim=-1)
        ref = (att @ v64).transpose(1, 2)  # [B, 1, H, D]
        tol = 2e-3 * ref.abs() + 1e-3 * float(ref.abs().max())
        worst = float(((got.double() - ref).abs() - tol).max())
        assert worst <= 0, f"beyond float16 rounding at pos {p}: excess {worst:.3e}"
        mask = (torch.arange(length, device="cuda")[None, :] <= pos[:, None])[None, None]
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q, kc, vc, attn_mask=mask, enable_gqa=kvh != h
        )
        assert rel_err(got.transpose(1, 2).double(), sdpa.double()) < 2e-3


def test_decode_attention_refuses_bad_input_in_one_line():
    from qtool.cuda.decode_attention import decode_attention

    q = torch.zeros(1, 4, 2, 32, dtype=torch.float16, device="cuda")
    cache = torch.zeros(1, 2, 8, 32, dtype=torch.float16, device="cuda")
    pos = torch.zeros(1, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match=r"decode_attention: found q \[1, 4, 2, 32\]"):
        decode_attention(q, cache, cache, pos)
    with pytest.raises(ValueError, match="pos: found torch.int32"):
        decode_attention(q[:, :, :1].contiguous(), cache, cache, pos.int())
