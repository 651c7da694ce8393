"""The warp-specialized VQ GEMM (kernels/vq/gemm_ws.cu in the engine's two forms; `cuda_gemm.gemm_ws`) against the
float64 reference of the `vq` layout's `dequantize()`, as test_vq_gemm.py checks the block-synchronous GEMM: GPTVQ-2
(the built configuration) with ragged row and column tiles, K = 576, a per-tensor codebook and 128-column tiles (a
codebook switch every two stages), every token tile of both forms on both sides of M, split-K off, planned and
forced, both fusions of the regs form, bias; and the same bits as the block-synchronous GEMM where both run one share of the same token tile
(the same decode and the same wgmma order). Outputs are poisoned with NaN before each launch; `synced` makes a
faulting launch fail here. A barrier that never completes hangs the launch: run these under a time limit.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.gpu.helpers import dependent_chain_runs, gpu_ready, rel_err, synced
from tests.gpu.test_vq_gemm import ODD, TOL, _hopper_and_fresh_inputs, reference64, vq_layer  # noqa: F401

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]


def run_ws(layer, x: torch.Tensor, bias=None, **kw) -> torch.Tensor:
    from qtool.layouts.vq.cuda_gemm import gemm_ws, prepare_layer

    out = torch.full((x.shape[0], layer.out_features), float("nan"), device="cuda", dtype=torch.float16)
    y = synced(gemm_ws(x, prepare_layer(layer), bias, out=out, **kw))
    assert y.data_ptr() == out.data_ptr()
    assert bool(torch.isfinite(y).all()), (
        f"unwritten or non-finite outputs: {int((~torch.isfinite(y)).sum())}"
    )
    return y


def _counters_zero() -> None:
    from qtool.cuda import split_k

    cnt = split_k.counters(torch.cuda.current_device())
    assert cnt is None or not bool(cnt.any()), "a split-K tile counter was left non-zero"


FORMS = [("regs", "direct"), ("regs", "shfl"), ("tile", None)]  # (form, fusion)


@pytest.mark.parametrize("form,fusion", FORMS)
@pytest.mark.parametrize("n,k", ODD)
def test_odd_shapes(form, fusion, n, k):
    layer = vq_layer(n, k, "gptvq-2", reindex=True)
    for m in (1, 5, 17, 100, 300):
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        y = run_ws(layer, x, form=form, fusion=fusion)
        assert rel_err(y, reference64(layer, x)) < TOL, (m, form, fusion)
    _counters_zero()


@pytest.mark.parametrize("tiles", [(256, 256), (None, None), (256, 128)])
def test_every_token_tile_and_split(tiles):
    from qtool.layouts.vq.cuda_gemm import WS_BUILT

    layer = vq_layer(384, 1024, "gptvq-2", reindex=True, tiles=tiles)
    for (form, tn), split, fusion in itertools.product(WS_BUILT, (1, 3, None, 16), ("direct", "shfl")):
        if form == "tile" and fusion == "shfl":
            continue
        for m in (tn - 3, tn + 5):
            x = torch.randn(m, 1024, device="cuda", dtype=torch.float16)
            y = run_ws(layer, x, tokens=tn, split=split, fusion=fusion, form=form)
            err = rel_err(y, reference64(layer, x))
            what = f"tiles {tiles}, M={m}, {form} {tn}, split {split}, {fusion}"
            assert err < TOL, f"relative error {err:.2e} ({what})"
    _counters_zero()


def test_the_block_synchronous_gemms_bits_at_one_share():
    from qtool.layouts.vq.cuda_gemm import BUILT, WS_BUILT, gemm, gemm_ws, prepare_layer

    layer = vq_layer(640, 1024, "gptvq-2", reindex=True)
    p = prepare_layer(layer)
    for form, tn in sorted(WS_BUILT):
        if tn not in BUILT[4, 8, 1]:
            continue
        x = torch.randn(tn + 7, 1024, device="cuda", dtype=torch.float16)
        for fusion in ("direct", "shfl") if form == "regs" else ("direct",):
            a = synced(gemm(x, p, tokens=tn, split=1, fusion=fusion))
            b = synced(gemm_ws(x, p, tokens=tn, split=1, fusion=fusion, form=form))
            assert torch.equal(a, b), f"{form} {tn} tokens, {fusion}: {int((a != b).sum())} elements differ"


def test_bias_and_llama_shape():
    layer = vq_layer(11008, 4096, "gptvq-2", reindex=False, bias=True)
    for m in (16, 64, 300):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
        y = run_ws(layer, x, bias=layer.bias.data)
        assert rel_err(y, reference64(layer, x) + layer.bias.double().cpu()) < TOL, m
    _counters_zero()


@pytest.mark.parametrize("form,tokens", [("regs", 16), ("regs", 128), ("tile", 16), ("tile", 128)])
def test_replayed_from_a_cuda_graph_gives_the_eager_bits(form, tokens):
    from qtool.layouts.vq.cuda_gemm import gemm_ws, prepare_layer

    layer = vq_layer(384, 1024, "gptvq-2", reindex=True)
    p = prepare_layer(layer)
    x = torch.randn(tokens + 3, 1024, device="cuda", dtype=torch.float16)
    out = torch.empty(tokens + 3, 384, device="cuda", dtype=torch.float16)
    for split in (1, 4):
        eager = synced(gemm_ws(x, p, tokens=tokens, split=split, form=form)).clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gemm_ws(x, p, out=out, tokens=tokens, split=split, form=form)
        for _ in range(3):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), f"split {split}: {int((out != eager).sum())} elements differ"
    _counters_zero()


def test_dependent_launches_read_the_activations_the_kernel_ahead_wrote():
    from qtool.layouts.vq.cuda_gemm import gemm_ws, prepare_layer

    layer = vq_layer(1024, 2048, "gptvq-2", reindex=True)
    p = prepare_layer(layer)
    x0 = torch.randn(40, 2048, device="cuda", dtype=torch.float16)
    buf = torch.empty_like(x0)

    def chain():
        torch.mul(x0, 2.0, out=buf)  # the kernel ahead writes the activations
        return torch.cat(
            [
                gemm_ws(buf, p, tokens=16),
                gemm_ws(buf, p, tokens=64, split=1, form="tile"),
                gemm_ws(buf, p, split=2),
            ]
        )

    plain, outs = dependent_chain_runs(chain)
    for o in outs:
        assert torch.equal(o, plain)
    assert rel_err(plain[:40], reference64(layer, buf)) < TOL
    _counters_zero()


def test_layer_forward_takes_gemm_ws_where_selected(monkeypatch):
    from qtool.layouts.vq import cuda_gemm

    layer = vq_layer(384, 1024, "gptvq-2", reindex=True)
    monkeypatch.setenv("QTOOL_KERNELS", "cuda")
    monkeypatch.setattr(cuda_gemm, "GEMM_WS", 1)
    calls = []
    real = cuda_gemm.gemm_ws
    monkeypatch.setattr(cuda_gemm, "gemm_ws", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for m in (3, 40, 130):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.float16)
        with torch.no_grad():
            y = synced(layer(x))
        assert rel_err(y, reference64(layer, x)) < TOL, m
    assert len(calls) == 2  # 40 and 130 rows; 3 take the GEMV


def test_what_it_does_not_build_is_refused_in_one_line():
    from qtool.cuda.compile import CudaUnavailableError
    from qtool.layouts.vq.cuda_gemm import gemm_ws, prepare_layer

    x = torch.randn(20, 1024, device="cuda", dtype=torch.float16)
    with pytest.raises(CudaUnavailableError, match=r"VQ<8,12,2> \(built for VQ<4,8,1>\); use gemm"):
        gemm_ws(x, prepare_layer(vq_layer(256, 1024, "aqlm-3", reindex=False)))
    p = prepare_layer(vq_layer(256, 1024, "gptvq-2", reindex=False))
    with pytest.raises(ValueError, match="tokens, form: found 48"):
        gemm_ws(x, p, tokens=48)
    with pytest.raises(ValueError, match=r"fusion: found 'shfl', expected direct \(the tile form"):
        gemm_ws(x, p, form="tile", fusion="shfl")
    with pytest.raises(ValueError, match="split: found 17"):
        gemm_ws(x, p, split=17)
    with pytest.raises(ValueError, match="fusion: found 'replica'"):
        gemm_ws(x, p, fusion="replica")
    assert gemm_ws(x[:0], p).shape == (0, 256)
