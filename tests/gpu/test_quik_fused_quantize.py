"""The fused form of the W4A4 layer (`quik.quantize_gemm`, kernels/quik/gemm.cu quik_gemm_wsq_*): one kernel
quantizes the activation rows and multiplies them, with rows handed between blocks through counters. It must give
the bits of the quantize kernel followed by the persistent GEMM, for every split of the rows between the math warps
(before the first tiles) and the copy warps (under them), on odd shapes and grids of fewer blocks than tiles, and
leave its counters at zero.

Outputs are poisoned before each launch; `synced` makes a faulting launch fail here."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.helpers import gpu_ready, rel_err, synced
from tests.gpu.test_quik_kernels import _fresh_seed, _x, assert_linear_chain_bits, needs_hopper, random_quik  # noqa: F401

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]

# (N, K, outliers): Llama-2-7B 4096 x 4096 and 4096 x 11008, then odd ones (N % 128 != 0, kb % 128 != 0, no outliers,
# rows of 6000 columns: two per ring slot, two copy warps)
SHAPES = [
    (4096, 4096, 256),
    (11008, 4096, 256),
    (1000, 520, 130),
    (72, 4000, 37),
    (104, 1000, 0),
    (264, 6000, 8),
]


def _poisoned(m: int, n: int, p):
    from qtool.layouts.quik import cuda as quik

    out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    a = quik.empty_activations(m, p, torch.device("cuda"))
    a.codes.fill_(0x5A)
    a.outliers.fill_(float("nan"))
    a.scale.fill_(float("nan"))
    a.zero.fill_(float("nan"))
    return out, a


def _two_kernels(x: torch.Tensor, p):
    from qtool.layouts.quik import cuda as quik

    out, a = _poisoned(x.shape[0], p.out_features, p)
    quik.quantize(x, p, out=a)
    synced(quik.gemm(a, p, out=out, kernel="wsp", tokens=256, stages=4))
    return out, a


def _check(x: torch.Tensor, p, ref, where: str, **plan) -> None:
    from qtool.cuda import split_k
    from qtool.layouts.quik import cuda as quik

    out, a = _poisoned(x.shape[0], p.out_features, p)
    quik.quantize_gemm(x, p, out=out, acts=a, **plan)
    synced(out)
    ref_out, ref_a = ref
    assert torch.equal(a.codes, ref_a.codes), f"codes differ ({where}, {plan})"
    assert torch.equal(a.outliers, ref_a.outliers), f"outlier columns differ ({where}, {plan})"
    assert torch.equal(a.scale, ref_a.scale) and torch.equal(a.zero, ref_a.zero), (
        f"s_x / z_x differ ({where})"
    )
    assert bool(torch.isfinite(out).all()), f"unwritten outputs ({where}, {plan})"
    bad = int((out != ref_out).sum())
    assert bad == 0, f"{bad} outputs differ from the two-kernel path ({where}, {plan})"
    cnt = split_k.counters(torch.cuda.current_device())
    assert cnt is not None and int(cnt.abs().sum()) == 0, "row counters left non-zero"


@needs_hopper
@pytest.mark.parametrize("n,k,ko", SHAPES)
@pytest.mark.parametrize("m", [129, 300, 2048])
def test_fused_form_gives_the_bits_of_quantize_then_gemm(n, k, ko, m):
    from qtool.layouts.quik import cuda as quik

    layer = random_quik(n, k, ko, 4, bias=True)
    p = quik.prepare(layer)
    x = _x(m, k, layer.outlier_idx)
    assert quik.fused_quantize_reason(x, p) is None
    ref = _two_kernels(x, p)
    where = f"M={m}, N={n}, K={k}, k={ko}"
    _check(x, p, ref, where)
    most = quik.wsq_copy_warps(p)
    # every row quantized before the first tiles / every row by the copy warps / a split inside a token tile
    for plan in (
        {"first_rows": m},
        {"first_rows": 0},
        {"first_rows": m // 3, "copy_warps": 1},
        {"blocks": 3, "copy_warps": most},
        {"blocks": 1, "first_rows": 0},
        {"blocks": 7, "first_rows": m},
    ):
        _check(x, p, ref, where, **plan)
    y = synced(layer(x))  # the module path, through either form: the same bits
    assert torch.equal(y, ref[0])
    err = rel_err(y, layer.reference_forward(x.float()).double())
    assert err < 2e-3, f"relative error {err:.2e} against the torch reference ({where})"


@needs_hopper
def test_fused_form_reads_strided_rows_and_a_graph_replays_it():
    from qtool.layouts.quik import cuda as quik

    layer = random_quik(1000, 520, 130, 4, bias=False)
    p = quik.prepare(layer)
    wide = _x(700, 528, torch.arange(0))
    x = wide[:, :520]  # row stride 528 halves: aligned, not contiguous
    x[:, layer.outlier_idx.long()] *= 30.0
    ref = _two_kernels(x, p)
    _check(x, p, ref, "strided rows", blocks=5)
    out = torch.empty(700, 1000, dtype=torch.float16, device="cuda")
    acts = quik.empty_activations(700, p, torch.device("cuda"))
    quik.quantize_gemm(x, p, out=out, acts=acts)  # counters allocated before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quik.quantize_gemm(x, p, out=out, acts=acts)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(synced(out), ref[0])


@needs_hopper
def test_fused_form_in_a_chain_of_dependent_launches(monkeypatch):
    """Layers chained through their outputs: each fused kernel quantizes what the kernel ahead wrote, as a
    programmatic dependent (eagerly and from a CUDA graph), and gives the bits of ordinary launches."""
    from qtool.layouts.quik import cuda as quik

    monkeypatch.setattr(quik, "FUSED_QUANTIZE", True)
    monkeypatch.setattr(quik, "WSQ_MIN_ROUNDS", 0)  # `linear` takes the fused form at these small shapes
    shapes = [(2048, 1024, 64), (1024, 2048, 128), (1536, 1024, 40), (1024, 1536, 96)] * 2
    ps = [quik.prepare(random_quik(n, k, ko, 4, bias=True)) for n, k, ko in shapes]
    x = torch.randn(700, 1024, device="cuda").half()
    assert all(
        quik.fused_quantize_reason(x if i == 0 else torch.empty(700, p.in_features, device="cuda").half(), p)
        is None
        for i, p in enumerate(ps)
    )
    assert_linear_chain_bits(ps, x)


@needs_hopper
def test_fused_form_refuses_in_one_line():
    from qtool.layouts.quik import cuda as quik

    p4 = quik.prepare(random_quik(256, 512, 64, 4))
    p8 = quik.prepare(random_quik(256, 512, 64, 8))
    x = torch.randn(300, 512, device="cuda").half()
    cases = [
        (lambda: quik.quantize_gemm(x, p8), "w8a8 (built for w4a4)"),
        (lambda: quik.quantize_gemm(x[:100], p4), "100 tokens"),
        (lambda: quik.quantize_gemm(x.float(), p4), "not 16-byte aligned float16"),
        (lambda: quik.quantize_gemm(x, p4, copy_warps=4), "copy_warps: found 4, expected 1..3"),
        (lambda: quik.quantize_gemm(x, p4, first_rows=301), "first_rows: found 301, expected 0..300"),
    ]
    for call, text in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert text in str(e.value) and "\n" not in str(e.value)
