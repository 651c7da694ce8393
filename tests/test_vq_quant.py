"""The vq quantizer (qtool/quant/vq.py) in float64: weighted k-means reaches its fixed point and is seeded, the
greedy and beam-search encoders against brute force, GPTQ's error feedback across vector columns, and VQ against
scalar GPTQ at equal index bits."""

from __future__ import annotations

import itertools

import torch

from qtool.layouts.grouped_int.layout import GroupedIntWeight
from qtool.quant.gptq import gptq_run
from qtool.quant.grid import GridSpec
from qtool.quant.vq import decode, encode, kmeans, kmeans_batched, nearest, vq_gptq

D64 = torch.float64


def _problem(n=48, k=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g, dtype=D64)
    mix = torch.eye(k, dtype=D64) + 0.3 * torch.randn(k, k, generator=g, dtype=D64)
    x = torch.randn(1024, k, generator=g, dtype=D64) @ mix
    return w, x, 2 * x.T @ x / x.shape[0]


def _out_err(w, q, x):
    return ((w - q) @ x.T).pow(2).mean().item()


def test_weighted_kmeans_reaches_its_fixed_point_and_is_seeded():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 3, generator=g, dtype=D64)
    w = torch.rand(300, 3, generator=g, dtype=D64) + 0.1
    c = kmeans(x, w, 8, 200, torch.Generator().manual_seed(5))
    idx, _ = nearest(x, w, c)
    # Each vector's entry is its nearest under the weighted distance (checked by brute force) ...
    brute = torch.stack([(w * (x - ci).pow(2)).sum(1) for ci in c], dim=1).argmin(1)
    assert torch.equal(idx, brute)
    # ... and each entry is the per-dimension weighted mean of its vectors.
    for e in range(8):
        m = idx == e
        torch.testing.assert_close(c[e], (w[m] * x[m]).sum(0) / w[m].sum(0))
    assert torch.equal(c, kmeans(x, w, 8, 200, torch.Generator().manual_seed(5)))
    assert not torch.equal(c, kmeans(x, w, 8, 200, torch.Generator().manual_seed(6)))


def test_batched_kmeans_fixed_point():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 200, 2, generator=g, dtype=D64)
    c = kmeans_batched(x, 6, 200, torch.Generator().manual_seed(0))
    for p in range(3):
        idx = torch.cdist(x[p], c[p]).argmin(1)
        for e in range(6):
            torch.testing.assert_close(c[p, e], x[p][idx == e].mean(0))


def test_encoders_against_brute_force():
    g = torch.Generator().manual_seed(3)
    books = torch.randn(2, 8, 3, generator=g, dtype=D64)
    x = torch.randn(50, 3, generator=g, dtype=D64)
    wd = torch.rand(3, generator=g, dtype=D64) + 0.5
    err = lambda c: (wd * (x - decode(c, books)).pow(2)).sum(1)  # noqa: E731
    greedy = encode(x, wd, books, beam=1)
    first = torch.stack([(wd * (x - b).pow(2)).sum(1) for b in books[0]], 1).argmin(1)
    assert torch.equal(greedy[0], first)
    # A beam as wide as every pair is the exhaustive search over both codebooks.
    full = encode(x, wd, books, beam=64)
    pairs = torch.tensor(list(itertools.product(range(8), range(8)))).T
    every = torch.stack([(wd * (x - books[0][i] - books[1][j]).pow(2)).sum(1) for i, j in pairs.T], 1)
    torch.testing.assert_close(err(full), every.min(1).values)
    # A narrower beam never does worse than greedy (z = 2: greedy's pair is among its candidates).
    beam4 = encode(x, wd, books, beam=4)
    assert bool((err(beam4) <= err(greedy) + 1e-12).all()) and err(beam4).sum() < err(greedy).sum()


def test_error_feedback_lowers_the_output_error():
    w, x, h = _problem()
    out = vq_gptq(w, h, 4, 32, 1, iters=30, seed=0)  # per tensor: codebooks fitted on the original weights
    torch.testing.assert_close(
        out.dequantized, decode(out.codes.reshape(1, -1), out.codebooks[0, 0]).reshape(w.shape)
    )
    plain = decode(encode(w.reshape(-1, 4), None, out.codebooks[0, 0]), out.codebooks[0, 0]).reshape(w.shape)
    assert _out_err(w, out.dequantized, x) < 0.8 * _out_err(w, plain, x)
    again = vq_gptq(w, h, 4, 32, 1, iters=30, seed=0)
    assert torch.equal(again.codes, out.codes) and torch.equal(again.codebooks, out.codebooks)


def test_vq_beats_scalar_gptq_at_equal_index_bits():
    """Two bits per weight: a 4-entry codebook per row and 32 columns (a non-uniform grid) and 256 entries of 4
    weights per tensor, both below GPTQ's uniform 2-bit grid with groups of 32."""
    w, x, h = _problem()
    spec = GridSpec(bits=2, symmetric=False, group_size=32)
    g = gptq_run(w, h, spec)
    scalar = _out_err(w, GroupedIntWeight.from_codes(g.codes, g.scales, g.zeros, spec).dequantize(D64), x)
    per_group = vq_gptq(w, h, 1, 4, 1, tile_rows=1, tile_cols=32, iters=30)
    tensor = vq_gptq(w, h, 4, 256, 1, iters=30)
    assert _out_err(w, per_group.dequantized, x) < scalar
    assert _out_err(w, tensor.dequantized, x) < scalar


def test_residual_codebooks_and_tiles():
    w, x, h = _problem(n=40, k=48)
    one = vq_gptq(w, h, 4, 16, 1, iters=20)
    two = vq_gptq(w, h, 4, 16, 2, iters=20, beam=4)
    assert two.codes.shape == (2, 40, 12) and two.codebooks.shape == (1, 1, 2, 16, 4)
    assert _out_err(w, two.dequantized, x) < _out_err(w, one.dequantized, x)
    tiled = vq_gptq(
        w, h, 4, 16, 1, tile_rows=16, tile_cols=32, iters=20
    )  # ragged: 16+16+8 rows, 32+16 columns
    assert tiled.codebooks.shape == (3, 2, 1, 16, 4)
    assert bool((tiled.codebooks == tiled.codebooks.half().double()).all())  # float16 values
