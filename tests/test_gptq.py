"""GPTQ against a direct float64 implementation of the algorithm, and the quantizers' basic guarantees."""

from __future__ import annotations

import pytest
import torch

from qtool.quant.clip import clip_ratios, clipped_grid_params
from qtool.quant.gptq import gptq_quantize
from qtool.quant.grid import GridSpec, dequantize, grid_params, quantize
from qtool.quant.rtn import rtn_quantize


def reference_gptq(
    w: torch.Tensor, h: torch.Tensor, spec: GridSpec, damp: float, order: torch.Tensor | None, static: bool
) -> torch.Tensor:
    """Optimal Brain Quantization, one column at a time, in float64, with the inverse Hessian of the remaining
    columns updated by Gaussian elimination (no Cholesky, no lazy batches). Returns dequantized weights."""
    w = w.double().clone()
    h = h.double().clone()
    k = w.shape[1]
    g = spec.group_size or k
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    params = {}
    if static or spec.group_size is None:
        for j, s in enumerate(range(0, k, g)):
            params[j] = grid_params(w[:, s : s + g], spec)
    order = torch.arange(k) if order is None else order
    h = h + damp * torch.mean(torch.diagonal(h)) * torch.eye(k, dtype=torch.float64)
    hinv = torch.linalg.inv(h)
    done = torch.zeros(k, dtype=torch.bool)
    out = torch.zeros_like(w)
    for col in order.tolist():
        j = col // g
        if j not in params:  # dynamic group: range of the error-updated weights when the group starts
            params[j] = grid_params(w[:, j * g : min(j * g + g, k)], spec)
        s, z = params[j]
        q = dequantize(quantize(w[:, col : col + 1], s, z, spec), s, z)[:, 0]
        out[:, col] = q
        err = (w[:, col] - q) / hinv[col, col]
        done[col] = True
        rest = ~done
        w[:, rest] -= err[:, None] * hinv[col, rest][None, :]
        hinv = hinv - torch.outer(hinv[:, col], hinv[col, :]) / hinv[col, col]
    return out


def _problem(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g, dtype=torch.float64)
    x = torch.randn(4 * k, k, generator=g, dtype=torch.float64) @ (
        torch.randn(k, k, generator=g, dtype=torch.float64) * 0.3
    )
    x[:, 3] = 0  # a dead input channel
    return w, 2 * x.T @ x / x.shape[0]


def _dequant(codes, scales, zeros, spec, k):
    g = spec.group_size or k
    idx = torch.arange(k) // g
    return (codes.double() - zeros[:, idx]) * scales[:, idx]


@pytest.mark.parametrize(
    "n,k,spec,act_order,static,block",
    [
        (24, 64, GridSpec(4, True, None), False, False, 128),
        (17, 96, GridSpec(3, False, 32), False, False, 32),
        (16, 100, GridSpec(4, False, 32), False, False, 64),  # partial last group, lazy batches of 64
        (20, 72, GridSpec(2, False, 16), False, False, 128),
        (12, 80, GridSpec(4, True, 16), True, True, 32),  # act-order with static groups
        (10, 50, GridSpec(8, True, None), True, False, 16),  # act-order, per-channel
    ],
)
def test_gptq_matches_direct_float64_algorithm(n, k, spec, act_order, static, block):
    w, h = _problem(n, k, seed=n * k)
    codes, scales, zeros = gptq_quantize(
        w, h, spec, damp=0.01, block_size=block, act_order=act_order, static_groups=static
    )
    ours = _dequant(codes, scales, zeros, spec, k)
    order = None
    if act_order:
        hd = h.clone()
        hd[torch.diagonal(h) == 0, torch.diagonal(h) == 0] = 1
        order = torch.argsort(torch.diagonal(hd), descending=True)
    ref = reference_gptq(w, h, spec, 0.01, order, static)
    assert (ours == ref).double().mean() > 0.999  # identical codes, up to a rare rounding tie
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-9 + float(scales.max()) * 1.01 * 0.002)


def _output_error(w, q, h):
    e = (w - q).double()
    return float(torch.einsum("ni,ij,nj->", e, h.double(), e))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gptq_beats_rtn_on_layer_output_error(bits):
    w, h = _problem(32, 128, seed=bits)
    spec = GridSpec(bits, False, 32)
    gq = _dequant(*gptq_quantize(w, h, spec), spec, 128)
    rq = _dequant(*rtn_quantize(w, spec), spec, 128)
    assert _output_error(w, gq, h) < 0.8 * _output_error(w, rq, h)


def test_clipping_never_increases_the_weighted_error():
    w, h = _problem(16, 64, seed=7)
    spec = GridSpec(3, True, None)
    s1, z1 = grid_params(w, spec)
    s2, z2 = clipped_grid_params(w, spec, clip_ratios(20, 0.5), h)
    e1 = w - dequantize(quantize(w, s1, z1, spec), s1, z1)
    e2 = w - dequantize(quantize(w, s2, z2, spec), s2, z2)
    per_row = lambda e: torch.einsum("ni,ij,nj->n", e, h, e)  # noqa: E731
    assert bool((per_row(e2) <= per_row(e1) + 1e-9).all())
    assert float(per_row(e2).sum()) < float(per_row(e1).sum())


def test_asymmetric_grid_keeps_zero_representable():
    spec = GridSpec(4, False, None)
    w = torch.tensor([[0.5, 1.0, 2.0, 0.0]])
    s, z = grid_params(w, spec)
    assert float(dequantize(quantize(torch.zeros(1, 1), s, z, spec), s, z)) == 0.0


def test_linears_of_one_input_share_one_statistics_object_equal_to_their_own():
    """q/k/v (and gate/up) take the same input tensor: `_collect` accumulates its Hessian once and hands the
    linears one object, equal to what each linear's own accumulation gives; o_proj and down_proj keep theirs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qtool.calibration.capture import capture_block_inputs
    from qtool.calibration.stats import LinearStats
    from qtool.pipeline import _collect

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg).eval()
    windows = torch.randint(0, 64, (3, 16))
    inputs, kwargs = capture_block_inputs(model, model.model.layers, windows, torch.device("cpu"))
    kwargs = kwargs[0]
    block = model.model.layers[0]
    names = [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ]
    stats = _collect(block, names, inputs, kwargs, hessian=True)
    assert stats["self_attn.q_proj"] is stats["self_attn.k_proj"] is stats["self_attn.v_proj"]
    assert stats["mlp.gate_proj"] is stats["mlp.up_proj"]
    assert len({id(s) for s in stats.values()}) == 4
    own = {n: LinearStats(block.get_submodule(n).in_features, True) for n in names}
    handles = [
        block.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: own[n].update(a[0])) for n in names
    ]
    with torch.no_grad():
        for x in inputs:
            block(x, **kwargs)
    for h in handles:
        h.remove()
    for n in names:
        assert stats[n].tokens == own[n].tokens == 3 * 16
        assert torch.equal(stats[n].hessian(), own[n].hessian()), n
        assert torch.equal(stats[n].absmax, own[n].absmax) and torch.equal(stats[n].sq_sum, own[n].sq_sum), n
