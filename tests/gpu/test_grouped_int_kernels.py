"""Every grouped_int CUDA kernel against the float64 reference, on fresh random inputs, real and odd shapes.

Outputs are poisoned with NaN before each launch, so an element the kernel forgets to write fails the test;
`synced` makes a faulting launch fail here rather than in a later test.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu.helpers import dependent_chain_runs, gpu_ready, random_layer, reference64, rel_err, synced

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]


@pytest.fixture(autouse=True)
def _fresh_inputs():
    """New activations every run (torch's default generators start from a fixed seed); printed for replay."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch seed {seed}")


# fp16 weights (one rounding of the exact value), fp16 inputs, fp32 accumulation, fp16 output: ~5e-4 typical.
TOL = 3e-3

ODD_SHAPES = [(100, 1000), (72, 4000), (17, 136), (200, 520)]  # N % 64 != 0, K % 128 != 0 (partial groups)
REAL_SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (N, K) of Llama-2-7B projections


def _x(m: int, k: int) -> torch.Tensor:
    return torch.randn(m, k, device="cuda", dtype=torch.float16)


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


def _check_gemv(
    layer, m: int, seed: int, warps: int | None = None, with_bias: bool = False, kernel: str = "gemv"
) -> None:
    from qtool.layouts.grouped_int import cuda as grouped_int

    gemv = getattr(grouped_int, kernel)
    p = _prep(layer)
    x = _x(m, layer.in_features)
    out = torch.full((m, layer.out_features), float("nan"), device="cuda", dtype=torch.float16)
    bias = layer.bias if with_bias else None
    y = synced(gemv(x, p, bias, out=out, warps=warps))
    assert y.data_ptr() == out.data_ptr()
    assert bool(torch.isfinite(y).all()), (
        f"unwritten or non-finite outputs: {int((~torch.isfinite(y)).sum())}"
    )
    ref = reference64(layer, x)
    if not with_bias and layer.bias is not None:
        ref = ref - layer.bias.double().cpu()
    err = rel_err(y, ref)
    assert err < TOL, f"relative error {err:.2e} (seed {seed}, M={m}, warps={warps})"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, None])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("nk", ODD_SHAPES)
def test_gemv_odd_shapes(bits, group_size, symmetric, nk):
    n, k = nk
    seed = int.from_bytes(os.urandom(4), "little")
    layer = random_layer(n, k, bits, group_size, symmetric, seed=seed, bias=True)
    for m in (1, 2, 7, 8, 9, 16, 31, 64):
        _check_gemv(layer, m, seed, with_bias=(m % 2 == 1))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("nk", REAL_SHAPES)
def test_gemv_real_shapes(bits, symmetric, nk):
    n, k = nk
    seed = int.from_bytes(os.urandom(4), "little")
    layer = random_layer(n, k, bits, 128, symmetric, seed=seed)
    for m in (1, 16, 64):
        _check_gemv(layer, m, seed)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, None])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("nk", ODD_SHAPES)
def test_gemv_fma_odd_shapes(bits, group_size, symmetric, nk):
    n, k = nk
    seed = int.from_bytes(os.urandom(4), "little")
    layer = random_layer(n, k, bits, group_size, symmetric, seed=seed, bias=True)
    for m in (1, 2):
        _check_gemv(layer, m, seed, with_bias=(m == 1), kernel="gemv_fma")
    for warps in (1, 3, 8):
        _check_gemv(layer, 1, seed, warps=warps, kernel="gemv_fma")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("nk", REAL_SHAPES[1:])
def test_gemv_fma_real_shapes(bits, symmetric, nk):
    n, k = nk
    seed = int.from_bytes(os.urandom(4), "little")
    layer = random_layer(n, k, bits, 128, symmetric, seed=seed)
    for m in (1, 2):
        _check_gemv(layer, m, seed, kernel="gemv_fma")
    _check_gemv(layer, 1, seed, warps=1, kernel="gemv_fma")  # more pieces than threads: the looping path


@pytest.mark.parametrize("group_size", [32, 128, None])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("nk", [(72, 9000), (33, 12288), (4096, 11008)])
def test_gemv_fma_long_rows(group_size, symmetric, nk):
    """Rows longer than 128 pieces at one token: by default each thread of a 4-warp block walks several pieces."""
    from qtool.layouts.grouped_int import cuda as grouped_int

    n, k = nk
    kp = -(-k // 128) * 128
    assert grouped_int.fma_warps(4, 1, False, kp // 32) * 32 < kp // 32
    seed = int.from_bytes(os.urandom(4), "little")
    layer = random_layer(n, k, 4, group_size, symmetric, seed=seed, bias=True)
    _check_gemv(layer, 1, seed, with_bias=True, kernel="gemv_fma")
    for warps in (1, 5, 12):  # fewer threads than pieces: the looping path
        _check_gemv(layer, 1, seed, warps=warps, kernel="gemv_fma")


@pytest.mark.parametrize("bits", [4, 8])
def test_gemv_fma_large_activations(bits):
    """A few activations in the thousands (as real decoders have) stay finite and accurate."""
    from qtool.layouts.grouped_int.cuda import gemv_fma

    seed = int.from_bytes(os.urandom(4), "little")
    layer = random_layer(1024, 4096, bits, 128, False, seed=seed)
    x = _x(1, 4096)
    x[0, torch.randperm(4096, device="cuda")[:8]] = 3000.0
    y = synced(gemv_fma(x, _prep(layer)))
    assert bool(torch.isfinite(y).all())
    err = rel_err(y, reference64(layer, x))
    assert err < TOL, f"relative error {err:.2e} (seed {seed})"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128, None])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("nk", ODD_SHAPES + REAL_SHAPES[:2])
def test_gemv_dependent_entry_gives_the_bits_of_the_ordinary_one(bits, group_size, symmetric, nk):
    """The dependent-launch entry (weights loaded before the wait, coherent activation loads, 64 registers) against
    the ordinary one at the same split of K: the same bits, every output written (poisoned), and within the float64
    reference's tolerance."""
    from qtool.layouts.grouped_int.cuda import gemv

    n, k = nk
    seed = int.from_bytes(os.urandom(4), "little")
    layer = random_layer(n, k, bits, group_size, symmetric, seed=seed, bias=True)
    p = _prep(layer)
    w64 = layer.layout.dequantize(torch.float32).double().cpu()  # reference64's weight, made once
    for m in (1, 2, 7, 8, 9, 16):
        x = _x(m, k)
        ref = x.double().cpu() @ w64.T + layer.bias.double().cpu()
        for warps in (None, 16, 5):
            ys = []
            for dependent in (False, True):
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
                ys.append(synced(gemv(x, p, layer.bias, out=out, warps=warps, dependent=dependent)))
            assert bool(torch.isfinite(ys[1]).all()), f"unwritten outputs (seed {seed}, M={m}, warps={warps})"
            assert torch.equal(ys[0], ys[1]), f"seed {seed}, M={m}, warps={warps}"
            err = rel_err(ys[1], ref)
            assert err < TOL, f"relative error {err:.2e} (seed {seed}, M={m}, warps={warps})"
    with pytest.raises(ValueError, match="dependent: found 17 rows, expected at most 16"):
        gemv(_x(17, k), p, dependent=True)


@pytest.mark.parametrize("warps", [1, 2, 3, 4, 5, 8, 16])
def test_gemv_any_split_k(warps):
    seed = int.from_bytes(os.urandom(4), "little")
    layer = random_layer(136, 2944, 4, 64, False, seed=seed)
    for m in (1, 16):
        _check_gemv(layer, m, seed, warps=warps)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128, None])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("nk", ODD_SHAPES[:2] + REAL_SHAPES[:1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequant_is_bit_exact(bits, group_size, symmetric, nk, dtype):
    from qtool.layouts.grouped_int.cuda import dequantize

    n, k = nk
    layer = random_layer(n, k, bits, group_size, symmetric, seed=int.from_bytes(os.urandom(4), "little"))
    p = _prep(layer)
    out = torch.full((n, p.kp), float("nan"), device="cuda", dtype=dtype)
    w = synced(dequantize(p, dtype, out=out))
    assert bool(torch.isfinite(w).all()), "dequant left unwritten (NaN) elements, padding included"
    expect = layer.layout.dequantize(torch.float32).to(dtype)
    assert torch.equal(w[:, :k], expect), f"max diff {(w[:, :k].float() - expect.float()).abs().max().item()}"


@pytest.mark.parametrize("m", [1, 5, 16, 32, 33, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_module_forward_dispatch(m, dtype):
    from qtool.layouts.grouped_int.cuda import choose_path

    seed = int.from_bytes(os.urandom(4), "little")
    layer = random_layer(200, 1000, 4, 128, False, seed=seed, bias=True)
    x = torch.randn(1, m, 1000, device="cuda", dtype=dtype)
    y = synced(layer(x))
    assert y.shape == (1, m, 200) and y.dtype == dtype
    assert bool(torch.isfinite(y).all())
    ref = reference64(layer, x.reshape(m, 1000).float()).reshape(1, m, 200)
    tol = TOL if dtype == torch.float16 else 1.5e-2
    assert rel_err(y, ref) < tol, (
        f"path {choose_path(m, dtype, 4, 128, 1000, 200)} error {rel_err(y, ref):.2e}"
    )
    from qtool.cuda.compile import target_arch
    from qtool.layouts.grouped_int.cuda import GEMV_MAX_M, MMA_MAX_M, MMA_MIN_M

    hopper = target_arch() == "sm_90a"
    if dtype != torch.float16:
        expected = "dequant+cublas"
    elif m == 1:
        expected = "gemv-fma"
    elif hopper and MMA_MIN_M <= m <= MMA_MAX_M:
        expected = "mma"
    else:
        expected = "gemv" if m <= GEMV_MAX_M else "dequant+cublas"
    assert choose_path(m, dtype, 4, 128, 1000, 200) == expected


def test_unsupported_layout_falls_back_and_strict_mode_names_reference(monkeypatch):
    from qtool.cuda.compile import CudaUnavailableError

    layer = random_layer(64, 256, 3, 64, True, seed=1)
    x = torch.randn(2, 256, device="cuda", dtype=torch.float16)
    y = synced(layer(x))
    assert rel_err(y, reference64(layer, x)) < TOL
    monkeypatch.setenv("QTOOL_KERNELS", "cuda")
    with pytest.raises(CudaUnavailableError) as exc:
        layer(x)
    msg = str(exc.value)
    assert "\n" not in msg and "reference" in msg and "bits=3" in msg


def test_bad_inputs_name_the_tensor():
    from qtool.layouts.grouped_int.cuda import gemv

    layer = random_layer(64, 256, 4, 64, True, seed=2)
    p = _prep(layer)
    with pytest.raises(ValueError, match="^x: found torch.float32"):
        gemv(torch.randn(1, 256, device="cuda"), p)
    with pytest.raises(ValueError, match="^x: found last dim 255"):
        gemv(torch.randn(1, 255, device="cuda", dtype=torch.float16), p)
    with pytest.raises(ValueError, match="^warps: found 17"):
        gemv(torch.randn(1, 256, device="cuda", dtype=torch.float16), p, warps=17)
    with pytest.raises(ValueError, match="^warps: found 16"):
        gemv(torch.randn(64, 256, device="cuda", dtype=torch.float16), p, warps=16)
    with pytest.raises(ValueError, match="^out: found"):
        gemv(
            torch.randn(1, 256, device="cuda", dtype=torch.float16),
            p,
            out=torch.empty(2, 64, device="cuda", dtype=torch.float16),
        )


def test_kernel_cache_reuses_binary(tmp_path, monkeypatch):
    from qtool.cuda import compile as cc

    monkeypatch.setenv("QTOOL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cc, "_MODULES", {})
    first = cc.load_module("grouped_int/gemv.cu")
    assert first.info.arch == cc.target_arch()
    monkeypatch.setattr(cc, "_MODULES", {})
    second = cc.load_module("grouped_int/gemv.cu")
    if first.info.how == "nvrtc-cubin":
        assert not first.info.from_cache and second.info.from_cache
        assert list(tmp_path.glob("*.cubin")) and first.info.path == second.info.path


def test_kernel_cache_key_follows_headers(tmp_path, monkeypatch):
    """Editing a shared header (kernels/*.cuh) rebuilds every source instead of reusing a stale binary."""
    from qtool.cuda import compile as cc

    monkeypatch.setenv("QTOOL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cc, "_MODULES", {})
    first = cc.load_module("grouped_int/gemv.cu")
    edited = {name: text + "\n// edited\n" for name, text in cc._headers().items()}
    monkeypatch.setattr(cc, "_headers", lambda: edited)
    monkeypatch.setattr(cc, "_MODULES", {})
    second = cc.load_module("grouped_int/gemv.cu")
    assert second.info.key != first.info.key
    if second.info.how == "nvrtc-cubin":
        assert not second.info.from_cache and second.info.path != first.info.path


def test_launch_follows_torch_stream():
    from qtool.layouts.grouped_int.cuda import gemv

    layer = random_layer(256, 512, 4, 128, True, seed=3)
    p = _prep(layer)
    x = torch.randn(4, 512, device="cuda", dtype=torch.float16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(5_000_000)  # keeps the side stream busy: a launch on the default stream would race
        out = torch.full((4, 256), float("nan"), device="cuda", dtype=torch.float16)
        y = gemv(x, p, out=out)
    s.synchronize()
    torch.cuda.synchronize()
    assert rel_err(y, reference64(layer, x)) < TOL


@pytest.mark.parametrize(
    "kernels,m",
    [("gemv_fma", 1), ("gemv_fma", 2), ("gemv_fma,gemv", 1), ("gemv", 5), ("gemv", 16)],
)
def test_dependent_launches_give_the_bits_of_ordinary_launches(kernels, m):
    """Layers chained through their outputs (4- and 8-bit, so both the one-row-group and the persistent CUDA-core
    grids run; with `gemv` between, the tensor-core kernel runs dependent where its grid is one wave of 16-warp
    blocks and ordinary elsewhere; `gemv` alone: layers where it is always dependent), each kernel reading what the
    one ahead wrote while the buffers a call frees are reused by the next at once. Launched as programmatic
    dependents (each may start, and load its weights, before the one ahead has finished), eagerly and replayed
    from a CUDA graph, the chain gives the bits of ordinary launches every time: an activation read or output
    write placed before a kernel's wait, or an activation read through the non-coherent cache, would race and
    differ (the latter gave zeros at M = 1)."""
    from qtool.layouts.grouped_int import cuda as grouped_int

    # (N, K, bits); K a multiple of 128, so no padding copy runs between the kernels
    shapes = [(2048, 1024, 4), (1024, 2048, 8), (1536, 1024, 4), (1024, 1536, 8)] * 2
    if (
        kernels == "gemv"
    ):  # layers whose tensor-core grid is one wave of 16-warp blocks: all dependent launches
        shapes = [(2048, 1024, 8), (1024, 2048, 4)] * 4
    seed = int.from_bytes(os.urandom(4), "little")
    ps = [
        _prep(random_layer(n, k, bits, 128, False, seed=seed + i, bias=True))
        for i, (n, k, bits) in enumerate(shapes)
    ]
    if kernels == "gemv":
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        nt = grouped_int._n_tiles(m)
        assert all(
            grouped_int.gemv_dependent(
                nt,
                grouped_int.gemv_warps(p.out_features, nt, p.kp, p.bits, sms),
                (p.out_features + 15) // 16,
                sms,
            )
            for p in ps
        )
    ops = [getattr(grouped_int, name) for name in kernels.split(",")]
    x = torch.randn(m, 1024, device="cuda", dtype=torch.float16)

    def chain() -> torch.Tensor:
        y = x
        for i, p in enumerate(ps):
            y = ops[i % len(ops)](y, p)
        return y

    plain, outs = dependent_chain_runs(chain)
    assert bool(torch.isfinite(plain).all()) and float(plain.abs().amax()) > 0, f"seed {seed}"
    for y in outs:
        assert torch.equal(y, plain), f"seed {seed}"
