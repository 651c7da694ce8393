"""The warp-specialized mixed-2-4-16 GEMM (kernels/mixed/gemm_ws.cu in its two forms, "regs" on
kernels/common/f16_ws_wgmma.cuh and "tile" on kernels/common/f16_ws_tile_wgmma.cuh; `mixed.gemm_ws`) against the
float64 reference of the layer, as test_mixed_kernels.py checks the block-synchronous GEMM: odd shapes (N not a
multiple of 128, K of 2 to 65 blocks of 64), token counts on both sides of every token tile, every build (form and
tile) forced, split-K off, planned and forced, bias, outliers (added into the tile form's decoded tiles, or by
mixed_spmv after the GEMM).

Outputs are poisoned with NaN before each launch, so an element the kernel forgets to write fails the test;
`synced` makes a faulting launch fail here rather than in a later test. A barrier that never completes hangs the
launch: run these under a time limit.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from qtool.layouts.mixed.cuda import GEMM_WS_BUILT
from tests.gpu.helpers import dependent_chain_runs, gpu_ready, rel_err, synced
from tests.gpu.test_mixed_kernels import TOL, random_mixed, reference64

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]

# (N, K, g2): N not a multiple of 128 (the last tile's rows past N), K of 2, 17, 65 and 16 blocks
ODD = [(12, 128, 4), (200, 1088, 8), (72, 4160, 4), (300, 1024, 12)]
MS = (1, 5, 16, 17, 33, 64, 100, 128, 257, 300)


BUILDS = [(None, None), *sorted(GEMM_WS_BUILT)]  # (form, tokens); (None, None): the plan


@pytest.fixture(autouse=True)
def _fresh_inputs():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch seed {seed}")


def _mixed():
    from qtool.layouts.mixed import cuda as mixed

    if not mixed.gemm_capable(torch.device("cuda")):
        pytest.skip("the mixed-2-4-16 GEMMs need a Hopper GPU")
    return mixed


def _layer(n: int, k: int, g2: int, fraction: float, seed: int):
    mixed = _mixed()
    layer = random_mixed(n, k, g2, "block4", fraction, seed, bias=True)
    p = mixed.prepare(layer, keep_checkpoint=False)
    assert not p.has_checkpoint and mixed.gemm_reason(p) is None
    return mixed, layer, p


def _counters_zero() -> None:
    from qtool.cuda import split_k

    cnt = split_k.counters(torch.cuda.current_device())
    assert cnt is None or int(cnt.abs().sum()) == 0, "a split-K tile counter was left non-zero"


@pytest.mark.parametrize("fraction", [0.0, 0.005])
@pytest.mark.parametrize("nkg", ODD)
def test_gemm_ws_matches_the_reference(fraction, nkg):
    n, k, g2 = nkg
    seed = int.from_bytes(os.urandom(4), "little")
    mixed, layer, p = _layer(n, k, g2, fraction, seed)
    nblk = k // 64
    for m in MS:
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        refs = {b: reference64(layer, x, b) for b in (False, True)}
        for (form, tokens), split in itertools.product(BUILDS, (1, None, min(3, nblk), nblk)):
            tile = mixed.gemm_ws_plan(m, tokens, form, outliers=fraction > 0)[0] == "tile"
            for outliers in (None, "spmv") if fraction and tile else (None,):
                with_bias = (m + (tokens or 0) + (split or 0)) % 2 == 1
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
                bias = layer.bias if with_bias else None
                kw = {"tokens": tokens, "split": split, "form": form, "outliers": outliers}
                y = synced(mixed.gemm_ws(x, p, bias, out=out, **kw))
                assert y.data_ptr() == out.data_ptr()
                what = f"seed {seed}, M={m}, {form} {tokens}, split {split}, bias {with_bias}, {outliers}"
                assert bool(torch.isfinite(y).all()), f"unwritten outputs ({what})"
                err = rel_err(y, refs[with_bias])
                assert err < TOL, f"relative error {err:.2e} ({what})"
    _counters_zero()


def test_gemm_ws_real_shape():
    """A Llama-2-7B down projection: 172 stages, the planned split and form at 16, 64, 128 and 300 tokens."""
    mixed, layer, p = _layer(4096, 11008, 16, 0.002, 31)
    for m in (16, 64, 128, 300):
        x = torch.randn(m, 11008, device="cuda", dtype=torch.float16)
        out = torch.full((m, 4096), float("nan"), device="cuda", dtype=torch.float16)
        y = synced(mixed.gemm_ws(x, p, layer.bias, out=out))
        assert rel_err(y, reference64(layer, x, True)) < TOL, m
    _counters_zero()


@pytest.mark.parametrize("kernel", ["gemm_ws regs", "gemm_ws tile", "gemm"])
def test_decoded_weights_are_the_reference_cast_bit_for_bit(kernel):
    """Identity activations: each output is one weight times 1 plus zeros in fp32, so y^T is the decoded fp16
    weight itself, which must be the reference's cast bit for bit (every GEMM decodes with mixed/tiled.cuh)."""
    mixed, layer, p = _layer(200, 1088, 8, 0.0, 41)
    eye = torch.eye(1088, device="cuda", dtype=torch.float16)
    ref = layer.cpu_layout().dense().half()
    name, _, form = kernel.partition(" ")
    fn = getattr(mixed, name)
    kw = {"form": form} if form else {}
    tiles = {"regs": (16, 128), "tile": (16, 128), "": (64, 256)}[form]
    for tokens in tiles:
        for split in (1, 5):
            y = synced(fn(eye, p, tokens=tokens, split=split, **kw)).cpu()
            same = y.T == ref
            assert bool(same.all()), f"{kernel}, tokens {tokens}, split {split}: {int((~same).sum())} differ"
    _counters_zero()


@pytest.mark.parametrize("tokens", [16, 128])
def test_outliers_in_the_tile_are_the_dequantized_weight_bit_for_bit(tokens):
    """Identity activations through the tile form with its outliers: y^T is the decoded tile after the outliers
    were added, which must be the dequantize kernel's weight (the fp16 sum of the cast and the outlier) bit for
    bit, in every block-stage, with the split stages in two blocks."""
    mixed, layer, p = _layer(300, 1088, 4, 0.01, 43)
    assert p.otile is not None and p.otile.rest is None and p.nnz > 300
    eye = torch.eye(1088, device="cuda", dtype=torch.float16)
    cpu = layer.cpu_layout()
    want = cpu.dense().half()
    r, c, v = cpu.outliers()
    want[r, c] = (want[r, c].float() + v.half().float()).half()  # mixed_outliers_into_dense's sum
    for split in (1, 5):
        y = synced(mixed.gemm_ws(eye, p, tokens=tokens, split=split, form="tile")).cpu()
        same = y.T == want
        assert bool(same.all()), f"split {split}: {int((~same).sum())} of {same.numel()} differ"
    _counters_zero()


def test_outliers_past_the_cap_go_to_spmv_beside_the_tile():
    """5% outliers: about 400 in each block-stage, 128 of them added in the tile and the rest by mixed_spmv after
    the GEMM (tile_outliers' `rest`); the regs form, which adds none itself, refuses "tile" in one line."""
    mixed, layer, p = _layer(200, 1088, 8, 0.05, 47)
    assert p.otile is not None and p.otile.rest is not None and p.otile.rest.nnz > p.nnz // 2
    for m, split in ((16, 1), (40, 3), (100, None)):
        x = torch.randn(m, 1088, device="cuda", dtype=torch.float16)
        out = torch.full((m, 200), float("nan"), device="cuda", dtype=torch.float16)
        y = synced(mixed.gemm_ws(x, p, layer.bias, out=out, split=split, form="tile"))
        assert rel_err(y, reference64(layer, x, True)) < TOL, (m, split)
    with pytest.raises(ValueError, match="outliers: found 'tile' with the regs form, which adds none"):
        mixed.gemm_ws(x, p, form="regs", outliers="tile")
    with pytest.raises(ValueError, match="outliers: found 'sparse'"):
        mixed.gemm_ws(x, p, outliers="sparse")
    _counters_zero()


@pytest.mark.parametrize("form,tokens", sorted(GEMM_WS_BUILT))
def test_gemm_ws_replayed_from_a_cuda_graph_gives_the_eager_bits(form, tokens):
    mixed, layer, p = _layer(264, 1024, 8, 0.01, 51)
    m = tokens + 3  # two token tiles, the second mostly past M
    x = torch.randn(m, 1024, device="cuda", dtype=torch.float16)
    out = torch.empty(m, 264, device="cuda", dtype=torch.float16)
    for split in (1, 4):
        eager = synced(mixed.gemm_ws(x, p, layer.bias, tokens=tokens, split=split, form=form)).clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            mixed.gemm_ws(x, p, layer.bias, out=out, tokens=tokens, split=split, form=form)
        for _ in range(3):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), f"split {split}: {int((out != eager).sum())} elements differ"
        x2 = torch.randn_like(x)
        x.copy_(x2)
        graph.replay()
        assert rel_err(synced(out), reference64(layer, x2, True)) < TOL
    _counters_zero()


def test_dependent_launches_read_the_activations_the_kernel_ahead_wrote():
    mixed, layer, p = _layer(1024, 4096, 16, 0.002, 61)
    x0 = torch.randn(40, 4096, device="cuda", dtype=torch.float16)
    buf = torch.empty_like(x0)

    def chain():
        torch.mul(x0, 2.0, out=buf)  # the kernel ahead writes the activations
        return torch.cat(
            [
                mixed.gemm_ws(buf, p, tokens=16),
                mixed.gemm_ws(buf, p, tokens=64, split=1),
                mixed.gemm_ws(buf, p, tokens=128, split=2),
            ]
        )

    plain, outs = dependent_chain_runs(chain)
    for o in outs:
        assert torch.equal(o, plain)
    assert rel_err(plain[:40], reference64(layer, buf, False)) < TOL
    _counters_zero()


@pytest.mark.parametrize("fraction", [0.0, 0.002])
def test_linear_takes_gemm_ws_where_selected(monkeypatch, fraction):
    mixed = _mixed()
    layer = random_mixed(256, 2048, 16, "block4", fraction, 71, bias=True)
    monkeypatch.setenv("QTOOL_KERNELS", "cuda")
    monkeypatch.setattr(mixed, "GEMM_WS", True)
    calls = []
    for name in ("gemm_ws", "gemm"):
        real = getattr(mixed, name)
        monkeypatch.setattr(mixed, name, lambda *a, _n=name, _f=real, **kw: calls.append(_n) or _f(*a, **kw))
    for m in (3, 40, 130, 600):
        x = torch.randn(m, 2048, device="cuda", dtype=torch.float16)
        y = synced(layer(x))
        assert rel_err(y, reference64(layer, x, True)) < TOL, m
    # 3 tokens take the GEMV; past GEMM_WS_MAX_M an outlier-free layer takes gemm.cu, one with outliers gemm_ws
    assert calls == ["gemm_ws", "gemm_ws", "gemm_ws" if fraction else "gemm"]


def test_gemm_ws_refuses_what_it_does_not_build():
    mixed, _, p = _layer(12, 128, 4, 0.0, 81)
    x = torch.randn(4, 128, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="tokens, form: found 48"):
        mixed.gemm_ws(x, p, tokens=48)
    with pytest.raises(ValueError, match="tokens, form: found 256, 'tile'"):
        mixed.gemm_ws(x, p, tokens=256, form="tile")
    with pytest.raises(ValueError, match="split: found 3"):
        mixed.gemm_ws(x, p, split=3)
    assert mixed.gemm_ws(x[:0], p).shape == (0, 12)
