"""Quantized KV cache kernels (qtool/kv_cache/cuda.py): the write is bit-identical to the torch form (rotary
embedding in float16 arithmetic, then qtool/kv_cache/quantized.py `quantize_kv`) and touches only its positions; the
decode attention over a cache of random codes matches float64 attention over the dequantized cache within float16
rounding, for every mode, grouped-query ratio and odd lengths, with every output written. The tensor-core form's tests
run each of its stage sizes (`copy_steps`: one step a stage, the dispatched form, and the entries of 2 and 4, these
with every stage copied before the query is staged and with one)."""

from __future__ import annotations

import itertools

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

COPY_STEPS = (1, 2, 4)  # qtool/kv_cache/cuda.py TC_COPY_STEP_CHOICES
# (copy_steps, early_stages): each stage size, and the larger ones with one stage copied ahead of the query's staging
STAGINGS = [(1, None), (2, None), (4, None), (2, 1), (4, 1)]


def _poisoned(mode, b, kvh, length, d):
    from qtool.kv_cache import cuda as kvc

    cache = kvc.allocate(mode, b, kvh, length, d, torch.device("cuda"), k_scale=0.05, v_scale=0.02)
    for t in (cache.k, cache.v):
        t.fill_(POISON)
    for t in (cache.k_params, cache.v_params):
        if t is not None:
            t.fill_(float("nan"))
    return cache


@pytest.mark.parametrize("mode", ["int4", "int8", "fp8"])
@pytest.mark.parametrize(
    "b,t,h,kvh,d,positions",
    [
        (1, 3, 32, 32, 128, [0, 1, 2]),  # Llama-2-7B head shape, a short prompt
        (2, 4, 9, 3, 64, [5, 9, 10, 30]),  # SmolLM2's heads, scattered positions
        (3, 1, 8, 2, 128, [17]),  # one decode token
        (1, 2, 4, 4, 32, [0, 63]),
        (2, 5, 6, 1, 96, [1, 2, 3, 4, 40]),  # head_dim 96: lanes idle in each row
    ],
)
def test_write_is_bit_identical_to_the_torch_form(mode, b, t, h, kvh, d, positions):
    from qtool.kv_cache import cuda as kvc

    if mode == "int4" and d % 8:
        pytest.skip("int4 needs head_dim % 8 == 0")
    gen = torch.Generator(device="cuda").manual_seed(b * 1000 + t * 10 + d)
    length = 64
    cos, sin = rope_tables(length, d)
    qkv = (torch.randn(b, t, h + 2 * kvh, d, device="cuda", generator=gen) * 3).half()
    qkv[0, 0, h] = 1.25  # a constant key: scale 1, zero -min
    qkv[-1, -1, h + kvh, :] = 0.5
    qkv[-1, -1, h + kvh, 1] = 0.5 + 2**-11  # a value range whose scale rounds to a float16 subnormal
    qkv[0, 0, -1] = 0.0
    qkv[0, 0, -1, 0] = 2**-24  # ... and to zero: the scale becomes 2^-24
    pos = torch.tensor(positions, device="cuda")
    got_c, ref_c = _poisoned(mode, b, kvh, length, d), _poisoned(mode, b, kvh, length, d)
    q, dk, dv = kvc.write(qkv, cos, sin, pos, got_c, h, dequantized=True)
    synced(q)
    rq, rk, rv = kvc.reference_write(qkv, cos, sin, pos, ref_c, h)
    assert torch.equal(q, rq), "rotated queries differ from the float16 torch form"
    assert torch.equal(dk, rk) and torch.equal(dv, rv), "dequantized keys/values differ from the torch form"
    for name in ("k", "v", "k_params", "v_params"):
        a, r = getattr(got_c, name), getattr(ref_c, name)
        if a is None:
            continue
        written = a[:, :, pos]
        assert torch.equal(written.view(torch.uint8), r[:, :, pos].view(torch.uint8)), (
            f"{name} at the positions"
        )
        others = torch.ones(length, dtype=torch.bool, device="cuda")
        others[pos] = False
        rest = a[:, :, others]
        untouched = rest.isnan().all() if rest.is_floating_point() else (rest == POISON).all()
        assert bool(untouched), f"{name}: the write touched positions outside {positions}"


def _random_cache(mode, b, kvh, length, d, gen):
    """A cache of random codes and params (not a write's output: every code and zero point value occurs)."""
    from qtool.kv_cache import cuda as kvc

    cache = kvc.allocate(mode, b, kvh, length, d, torch.device("cuda"), k_scale=0.5, v_scale=0.25)
    for t in (cache.k, cache.v):
        if mode == "fp8":
            vals = torch.randn(*t.shape, device="cuda", generator=gen) * 4
            t.copy_(vals.to(torch.float8_e4m3fn).view(torch.uint8))
        else:
            t.copy_(
                torch.randint(0, 256, t.shape, device="cuda", generator=gen, dtype=torch.int32).to(
                    torch.uint8
                )
            )
    for t in (cache.k_params, cache.v_params):
        if t is not None:
            maxq = 15 if mode == "int4" else 255
            t[..., 0] = (torch.rand(t.shape[:-1], device="cuda", generator=gen) * 4 / maxq + 1e-3).half()
            t[..., 1] = (torch.rand(t.shape[:-1], device="cuda", generator=gen) * maxq).half()
    return cache


@pytest.mark.parametrize("mode", ["int4", "int8", "fp8"])
@pytest.mark.parametrize(
    "b,h,kvh,length,d",
    [
        (2, 32, 32, 300, 128),  # Llama-2-7B heads, L not a multiple of the rows a block takes
        (3, 32, 8, 200, 128),  # Llama-3-8B: 4 query heads per KV head
        (2, 9, 3, 77, 64),  # SmolLM2: 3
        (1, 8, 1, 1024, 64),  # 8 per KV head (the most one block holds)
        (3, 4, 2, 129, 64),  # 2 per KV head: two words a lane
        (1, 4, 4, 1, 32),  # a one-position cache
        (2, 6, 3, 45, 96),  # idle lanes in each row
    ],
)
def test_attention_matches_float64_reference(mode, b, h, kvh, length, d):
    from qtool.kv_cache import cuda as kvc

    if mode == "int4" and d % 8:
        pytest.skip("int4 needs head_dim % 8 == 0")
    if mode != "int4" and d > 128:
        pytest.skip("8-bit caches hold head_dim <= 128")
    gen = torch.Generator(device="cuda").manual_seed(b * 100 + h + length + d)
    cache = _random_cache(mode, b, kvh, length, d, gen)
    q = (torch.randn(b, h, 1, d, device="cuda", generator=gen) * 0.5).half()
    variants = sorted({1, kvc.words_per_lane(mode, h // kvh, d)})  # both kernel forms where there are two
    for p in sorted({0, length // 2, length - 1, length + 5}):
        pos = torch.tensor([p], device="cuda")
        ref = kvc.reference_attention(q, cache, p)
        for wpl in variants:
            out = torch.full((b, 1, h, d), float("nan"), dtype=torch.float16, device="cuda")
            got = synced(kvc.attention(q, cache, pos, out=out, wpl=wpl))
            assert bool(torch.isfinite(got).all()), f"unwritten outputs (pos {p}, {wpl} words a lane)"
            worst = attention_excess(got, ref)
            assert worst <= 0, (
                f"{mode}: beyond float16 rounding at pos {p}, {wpl} words a lane: excess {worst:.3e}"
            )


@pytest.mark.parametrize(
    "b,h,kvh,length,d",
    [
        (2, 32, 32, 300, 128),  # Llama-2-7B: one query head per KV head
        (3, 32, 8, 200, 128),  # Llama-3-8B: 4 query heads per KV head
        (2, 9, 3, 77, 64),  # SmolLM2: 3
        (1, 8, 1, 1024, 64),  # 8 per KV head
        (3, 4, 2, 129, 64),  # 2 per KV head
        (2, 16, 2, 1, 128),  # a one-position cache
        (2, 56, 8, 333, 128),  # 7 per KV head, a partial last step of every warp
        (1, 3, 3, 200, 64),  # one per KV head at head dim 64, fewer pairs than any split fills
    ],
)
@pytest.mark.parametrize("copy_steps,early", STAGINGS)
def test_tensor_core_attention_matches_float64_reference(b, h, kvh, length, d, copy_steps, early):
    """The KV4 tensor-core form (float16 products of the exact codes with the query, P·s rounded to float16) stays
    within the CUDA-core form's bound against float64, at every position of the cache, and it is what the dispatch
    takes for these caches."""
    from qtool.kv_cache import cuda as kvc

    assert kvc.attention_kernel("int4", h // kvh, d) == "tc"
    gen = torch.Generator(device="cuda").manual_seed(b * 100 + h + length + d + 7)
    cache = _random_cache("int4", b, kvh, length, d, gen)
    q = (torch.randn(b, h, 1, d, device="cuda", generator=gen) * 0.5).half()
    for p in sorted({0, 15, 16, length // 2, length - 1, length + 5}):
        pos = torch.tensor([p], device="cuda")
        ref = kvc.reference_attention(q, cache, p)
        # split along the cache as the dispatch picks it, not at all, in parts of uneven and of empty ranges; each
        # block size
        for splits, warps in itertools.product((None, 1, 5, kvc.TC_MAX_SPLITS), (None, *kvc.TC_WARPS)):
            out = torch.full((b, 1, h, d), float("nan"), dtype=torch.float16, device="cuda")
            got = synced(
                kvc.attention(
                    q,
                    cache,
                    pos,
                    out=out,
                    kernel="tc",
                    splits=splits,
                    warps=warps,
                    copy_steps=copy_steps,
                    early_stages=early,
                )
            )
            what = f"pos {p}, {splits} splits, {warps} warps, {copy_steps} steps a stage, {early} early"
            assert bool(torch.isfinite(got).all()), f"unwritten outputs ({what})"
            worst = attention_excess(got, ref)
            assert worst <= 0, f"tc: beyond float16 rounding ({what}): excess {worst:.3e}"


@pytest.mark.parametrize("copy_steps,early", STAGINGS)
def test_tensor_core_attention_ignores_what_lies_past_the_position(copy_steps, early):
    """Positions past the step's own hold whatever an earlier, longer sequence left there (here poison codes and
    NaN scales): no weight reaches them, with the cache split or not."""
    from qtool.kv_cache import cuda as kvc

    b, h, kvh, length, d = 2, 32, 8, 300, 128
    gen = torch.Generator(device="cuda").manual_seed(11)
    cache = _random_cache("int4", b, kvh, length, d, gen)
    q = (torch.randn(b, h, 1, d, device="cuda", generator=gen) * 0.5).half()
    for p in (200, 37, 0):  # each poisons more of the cache
        cache.k[:, :, p + 1 :] = POISON
        cache.v[:, :, p + 1 :] = POISON
        cache.k_params[:, :, p + 1 :] = float("nan")
        cache.v_params[:, :, p + 1 :] = float("nan")
        ref = kvc.reference_attention(q, cache, p)
        for splits, warps in itertools.product((1, 3, 7), kvc.TC_WARPS):
            out = torch.full((b, 1, h, d), float("nan"), dtype=torch.float16, device="cuda")
            pos = torch.tensor([p], device="cuda")
            got = synced(
                kvc.attention(
                    q,
                    cache,
                    pos,
                    out=out,
                    splits=splits,
                    warps=warps,
                    copy_steps=copy_steps,
                    early_stages=early,
                )
            )
            what = f"pos {p}, {splits} splits, {warps} warps, {copy_steps} steps a stage, {early} early"
            assert bool(torch.isfinite(got).all()), f"non-finite outputs ({what})"
            worst = attention_excess(got, ref)
            assert worst <= 0, f"beyond float16 rounding ({what}): excess {worst:.3e}"


@pytest.mark.parametrize("copy_steps,early", STAGINGS)
def test_write_then_attention_under_dependent_launches_and_a_graph(copy_steps, early, monkeypatch):
    """The decode step's pair (write at pos, attend to 0..pos) chained as the runtime runs it, with each stage size
    of the tensor-core form (set as the module's defaults)."""
    from qtool.kv_cache import cuda as kvc

    monkeypatch.setattr(kvc, "TC_COPY_STEPS", copy_steps)
    monkeypatch.setattr(kvc, "TC_EARLY_STAGES", early)
    check_write_then_attention_chain(
        kvc, lambda gen, b, kvh, length, d: kvc.allocate("int4", b, kvh, length, d, torch.device("cuda"))
    )


def test_kv_cache_kernels_refuse_bad_input_in_one_line():
    from qtool.kv_cache import cuda as kvc

    with pytest.raises(ValueError, match="found head_dim 36, expected a multiple of 8"):
        kvc.allocate("int4", 1, 1, 8, 36, torch.device("cuda"))
    with pytest.raises(ValueError, match="KV cache mode: found 'int3'"):
        kvc.allocate("int3", 1, 1, 8, 64, torch.device("cuda"))
    cache = kvc.allocate("int4", 1, 2, 8, 64, torch.device("cuda"))
    pos = torch.zeros(1, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match=r"q: found \[1, 3, 1, 64\]"):
        kvc.attention(torch.zeros(1, 3, 1, 64, dtype=torch.float16, device="cuda"), cache, pos)
    with pytest.raises(ValueError, match=r"at most 8 per KV head"):
        kvc.attention(torch.zeros(1, 18, 1, 64, dtype=torch.float16, device="cuda"), cache, pos)
    with pytest.raises(ValueError, match="pos: found torch.int32"):
        kvc.attention(torch.zeros(1, 4, 1, 64, dtype=torch.float16, device="cuda"), cache, pos.int())
    # the tensor-core form stages the query by 16-byte loads: a query 2 bytes past a boundary is refused
    shifted = torch.zeros(4 * 64 + 8, dtype=torch.float16, device="cuda")[1:257].view(1, 4, 1, 64)
    for copy_steps in COPY_STEPS:
        with pytest.raises(ValueError, match="q: .*expected contiguous 16-byte aligned float16"):
            kvc.attention(shifted, cache, pos, kernel="tc", copy_steps=copy_steps)
    q = torch.zeros(1, 4, 1, 64, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="copy_steps: found 3, expected one of"):
        kvc.attention(q, cache, pos, kernel="tc", copy_steps=3)
    with pytest.raises(ValueError, match="early_stages: found 1 with one step a stage"):
        kvc.attention(q, cache, pos, kernel="tc", copy_steps=1, early_stages=1)
    with pytest.raises(ValueError, match=r"early_stages: found 0, expected 1 to \d"):
        kvc.attention(q, cache, pos, kernel="tc", copy_steps=2, early_stages=0)
    with pytest.raises(ValueError, match="kernel fma: found warps, splits, copy_steps or early_stages"):
        kvc.attention(q, cache, pos, kernel="fma", copy_steps=2)
    # the stages are filled by 16-byte bulk copies: a cache tensor off a 16-byte boundary is refused
    odd = kvc.allocate("int4", 1, 2, 8, 64, torch.device("cuda"))
    odd.k_params = torch.zeros(1 * 2 * 8 * 2 + 2, dtype=torch.float16, device="cuda")[2:].view(1, 2, 8, 2)
    for copy_steps in COPY_STEPS:
        with pytest.raises(ValueError, match="cache.k_params: found a tensor not contiguous from a 16-byte"):
            kvc.attention(q, odd, pos, kernel="tc", copy_steps=copy_steps)


@pytest.mark.parametrize(
    "variant,copy_steps,early", [*(("w4a8kv4", c, e) for c, e in STAGINGS), ("fp8", 1, None)]
)
def test_bench_decoder_runs_quantized_caches_under_graphs(variant, copy_steps, early, monkeypatch):
    """The throughput bench's decoder on KV4/FP8 caches with W4A8/FP8 linears: check_bench_decoder_under_graphs
    (key codes [B, KVH, L, bytes]), KV4 with each stage size of the tensor-core form."""
    from qtool.kv_cache import cuda as kvc

    monkeypatch.setattr(kvc, "TC_COPY_STEPS", copy_steps)
    monkeypatch.setattr(kvc, "TC_EARLY_STAGES", early)
    check_bench_decoder_under_graphs(variant, lambda k: k.movedim(2, -1))
