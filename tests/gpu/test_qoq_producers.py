"""The kernels that produce a W4A8 layer's input also write its INT8 activation codes (kernels/qoq/act.cuh, used by
add_rms_norm_q8 and swiglu_q8): codes, s_x and code sums must equal those of the float16 kernel followed by the
quantize kernel, bit for bit, and the float16 rows, where asked for, those of the float16 kernel, for 4-bit layers
(the codes in the 4-bit order) and 8-bit ones (column order), with the SwiGLU row over every cluster size and
without the cluster it was launched for. Outputs are poisoned before each launch; `synced` makes a faulting launch
fail here."""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu.helpers import QoQFieldLayer, gpu_ready, synced

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]


@pytest.fixture(autouse=True)
def _fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch seed {seed}")


def _poisoned(rows: int, p):
    from qtool.layouts.qoq import cuda as qoq

    a = qoq.empty_activations(rows, p, torch.device("cuda"))
    a.codes.fill_(0x5A)
    a.scale.fill_(float("nan"))
    a.rowsum.fill_(-0x5A5A5A5A)
    return a


def _same(a, b) -> None:
    assert torch.equal(a.codes, b.codes), f"codes differ in {(a.codes != b.codes).sum().item()} places"
    assert torch.equal(a.scale, b.scale) and torch.equal(a.rowsum, b.rowsum)


# 12296: rows past the 8192 columns a thread's registers hold (pieces staged in shared memory), and K % 32 != 0
@pytest.mark.parametrize("d", [136, 576, 4096, 8192, 12296])
@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_rms_norm_codes_equal_norm_then_quantize(d, rows, residual, bits):
    from qtool.cuda.rms_norm import add_rms_norm
    from qtool.layouts.qoq import cuda as qoq
    from qtool.layouts.qoq.producers import add_rms_norm_codes

    p = qoq.prepare(QoQFieldLayer(64, d, bits, None, False).cuda())
    h = (torch.randn(rows, d, device="cuda") * 3).half()
    y = torch.randn(rows, d, device="cuda").half() if residual else None
    if rows > 2:
        h[1] = 0.0  # an all-zero row (no residual): unit scale, zero codes
    w = (torch.rand(d, device="cuda") + 0.5).half()
    hs_ref, x_ref = add_rms_norm(h, y, w, 1e-5)
    ref = qoq.quantize_activations(x_ref, p)
    for with_rows in (False, True):
        a = _poisoned(rows, p)
        hs, x, a = add_rms_norm_codes(h, y, w, 1e-5, p, with_rows=with_rows, a=a)
        synced(a.codes)
        _same(a, ref)
        assert torch.equal(hs, hs_ref)
        assert (x is None) != with_rows and (x is None or torch.equal(x, x_ref))


def _swiglu_codes_equal_swiglu_then_quantize(
    i: int, rows: int, bits: int = 4, cluster: int | None = None
) -> None:
    from qtool.cuda.swiglu import swiglu
    from qtool.layouts.qoq import cuda as qoq
    from qtool.layouts.qoq.producers import swiglu_codes

    p = qoq.prepare(QoQFieldLayer(64, i, bits, None, False).cuda())
    gu = (torch.randn(rows, 2 * i, device="cuda") * 2).half()
    if rows > 2:
        gu[1, :i] = 0.0  # an all-zero row: unit scale, zero codes
    x_ref = swiglu(gu)
    ref = qoq.quantize_activations(x_ref, p)
    for with_rows in (False, True):
        a = _poisoned(rows, p)
        x, a = swiglu_codes(gu, p, with_rows=with_rows, a=a, cluster=cluster)
        synced(a.codes)
        _same(a, ref)
        assert (x is None) != with_rows and (x is None or torch.equal(x, x_ref))


@pytest.mark.parametrize("i", [136, 576, 11008, 14336])
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("bits", [4, 8])
def test_swiglu_codes_equal_swiglu_then_quantize(i, rows, bits):
    _swiglu_codes_equal_swiglu_then_quantize(i, rows, bits)


@pytest.mark.parametrize("i", [136, 11008])
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("cluster", [1, 2, 4, 8])
def test_swiglu_codes_over_every_cluster_size(i, rows, cluster):
    """A row over 1-8 blocks, whatever the host would pick: at i = 136 (17 pieces in 8 units of 32 columns) the
    blocks past the first take only zero padding or nothing of the row."""
    _swiglu_codes_equal_swiglu_then_quantize(i, rows, cluster=cluster)


@pytest.mark.parametrize("i", [136, 11008])
@pytest.mark.parametrize("cluster", [2, 8])
def test_swiglu_codes_without_the_cluster(monkeypatch, i, cluster):
    """The driver refusing clusters: the launch runs without one, on the same grid of `cluster` blocks a row, and
    each row's first block takes the whole row."""
    from qtool.cuda import dependent_launch

    monkeypatch.setitem(dependent_launch._STATE, "cluster_max", 1)
    _swiglu_codes_equal_swiglu_then_quantize(i, 16, cluster=cluster)


def test_producers_refuse_a_layer_of_another_width_and_a_cluster_size_they_lack():
    from qtool.layouts.qoq import cuda as qoq
    from qtool.layouts.qoq.producers import add_rms_norm_codes, swiglu_codes

    p = qoq.prepare(QoQFieldLayer(64, 256, 4, None, False).cuda())
    x = torch.zeros(2, 512, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="layer's input"):
        add_rms_norm_codes(x, None, torch.ones(512, dtype=torch.float16, device="cuda"), 1e-5, p)
    with pytest.raises(ValueError, match="layer's input"):
        swiglu_codes(torch.zeros(2, 1024, dtype=torch.float16, device="cuda"), p)
    with pytest.raises(ValueError, match="found cluster 3"):
        swiglu_codes(torch.zeros(2, 512, dtype=torch.float16, device="cuda"), p, cluster=3)


@pytest.mark.parametrize("batch", [8, 2])
def test_bench_decoder_same_tokens_with_codes_from_the_producers(monkeypatch, batch):
    """The W4A8KV4 decoder gives the same tokens whether its projections' codes come from the normalization and
    SwiGLU kernels or are quantized from float16 rows (prefill of batch x 20 tokens, then decode steps of `batch`
    rows: 8 run the GEMM, 2 the decode GEMV on the producers' codes against the GEMV that quantizes itself)."""
    from qtool.bench import e2e
    from qtool.bench.throughput import _caches, make_linear

    d = e2e.dims_for("tiny")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(5)
    model = e2e.Decoder(d, make_linear("w4a8kv4", dev, None, gen), dev).eval()
    tables = model.rope_tables(40, dev)
    ids = torch.randint(0, d.vocab, (batch, 20), device=dev, generator=gen)
    out = {}
    with torch.inference_mode():
        for fused in (True, False):
            monkeypatch.setattr(e2e, "FUSED_QUANT", fused)
            cache = _caches("w4a8kv4", model, batch, 32, dev)
            tok = model(ids, torch.arange(20, device=dev), cache, tables, decode=False)
            toks = [tok]
            for p in range(20, 24):
                tok = model(tok[:, None], torch.tensor([p], device=dev), cache, tables, decode=True)
                toks.append(tok)
            out[fused] = torch.stack(toks)
    assert torch.equal(out[True], out[False])
