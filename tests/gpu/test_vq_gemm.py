"""The fused VQ GEMM (kernels/vq/gemm.cu) against the float64 reference of the `vq` layout's `dequantize()`.

Both presets (GPTVQ-2: d 4, 256 entries, 256x256 tiles; AQLM-3: d 8, 4096 entries, two residuals per tensor), odd
shapes (ragged row and column tiles, K = 576, M not a multiple of the token tile, N an odd multiple of the block),
every token tile, split-K, every fusion (shuffles, direct lookups, replicated codebooks), with and without
re-indexing; fresh random inputs, outputs poisoned with
NaN before each launch and a sync after it. Skips without a Hopper GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu.helpers import gpu_ready, rel_err, synced

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]

TOL = 3e-3  # fp16 weights (one rounding of the residual sum), fp16 inputs, fp32 accumulation, fp16 output
# preset -> (d, entries, residuals, tile_rows, tile_cols)
PRESETS = {"gptvq-2": (4, 256, 1, 256, 256), "aqlm-3": (8, 4096, 2, None, None)}
# (N, K): 576 = 256 + 256 + 64 (ragged column tile), 200 < one 256-row tile, 384 = 256 + 128 and 640 (ragged row
# tiles; odd multiples of the 128-row block), 300 (a partial block)
ODD = [(200, 576), (384, 576), (640, 1024), (300, 256)]


@pytest.fixture(autouse=True)
def _hopper_and_fresh_inputs():
    from qtool.cuda.compile import target_arch

    if target_arch() != "sm_90a":
        pytest.skip(f"the VQ GEMM needs a Hopper GPU (found {target_arch()})")
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch seed {seed}")


def vq_layer(
    n: int,
    k: int,
    preset: str,
    *,
    reindex: bool,
    bias: bool = False,
    seed: int | None = None,
    tiles: tuple[int | None, int | None] | None = None,
):
    """A random VQLinear on CUDA: skewed codes (so re-indexing permutes entries), codebook entries sized so that
    outputs are O(1) for unit-variance inputs."""
    from qtool.layouts.vq.layout import VQWeight, tile_counts
    from qtool.layouts.vq.module import VQLinear

    d, e, z, tr, tc = PRESETS[preset]
    if tiles is not None:
        tr, tc = tiles
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") if seed is None else seed)
    codes = (torch.rand(z, n, k // d, generator=gen) ** 2 * e).long().clamp_max(e - 1)
    books = torch.randn(*tile_counts(n, k, tr, tc), z, e, d, generator=gen) / (k * z) ** 0.5
    b = (torch.randn(n, generator=gen) * 0.1).half() if bias else None
    return VQLinear(VQWeight.from_codes(codes, books, tr, tc, reindex=reindex), b).to("cuda")


def reference64(layer, x: torch.Tensor) -> torch.Tensor:
    w = layer.layout.dequantize(torch.float32).double().cpu()
    return x.double().cpu() @ w.T


def run(layer, x: torch.Tensor, bias=None, **kw) -> torch.Tensor:
    from qtool.layouts.vq.cuda_gemm import gemm, prepare_layer

    out = torch.full((x.shape[0], layer.out_features), float("nan"), device="cuda", dtype=torch.float16)
    y = synced(gemm(x, prepare_layer(layer), bias, out=out, **kw))
    assert y.data_ptr() == out.data_ptr()
    assert bool(torch.isfinite(y).all()), (
        f"unwritten or non-finite outputs: {int((~torch.isfinite(y)).sum())}"
    )
    return y


def check(layer, m: int, **kw) -> torch.Tensor:
    x = torch.randn(m, layer.in_features, device="cuda", dtype=torch.float16)
    y = run(layer, x, **kw)
    err = rel_err(y, reference64(layer, x))
    assert err < TOL, f"relative error {err:.2e} (N={layer.out_features}, K={layer.in_features}, M={m}, {kw})"
    return y


FUSIONS = {"gptvq-2": ("shfl", "direct", "replica"), "aqlm-3": ("shfl", "direct")}


@pytest.mark.parametrize("preset,fusion", [(p, f) for p, fs in FUSIONS.items() for f in fs])
@pytest.mark.parametrize("n,k", ODD)
def test_odd_shapes(preset, fusion, n, k):
    layer = vq_layer(n, k, preset, reindex=True)
    for m in (17, 100, 300):
        check(layer, m, fusion=fusion)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_token_tile_and_split(preset):
    from qtool.cuda import split_k
    from qtool.layouts.vq.cuda_gemm import BUILT

    cfg = {"gptvq-2": (4, 8, 1), "aqlm-3": (8, 12, 2)}[preset]
    layer = vq_layer(384, 1024, preset, reindex=True)
    for tn in BUILT[cfg]:
        for split in (1, 3, 16):
            for fusion in FUSIONS[preset]:
                check(layer, tn + 5, tokens=tn, split=split, fusion=fusion)
    ctr = split_k.counters(torch.cuda.current_device())
    assert ctr is not None and not bool(ctr.any()), "split-K tile counters left non-zero"


@pytest.mark.parametrize("preset", list(PRESETS))
def test_reindexing_leaves_outputs_unchanged(preset):
    """The same codes and codebooks with and without re-indexing: the kernel's outputs are bit-identical (the
    permutation is lossless and the kernel adds in the same order), and both match the reference."""
    a = vq_layer(384, 576, preset, reindex=False, seed=7)
    b = vq_layer(384, 576, preset, reindex=True, seed=7)
    assert not torch.equal(a.indices, b.indices), "re-indexing changed nothing: the test would prove nothing"
    x = torch.randn(130, 576, device="cuda", dtype=torch.float16)
    ya, yb = run(a, x), run(b, x)
    assert torch.equal(ya, yb)
    assert rel_err(yb, reference64(b, x)) < TOL


@pytest.mark.parametrize("preset", list(PRESETS))
def test_bias(preset):
    layer = vq_layer(200, 576, preset, reindex=True, bias=True)
    x = torch.randn(40, 576, device="cuda", dtype=torch.float16)
    y = run(layer, x, bias=layer.bias.data)
    ref = reference64(layer, x) + layer.bias.double().cpu()
    assert rel_err(y, ref) < TOL


@pytest.mark.parametrize("preset,n,k", [("gptvq-2", 11008, 4096), ("aqlm-3", 4096, 4096)])
def test_llama_shapes(preset, n, k):
    layer = vq_layer(n, k, preset, reindex=False)
    check(layer, 300)


def test_per_tensor_gptvq_codebook():
    """One 256-entry codebook for the whole tensor (tile_rows = tile_cols = null) runs the same kernel."""
    check(vq_layer(384, 576, "gptvq-2", reindex=True, tiles=(None, None)), 77)


def test_replica_buffers_with_short_column_tiles():
    """128-column tiles at the 4-stage ring: a tile's replica buffer is refilled two stages ahead, right after the
    tile before the last is decoded (the shortest tiles the replicas allow); with split-K the shares start inside
    tiles. Where a ring is deeper than the tiles allow, the default falls back to direct lookups."""
    from qtool.layouts.vq.cuda_gemm import fusion_reason, prepare_layer

    layer = vq_layer(384, 1024, "gptvq-2", reindex=True, tiles=(256, 128))
    for tn in (128, 256):
        for split in (1, 3):
            check(layer, tn - 3, tokens=tn, split=split, fusion="replica")
    assert fusion_reason(prepare_layer(layer), "replica", 32) is not None
    check(layer, 20)  # 32-token tile: the default's fallback


def test_layer_forward_dispatches_the_gemm(monkeypatch):
    """VQLinear on CUDA with more than 16 rows runs the GEMM (counted), matching the reference path."""
    from qtool.layouts.vq import cuda_gemm as vq_gemm

    calls = []
    real = vq_gemm.gemm
    monkeypatch.setattr(vq_gemm, "gemm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for preset in PRESETS:
        layer = vq_layer(384, 576, preset, reindex=True, bias=True)
        x = torch.randn(2, 20, 576, device="cuda", dtype=torch.float16)
        monkeypatch.setenv("QTOOL_KERNELS", "cuda")
        y = synced(layer(x))
        monkeypatch.setenv("QTOOL_KERNELS", "reference")
        ref = layer(x)
        assert y.shape == (2, 20, 384)
        assert rel_err(y, ref) < TOL
    assert len(calls) == 2


def test_unsupported_layer_falls_back_or_fails_in_one_line(monkeypatch):
    from qtool.cuda.compile import CudaUnavailableError

    layer = vq_layer(256, 576, "gptvq-2", reindex=False, tiles=(256, 96))  # 96-column tiles: not whole stages
    x = torch.randn(32, 576, device="cuda", dtype=torch.float16)
    monkeypatch.setenv("QTOOL_KERNELS", "auto")
    y = synced(layer(x))
    assert rel_err(y, reference64(layer, x)) < TOL
    monkeypatch.setenv("QTOOL_KERNELS", "cuda")
    with pytest.raises(CudaUnavailableError) as info:
        layer(x)
    msg = str(info.value)
    assert "\n" not in msg and "vq layer" in msg and "tile_cols 96" in msg
