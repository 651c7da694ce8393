"""Block-wise fine-tuning of quantization parameters: with one decoder block on the device, its quantized linears'
continuous parameters are trained (Adam) so that the block's output on the calibration inputs matches the float
block's, the integer codes staying as quantized. One block at a time, as the pipeline quantizes, so it fits
wherever quantizing fits.

A linear being tuned is swapped into the block's forward as a function of its parameters
(`torch.func.functional_call`), so the block's own modules and weights are never changed while tuning."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from qtool.calibration.capture import block_output


@dataclass
class TuneResult:
    error_before: float  # relative output error Σ‖y − y_float‖² / Σ‖y_float‖² over all calibration inputs
    error_after: float
    kept: bool  # False: tuning did not lower the error and the starting parameters were restored


def _relative_error(
    block: nn.Module,
    weights: dict[str, torch.Tensor],
    inputs: list[torch.Tensor],
    kwargs: dict,
    targets: list[torch.Tensor],
) -> float:
    num = den = 0.0
    with torch.no_grad():
        for x, t in zip(inputs, targets, strict=True):
            y = block_output(functional_call(block, weights, (x,), kwargs)).float()
            num += float((y - t.float()).pow(2).sum())
            den += float(t.float().pow(2).sum())
    return num / max(den, 1e-30)


def tune_block(
    block: nn.Module,
    weight_fns: dict[str, Callable[[], torch.Tensor]],
    params: list[nn.Parameter],
    inputs: list[torch.Tensor],
    kwargs: dict,
    targets: list[torch.Tensor],
    *,
    steps: int,
    lr: float,
    samples: int,
) -> TuneResult:
    """Train `params` for `steps` Adam steps on the mean squared error between the block's output, with each
    named weight (`"<linear>.weight"`) given by its function of `params`, and `targets` (the float block's
    outputs on `inputs`). Step t uses the calibration windows t·samples .. t·samples + samples - 1 (mod their
    number): no randomness, so a run is reproducible. If the final relative error is not below the starting one,
    `params` are restored."""
    frozen = [(p, p.requires_grad) for p in block.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    start = [p.detach().clone() for p in params]
    dtypes = {name: block.get_submodule(name.removesuffix(".weight")).weight.dtype for name in weight_fns}

    def weights() -> dict[str, torch.Tensor]:
        return {name: fn().to(dtypes[name]) for name, fn in weight_fns.items()}

    try:
        before = _relative_error(block, weights(), inputs, kwargs, targets)
        opt = torch.optim.Adam(params, lr=lr)
        n = len(inputs)
        with torch.enable_grad():
            for step in range(steps):
                opt.zero_grad(set_to_none=True)
                w = weights()
                for j in range(samples):
                    i = (step * samples + j) % n
                    y = block_output(functional_call(block, w, (inputs[i],), kwargs)).float()
                    t = targets[i].float()
                    # Normalized per window so that the loss scale (and Adam's first steps) is the same in every
                    # block, whatever the size of its hidden states.
                    loss = (y - t).pow(2).mean() / t.pow(2).mean().clamp_min(1e-30) / samples
                    loss.backward(retain_graph=j < samples - 1)
                opt.step()
        after = _relative_error(block, weights(), inputs, kwargs, targets)
        kept = after < before
        if not kept:
            with torch.no_grad():
                for p, s in zip(params, start, strict=True):
                    p.copy_(s)
        return TuneResult(before, after, kept)
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)
