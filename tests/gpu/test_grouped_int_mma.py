"""The Hopper wgmma kernel for grouped_int (kernels/grouped_int/mma.cu) against the float64 reference.

Fresh random inputs, real and odd shapes, every token tile, split-K and stage count; outputs poisoned with NaN
before each launch and a sync after it. Skips without a Hopper GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu.helpers import gpu_ready, random_layer, reference64, rel_err, synced

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]

TOL = 3e-3  # fp16 weights (one rounding), fp16 inputs, fp32 accumulation, fp16 output
ODD_SHAPES = [(100, 1000), (72, 4000), (17, 136), (200, 520)]  # N % 64 != 0, K % 128 != 0 (partial groups)
REAL_SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (N, K) of Llama-2-7B projections


@pytest.fixture(autouse=True)
def _hopper_and_fresh_inputs():
    from qtool.cuda.compile import target_arch

    if target_arch() != "sm_90a":
        pytest.skip(f"the wgmma kernel needs a Hopper GPU (found {target_arch()})")
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch seed {seed}")


def _prep(layer):
    from qtool.layouts.grouped_int.cuda import prepare

    return prepare(
        layer.qweight,
        layer.scales,
        layer.zeros,
        layer.spec.bits,
        layer.spec.group_size,
        layer.in_features,
        layer.out_features,
    )


def _check(layer, m: int, *, with_bias: bool = False, sample: int | None = None, **kw) -> torch.Tensor:
    """Run the kernel on fresh inputs; compare all rows (or `sample` random ones) with the float64 reference."""
    from qtool.layouts.grouped_int.cuda import mma

    p = _prep(layer)
    x = torch.randn(m, layer.in_features, device="cuda", dtype=torch.float16)
    out = torch.full((m, layer.out_features), float("nan"), device="cuda", dtype=torch.float16)
    bias = layer.bias if with_bias else None
    y = synced(mma(x, p, bias, out=out, **kw))
    assert y.data_ptr() == out.data_ptr()
    assert bool(torch.isfinite(y).all()), (
        f"unwritten or non-finite outputs: {int((~torch.isfinite(y)).sum())}"
    )
    idx = torch.arange(m) if sample is None or sample >= m else torch.randperm(m)[:sample]
    ref = reference64(layer, x[idx.cuda()])
    if not with_bias and layer.bias is not None:
        ref = ref - layer.bias.double().cpu()
    err = rel_err(y[idx.cuda()], ref)
    assert err < TOL, f"relative error {err:.2e} (M={m}, {kw})"
    return y


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, None])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("nk", ODD_SHAPES)
def test_mma_odd_shapes(bits, group_size, symmetric, nk):
    n, k = nk
    layer = random_layer(
        n, k, bits, group_size, symmetric, seed=int.from_bytes(os.urandom(4), "little"), bias=True
    )
    for m in (1, 7, 9, 64, 100, 257):
        _check(layer, m, with_bias=(m % 2 == 1))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("nk", REAL_SHAPES)
def test_mma_real_shapes(bits, symmetric, nk):
    n, k = nk
    layer = random_layer(n, k, bits, 128, symmetric, seed=int.from_bytes(os.urandom(4), "little"))
    for m in (1, 16, 64, 2048):
        _check(layer, m, sample=96)


@pytest.mark.parametrize("bits", [4, 8])
def test_mma_every_kernel_split_and_stage_count(bits):
    from qtool.layouts.grouped_int.cuda import MMA_KERNELS

    layer = random_layer(300, 1500, bits, 64, False, seed=int.from_bytes(os.urandom(4), "little"), bias=True)
    for (tn, rows), stage_counts in MMA_KERNELS.items():
        for stages in stage_counts:
            for split in (1, 2, 3, 24):  # 24: every block a single 64-code stage
                _check(layer, 37, with_bias=True, tokens=tn, rows=rows, split=split, stages=stages)
    wide = random_layer(700, 512, bits, 128, True, seed=int.from_bytes(os.urandom(4), "little"), bias=True)
    for tn, rows in MMA_KERNELS:
        if rows == 256:
            _check(wide, 300, with_bias=True, tokens=tn, rows=rows)  # 3 row tiles, the last partial


def test_mma_split_k_is_deterministic_and_leaves_counters_zero():
    from qtool.cuda import split_k
    from qtool.layouts.grouped_int.cuda import mma

    layer = random_layer(1000, 4096, 4, 128, True, seed=int.from_bytes(os.urandom(4), "little"))
    p = _prep(layer)
    x = torch.randn(5, 4096, device="cuda", dtype=torch.float16)
    first = synced(mma(x, p, split=7)).clone()
    for split in (7, 7, 3):
        again = synced(mma(x, p, split=split))
        if split == 7:
            assert torch.equal(first, again), "split-K results differ between identical launches"
    dev = torch.cuda.current_device()
    assert int(split_k.counters(dev).abs().sum()) == 0, "tile counters not reset"


def test_mma_in_a_cuda_graph():
    from qtool.cuda.graphs import GraphedStep
    from qtool.layouts.grouped_int.cuda import mma

    layer = random_layer(4096, 4096, 4, 128, False, seed=int.from_bytes(os.urandom(4), "little"), bias=True)
    p = _prep(layer)
    bias = layer.bias
    step = GraphedStep(lambda x: mma(x, p, bias, split=4), [torch.randn(16, 4096, device="cuda").half()])
    for _ in range(3):
        x = torch.randn(16, 4096, device="cuda", dtype=torch.float16)
        y = synced(step(x))
        assert torch.equal(y, synced(mma(x, p, bias, split=4)))
        assert rel_err(y, reference64(layer, x)) < TOL


def test_mma_refuses_small_groups_and_bad_arguments():
    from qtool.cuda.compile import CudaUnavailableError
    from qtool.layouts.grouped_int.cuda import choose_path, mma

    layer = random_layer(64, 256, 8, 16, True, seed=5)
    x = torch.randn(32, 256, device="cuda", dtype=torch.float16)
    with pytest.raises(CudaUnavailableError, match="group_size=16"):
        mma(x, _prep(layer))
    assert choose_path(32, torch.float16, 8, 16, 256, 64) != "mma"
    y = synced(layer(x))  # the layer still runs (another path)
    assert rel_err(y, reference64(layer, x)) < TOL
    good = _prep(random_layer(64, 256, 4, 64, True, seed=6))
    with pytest.raises(ValueError, match="^tokens: found 12"):
        mma(x, good, tokens=12)
    with pytest.raises(ValueError, match="^split: found 0"):
        mma(x, good, split=0)
    with pytest.raises(ValueError, match="^stages: found 3"):
        mma(x, good, stages=3)
    with pytest.raises(ValueError, match="^rows: found 256 with tokens=8"):
        mma(x, good, tokens=8, rows=256)


@pytest.mark.parametrize("bits", [4, 8])
# 256: the scale/zero words are reloaded on every fourth stage only (next_meta)
@pytest.mark.parametrize("group_size", [32, 64, 128, 256, None])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("nk", ODD_SHAPES + [(4096, 4096)])
def test_mma_warp_specialized_equals_block_synchronous(bits, group_size, symmetric, nk):
    """The warp-specialized kernel (bulk tensor copies, mbarrier ring) against the float64 reference, and bit for
    bit against the block-synchronous kernel with the same 256-token tiles: same fragments, same wgmma order."""
    from qtool.layouts.grouped_int.cuda import mma

    n, k = nk
    layer = random_layer(
        n, k, bits, group_size, symmetric, seed=int.from_bytes(os.urandom(4), "little"), bias=True
    )
    p = _prep(layer)
    for m in (129, 300, 777):
        y = _check(layer, m, with_bias=True, sample=64, kernel="ws", tokens=256, split=1)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        a = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
        b = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
        synced(mma(x, p, layer.bias, out=a, kernel="ws", tokens=256, split=1))
        synced(mma(x, p, layer.bias, out=b, kernel="sync", tokens=256, split=1))
        assert torch.equal(a, b), f"ws and sync differ (M={m}): {int((a != b).sum())} elements"
        assert y.shape == (m, n)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128, None])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("nk", ODD_SHAPES + [(4096, 4096)])
def test_mma_warp_specialized_split_k_equals_block_synchronous(bits, group_size, symmetric, nk):
    """The warp-specialized kernel at every token tile (64, 128, 256) and with split-K (shares of K added by the
    tile's last block) against the float64 reference, bit for bit against the block-synchronous kernel at the same
    tile and split, and with its own choice of tile and split (ws_plan); the tile counters end at zero."""
    from qtool.cuda import split_k
    from qtool.layouts.grouped_int.cuda import mma

    n, k = nk
    layer = random_layer(
        n, k, bits, group_size, symmetric, seed=int.from_bytes(os.urandom(4), "little"), bias=True
    )
    p = _prep(layer)
    # tokens past M in the last tile (17, 100, 300), every share one 64-code stage (split = stages), 2-wave grids,
    # 64-token tiles two blocks per SM
    for m, tn, split, per_sm in (
        (17, 64, 3, 1),
        (64, 64, 1, 1),
        (100, 128, 2, 1),
        (100, 64, p.kp // 64, 1),
        (256, 256, 4, 1),
        (300, 128, 1, 1),
        (300, 256, 2, 1),
        (20, 64, 3, 2),
        (64, 64, 1, 2),
        (130, 64, p.kp // 64, 2),
    ):
        split = min(split, p.kp // 64)
        _check(layer, m, with_bias=True, sample=64, kernel="ws", tokens=tn, split=split, per_sm=per_sm)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        a = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
        b = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
        synced(mma(x, p, layer.bias, out=a, kernel="ws", tokens=tn, split=split, per_sm=per_sm))
        synced(mma(x, p, layer.bias, out=b, kernel="sync", tokens=tn, split=split))
        assert torch.equal(a, b), (
            f"ws and sync differ (M={m}, tokens={tn}, split={split}, per_sm={per_sm}): {int((a != b).sum())}"
        )
    for m in (65, 200, 512):
        _check(layer, m, sample=64, kernel="ws")
        _check(layer, m, sample=64)  # the default path for this many tokens
    assert int(split_k.counters(torch.cuda.current_device()).abs().sum()) == 0, "tile counters not reset"


def test_mma_warp_specialized_split_k_in_a_cuda_graph():
    from qtool.cuda.graphs import GraphedStep
    from qtool.layouts.grouped_int.cuda import mma, ws_plan

    layer = random_layer(4096, 4096, 4, 128, False, seed=int.from_bytes(os.urandom(4), "little"), bias=True)
    p = _prep(layer)
    assert ws_plan(4096, 200, p.kp, 132)[1] > 1  # this case splits K
    step = GraphedStep(
        lambda x: mma(x, p, layer.bias, kernel="ws"), [torch.randn(200, 4096, device="cuda").half()]
    )
    for _ in range(3):
        x = torch.randn(200, 4096, device="cuda", dtype=torch.float16)
        y = synced(step(x))
        assert torch.equal(y, synced(mma(x, p, layer.bias, kernel="ws")))
        assert rel_err(y, reference64(layer, x)) < TOL


def test_mma_warp_specialized_refuses_bad_tiles():
    from qtool.layouts.grouped_int.cuda import mma

    p = _prep(random_layer(256, 512, 4, 128, True, seed=7))
    x = torch.randn(100, 512, device="cuda", dtype=torch.float16)
    with pytest.raises(
        ValueError, match=r"^tokens: found 32 for kernel ws, expected one of \(64, 128, 256\)$"
    ):
        mma(x, p, kernel="ws", tokens=32)
    with pytest.raises(
        ValueError, match=r"^stages: found 5 for kernel ws with tokens=64, expected one of \(8,\)$"
    ):
        mma(x, p, kernel="ws", tokens=64, stages=5)
    with pytest.raises(ValueError, match="^kernel ws: needs tiles of 128 rows"):
        mma(x, p, kernel="ws", tokens=128, rows=256)
    with pytest.raises(ValueError, match="^split: found 9, expected 1..8"):
        mma(x, p, kernel="ws", split=9)
    with pytest.raises(
        ValueError, match="^per_sm: found 2 for kernel ws with tokens=128, expected 1, or 2 for"
    ):
        mma(x, p, kernel="ws", tokens=128, per_sm=2)
    with pytest.raises(ValueError, match="^per_sm: found 2 for kernel sync, expected 1"):
        mma(x, p, kernel="sync", per_sm=2)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128, None])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(
    "nk", [(72, 4000), (200, 520), (136, 1000), (4096, 4096)]
)  # N % 8 == 0: aligned rows
def test_mma_persistent_equals_one_tile_per_block(bits, group_size, symmetric, nk):
    """The persistent warp-specialized kernel (blocks walk several tiles through one ring, copy-engine epilogue)
    against the float64 reference, and bit for bit against the one-tile-per-block kernel, at every ring depth and
    with grids capped so that blocks take 1, 2, 3 or many tiles (the last ones partial in tokens and rows), and
    such that the last partial round runs as 64-token quarters (those past M skipped)."""
    from qtool.layouts.grouped_int.cuda import mma, wsp_full_tiles

    n, k = nk
    layer = random_layer(
        n, k, bits, group_size, symmetric, seed=int.from_bytes(os.urandom(4), "little"), bias=True
    )
    p = _prep(layer)
    quartered = 0
    for m in (129, 777, 2048):
        _check(layer, m, with_bias=True, sample=64, kernel="wsp", blocks=3)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        ref = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
        synced(mma(x, p, layer.bias, out=ref, kernel="ws", tokens=256, split=1))
        tiles = -(-n // 128) * -(-m // 256)
        for stages in (4, 5):
            for blocks in (None, 1, 2, 3, 7, 84):
                quartered += wsp_full_tiles(tiles, min(tiles, blocks or 10**6)) < tiles
                y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
                synced(mma(x, p, layer.bias, out=y, kernel="wsp", stages=stages, blocks=blocks))
                assert torch.equal(y, ref), (
                    f"wsp and ws differ (M={m}, stages={stages}, blocks={blocks}): "
                    f"{int((y != ref).sum())} elements"
                )
    assert quartered > 0, "no grid of this test ran the last round as 64-token quarters"


def test_mma_persistent_refuses_unaligned_output_rows_and_stray_grid_caps():
    from qtool.layouts.grouped_int.cuda import mma

    layer = random_layer(100, 512, 4, 128, True, seed=int.from_bytes(os.urandom(4), "little"))
    p = _prep(layer)
    x = torch.randn(300, 512, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="^kernel wsp: found output rows of 100 halves"):
        mma(x, p, kernel="wsp")
    with pytest.raises(ValueError, match="^blocks: found 2 for kernel ws"):
        mma(x, p, kernel="ws", blocks=2)
    y = synced(mma(x, p))  # the default takes a kernel that can write these rows
    assert rel_err(y, reference64(layer, x)) < TOL
