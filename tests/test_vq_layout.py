"""The `vq` layout (formats/vq.md): pack → unpack round trips, the documented bit order of 12-bit indices,
re-indexing by access frequency (lossless, hot entries first, tier boundaries from the counts), the codebook lookup
forward against `dequantize()`, stored bits, and the loader's one-line errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.errors import CheckpointError
from qtool.layouts.bitpack import pack_codes, unpack_codes
from qtool.layouts.vq.layout import VQWeight, bits_for, entry_counts, tier_bounds, tile_counts
from qtool.layouts.vq.module import VQLinear


def _random(n, v, d, bits, z, tile_rows, tile_cols, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    e = 1 << bits
    if skew:  # a few hot entries, as trained codebooks have
        probs = torch.rand(e, generator=g) ** 4
        codes = torch.multinomial(probs, z * n * v, replacement=True, generator=g).reshape(z, n, v)
    else:
        codes = torch.randint(0, e, (z, n, v), generator=g)
    r, c = tile_counts(n, v * d, tile_rows, tile_cols)
    books = torch.randn(r, c, z, e, d, generator=g)
    return codes, books


def _reference(codes, books, d, tile_rows, tile_cols):
    """W by the definition, one vector at a time, in float64."""
    z, n, v = codes.shape
    w = torch.zeros(n, v * d, dtype=torch.float64)
    b16 = books.to(torch.float16).to(torch.float64)
    for row in range(n):
        for j in range(v):
            rt = 0 if tile_rows is None else row // tile_rows
            ct = 0 if tile_cols is None else (j * d) // tile_cols
            for r in range(z):
                w[row, j * d : (j + 1) * d] += b16[rt, ct, r, codes[r, row, j]]
    return w


shapes = st.tuples(
    st.integers(1, 9),
    st.integers(1, 13),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(1, 12),
    st.integers(1, 2),
    st.sampled_from([None, 1, 3, 4]),
    st.sampled_from([None, 1, 2, 5]),
    st.integers(0, 2**31 - 1),
)


@settings(max_examples=40, deadline=None)
@given(shapes)
def test_round_trip_and_definition(case):
    n, v, d, bits, z, tile_rows, tile_vecs, seed = case
    tile_cols = None if tile_vecs is None else tile_vecs * d
    codes, books = _random(n, v, d, bits, z, tile_rows, tile_cols, seed)
    lay = VQWeight.from_codes(codes, books, tile_rows, tile_cols, reindex=False)
    assert torch.equal(lay.codes(), codes)
    assert torch.equal(lay.codebooks, books.to(torch.float16))
    assert lay.indices.shape == (z, n, (v * bits + 31) // 32)
    torch.testing.assert_close(
        lay.dequantize(torch.float64), _reference(codes, books, d, tile_rows, tile_cols)
    )
    # Stored → loaded gives the same layer; the stored bits are the formula's.
    back = VQWeight.from_tensors("l", lay.layer_config(False), lay.tensors())
    assert torch.equal(back.dequantize(), lay.dequantize())
    assert lay.stored_bits() == bits_for(n, v * d, d, 1 << bits, z, tile_rows, tile_cols)


@settings(max_examples=30, deadline=None)
@given(shapes)
def test_reindexing_is_lossless_and_puts_hot_entries_first(case):
    n, v, d, bits, z, tile_rows, tile_vecs, seed = case
    tile_cols = None if tile_vecs is None else tile_vecs * d
    codes, books = _random(n, v, d, bits, z, tile_rows, tile_cols, seed, skew=True)
    plain = VQWeight.from_codes(codes, books, tile_rows, tile_cols, reindex=False)
    hot = VQWeight.from_codes(codes, books, tile_rows, tile_cols, reindex=True)
    assert torch.equal(hot.dequantize(), plain.dequantize())  # bit-exact: the same entries, renamed
    counts = entry_counts(hot.codes(), 1 << bits, d, tile_rows, tile_cols)
    assert bool((counts[..., 1:] <= counts[..., :-1]).all())
    before = entry_counts(codes, 1 << bits, d, tile_rows, tile_cols)
    assert torch.equal(counts, before.sort(dim=-1, descending=True).values)
    for c, t in zip(counts.reshape(-1, 1 << bits), hot.entry_tiers.reshape(-1, 2), strict=True):
        mu, sd = c.double().mean(), c.double().std(unbiased=False)
        assert t.tolist() == [int((c > mu + 3 * sd).sum()), int((c > mu).sum())]
    assert not plain.entry_tiers.any()
    VQWeight.from_tensors("l", hot.layer_config(False), hot.tensors())


def test_tiers_of_a_skewed_codebook():
    counts = torch.tensor([1000, 40, 30, 20] + [1] * 60)
    hot, warm = tier_bounds(counts)
    assert (hot, warm) == (1, 4)


def test_twelve_bit_indices_are_lsb_first():
    codes = torch.tensor([[0xABC, 0x123, 0xFFF]])
    words = pack_codes(codes, 12)[0].tolist()
    assert [w & 0xFFFFFFFF for w in words] == [0xFF123ABC, 0xF]  # the third code straddles the two words
    assert torch.equal(unpack_codes(pack_codes(codes, 12), 12, 3), codes)


@pytest.mark.parametrize(
    "d,bits,z,tile_rows,tile_cols,t",
    [(4, 8, 1, 16, 16, 1), (8, 12, 2, None, None, 3), (2, 4, 2, 5, 6, 16), (4, 6, 1, None, 12, 7)],
)
def test_lookup_forward_matches_dequantized_matmul(d, bits, z, tile_rows, tile_cols, t):
    n, v = 37, 9 if d != 2 else 15
    codes, books = _random(n, v, d, bits, z, tile_rows, tile_cols, 1, skew=True)
    lay = VQWeight.from_codes(codes, books, tile_rows, tile_cols)
    bias = torch.randn(n)
    mod = VQLinear(lay, bias)
    x = torch.randn(2, t, v * d)
    expect = F.linear(x.double(), lay.dequantize(torch.float64), bias.double())
    lookup = mod.lookup_forward(x.reshape(-1, v * d)).reshape(2, t, n) + bias
    torch.testing.assert_close(lookup.double(), expect, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mod(x).double(), expect, rtol=1e-4, atol=1e-4)  # 2t rows: either path
    assert mod.half().codebooks.dtype == torch.float16


def _good():
    codes, books = _random(6, 9, 4, 4, 2, 4, 16, 3, skew=True)
    lay = VQWeight.from_codes(codes, books, 4, 16)
    return lay.layer_config(False), dict(lay.tensors())


def _bad_tiers(cfg, t):
    t["entry_tiers"] = t["entry_tiers"].clone()
    t["entry_tiers"][0, 0, 0, 1] += 1


def _not_sorted(cfg, t):
    codes, books = _random(6, 9, 4, 4, 2, 4, 16, 3, skew=True)
    plain = VQWeight.from_codes(codes, books, 4, 16, reindex=False)
    t.update(plain.tensors())


def _padding(cfg, t):
    t["indices"] = t["indices"].clone()
    t["indices"][0, 0, -1] |= 1 << 31


def _nan(cfg, t):
    t["codebooks"] = t["codebooks"].clone()
    t["codebooks"][0, 0, 0, 0, 0] = float("nan")


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda c, t: c.update(entries=12), ["key 'entries' found 12", "power of two"]),
        (lambda c, t: c.update(index_bits=8), ["key 'index_bits' found 8", "4 (log2 of entries 16)"]),
        (lambda c, t: c.update(vector_size=5), ["key 'vector_size' found 5", "divisor of in_features 36"]),
        (lambda c, t: c.update(tile_cols=18), ["key 'tile_cols' found 18", "multiple of vector_size 4"]),
        (lambda c, t: c.update(reindexed="yes"), ["key 'reindexed' found 'yes'"]),
        (lambda c, t: t.pop("codebooks"), ["tensor l.codebooks: missing"]),
        (
            lambda c, t: t.update(codebooks=t["codebooks"].float()),
            ["tensor l.codebooks: found torch.float32"],
        ),
        (
            lambda c, t: t.update(indices=t["indices"][:, :5]),
            ["tensor l.indices: found torch.int32 [2, 5, 2]"],
        ),
        (_nan, ["tensor l.codebooks: found non-finite"]),
        (_padding, ["tensor l.indices: found nonzero padding bits"]),
        (_bad_tiers, ["tensor l.entry_tiers: found boundaries"]),
        (_not_sorted, ["tensor l.indices: entries are not in descending order of use"]),
    ],
)
def test_loader_errors_name_the_key_or_tensor(mutate, words):
    cfg, tensors = _good()
    mutate(cfg, tensors)
    with pytest.raises(CheckpointError) as e:
        VQWeight.from_tensors("l", cfg, tensors)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg
