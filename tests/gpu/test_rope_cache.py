"""The fused rotary-embedding + KV-cache kernel (qtool/cuda/rope_cache.py) against its torch form (the bench
decoder's `rope` and two `index_copy_`): bit-identical queries and caches on fresh random inputs, untouched cache
positions left alone, and a decode step of the bench decoder that gives the same token either way. Also the
bench decoder with all its fused kernels against all the torch forms."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.helpers import gpu_ready, synced

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]

SENTINEL = 7.0  # cache contents that no write may touch except at the step's positions


def _torch_form(qkv, cos, sin, pos, kc, vc, heads, kv_heads):
    from qtool.bench.e2e import rope

    x = qkv.transpose(1, 2)
    qk = rope(x[:, : heads + kv_heads], cos[pos][None, None], sin[pos][None, None])
    kc.index_copy_(2, pos, qk[:, heads:])
    vc.index_copy_(2, pos, x[:, heads + kv_heads :])
    return qk[:, :heads]


@pytest.mark.parametrize(
    "b,t,heads,kv_heads,d",
    [
        (1, 1, 32, 32, 128),  # Llama-2-7B decode
        (3, 1, 32, 8, 128),  # grouped-query attention, a batch
        (2, 5, 6, 2, 64),
        (1, 37, 4, 4, 32),  # a short prefill, odd length
        (2, 3, 3, 1, 96),  # odd head counts
    ],
)
def test_rope_cache_bit_identical_to_torch_form(b, t, heads, kv_heads, d):
    from qtool.cuda.rope_cache import rope_cache

    gen = torch.Generator(device="cuda").manual_seed(b * 1000 + t * 10 + heads)
    length, table = 50, 64
    qkv = (torch.randn(b, t, heads + 2 * kv_heads, d, device="cuda", generator=gen) * 3).half()
    ang = torch.rand(table, d // 2, device="cuda", generator=gen) * 6.3
    cos, sin = ang.cos().half(), ang.sin().half()
    pos = torch.randperm(length, device="cuda", generator=gen)[:t].sort().values  # distinct, not contiguous
    caches = [
        torch.full((b, kv_heads, length, d), SENTINEL, dtype=torch.float16, device="cuda") for _ in range(4)
    ]
    q = synced(rope_cache(qkv, cos, sin, pos, caches[0], caches[1], heads, kv_heads))
    q_ref = _torch_form(qkv, cos, sin, pos, caches[2], caches[3], heads, kv_heads)
    assert q.shape == (b, heads, t, d)
    assert torch.equal(q.view(torch.int16), q_ref.contiguous().view(torch.int16)), "queries differ"
    assert torch.equal(caches[0].view(torch.int16), caches[2].view(torch.int16)), "key caches differ"
    assert torch.equal(caches[1].view(torch.int16), caches[3].view(torch.int16)), "value caches differ"
    untouched = torch.ones(length, dtype=torch.bool, device="cuda")
    untouched[pos] = False
    assert bool((caches[0][:, :, untouched] == SENTINEL).all()) and bool(
        (caches[1][:, :, untouched] == SENTINEL).all()
    )


def test_rope_cache_refuses_bad_input_in_one_line():
    from qtool.cuda.rope_cache import rope_cache

    qkv = torch.zeros(1, 1, 6, 64, dtype=torch.float16, device="cuda")
    table = torch.zeros(8, 32, dtype=torch.float16, device="cuda")
    cache = torch.zeros(1, 2, 8, 64, dtype=torch.float16, device="cuda")
    pos = torch.zeros(1, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match=r"qkv: found \[1, 1, 6, 64\], expected \[B, T, 8, even D\]"):
        rope_cache(qkv, table, table, pos, cache, cache, 4, 2)
    with pytest.raises(ValueError, match="pos: found torch.int32"):
        rope_cache(qkv, table, table, pos.int(), cache, cache, 2, 2)
    with pytest.raises(ValueError, match="cos: found torch.float32"):
        rope_cache(qkv, table.float(), table, pos, cache, cache, 2, 2)


def _decode_run(e2e, d, dev):
    torch.manual_seed(0)
    model = e2e.Decoder(d, e2e.fp16_linear(dev), dev)
    tables = model.rope_tables(64, dev)
    shape = (2, d.kv_heads, 32, d.head_dim)
    cache = [
        (
            torch.zeros(shape, dtype=torch.float16, device=dev),
            torch.zeros(shape, dtype=torch.float16, device=dev),
        )
        for _ in range(d.layers)
    ]
    with torch.inference_mode():
        prefill = model(
            torch.arange(32, device=dev).remainder(d.vocab)[None].repeat(2, 1),
            torch.arange(32, device=dev),
            cache,
            tables,
            decode=False,
        )
        step = model(
            torch.tensor([[3], [5]], device=dev), torch.tensor([9], device=dev), cache, tables, decode=True
        )
    return model, synced(prefill).tolist(), step.tolist(), [c[0].clone() for c in cache]


def test_bench_decoder_fused_kernels_match_torch_forms(monkeypatch):
    """All fused kernels of the bench decoder against all torch forms: caches within float16 rounding of each
    other (the normalization sums its squares in another order)."""
    from qtool.bench import e2e

    d = e2e.dims_for("tiny")
    dev = torch.device("cuda")
    runs = {}
    for fused in (True, False):
        for flag in ("FUSED_ROPE", "FUSED_NORM", "FUSED_SWIGLU"):
            monkeypatch.setattr(e2e, flag, fused)
        runs[fused] = _decode_run(e2e, d, dev)
        blk = runs[fused][0].blocks[0]
        assert (blk.fused_rope, blk.fused_norm, blk.fused_swiglu) == (fused,) * 3
    for a, b in zip(runs[True][3], runs[False][3], strict=True):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2


def test_bench_decoder_same_token_with_and_without_fusion(monkeypatch):
    from qtool.bench import e2e

    d = e2e.dims_for("tiny")
    dev = torch.device("cuda")
    tokens = {}
    for fused in (True, False):
        monkeypatch.setattr(e2e, "FUSED_ROPE", fused)
        model, *tokens[fused] = _decode_run(e2e, d, dev)
        assert model.blocks[0].fused_rope is fused
    assert tokens[True][:2] == tokens[False][:2]
    assert all(torch.equal(a, b) for a, b in zip(tokens[True][2], tokens[False][2], strict=True))


@pytest.mark.parametrize("model_config", ["tiny", "llama-3-8b"])
def test_bench_decoder_span_matches_the_masked_step_under_a_graph(model_config):
    """The decode step the benches capture (SDPA over the cache's first `span` positions after the fused rotary
    write, no mask) against the masked form over the whole static cache, on a cache whose later positions hold
    stale values: logits within float16 rounding, replayed from a CUDA graph as the benches time it."""
    from qtool.bench import e2e
    from qtool.cuda.graphs import GraphedStep

    d = e2e.dims_for(model_config)
    d = e2e.Dims(d.hidden, 256, 1, d.heads, d.kv_heads, 1000, head_dim=d.head_dim)  # one layer, small MLP
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = e2e.Decoder(d, e2e.fp16_linear(dev), dev).eval()
    assert model.blocks[0].fused_rope
    tables = model.rope_tables(96, dev)
    stale = torch.randn(2, 3, d.kv_heads, 96, d.head_dim, device=dev).half()
    ids = torch.randint(0, d.vocab, (3, 1), device=dev)
    pos = torch.tensor([40], device=dev)
    logits = {}
    for span in (None, 41):
        cache = [(stale[0].clone(), stale[1].clone())]
        with torch.inference_mode():
            step = GraphedStep(
                lambda ids, pos, cache=cache, span=span: model.logits(
                    ids, pos, cache, tables, decode=True, span=span
                ),
                [ids, pos],
            )
            logits[span] = synced(step.replay()).float()
    err = float((logits[41] - logits[None]).norm() / logits[None].norm())
    assert err < 1e-2, err
