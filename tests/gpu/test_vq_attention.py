"""Vector-quantized KV cache kernels (qtool/kv_cache/vq_cuda.py, CQ-2 and CQ-4): the write gives exactly the codes
of qtool/kv_cache/vq.py `encode` on the rotated keys and the values (ties to the lower index) and touches
only its positions; decode attention over a cache of random codes and random codebooks matches float64 attention
over the decoded cache within float16 rounding, for both forms, head dims 64 and 128, 1 to 8 query heads per KV
head, odd lengths and splits along the cache, with every output written."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.helpers import KV_POISON as POISON
from tests.gpu.helpers import (
    attention_excess,
    check_bench_decoder_under_graphs,
    check_write_then_attention_chain,
    gpu_ready,
    rope_tables,
    synced,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]


def _books(kvh, d, dv, gen, entries=256):
    """Random codebooks [KVH, G, E, dv] for keys and values (keys wider, as rotated keys are)."""
    shape = (kvh, d // dv, entries, dv)
    return (
        (torch.randn(shape, device="cuda", generator=gen) * 2).half(),
        (torch.randn(shape, device="cuda", generator=gen)).half(),
    )


@pytest.mark.parametrize("dv", [4, 2])
@pytest.mark.parametrize(
    "b,t,h,kvh,d,positions",
    [
        (1, 3, 32, 32, 128, [0, 1, 2]),  # Llama-2-7B heads, a short prompt
        (2, 4, 9, 3, 64, [5, 9, 10, 30]),  # SmolLM2's heads, scattered positions
        (3, 1, 8, 1, 128, [17]),  # one decode token, 8 query heads per KV head
        (2, 5, 8, 2, 64, [1, 2, 3, 4, 40]),
    ],
)
def test_write_gives_the_codes_of_encode(dv, b, t, h, kvh, d, positions):
    from qtool.kv_cache import vq_cuda as vqa

    gen = torch.Generator(device="cuda").manual_seed(b * 1000 + t * 10 + d + dv)
    length = 64
    cos, sin = rope_tables(length, d)
    kb, vb = _books(kvh, d, dv, gen)
    # a tie: entry 9 of every value codebook is entry 5, and a value vector that is exactly that entry: the lower
    # index must win
    vb[:, :, 9] = vb[:, :, 5]
    qkv = (torch.randn(b, t, h + 2 * kvh, d, device="cuda", generator=gen) * 2).half()
    qkv[0, 0, h + kvh] = vb[0, :, 5].reshape(d)
    pos = torch.tensor(positions, device="cuda")
    got_c, ref_c = (
        vqa.allocate(kb, vb, b, length, torch.device("cuda")),
        vqa.allocate(kb, vb, b, length, torch.device("cuda")),
    )
    for c in (got_c, ref_c):
        c.k.fill_(POISON)
        c.v.fill_(POISON)
    q, dk, dv_ = vqa.write(qkv, cos, sin, pos, got_c, h, dequantized=True)
    synced(q)
    rq, rk, rv = vqa.reference_write(qkv, cos, sin, pos, ref_c, h)
    assert torch.equal(q, rq), "rotated queries differ from the float16 torch form"
    assert torch.equal(dk, rk) and torch.equal(dv_, rv), "decoded keys/values differ from the torch form"
    assert bool((vqa.token_major(got_c.v)[0, 0, :, positions[0]] == 5).all()), (
        "a tie did not go to the lower index"
    )
    for name in ("k", "v"):
        a, r = vqa.token_major(getattr(got_c, name)), vqa.token_major(getattr(ref_c, name))
        assert torch.equal(a[..., pos], r[..., pos]), f"{name} codes at the positions differ from encode"
        others = torch.ones(a.shape[-1], dtype=torch.bool, device="cuda")
        others[pos] = False
        assert bool((a[..., others] == POISON).all()), (
            f"{name}: the write touched positions outside {positions}"
        )


def _random_cache(b, kvh, length, d, dv, gen, entries=256):
    """A cache of random codes (every entry occurs) over random codebooks."""
    from qtool.kv_cache import vq_cuda as vqa

    kb, vb = _books(kvh, d, dv, gen, entries)
    cache = vqa.allocate(kb * 0.25, vb, b, length, torch.device("cuda"))
    for t in (cache.k, cache.v):
        t.copy_(
            torch.randint(0, entries, t.shape, device="cuda", generator=gen, dtype=torch.int32).to(
                torch.uint8
            )
        )
    return cache


@pytest.mark.parametrize("dv", [4, 2])
@pytest.mark.parametrize(
    "b,h,kvh,length,d",
    [
        (1, 32, 32, 300, 128),  # Llama-2-7B heads, batch 1 (split along the cache)
        (3, 32, 8, 200, 128),  # Llama-3-8B: 4 query heads per KV head
        (16, 8, 1, 77, 64),  # 8 per KV head, batch 16
        (3, 9, 3, 45, 64),  # SmolLM2: 3
        (1, 4, 4, 1, 128),  # a one-position cache
    ],
)
def test_attention_matches_float64_reference(dv, b, h, kvh, length, d):
    from qtool.kv_cache import vq_cuda as vqa

    gen = torch.Generator(device="cuda").manual_seed(b * 100 + h + length + d + dv)
    cache = _random_cache(b, kvh, length, d, dv, gen)
    q = (torch.randn(b, h, 1, d, device="cuda", generator=gen) * 0.5).half()
    r = h // kvh
    forms = ["direct"] + (["lut"] if r in vqa.LUT_GROUPS[(d, dv)] else [])
    for p in sorted({0, 31, 32, length // 2, length - 1, length + 5}):
        pos = torch.tensor([p], device="cuda")
        ref = vqa.reference_attention(q, cache, p)
        for form in forms:
            for splits in (None, 1, 3, vqa.MAX_SPLITS):
                out = torch.full((b, 1, h, d), float("nan"), dtype=torch.float16, device="cuda")
                got = synced(vqa.attention(q, cache, pos, out=out, form=form, splits=splits))
                assert bool(torch.isfinite(got).all()), (
                    f"unwritten outputs ({form}, pos {p}, {splits} splits)"
                )
                worst = attention_excess(got, ref)
                assert worst <= 0, (
                    f"{form}: beyond float16 rounding at pos {p}, {splits} splits: excess {worst:.3e}"
                )


def test_attention_with_fewer_entries():
    """16-entry codebooks (4-bit codes stored a byte each): the tables hold only the entries there are."""
    from qtool.kv_cache import vq_cuda as vqa

    gen = torch.Generator(device="cuda").manual_seed(5)
    cache = _random_cache(2, 2, 100, 64, 4, gen, entries=16)
    q = (torch.randn(2, 4, 1, 64, device="cuda", generator=gen) * 0.5).half()
    ref = vqa.reference_attention(q, cache, 90)
    for form in vqa.FORMS:
        got = synced(vqa.attention(q, cache, torch.tensor([90], device="cuda"), form=form))
        assert attention_excess(got, ref) <= 0, form


def test_attention_splits_the_cache_when_pairs_are_few():
    from qtool.kv_cache import vq_cuda as vqa

    assert vqa.attention_form(1, 128, 4, 16 * 32, 132) == "lut"  # Llama-2-7B, batch 16: score tables
    assert vqa.attention_form(1, 128, 4, 32, 132) == "direct"  # batch 1: split, the direct form
    assert vqa.attention_form(8, 128, 4, 16 * 32, 132) == "direct"  # 8 tables do not fit

    assert vqa.attention_splits(32, 1024, 264) == 4  # Llama-2-7B, batch 1: 4 parts of 256 tokens
    assert vqa.attention_splits(32, 8192, 264) == 9
    assert vqa.attention_splits(32, 100, 264) == 1  # a short cache stays one block per pair
    assert vqa.attention_splits(16 * 32, 4096, 264) == 1  # batch 16 fills the GPU already


def test_write_then_attention_under_dependent_launches_and_a_graph():
    """The decode step's pair (write at pos, attend to 0..pos) chained as the runtime runs it."""
    from qtool.kv_cache import vq_cuda as vqa

    def new_cache(gen, b, kvh, length, d):
        kb, vb = _books(kvh, d, 4, gen)
        return vqa.allocate(kb, vb, b, length, torch.device("cuda"))

    check_write_then_attention_chain(vqa, new_cache)


def test_vq_cache_kernels_refuse_bad_input_in_one_line():
    from qtool.kv_cache import vq_cuda as vqa

    dev = torch.device("cuda")
    books = torch.zeros(2, 16, 256, 4, dtype=torch.float16, device=dev)
    with pytest.raises(ValueError, match=r"found 16 groups of 3 channels"):
        vqa.allocate(torch.zeros(2, 16, 256, 3, dtype=torch.float16, device=dev), books, 1, 8, dev)
    with pytest.raises(ValueError, match=r"found 100 entries|and 100 entries"):
        vqa.allocate(torch.zeros(2, 16, 100, 4, dtype=torch.float16, device=dev), books, 1, 8, dev)
    cache = vqa.allocate(books, books, 1, 8, dev)
    pos = torch.zeros(1, dtype=torch.int64, device=dev)
    with pytest.raises(ValueError, match=r"q: found \[1, 3, 1, 64\]"):
        vqa.attention(torch.zeros(1, 3, 1, 64, dtype=torch.float16, device=dev), cache, pos)
    with pytest.raises(ValueError, match=r"q: found \[1, 10, 1, 64\]"):  # 5 per KV head: not built
        vqa.attention(torch.zeros(1, 10, 1, 64, dtype=torch.float16, device=dev), cache, pos)
    with pytest.raises(ValueError, match=r"form: found 'lut' for 8"):
        vqa.attention(torch.zeros(1, 16, 1, 64, dtype=torch.float16, device=dev), cache, pos, form="lut")
    with pytest.raises(ValueError, match="pos: found torch.int32"):
        vqa.attention(torch.zeros(1, 4, 1, 64, dtype=torch.float16, device=dev), cache, pos.int())
    with pytest.raises(ValueError, match="splits: found 0"):
        vqa.attention(torch.zeros(1, 4, 1, 64, dtype=torch.float16, device=dev), cache, pos, splits=0)


def test_bench_decoder_runs_cq_caches_under_graphs():
    """The throughput bench's decoder on CQ-2 caches: check_bench_decoder_under_graphs."""
    from qtool.kv_cache.vq_cuda import token_major

    check_bench_decoder_under_graphs("w4a8cq2", token_major)
