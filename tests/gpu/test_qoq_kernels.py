"""The qoq CUDA kernels (qtool/layouts/qoq/cuda.py) against the layout's arithmetic (formats/qoq.md), on fresh random
inputs, real and odd shapes: the activation codes, scales and row sums and the int32 products must be identical,
the float16 output equal to the layout's float32 order and within one float16 rounding of float64.

The layers are built from the layout's field definitions (tests/gpu/helpers.py QoQFieldLayer), so these tests do not
depend on the quantizer. Outputs are poisoned
before each launch (NaN for float16, a sentinel for int32) so an unwritten element fails; `synced` makes a faulting
launch fail here rather than in a later test.
"""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch

from tests.gpu.helpers import QoQFieldLayer as FieldLayer
from tests.gpu.helpers import gpu_ready, synced

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]

POISON = -0x5A5A5A5A


def _hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(
    gpu_ready() is None and not _hopper(), reason="qoq kernels need Hopper (wgmma)"
)


@pytest.fixture(autouse=True)
def _fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch seed {seed}")
    return seed


def _x(m: int, k: int) -> torch.Tensor:
    x = torch.randn(m, k, device="cuda")
    x[:, torch.randperm(k)[: max(1, k // 64)]] *= 20.0  # a few large channels, as in real activations
    if m > 2:
        x[1] = 0.0  # amax = 0: unit scale, all-zero codes
        x[2, 1:] = 0.0  # one nonzero value: it takes the code ±127 exactly
    return x.half()


def _spec_y(acc: torch.Tensor, sx: torch.Tensor, layer: FieldLayer) -> torch.Tensor:
    """The layout's output order in float32: float32(acc) · (s_x · s0), + bias, then float16."""
    y = acc.to(torch.float32) * (sx[:, None] * layer.scales.float()[None, :])
    if layer.bias is not None:
        y = y + layer.bias.float()
    return y.half()


def _check_y(y: torch.Tensor, acc: torch.Tensor, sx: torch.Tensor, layer: FieldLayer) -> None:
    assert not torch.isnan(y).any(), "unwritten (NaN-poisoned) outputs"
    ref = _spec_y(acc, sx, layer)
    bad = (y != ref).sum().item()
    assert bad == 0, f"{bad} of {y.numel()} outputs differ from the layout's float32 order"
    y64 = acc.double() * (sx.double()[:, None] * layer.scales.double()[None, :])
    if layer.bias is not None:
        y64 = y64 + layer.bias.double()
    # one float16 rounding, half a float16 ulp at |y64| with slack, plus the float32 roundings before it (the
    # integer sum as a float, the scale product, the product, the bias add: each within 2^-24 of its operands'
    # size), which matter where the bias cancels most of the product (seen on 129 x 4096 x 11008: 0.71 ulp)
    ulp = torch.exp2(torch.floor(torch.log2(y64.abs().clamp_min(2.0**-14))) - 10)
    prod = (acc.double() * (sx.double()[:, None] * layer.scales.double()[None, :])).abs()
    f32 = 4 * 2.0**-24 * (prod + (layer.bias.double().abs() if layer.bias is not None else 0.0))
    assert bool(((y.double() - y64).abs() <= 0.75 * ulp + f32).all()), (
        "output off by more than one float16 rounding"
    )


def _acc_ref(codes: torch.Tensor, layer: FieldLayer) -> torch.Tensor:
    """Σ qx·Wint exactly: float64 products and sums of integers stay below 2^53."""
    return (codes.double() @ layer.wint.cuda().double().t()).round().to(torch.int32)


def _quantized(x: torch.Tensor, p):
    from qtool.layouts.qoq import cuda as qoq

    a = qoq.empty_activations(x.shape[0], p, x.device)
    a.codes.fill_(0x5A)
    a.scale.fill_(float("nan"))
    a.rowsum.fill_(POISON)
    qoq.quantize_activations(x, p, out=a)
    synced(a.codes)
    return a


def _check_products(
    launch, layer: FieldLayer, acc_ref: torch.Tensor, sx: torch.Tensor, raw: bool = True
) -> torch.Tensor:
    """`launch(out=, raw=)` (a GEMM or GEMV on fixed operands): the exact int32 products (unless `raw` is False),
    then the layout's float16 output, each into a poisoned buffer. Returns the float16 output."""
    m, n = acc_ref.shape
    if raw:
        out = torch.full((m, n), POISON, dtype=torch.int32, device="cuda")
        synced(launch(out=out, raw=True))
        assert torch.equal(out, acc_ref), f"int32 products differ in {(out != acc_ref).sum().item()} places"
    y = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    synced(launch(out=y, raw=False))
    _check_y(y, acc_ref, sx, layer)
    return y


def _check_gemm(
    a, p, layer: FieldLayer, acc_ref: torch.Tensor, sx: torch.Tensor, raw: bool = True, **kw
) -> None:
    """qoq.gemm with the dispatch overrides `kw`: _check_products."""
    from qtool.layouts.qoq import cuda as qoq

    _check_products(partial(qoq.gemm, a, p, **kw), layer, acc_ref, sx, raw)


SCHEMES = [(8, None), (4, None), (4, 32), (4, 64), (4, 128)]
SCHEME_IDS = ["w8", "w4pc", "w4g32", "w4g64", "w4g128"]


@needs_hopper
@pytest.mark.parametrize("k", [64, 100, 256, 576, 4096, 11008])
@pytest.mark.parametrize("m", [1, 7, 129, 2048])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_kernel_equals_reference(k, m, bits):
    from qtool.layouts.qoq import cuda as qoq

    layer = FieldLayer(8, k, bits, None, False).cuda() if bits == 4 or k % 8 == 0 else None
    if layer is None:
        pytest.skip("w8 layers have K % 8 == 0")
    p = qoq.prepare(layer)
    x = _x(m, k)
    for xin in (
        x,
        torch.cat([x, x[:, :1]], 1)[:, :k],
    ):  # contiguous, and rows with a stride not a multiple of 8
        a = _quantized(xin, p)
        codes, sx, rs = qoq.quantize_torch(xin)
        pos = p.dest.long()
        assert torch.equal(a.codes[:, pos], codes), "codes differ"
        rest = torch.ones(p.kp, dtype=torch.bool, device="cuda")
        rest[pos] = False
        assert not a.codes[:, rest].any(), "padding positions are not zero"
        assert torch.equal(a.scale, sx) and torch.equal(a.rowsum, rs)
        assert torch.equal(rs, codes.int().sum(1).int())


SMALL = [(64, 256), (200, 576), (72, 128), (136, 4096)]
LARGE = [(4096, 4096), (11008, 4096), (4096, 11008)]
CASES = [(n, k, m) for n, k in SMALL for m in (1, 7, 16, 64, 129, 512, 2048)] + [
    (n, k, m) for n, k in LARGE for m in (1, 16, 64, 129, 512, 2048)
]


@needs_hopper
@pytest.mark.parametrize("bits,group_size", SCHEMES, ids=SCHEME_IDS)
@pytest.mark.parametrize("n,k,m", CASES)
def test_gemm_exact(bits, group_size, n, k, m):
    from qtool.layouts.qoq import cuda as qoq

    if group_size and k % group_size:
        pytest.skip(f"K {k} is not a multiple of g {group_size}")
    layer = FieldLayer(n, k, bits, group_size, bias=m % 2 == 1).cuda()
    assert qoq.unsupported_reason(bits, group_size, k, n, torch.device("cuda")) is None
    p = qoq.prepare(layer)
    x = _x(m, k)
    a = _quantized(x, p)
    codes, sx, _ = qoq.quantize_torch(x)
    _check_gemm(a, p, layer, _acc_ref(codes, layer), sx)


@needs_hopper
@pytest.mark.parametrize("bits,group_size", SCHEMES[1:], ids=SCHEME_IDS[1:])
@pytest.mark.parametrize("tokens", [64, 128, 256])
@pytest.mark.parametrize("m", [1, 33, 300])
def test_gemm_tiles_and_splits(bits, group_size, tokens, m):
    """Every token tile on several tiles of tokens and weight rows, and split-K shares (exact integer sums)."""
    from qtool.layouts.qoq import cuda as qoq

    n, k = 328, 2048
    layer = FieldLayer(n, k, bits, group_size, bias=True).cuda()
    p = qoq.prepare(layer)
    x = _x(m, k)
    a = _quantized(x, p)
    codes, sx, _ = qoq.quantize_torch(x)
    acc_ref = _acc_ref(codes, layer)
    _check_gemm(a, p, layer, acc_ref, sx, tokens=tokens, kernel="sync")
    for split in (3, 16) if tokens <= 128 else ():
        _check_gemm(a, p, layer, acc_ref, sx, tokens=tokens, kernel="sync", split=split, raw=False)


@needs_hopper
@pytest.mark.parametrize("bits,group_size", SCHEMES, ids=SCHEME_IDS)
def test_module_forward(bits, group_size, monkeypatch):
    """module_forward on a 3-D input equals quantize + gemm; it declines CPU inputs and the reference mode."""
    from qtool.layouts.qoq import cuda as qoq

    n, k = 264, 1024
    layer = FieldLayer(n, k, bits, group_size, bias=True).cuda()
    x = _x(10, k).reshape(2, 5, k)
    y = qoq.module_forward(layer, x)
    synced(y)
    assert y is not None and y.shape == (2, 5, n) and y.dtype == torch.float16
    codes, sx, _ = qoq.quantize_torch(x.reshape(-1, k))
    _check_y(y.reshape(-1, n), _acc_ref(codes, layer), sx, layer)
    assert qoq.module_forward(layer, x.float()) is None  # the kernels read float16
    monkeypatch.setenv("QTOOL_KERNELS", "reference")
    assert qoq.module_forward(layer, x) is None
    monkeypatch.setenv("QTOOL_KERNELS", "cuda")
    with pytest.raises(Exception, match="qoq layer"):
        qoq.module_forward(layer, x.float())


WS_CASES = [
    ("sync", 64),
    ("sync", 128),
    ("ws", 16),
    ("ws", 32),
    ("ws", 64),
    ("ws", 128),
    ("ws", 256),
    ("wsp", 128),
    ("wsp", 256),
]


@needs_hopper
@pytest.mark.parametrize("bits,group_size", SCHEMES[1:], ids=SCHEME_IDS[1:])
@pytest.mark.parametrize("kernel,tokens", WS_CASES, ids=[f"{k}{t}" for k, t in WS_CASES])
@pytest.mark.parametrize("n,k,m", [(328, 2048, 1), (328, 2048, 300), (200, 576, 700), (136, 4096, 129)])
def test_gemm_forms_exact(bits, group_size, kernel, tokens, n, k, m):
    """Every 4-bit form (block-synchronous, warp-specialized, persistent) gives the exact int32 products and the
    layout's float16 output; the persistent one also with fewer blocks than tiles (each block walks several)."""
    from qtool.layouts.qoq import cuda as qoq

    if group_size and k % group_size:
        pytest.skip(f"K {k} is not a multiple of g {group_size}")
    layer = FieldLayer(n, k, bits, group_size, bias=True).cuda()
    p = qoq.prepare(layer)
    x = _x(m, k)
    a = _quantized(x, p)
    codes, sx, _ = qoq.quantize_torch(x)
    acc_ref = _acc_ref(codes, layer)
    for blocks in (None, 2) if kernel == "wsp" else (None,):
        _check_gemm(a, p, layer, acc_ref, sx, tokens=tokens, kernel=kernel, blocks=blocks)


WS_SPLITS = [(16, 4, 0), (32, 3, 2), (64, 2, 0), (64, 16, 0), (128, 3, 1), (256, 4, 0), (64, 3, 5)]


@needs_hopper
@pytest.mark.parametrize("bits,group_size", SCHEMES[1:], ids=SCHEME_IDS[1:])
@pytest.mark.parametrize("tokens,split,whole", WS_SPLITS, ids=[f"ws{t}x{s}+{w}" for t, s, w in WS_SPLITS])
@pytest.mark.parametrize("n,k,m", [(328, 2048, 1), (328, 2048, 300), (200, 576, 33), (136, 128, 70)])
def test_gemm_ws_split_exact(bits, group_size, tokens, split, whole, n, k, m):
    """The warp-specialized form with K split over blocks per tile, all tiles or those after the first `whole`
    (more than the layer has: none split): exact int32 sums and the layout's float16 output on odd shapes, uneven
    shares (16 stages in 3), more blocks than the layer has stages (K = 128: one stage, so all but one share are
    empty), twice in a row: the tile counters are back at zero after each."""
    from qtool.cuda import split_k
    from qtool.layouts.qoq import cuda as qoq

    if group_size and k % group_size:
        pytest.skip(f"K {k} is not a multiple of g {group_size}")
    layer = FieldLayer(n, k, bits, group_size, bias=True).cuda()
    p = qoq.prepare(layer)
    x = _x(m, k)
    a = _quantized(x, p)
    codes, sx, _ = qoq.quantize_torch(x)
    acc_ref = _acc_ref(codes, layer)
    for _ in range(2):
        _check_gemm(a, p, layer, acc_ref, sx, tokens=tokens, kernel="ws", split=split, whole=whole)
        assert not split_k.counters(torch.cuda.current_device()).any(), "a tile counter was left non-zero"


@needs_hopper
def test_gemm_split_arguments():
    from qtool.layouts.qoq import cuda as qoq

    layer = FieldLayer(136, 256, 4, None, False).cuda()
    p = qoq.prepare(layer)
    a = _quantized(_x(3, 256), p)
    with pytest.raises(ValueError, match="split: found 17"):
        qoq.gemm(a, p, kernel="ws", tokens=64, split=17)
    with pytest.raises(ValueError, match="kernel wsp"):
        qoq.gemm(a, p, kernel="wsp", split=2)
    with pytest.raises(ValueError, match="tokens: found 16 for kernel sync"):
        qoq.gemm(a, p, kernel="sync", tokens=16)
    with pytest.raises(ValueError, match="tokens: found 16 for kernel wsp"):
        qoq.gemm(a, p, kernel="wsp", tokens=16)
    with pytest.raises(ValueError, match="tokens: found 48"):
        qoq.gemm(a, p, kernel="ws", tokens=48)


GEMV_SHAPES = [(64, 256), (200, 576), (72, 128), (13, 136), (4096, 4096), (11008, 4096), (4096, 11008)]


def _gemv_cases(test):
    """The decode GEMV's cases, for both of its forms: the 4-bit schemes, real and odd shapes, 1 to 4 tokens."""
    for mark in (
        pytest.mark.parametrize("m", [1, 2, 3, 4]),
        pytest.mark.parametrize("n,k", GEMV_SHAPES),
        pytest.mark.parametrize("bits,group_size", SCHEMES[1:], ids=SCHEME_IDS[1:]),
        needs_hopper,
    ):
        test = mark(test)
    return test


def _gemv_layer(bits: int, group_size: int | None, n: int, k: int, bias: bool):
    """A random field layer and its prepared operands (skips schemes whose group size does not divide K)."""
    from qtool.layouts.qoq import cuda as qoq

    if group_size and k % group_size:
        pytest.skip(f"K {k} is not a multiple of g {group_size}")
    layer = FieldLayer(n, k, bits, group_size, bias=bias).cuda()
    return layer, qoq.prepare(layer)


@_gemv_cases
def test_gemv_fused_quantization_exact(bits, group_size, n, k, m):
    """The decode GEMV quantizes its own rows: its int32 products and float16 outputs equal those of the quantize
    kernel + the layout's arithmetic, on contiguous rows and on rows with a longer stride."""
    from qtool.layouts.qoq import cuda as qoq

    layer, p = _gemv_layer(bits, group_size, n, k, bias=m % 2 == 1)
    base = _x(m, k + 24)
    for x in (base[:, :k].contiguous(), base[:, :k]):
        assert qoq.gemv_reason(x, p) is None
        codes, sx, _ = qoq.quantize_torch(x)
        _check_products(partial(qoq.gemv, x, p), layer, _acc_ref(codes, layer), sx)


def _torch_codes(x: torch.Tensor, p, pad: int = 0):
    """QoQActivations from the layout's torch arithmetic (codes at the layer's positions, zero padding), in rows of
    p.kp + pad bytes (pad > 0: a row stride longer than the row)."""
    from qtool.layouts.qoq import cuda as qoq

    q, sx, rs = qoq.quantize_torch(x)
    buf = torch.zeros(x.shape[0], p.kp + pad, dtype=torch.int8, device="cuda")
    buf[:, p.dest.long()] = q
    return qoq.QoQActivations(codes=buf[:, : p.kp], scale=sx, rowsum=rs), q


@_gemv_cases
def test_gemv_codes_exact(bits, group_size, n, k, m):
    """The decode GEMV on codes made beforehand (what gemm() dispatches at decode sizes): int32 products and float16
    outputs equal to the layout's arithmetic, on contiguous code rows and rows with a longer stride; gemm() gives
    the same float16 output whichever form it picks."""
    from qtool.layouts.qoq import cuda as qoq

    layer, p = _gemv_layer(bits, group_size, n, k, bias=m % 2 == 0)
    x = _x(m, k)
    for pad in (0, 48):
        a, codes = _torch_codes(x, p, pad)
        assert qoq.gemv_codes_reason(a, p) is None
        y = _check_products(partial(qoq.gemv_codes, a, p), layer, _acc_ref(codes, layer), a.scale)
        y2 = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
        synced(qoq.gemm(a, p, out=y2))
        assert torch.equal(y2, y)


@needs_hopper
def test_gemv_codes_declines_what_it_cannot_take():
    """Code rows whose stride is not a whole number of 16-byte pieces are refused (no launch); more than 4 tokens
    go to the GEMM."""
    from qtool.layouts.qoq import cuda as qoq

    layer = FieldLayer(64, 256, 4, 128, bias=True).cuda()
    p = qoq.prepare(layer)
    a, _ = _torch_codes(_x(2, 256), p, pad=8)
    assert "16-byte" in qoq.gemv_codes_reason(a, p)
    with pytest.raises(ValueError, match="qoq gemv"):
        qoq.gemv_codes(a, p)
    a5, codes = _torch_codes(_x(5, 256), p)
    assert "tokens" in qoq.gemv_codes_reason(a5, p)
    raw = torch.full((5, 64), POISON, dtype=torch.int32, device="cuda")
    synced(qoq.gemm(a5, p, out=raw, raw=True))  # the block-synchronous GEMM
    assert torch.equal(raw, _acc_ref(codes, layer))


@needs_hopper
def test_gemv_declines_what_it_cannot_take():
    from qtool.layouts.qoq import cuda as qoq

    layer = FieldLayer(64, 100, 4, None, False).cuda()
    p = qoq.prepare(layer)
    assert "16-byte" in qoq.gemv_reason(_x(1, 100), p)
    layer = FieldLayer(64, 256, 4, None, False).cuda()
    p = qoq.prepare(layer)
    assert "tokens" in qoq.gemv_reason(_x(5, 256), p)
    y = qoq.linear(
        _x(1, 100), qoq.prepare(FieldLayer(64, 100, 4, None, False).cuda())
    )  # falls back to the GEMM
    synced(y)
    assert y.shape == (1, 64)


@needs_hopper
@pytest.mark.parametrize(
    "kernel,tokens,split",
    [("ws", 16, 2), ("ws", 32, None), ("ws", 64, None), ("ws", 64, 3), ("ws", 128, None), ("wsp", 128, None)],
)
@pytest.mark.parametrize("m", [1, 16, 33, 65])
def test_gemm_ignores_the_padding_rows_of_its_activations(kernel, tokens, split, m):
    """The activation code rows are allocated on to a multiple of 64 and the warp-specialized GEMMs map those rows
    too (boxes inside the tensor): whatever the rows past M hold, the products and outputs are those of the M
    tokens, and nothing is written past them."""
    from qtool.layouts.qoq import cuda as qoq

    n, k = 328, 2048
    layer = FieldLayer(n, k, 4, 128, bias=True).cuda()
    p = qoq.prepare(layer)
    x = _x(m, k)
    a = _quantized(x, p)
    rows = a.codes.untyped_storage().nbytes() // p.kp
    assert rows % qoq.ACT_ROW_PAD == 0 and rows >= m
    pad = torch.as_strided(a.codes, (rows, p.kp), a.codes.stride())
    for fill in (127, -128):
        pad[m:] = fill
        codes, sx, _ = qoq.quantize_torch(x)
        acc_ref = _acc_ref(codes, layer)
        _check_gemm(a, p, layer, acc_ref, sx, tokens=tokens, kernel=kernel, split=split)
        out = torch.full((m + 8, n), float("nan"), dtype=torch.float16, device="cuda")
        synced(qoq.gemm(a, p, out=out[:m], tokens=tokens, kernel=kernel, split=split))
        assert torch.isnan(out[m:]).all(), "a GEMM wrote past its M output rows"
