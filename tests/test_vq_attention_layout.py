"""The CUDA CQ cache's torch side (qtool/kv_cache/vq_cuda.py), on the CPU: the tiled code layout the write fills
is what `token_major` and the float64 reference read, and every attention kernel the dispatch can name fits one
block's shared memory."""

from __future__ import annotations

import torch

from qtool.kv_cache import vq_cuda as vqa
from qtool.kv_cache.cuda import rope_half
from qtool.kv_cache.vq import encode


def _cache(b, kvh, d, dv, cap, gen):
    books = [(torch.randn(kvh, d // dv, 256, dv, generator=gen) * s).half() for s in (2.0, 1.0)]
    codes = [
        torch.full((b, kvh, cap // vqa.TILE, d // dv, vqa.TILE), 0xA5, dtype=torch.uint8) for _ in range(2)
    ]
    return vqa.VQCache(codes[0], codes[1], vqa.kernel_books(books[0]), vqa.kernel_books(books[1])), books


def test_reference_write_fills_the_tiles_at_the_positions():
    gen = torch.Generator().manual_seed(0)
    b, t, h, kvh, d, dv, cap = 2, 3, 4, 2, 64, 4, 64
    cache, (kb, vb) = _cache(b, kvh, d, dv, cap, gen)
    assert (cache.length, cache.groups, cache.head_dim, cache.entries) == (64, 16, 64, 256)
    ang = torch.arange(cap, dtype=torch.float32)[:, None] * torch.rand(d // 2, generator=gen)[None]
    cos, sin = ang.cos().half(), ang.sin().half()
    qkv = (torch.randn(b, t, h + 2 * kvh, d, generator=gen) * 2).half()
    pos = torch.tensor([3, 17, 40])
    _, k, v = vqa.reference_write(qkv, cos, sin, pos, cache, h)
    keys = rope_half(qkv.transpose(1, 2)[:, h : h + kvh], cos[pos], sin[pos])
    want = encode(keys, kb)  # [B, KVH, T, G]
    # token 17 of group g is byte [17 div 16, g, 17 mod 16] of its (sequence, head)
    assert torch.equal(cache.k[:, :, 1, :, 1].long(), want[:, :, 1])
    assert torch.equal(vqa.token_major(cache.k)[..., pos].permute(0, 1, 3, 2).long(), want)
    assert torch.equal(vqa.decoded(cache, "k")[:, :, pos].half(), k)
    assert torch.equal(vqa.decoded(cache, "v")[:, :, pos].half(), v)
    untouched = torch.ones(cap, dtype=torch.bool)
    untouched[pos] = False
    assert bool((vqa.token_major(cache.v)[..., untouched] == 0xA5).all())


def test_every_dispatched_kernel_fits_shared_memory():
    for (d, dv), lut in vqa.LUT_GROUPS.items():
        for r in vqa.GROUPS:
            form = vqa.attention_form(r, d, dv, 10_000, 132)
            assert form == ("lut" if r in lut else "direct")
            assert vqa.shared_bytes(form, r, d, dv, 256) + 4 * r * d <= vqa.MAX_SHARED, (d, dv, r, form)
