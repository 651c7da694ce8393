"""The quik CUDA kernels against the torch reference (formats/quik.md), on fresh random inputs, real and odd
shapes: the activation codes and the int32 accumulators must be identical, the fused output within fp16 rounding.

Outputs are poisoned before each launch (NaN for float16, a sentinel for int32) so an unwritten element fails;
`synced` makes a faulting launch fail here rather than in a later test.
"""

from __future__ import annotations

import os

import pytest
import torch

from qtool.layouts.quik.layout import QuikWeight
from qtool.layouts.quik.module import QuikLinear
from tests.gpu.helpers import dependent_chain_runs, gpu_ready, rel_err, synced

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]

POISON = -0x5A5A5A5A


def _hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(
    gpu_ready() is None and not _hopper(), reason="quik kernels need Hopper (wgmma)"
)


@pytest.fixture(autouse=True)
def _fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch seed {seed}")
    return seed


def random_quik(
    n: int, k: int, ko: int, bits: int, *, bias: bool = False, sparse: bool = False
) -> QuikLinear:
    """Uniform random codes, random outlier columns and weights; scales keep outputs O(1)."""
    codes = torch.randint(0, 1 << bits, (n, k - ko))
    if sparse:  # zero two of every four base codes (signed zero = 2^(b-1))
        keep = torch.rand(n, (k - ko + 3) // 4 * 4).argsort(dim=1) % 4 < 2
        codes = torch.where(keep[:, : k - ko], codes, torch.full_like(codes, 1 << (bits - 1)))
    scales = (torch.rand(n) + 0.5) * (2.0 / ((1 << bits) * k**0.5))
    idx = torch.randperm(k)[:ko].to(torch.int32)
    wo = torch.randn(n, ko) * 0.05
    w = QuikWeight.from_codes(codes, scales, idx, wo, bits, bits, sparsity_24=sparse)
    b = (torch.randn(n) * 0.1).half() if bias else None
    return QuikLinear(w, b).cuda()


def _x(m: int, k: int, outlier_idx: torch.Tensor) -> torch.Tensor:
    x = torch.randn(m, k, device="cuda")
    x[:, outlier_idx.long()] *= 30.0  # outlier columns as the stage picks them: the large ones
    return x.half()


SHAPES = [  # (N, K, outliers): Llama-2-7B projections, then odd ones (N % 128 != 0, K - k % 128 != 0)
    (4096, 4096, 256),
    (11008, 4096, 256),
    (4096, 11008, 896),
    (100, 1000, 0),
    (72, 4000, 37),
    (17, 136, 8),
    (200, 520, 130),
    (130, 300, 300),
]


def _check_quantize(x: torch.Tensor, p, **kernel) -> None:
    """The kernel's codes, scales, zeros and outlier values equal the torch split + quantize, under two poisons
    (an unwritten byte differs from the reference in one of them)."""
    from qtool.layouts.quik import cuda as quik

    m = x.shape[0]
    ref = quik.quantize_torch(x, p)
    for poison in (0x5A, -0x5B):
        a = quik.empty_activations(m, p, x.device)
        a.codes.fill_(poison)
        a.outliers.fill_(float("nan"))
        a.scale.fill_(float("nan"))
        a.zero.fill_(float("nan"))
        quik.quantize(x, p, out=a, **kernel)
        synced(a.codes)
        assert torch.equal(a.codes, ref.codes), f"codes differ (poison {poison}, {kernel})"
        assert torch.equal(a.scale, ref.scale) and torch.equal(a.zero, ref.zero), kernel
        assert torch.equal(a.outliers, ref.outliers), kernel


@needs_hopper
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,ko", SHAPES)
@pytest.mark.parametrize("m", [1, 7, 128, 333])
@pytest.mark.parametrize("kernel", ["block", "warp"])
def test_quantize_kernel_codes_equal_reference(bits, n, k, ko, m, kernel):
    from qtool.layouts.quik import cuda as quik
    from qtool.layouts.quik.layout import quantize_activations

    if kernel == "warp" and k % 8:
        pytest.skip("the warp-per-row kernel takes whole 16-byte pieces (K % 8 == 0)")
    layer = random_quik(n, k, ko, bits)
    p = quik.prepare(layer)
    x = _x(m, k, layer.outlier_idx)
    _check_quantize(x, p, kernel=kernel)
    if kernel == "warp":  # also a lone warp per row (no named barrier) with a second row buffer
        _check_quantize(x, p, kernel=kernel, team=1, stages=2)
    if ko < k:
        ref = quik.quantize_torch(x, p)
        act = quantize_activations(x.float()[:, layer.base_idx], bits)
        assert torch.equal(ref.scale, act.scale) and torch.equal(ref.zero, act.zero)


@needs_hopper
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("team", [1, 2, 4])
@pytest.mark.parametrize("teams,blocks", [(1, 1), (2, 3), (3, 2)])
def test_quantize_warp_kernel_reuses_its_row_buffers(bits, stages, team, teams, blocks):
    """Few row teams over many rows: every team refills each of its buffers many times (the mbarrier parity
    flips), on shapes with and without holes in the last group of 32 code positions, and with no base column."""
    from qtool.layouts.quik import cuda as quik

    for n, k, ko in ((64, 4096, 256), (40, 1000, 37), (24, 512, 0), (16, 64, 64)):
        layer = random_quik(n, k, ko, bits)
        p = quik.prepare(layer)
        x = _x(97, k, layer.outlier_idx)
        _check_quantize(x, p, kernel="warp", stages=stages, team=team, teams=teams, blocks=blocks)


@needs_hopper
def test_quantize_warp_kernel_constant_rows_and_ties():
    """Rows whose base columns are all equal (scale 1, every code -2^(b-1)) and rows of small integers, whose
    quotients land on exact halves, so rounding ties to even must match the reference."""
    from qtool.layouts.quik import cuda as quik

    for bits in (4, 8):
        layer = random_quik(48, 2048, 64, bits)
        p = quik.prepare(layer)
        x = _x(300, 2048, layer.outlier_idx)
        x[:100, p.base_idx.long()] = 0.75
        x[100:200] = torch.randint(-3, 4, (100, 2048), device="cuda").half() * 0.5
        # scale exactly 1 (4 and 8 bits): every quotient of a half-integer column is a tie
        x[150, p.base_idx.long()[:2]] = torch.tensor([-1.5, 13.5], device="cuda").half()
        x[151, p.base_idx.long()[:2]] = torch.tensor([-1.5, 253.5], device="cuda").half()
        _check_quantize(x, p, kernel="warp")
        _check_quantize(x, p, kernel="block")


@needs_hopper
def test_quantize_kernel_strided_and_unaligned_rows():
    """Rows that are not 16-byte aligned (K % 8 != 0, or a strided view) take the element-wise loads."""
    from qtool.layouts.quik import cuda as quik

    for n, k, ko in ((64, 300, 20), (64, 4096, 256)):
        layer = random_quik(n, k, ko, 4)
        p = quik.prepare(layer)
        wide = _x(9, k + 3, layer.outlier_idx)
        x = wide[:, 1 : k + 1]  # row stride k + 3, first element 2 bytes past an alignment boundary
        a = quik.quantize(x, p)
        synced(a.codes)
        ref = quik.quantize_torch(x, p)
        assert torch.equal(a.codes, ref.codes) and torch.equal(a.outliers, ref.outliers)
        assert torch.equal(a.scale, ref.scale) and torch.equal(a.zero, ref.zero)


def _variants(bits: int, m: int = 1 << 30) -> list[tuple[int | None, str, int | None]]:
    """Every GEMM build for M tokens: each token tile, with each kernel (cp.async + block barrier, warp-specialized,
    and its persistent form, at each ring depth built), and the GEMV where M allows it: (tokens, kernel, stages)."""
    from qtool.layouts.quik import cuda as quik

    out: list[tuple[int | None, str, int | None]] = [(tn, "sync", None) for tn in sorted(quik.GEMM_TILES)]
    for kernel, tiles in (("ws", quik.WS_TILES), ("wsp", quik.WSP_TILES)):
        out += [(tn, kernel, st) for tn in sorted(tiles) for st in quik.ws_rings(kernel, bits, tn)]
    return out + ([(None, "gemv", None)] if m <= quik.GEMV_MAX_TOKENS else [])


def _wsp_rings(bits: int) -> list[tuple[int, int]]:
    """(tokens, ring stages) of every persistent GEMM build."""
    from qtool.layouts.quik import cuda as quik

    return [(tn, st) for tn in sorted(quik.WSP_TILES) for st in quik.ws_rings("wsp", bits, tn)]


def _acc_reference(layer: QuikLinear, x: torch.Tensor) -> torch.Tensor:
    acc, _ = layer.accumulate(x.float())
    return acc


@needs_hopper
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,ko", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 16, 200, 2048])
def test_gemm_integer_accumulators_exact(bits, n, k, ko, m):
    from qtool.layouts.quik import cuda as quik

    if m == 2048 and n * k > 4096 * 4096:
        m = 512  # keep the int64 reference product small; 2048 rows run on the 4096x4096 shape
    layer = random_quik(n, k, ko, bits)
    p = quik.prepare(layer)
    x = _x(m, k, layer.outlier_idx)
    a = quik.quantize(x, p)
    ref = _acc_reference(layer, x) if ko < k else torch.zeros(m, n, dtype=torch.int32, device="cuda")
    for tokens, kernel, stages in _variants(bits, m):
        out = torch.full((m, n), POISON, dtype=torch.int32, device="cuda")
        synced(quik.gemm(a, p, fused=False, out=out, tokens=tokens, kernel=kernel, stages=stages))
        bad = (out != ref).sum().item()
        assert bad == 0, (
            f"{bad} of {out.numel()} accumulators differ (M={m}, N={n}, K={k}, k={ko}, tile {tokens}, "
            f"{kernel}, ring {stages})"
        )


@needs_hopper
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,ko", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 33, 256, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_output_matches_reference(bits, n, k, ko, m, bias):
    layer = random_quik(n, k, ko, bits, bias=bias)
    x = _x(m, k, layer.outlier_idx)
    y = synced(layer(x))
    assert y.dtype == torch.float16 and y.shape == (m, n)
    assert layer.prepared is not None, "the CUDA path was not taken"
    assert bool(torch.isfinite(y).all()), (
        f"unwritten or non-finite outputs: {int((~torch.isfinite(y)).sum())}"
    )
    ref = layer.reference_forward(x.float()).double()
    err = rel_err(y, ref)
    assert err < 2e-3, f"relative error {err:.2e} (M={m}, N={n}, K={k}, k={ko}, w{bits}a{bits})"
    # Elementwise: within a few fp16 ulps of the float32 reference.
    tol = (4e-3 * ref.abs() + 1e-3 * float(ref.abs().max())).to(y.device)
    worst = float(((y.double() - ref.to(y.device)).abs() - tol).max())
    assert worst <= 0, f"element off by more than fp16 rounding (excess {worst:.3e})"


@needs_hopper
def test_fused_output_poisoned_buffer_fully_written():
    from qtool.layouts.quik import cuda as quik

    layer = random_quik(200, 520, 130, 4, bias=True)
    p = quik.prepare(layer)
    x = _x(77, 520, layer.outlier_idx)
    a = quik.quantize(x, p)
    ref = layer.reference_forward(x.float()).double()
    for tokens, kernel, stages in _variants(4):
        out = torch.full((77, 200), float("nan"), device="cuda", dtype=torch.float16)
        synced(quik.gemm(a, p, out=out, tokens=tokens, kernel=kernel, stages=stages))
        assert bool(torch.isfinite(out).all()), f"unwritten outputs (tile {tokens}, {kernel}, ring {stages})"
        err = rel_err(out, ref)
        assert err < 2e-3, f"relative error {err:.2e} (tile {tokens}, {kernel}, ring {stages})"


@needs_hopper
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("blocks", [1, 3, 7])
def test_persistent_gemm_walks_several_tiles_per_block(bits, blocks):
    """The persistent kernel with fewer blocks than tiles: every block runs several tiles through one ring
    (stage phases carry over between tiles), and the integer sums and fused outputs stay exact."""
    from qtool.layouts.quik import cuda as quik

    n, k, ko, m = 1000, 520, 130, 700  # 8 x 3 tiles of 128 x 256, 16 x 6 of 128 x 128
    layer = random_quik(n, k, ko, bits, bias=True)
    p = quik.prepare(layer)
    x = _x(m, k, layer.outlier_idx)
    a = quik.quantize(x, p)
    ref = _acc_reference(layer, x)
    fused_ref = synced(quik.gemm(a, p, tokens=256, kernel="ws"))
    for tn, st in _wsp_rings(bits):
        out = torch.full((m, n), POISON, dtype=torch.int32, device="cuda")
        synced(quik.gemm(a, p, fused=False, out=out, tokens=tn, kernel="wsp", blocks=blocks, stages=st))
        assert int((out != ref).sum()) == 0, f"accumulators differ (tile {tn}, ring {st}, {blocks} blocks)"
        y = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
        synced(quik.gemm(a, p, out=y, tokens=tn, kernel="wsp", blocks=blocks, stages=st))
        assert bool(torch.isfinite(y).all()), f"unwritten outputs (tile {tn}, ring {st}, {blocks} blocks)"
        assert rel_err(y, fused_ref.double()) < 1e-3


@needs_hopper
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "n,k,ko,m", [(4096, 4096, 256, 300), (200, 520, 130, 77), (72, 4000, 37, 1000), (1000, 520, 130, 700)]
)
def test_persistent_epilogue_stores_through_the_copy_engine_bit_for_bit(bits, n, k, ko, m, monkeypatch):
    """The persistent kernel's epilogue through bulk tensor stores (tiles clipped at M and N, its buffers reused
    in turn over several tiles per block, at every ring depth and so every buffer count) writes exactly the bits
    of its thread-store epilogue, and an output whose rows the copy engine cannot address takes the thread
    stores."""
    from qtool.layouts.quik import cuda as quik

    layer = random_quik(n, k, ko, bits, bias=True)
    p = quik.prepare(layer)
    x = _x(m, k, layer.outlier_idx)
    a = quik.quantize(x, p)
    for tn, st in _wsp_rings(bits):
        for blocks in (None, 3):
            outs = {}
            for tma_store in (True, False):
                monkeypatch.setattr(quik, "TMA_STORE", tma_store)
                y = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
                outs[tma_store] = synced(
                    quik.gemm(a, p, out=y, tokens=tn, kernel="wsp", blocks=blocks, stages=st)
                )
            where = f"tile {tn}, ring {st}, {blocks} blocks"
            assert bool(torch.isfinite(outs[True]).all()), f"unwritten outputs ({where})"
            assert torch.equal(outs[True], outs[False]), f"epilogues differ ({where})"
    monkeypatch.setattr(quik, "TMA_STORE", True)
    flat = torch.full((m * n + 1,), float("nan"), dtype=torch.float16, device="cuda")
    shifted = flat[1:].view(m, n)  # starts 2 bytes past an aligned address: no tensor map
    synced(quik.gemm(a, p, out=shifted, tokens=tn, kernel="wsp", blocks=3, stages=st))
    assert torch.equal(shifted, outs[True]) and bool(flat[0].isnan())


@needs_hopper
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,ko", SHAPES)
@pytest.mark.parametrize("m", [1, 16, 100])
def test_split_k_gemm_matches_reference_deterministic_counters_zero(bits, n, k, ko, m):
    """The block-synchronous GEMM split along K (the decode tiles): every split count, up to one stage per block
    (shares that end inside the integer stages, start in the outlier stages or straddle the switch), gives the
    reference's output within fp16 rounding, the same bits when launched again, every element written, and
    leaves the tile counters at zero."""
    from qtool.cuda import split_k
    from qtool.layouts.quik import cuda as quik

    layer = random_quik(n, k, ko, bits, bias=True)
    p = quik.prepare(layer)
    x = _x(m, k, layer.outlier_idx)
    a = quik.quantize(x, p)
    ref = layer.reference_forward(x.float()).double()
    tn = quik.gemm_tokens(m)
    steps = (p.kp // quik.KP_MULTIPLE if p.kb else 0) + p.kop // quik.KO_MULTIPLE
    tol = (4e-3 * ref.abs() + 1e-3 * float(ref.abs().max())).to("cuda")
    for split in sorted({None, 1, 2, 3, 7, steps}, key=lambda v: v or 0):
        if split is not None and split > steps:
            continue
        outs = []
        for _ in range(2):
            y = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
            outs.append(synced(quik.gemm(a, p, out=y, tokens=tn, kernel="sync", split=split)))
        assert bool(torch.isfinite(outs[0]).all()), f"unwritten outputs (split {split} of {steps} stages)"
        assert torch.equal(outs[0], outs[1]), f"split {split}: two launches differ"
        worst = float(((outs[0].double() - ref.to("cuda")).abs() - tol).max())
        assert worst <= 0, f"split {split} of {steps}: off by more than fp16 rounding (excess {worst:.3e})"
        cnt = split_k.counters(torch.cuda.current_device())
        assert cnt is None or int(cnt.abs().sum()) == 0, "tile counters not reset"


@needs_hopper
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,ko", SHAPES)
@pytest.mark.parametrize("m", [1, 2])
def test_gemv_is_the_decode_path_and_matches_the_gemm(bits, n, k, ko, m):
    """At 1-2 tokens the dispatch takes the CUDA-core GEMV; its fused output (poisoned before) equals the
    block-synchronous GEMM's within fp16 rounding, and more tokens are refused in one line."""
    from qtool.layouts.quik import cuda as quik

    layer = random_quik(n, k, ko, bits, bias=True)
    p = quik.prepare(layer)
    x = _x(m, k, layer.outlier_idx)
    a = quik.quantize(x, p)
    assert quik.gemm_kernel(m, a, p) == "gemv"
    y = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    synced(quik.gemm(a, p, out=y, kernel="gemv"))
    assert bool(torch.isfinite(y).all()), "unwritten outputs"
    ref = synced(quik.gemm(a, p, kernel="sync", split=1)).double()
    tol = 2e-3 * ref.abs() + 1e-3 * float(ref.abs().max())
    worst = float(((y.double() - ref).abs() - tol).max())
    assert worst <= 0, f"GEMV vs GEMM: excess {worst:.3e} (M={m}, N={n}, K={k}, k={ko}, w{bits})"
    if m == 2:
        a3 = quik.quantize(_x(3, k, layer.outlier_idx), p)
        with pytest.raises(ValueError, match="kernel gemv: found 3 tokens"):
            quik.gemm(a3, p, kernel="gemv")


@needs_hopper
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,ko", SHAPES)
def test_fused_gemm_kernels_agree(bits, n, k, ko):
    """Both GEMM kernels at every tile give the same fused output for one set of activations: the same integer
    sums, the same Eq. 1 arithmetic, outlier products that differ only in float32 summation order."""
    from qtool.layouts.quik import cuda as quik

    layer = random_quik(n, k, ko, bits, bias=True)
    p = quik.prepare(layer)
    x = _x(300, k, layer.outlier_idx)
    a = quik.quantize(x, p)
    outs = {}
    for tokens, kernel, stages in _variants(bits):
        out = torch.full((300, n), float("nan"), device="cuda", dtype=torch.float16)
        outs[(tokens, kernel, stages)] = synced(
            quik.gemm(a, p, out=out, tokens=tokens, kernel=kernel, stages=stages)
        )
    first = outs[(256, "sync", None)]
    assert bool(torch.isfinite(first).all())
    for key, y in outs.items():
        assert bool(torch.isfinite(y).all()), f"unwritten outputs ({key})"
        assert rel_err(y, first.double()) < 1e-3, f"{key} differs from (256, sync)"


@needs_hopper
@pytest.mark.parametrize("m", [1, 2, 5, 700])
def test_dependent_launches_give_the_bits_of_ordinary_launches(m):
    """Layers chained through their outputs, so each quantize kernel reads what the GEMM ahead of it wrote, and the
    buffers a call frees are reused by the next one at once. Launched as programmatic dependents (each kernel may
    start before the one ahead has finished), eagerly and replayed from a CUDA graph, the chain gives the bits of
    ordinary launches every time: a read or write placed before a kernel's wait, or a read of the kernel ahead's
    output through the non-coherent cache, would race and differ. M = 1, 2 run the GEMV, 5 the block-synchronous
    GEMM, 700 the persistent one; K = 1002 (rows not 16-byte aligned) the block quantize kernel."""
    from qtool.layouts.quik import cuda as quik

    # (N, K, outliers)
    shapes = [(2048, 1024, 64), (1024, 2048, 128), (1002, 1024, 0), (1536, 1002, 40), (1024, 1536, 96)] * 2
    ps = [quik.prepare(random_quik(n, k, ko, 4, bias=True)) for n, k, ko in shapes]
    assert_linear_chain_bits(ps, torch.randn(m, 1024, device="cuda").half())


def assert_linear_chain_bits(ps: list, x: torch.Tensor) -> None:
    """`quik.linear` through the layers `ps` in turn: dependent launches (eager and replayed) give the bits of
    ordinary ones, finite and not all zero."""
    from qtool.layouts.quik import cuda as quik

    def chain() -> torch.Tensor:
        y = x
        for p in ps:
            y = quik.linear(y, p)
        return y

    plain, outs = dependent_chain_runs(chain)
    assert bool(torch.isfinite(plain).all()) and float(plain.abs().amax()) > 0
    for y in outs:
        assert torch.equal(y, plain)


@needs_hopper
def test_24_sparse_layer_runs_on_the_kernel():
    layer = random_quik(256, 1024, 64, 4, sparse=True)
    x = _x(64, 1024, layer.outlier_idx)
    y = synced(layer(x))
    err = rel_err(y, layer.reference_forward(x.float()).double())
    assert err < 2e-3


@needs_hopper
def test_unsupported_widths_fall_back_or_fail_in_one_line(monkeypatch):
    from qtool.cuda.compile import CudaUnavailableError

    codes = torch.randint(0, 16, (64, 192))
    w = QuikWeight.from_codes(
        codes, torch.rand(64) + 0.1, torch.arange(64, dtype=torch.int32), torch.randn(64, 64), 4, 8
    )
    layer = QuikLinear(w).cuda()
    x = torch.randn(5, 256, device="cuda", dtype=torch.float16)
    y = layer(x)  # auto: the reference path
    assert layer.prepared is None
    assert torch.allclose(y.float(), layer.reference_forward(x.float()), atol=1e-2, rtol=1e-2)
    monkeypatch.setenv("QTOOL_KERNELS", "cuda")
    with pytest.raises(CudaUnavailableError, match="w4a8"):
        layer(x)
