"""The mixed-2-4-16 CUDA kernels (kernels/mixed/gemv.cu) against the float64 reference, on fresh random layers and
activations, real and odd shapes, both assignment rules, with and without outliers, M = 1..16 for the GEMV.

Outputs are poisoned with NaN before each launch, so an element the kernel forgets to write fails the test;
`synced` makes a faulting launch fail here rather than in a later test.
"""

from __future__ import annotations

import os

import pytest
import torch

from qtool.layouts.mixed.layout import MixedWeight
from qtool.layouts.mixed.module import MixedLinear
from tests.gpu.helpers import dependent_chain_runs, gpu_ready, rel_err, synced

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]

# fp16 activations, exact (q - z)/64 weights, fp16 product chains of 8, fp32 across groups, fp16 output.
TOL = 3e-3
# (N, K, g2): N not a multiple of the rows per block or of 16, g2 odd, K of 1, 5, 17, 65 and 300 64-channel blocks
ODD = [(17, 64, 17), (100, 320, 5), (200, 1088, 8), (72, 4160, 9), (40, 19200, 8)]
# block4 layers of these take the tiled GEMV (g2 a multiple of 4): N not a multiple of 8 (the 8-row blocks' last
# rows past N), K of 2, 65 and 300 blocks
ODD_TILED = [(12, 128, 4), (20, 4160, 4), (36, 19200, 12)]
REAL = [(4096, 4096, 16), (11008, 4096, 16), (4096, 11008, 16)]  # (N, K) of Llama-2-7B projections
MS = (1, 2, 3, 4, 5, 7, 8, 9, 12, 16)


@pytest.fixture(autouse=True)
def _fresh_inputs():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch seed {seed}")


def random_mixed(
    n: int, k: int, g2: int, assign: str, outlier_fraction: float, seed: int, bias: bool = False
) -> MixedLinear:
    """Uniform random codes, scale codes and zeros; second-order and 4-bit scales sized for O(1) outputs; outliers
    at random positions of the 2-bit stripes."""
    g = torch.Generator().manual_seed(seed)
    s = k // 16
    if assign == "block4":
        is4 = torch.zeros(s, dtype=torch.bool)
        is4[torch.arange(s // 4) * 4 + torch.randint(0, 4, (s // 4,), generator=g)] = True
    else:
        is4 = torch.rand(s, generator=g) < 0.3
        is4[0] = True  # a block of four 4-bit stripes and one of none, whatever the draw
        is4[1:4] = True
        is4[4:8] = False
    s4, s2 = int(is4.sum()), s - int(is4.sum())
    cols4 = is4.repeat_interleave(16)
    codes = torch.randint(0, 4, (n, k), generator=g)
    codes[:, cols4] = torch.randint(0, 16, (n, int(cols4.sum())), generator=g)
    scale_codes = torch.randint(0, 16, (n, s2), generator=g)
    zeros2 = torch.randint(0, 4, (n, s2), generator=g)
    s2nd = (torch.rand(n // g2, s2, generator=g) + 0.5) / (15 * k**0.5)
    u = torch.randint(0, 16, (n // g2, s2), generator=g)
    if s2:
        u[0, 0] = scale_codes[0, 0] = 15  # the largest scale, (c + u) = 30
    scales4 = (torch.rand(n, s4, generator=g) + 0.5) / (8 * k**0.5)
    zeros4 = torch.randint(0, 16, (n, s4), generator=g)
    cols2 = torch.nonzero(~cols4)[:, 0]
    nnz = int(outlier_fraction * n * k) if len(cols2) else 0
    flat = (
        torch.unique(torch.randint(0, n * len(cols2), (nnz,), generator=g))
        if nnz
        else torch.zeros(0, dtype=torch.long)
    )
    rows, cols = flat // len(cols2), cols2[flat % len(cols2)]
    vals = torch.randn(len(flat), generator=g) / k**0.5
    w = MixedWeight.from_codes(
        codes, is4, 16, g2, assign, scale_codes, zeros2, s2nd, u, scales4, zeros4, rows, cols, vals
    )
    b = (torch.randn(n, generator=g) * 0.1).half() if bias else None
    return MixedLinear(w, b).to("cuda")


_WEIGHTS: dict[int, torch.Tensor] = {}


def reference64(layer: MixedLinear, x: torch.Tensor, with_bias: bool) -> torch.Tensor:
    """y in float64 on the CPU from the exact weight (dense part plus outliers)."""
    if getattr(layer, "_w64_key", None) not in _WEIGHTS:
        _WEIGHTS.clear()  # one layer at a time: the real shapes' weights are 360 MB in float64
        layer._w64_key = id(layer)
        _WEIGHTS[id(layer)] = layer.dequantize(torch.float32).double()
    y = x.double().cpu() @ _WEIGHTS[layer._w64_key].T
    if with_bias and layer.bias is not None:
        y = y + layer.bias.double().cpu()
    return y


def _prep(layer):
    from qtool.layouts.mixed.cuda import prepare

    return prepare(layer, keep_checkpoint=True)  # both layouts: the direct GEMV and the dequantize kernel too


def mixed_layout(p) -> str:
    from qtool.layouts.mixed.cuda import gemv_layout

    return gemv_layout(p)


def _check(layer, p, m: int, seed: int, with_bias: bool = False, **kw) -> None:
    from qtool.layouts.mixed import cuda as mixed

    x = torch.randn(m, layer.in_features, device="cuda", dtype=torch.float16)
    out = torch.full((m, layer.out_features), float("nan"), device="cuda", dtype=torch.float16)
    y = synced(mixed.gemv(x, p, layer.bias if with_bias else None, out=out, **kw))
    assert y.data_ptr() == out.data_ptr()
    assert bool(torch.isfinite(y).all()), (
        f"unwritten or non-finite outputs: {int((~torch.isfinite(y)).sum())}"
    )
    err = rel_err(y, reference64(layer, x, with_bias))
    assert err < TOL, f"relative error {err:.2e} (seed {seed}, M={m}, {kw})"


@pytest.mark.parametrize("assign", ["block4", "global"])
@pytest.mark.parametrize("fraction", [0.0, 0.002, 0.02])
@pytest.mark.parametrize("nkg", ODD)
def test_gemv_odd_shapes(assign, fraction, nkg):
    n, k, g2 = nkg
    seed = int.from_bytes(os.urandom(4), "little")
    layer = random_mixed(n, k, g2, assign, fraction, seed, bias=True)
    p = _prep(layer)
    assert p.block4 == (assign == "block4")
    for m in MS:
        for outliers in ("fused", "spmv"):
            _check(layer, p, m, seed, with_bias=(m % 2 == 1), outliers=outliers)
    for warps in (1, 2, 8):  # several blocks per thread (K up to 300 of them)
        _check(layer, p, 1, seed, outliers="fused", warps=warps, layout="direct")
    assert (p.tiled is not None) == (assign == "block4" and g2 % 4 == 0)
    if p.tiled is not None:
        _check_tiled(layer, p, seed)


def _check_tiled(layer, p, seed: int) -> None:
    """The tiled GEMV at every token count, and at one token every warp count, both outlier modes."""
    for m in MS:
        _check(layer, p, m, seed, with_bias=(m % 2 == 1), outliers="fused", layout="tiled")
    for warps in (1, 2, 4, 8):
        for outliers in ("fused", "spmv"):
            _check(layer, p, 1, seed, with_bias=True, outliers=outliers, layout="tiled", warps=warps)


@pytest.mark.parametrize("fraction", [0.0, 0.002, 0.02])
@pytest.mark.parametrize("nkg", ODD_TILED)
def test_tiled_gemv_odd_shapes(fraction, nkg):
    n, k, g2 = nkg
    seed = int.from_bytes(os.urandom(4), "little")
    layer = random_mixed(n, k, g2, "block4", fraction, seed, bias=True)
    p = _prep(layer)
    assert p.tiled is not None
    for m in MS:
        _check(layer, p, m, seed, with_bias=(m % 2 == 1), outliers="spmv", layout="tiled")
    _check_tiled(layer, p, seed)


@pytest.mark.parametrize("nkg", REAL)
def test_gemv_real_shapes(nkg):
    n, k, g2 = nkg
    seed = int.from_bytes(os.urandom(4), "little")
    layer = random_mixed(n, k, g2, "block4", 0.002, seed)
    p = _prep(layer)
    for m in (1, 2, 4, 8, 16):
        for outliers in ("fused", "spmv"):
            _check(layer, p, m, seed, outliers=outliers)
    for warps in (1, 2, 4, 8):
        for outliers in ("fused", "spmv"):
            _check(layer, p, 1, seed, warps=warps, outliers=outliers, layout="direct")
    assert mixed_layout(p) == "tiled"
    _check_tiled(layer, p, seed)


def test_dequantize_matches_the_reference_cast_bit_for_bit():
    from qtool.layouts.mixed import cuda as mixed

    for assign in ("block4", "global"):
        layer = random_mixed(48, 1088, 16, assign, 0.01, 7)
        p = _prep(layer)
        dense = synced(mixed.dequantize(p, outliers=False)).cpu()
        assert torch.equal(dense, layer.cpu_layout().dense().half()), assign
        full = synced(mixed.dequantize(p)).double().cpu()
        err = rel_err(full, layer.dequantize(torch.float32).double())
        assert err < 1e-3, f"{assign}: {err:.2e}"


@pytest.mark.parametrize("m", [17, 64, 200])
def test_dequant_cublas_path(m):
    from qtool.layouts.mixed import cuda as mixed

    layer = random_mixed(264, 1024, 8, "global", 0.005, m, bias=True)
    p = _prep(layer)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.float16)
    y = synced(mixed.linear(x, p, layer.bias))
    assert mixed.choose_path(m, torch.float16, 16, 1024) == "dequant+cublas"
    assert rel_err(y, reference64(layer, x, True)) < TOL


def test_module_forward_takes_the_kernels_and_agrees_with_the_reference(monkeypatch):
    layer = random_mixed(256, 2048, 16, "block4", 0.002, 3, bias=True)
    x = torch.randn(2, 3, 2048, device="cuda", dtype=torch.float16)
    monkeypatch.setenv("QTOOL_KERNELS", "cuda")
    y = synced(layer(x))
    assert layer.prepared is not None
    ref = layer.reference_forward(x)
    assert y.shape == ref.shape == (2, 3, 256)
    assert rel_err(y, ref) < TOL
    assert rel_err(y.reshape(6, 256), reference64(layer, x.reshape(6, 2048), True)) < TOL
    # bf16 has no kernel: a one-line error under QTOOL_KERNELS=cuda, the reference under auto
    with pytest.raises(Exception, match="mixed-2-4-16 layer: dtype"):
        layer(x.bfloat16())
    monkeypatch.setenv("QTOOL_KERNELS", "auto")
    yb = layer(x.bfloat16())
    assert yb.dtype == torch.bfloat16 and rel_err(yb, ref) < 2e-2


def test_gemv_and_spmv_replayed_from_one_cuda_graph():
    from qtool.layouts.mixed import cuda as mixed

    layer = random_mixed(512, 1024, 16, "block4", 0.01, 11)
    p = _prep(layer)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.float16)
    out = torch.empty(1, 512, device="cuda", dtype=torch.float16)
    mixed.gemv(x, p, out=out, outliers="spmv")  # builds the module outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mixed.gemv(x, p, out=out, outliers="spmv")
    for _ in range(3):
        x.copy_(torch.randn(1, 1024, device="cuda", dtype=torch.float16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference64(layer, x, False)) < TOL


def test_dependent_launches_read_the_activations_the_kernel_ahead_wrote():
    from qtool.layouts.mixed import cuda as mixed

    layer = random_mixed(1024, 4096, 16, "block4", 0.002, 5)
    p = _prep(layer)
    x0 = torch.randn(4, 4096, device="cuda", dtype=torch.float16)
    buf = torch.empty_like(x0)

    def chain():
        torch.mul(x0, 2.0, out=buf)  # the kernel ahead writes the activations
        return torch.cat([mixed.gemv(buf, p, outliers="spmv"), mixed.gemv(buf, p, outliers="fused")])

    plain, outs = dependent_chain_runs(chain)
    for o in outs:
        assert torch.equal(o, plain)
    assert rel_err(mixed.gemv(buf, p), reference64(layer, buf, False)) < TOL


def test_bench_decoder_with_mixed_linears_gives_the_bits_of_ordinary_launches():
    """`qtool bench e2e --mixed`: the bench decoder on mixed-2-4-16 projections (tiled GEMV, fused outliers) gives the
    same bits eagerly with ordinary and dependent launches and replayed from a CUDA graph."""
    from qtool.bench import e2e
    from qtool.layouts.mixed import cuda as mixed

    seed = int.from_bytes(os.urandom(4), "little")
    dev = torch.device("cuda", torch.cuda.current_device())
    d = e2e.Dims(hidden=512, intermediate=1408, layers=2, heads=8, kv_heads=4, vocab=1000)
    gen = torch.Generator(device=dev).manual_seed(seed)
    model = e2e.Decoder(d, e2e.mixed_linear(dev, 0.002, gen), dev).eval()
    length = 16
    tables = model.rope_tables(length, dev)
    caches = [
        (
            torch.randn(1, d.kv_heads, length, d.head_dim, device=dev, generator=gen).half(),
            torch.randn(1, d.kv_heads, length, d.head_dim, device=dev, generator=gen).half(),
        )
        for _ in range(d.layers)
    ]
    x = torch.randn(1, 1, d.hidden, device=dev, generator=gen).half()
    pos = torch.tensor([9], device=dev)
    mask = (torch.arange(length, device=dev)[None, :] <= pos[:, None])[None, None]

    def chain() -> torch.Tensor:
        h, y = x, None
        for b, (kc, vc) in zip(model.blocks, caches, strict=True):
            h, y = b(h, y, tables, (kc, vc), pos, True, mask)
        return torch.cat([h.flatten(), y.flatten()])

    with torch.inference_mode():
        plain, outs = dependent_chain_runs(chain)
    assert all(mixed.gemv_layout(b.qkv.prepared) == "tiled" for b in model.blocks)
    assert bool(torch.isfinite(plain).all()) and float(plain.abs().amax()) > 0, f"seed {seed}"
    for i, y in enumerate(outs):
        assert torch.equal(y, plain), f"seed {seed}, run {i}: {int((y != plain).sum())} elements differ"


def _gemm_ready():
    from qtool.layouts.mixed import cuda as mixed

    return mixed.gemm_capable(torch.device("cuda"))


@pytest.mark.parametrize("fraction", [0.0, 0.002, 0.02])
@pytest.mark.parametrize("nkg", ODD_TILED + [(264, 1024, 8), (4096, 11008, 16)])
def test_gemm_matches_the_reference(fraction, nkg):
    """The tiled-stream GEMM (prefill): every token tile, split-K on and off, rows past N and tokens past the tile,
    bias, outliers in the epilogue or by the second kernel; outputs poisoned before each launch."""
    from qtool.layouts.mixed import cuda as mixed

    if not _gemm_ready():
        pytest.skip("the mixed-2-4-16 GEMM needs a Hopper GPU")
    n, k, g2 = nkg
    seed = int.from_bytes(os.urandom(4), "little")
    layer = random_mixed(n, k, g2, "block4", fraction, seed, bias=True)
    p = mixed.prepare(layer, keep_checkpoint=False)
    assert not p.has_checkpoint and mixed.gemm_reason(p) is None
    nblk = k // 64
    cases = [(17, None, None), (64, 64, 1), (130, 128, None), (200, 256, 1), (300, 128, min(3, nblk))]
    if n >= 4096:
        cases = [(128, None, None), (200, 128, 4)]
    for m, tokens, split in cases:
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        for bias, outliers in ((None, "fused"), (layer.bias, "fused"), (layer.bias, "spmv")):
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
            y = synced(mixed.gemm(x, p, bias, out=out, tokens=tokens, split=split, outliers=outliers))
            assert bool(torch.isfinite(y).all()), f"unwritten outputs (seed {seed}, M={m})"
            err = rel_err(y, reference64(layer, x, bias is not None))
            assert err < TOL, (
                f"relative error {err:.2e} (seed {seed}, M={m}, tokens {tokens}, split {split}, "
                f"outliers {outliers})"
            )
    from qtool.cuda import split_k

    cnt = split_k.counters(torch.cuda.current_device())
    assert cnt is None or int(cnt.abs().sum()) == 0


def test_module_keeps_only_the_tiled_streams_on_the_gpu(monkeypatch):
    """Where the GEMM runs, a tiled layer's first CUDA forward moves its checkpoint tensors to host memory; every
    path (GEMV, GEMM, the bf16 reference) still agrees with the reference, and the state dict is intact."""
    if not _gemm_ready():
        pytest.skip("the mixed-2-4-16 GEMM needs a Hopper GPU")
    layer = random_mixed(256, 2048, 16, "block4", 0.002, 21, bias=True)
    before = {k: v.cpu().clone() for k, v in layer.state_dict().items()}
    monkeypatch.setenv("QTOOL_KERNELS", "cuda")
    for m in (1, 3, 40, 130):
        x = torch.randn(m, 2048, device="cuda", dtype=torch.float16)
        y = synced(layer(x))
        assert rel_err(y, reference64(layer, x, True)) < TOL, m
    p = layer.prepared
    assert not p.has_checkpoint and p.tiled is not None
    assert all(not t.is_cuda for t in layer.buffers())
    assert all(torch.equal(v.cpu(), before[k]) for k, v in layer.state_dict().items())
    assert layer.prepared is p  # not rebuilt per call
    monkeypatch.setenv("QTOOL_KERNELS", "auto")
    x = torch.randn(2, 2048, device="cuda", dtype=torch.float16)
    assert rel_err(layer(x.bfloat16()).float(), reference64(layer, x, True)) < 2e-2
    layer.to("cuda")  # moves the tensors back; the next forward prepares (and moves them) again
    assert rel_err(synced(layer(x)), reference64(layer, x, True)) < TOL
    assert not layer.prepared.has_checkpoint


@pytest.mark.parametrize("fraction", [0.0, 0.002])
def test_gemv_swiglu_epilogue_gives_the_bits_of_gemv_then_swiglu(fraction):
    """The tiled GEMV with the SwiGLU epilogue (a row-interleaved gate/up layer) against the GEMV's projection
    followed by the SwiGLU kernel on the de-interleaved halves: the same bits."""
    from qtool.cuda.swiglu import swiglu
    from qtool.layouts.mixed import cuda as mixed

    seed = int.from_bytes(os.urandom(4), "little")
    n, k = 2 * 1408, 2048
    layer = random_mixed(n, k, 16, "block4", fraction, seed)
    p = _prep(layer)
    x = torch.randn(1, k, device="cuda", dtype=torch.float16)
    gu = mixed.gemv(x, p, outliers="fused").reshape(1, n // 4, 2, 2)
    plain = swiglu(torch.cat([gu[:, :, 0].reshape(1, n // 2), gu[:, :, 1].reshape(1, n // 2)], dim=-1))
    out = torch.full((1, n // 2), float("nan"), device="cuda", dtype=torch.float16)
    y = synced(mixed.gemv_swiglu(x, p, out=out))
    assert torch.equal(y, plain), f"seed {seed}: {int((y != plain).sum())} elements differ"
    ref = mixed.swiglu_interleaved(reference64(layer, x, False).half().cuda())
    assert rel_err(y, ref) < 1e-2
