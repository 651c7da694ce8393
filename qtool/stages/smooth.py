"""Stage `smooth` (QoQ §4.3.2, block-output smoothing): the inputs of a block's output modules (o_proj, down_proj)
have channels far larger than the rest. Dividing input channel k by λ_k and multiplying the weight column by λ_k
leaves the product unchanged; the division is folded into the linear that produces the channel (v_proj's output
row for o_proj, shared by the query heads of one KV head under GQA; up_proj's row for down_proj, since
SiLU(gate)·up is linear in up; fc1's row and bias through OPT's ReLU), so nothing runs at inference time.

λ_k = max|X_k|^α / max|W_k|^(1-α). The paper finds the best α near 0 (λ set by the weights) and gives no grid;
this stage searches `alpha_grid` for each output module of each block, minimising the output error of the module
when its weight is rounded to nearest under the quantizer that claims it and its input goes through that
quantizer's activation quantization, on the block's calibration tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtool.errors import RecipeError, shown
from qtool.options import option
from qtool.stages.base import BlockContext, QuantizerStage, TransformStage, known_structure
from qtool.stages.smooth_attention import attention_shape, check_attention_groups

# Calibration tokens the α search evaluates the output error on (the statistics use all of them).
SEARCH_TOKENS = 4096


@dataclass
class SmoothOptions:
    alpha: float | None = option(
        None, min=0.0, max=1.0, help="fixed migration strength; null searches alpha_grid"
    )
    alpha_grid: list[float] = option(
        default_factory=lambda: [0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5],
        help="strengths tried per output module when alpha is null",
    )

    def validate(self) -> tuple[str, str] | None:
        if not self.alpha_grid or any(not 0.0 <= a <= 1.0 for a in self.alpha_grid):
            return (
                "alpha_grid",
                f"found {shown(self.alpha_grid)}, expected a non-empty list of numbers in 0..1",
            )
        return None


def check_output_producers(config, where: str, stage: str) -> None:
    """Refuse a family whose o_proj and down_proj inputs have no separate producing linear to fold into."""
    adapter = known_structure(
        config, where, stage, "the linears that produce o_proj's and down_proj's inputs"
    )
    if not adapter.smooth_producers:
        raise RecipeError(
            f"{where}: {config.architectures[0]} makes o_proj's and down_proj's inputs with row slices of fused "
            f"linears (qkv_proj, gate_up_proj), which {stage} does not fold into; expected separate v_proj and "
            f"up_proj (drop {stage} for this family)"
        )


def smoothing_factors(xmax: torch.Tensor, wmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """λ = max|X|^α / max|W|^(1-α) per channel (float64); a channel without signal keeps λ = 1."""
    x = xmax.double().clamp(min=1e-5)
    w = wmax.double().clamp(min=1e-5)
    lam = x.pow(alpha) / w.pow(1.0 - alpha)
    return torch.where((xmax > 0) & (wmax > 0), lam, torch.ones_like(lam))


class SmoothStage(TransformStage):
    name = "smooth"
    options_cls = SmoothOptions
    help = "block-output smoothing of o_proj/down_proj inputs, folded into v_proj/up_proj; strength searched"

    def needs_calibration(self) -> bool:
        return True

    def check_config(self, config, where: str) -> None:
        check_output_producers(config, where, self.name)
        check_attention_groups(config, where)

    def apply_block(self, ctx: BlockContext) -> dict | None:
        done = {}
        names = [n for n in ctx.adapter.smooth_producers if self.targets.matches(f"{ctx.prefix}.{n}")]
        if not names:
            return None
        # One pass for all: smoothing one output module preserves the block's function, so the inputs of the
        # others do not change.
        xs = ctx.capture(names)
        for out_name in names:
            if not xs[out_name]:  # an expert no calibration token was routed to: nothing to measure
                continue
            producers = ctx.adapter.smooth_producers[out_name]
            x = torch.cat(xs.pop(out_name))
            out = ctx.block.get_submodule(out_name)
            # Channels that one producer row feeds must share λ: under GQA, o_proj's input channel h·D + d comes
            # from v_proj's row (h // group)·D + d for every query head h of the group.
            share = _shared_channels(ctx, out_name, producers, out.in_features)
            xmax = _group_max(x.abs().amax(dim=0), share)
            wmax = _group_max(out.weight.detach().float().abs().amax(dim=0), share)
            alpha, err = self._choose(
                x, out.weight.detach().float(), xmax, wmax, share, ctx.quantizers.get(out_name)
            )
            lam = smoothing_factors(xmax, wmax, alpha)
            with torch.no_grad():
                w = out.weight
                w.copy_((w.double() * lam[share][None, :].to(w.device)).to(w.dtype))
                for p in producers:
                    _divide_rows(ctx.block.get_submodule(p), lam)
            done[out_name] = {"alpha": alpha, "error": err}
        return done or None

    def _choose(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        xmax: torch.Tensor,
        wmax: torch.Tensor,
        share: torch.Tensor,
        quantizer: QuantizerStage | None,
    ) -> tuple[float, float | None]:
        if self.options.alpha is not None:
            return self.options.alpha, None
        if x.shape[0] > SEARCH_TOKENS:
            x = x[torch.linspace(0, x.shape[0] - 1, SEARCH_TOKENS, device=x.device).long()]
        ref = x @ w.T
        best = (float("inf"), self.options.alpha_grid[0])
        for alpha in self.options.alpha_grid:
            lam = smoothing_factors(xmax, wmax, alpha)[share].to(x.device).float()
            xs, ws = x / lam, w * lam
            if quantizer is not None:
                xs, ws = quantizer.preview_activations(xs), quantizer.preview(ws)
            err = float((xs @ ws.T - ref).pow(2).mean())
            if err < best[0]:
                best = (err, alpha)
        return best[1], best[0]


def _shared_channels(
    ctx: BlockContext, out_name: str, producers: tuple[str, ...], width: int
) -> torch.Tensor:
    """For each input channel of the output module, the index of the producer row that makes it."""
    rows = ctx.block.get_submodule(producers[0]).out_features
    if rows == width:
        return torch.arange(width)
    heads, kv, dim = attention_shape(ctx.config)
    if producers == (ctx.adapter.v_proj,) and rows == kv * dim and width == heads * dim:
        head = torch.arange(width) // dim
        return (head // (heads // kv)) * dim + torch.arange(width) % dim
    raise RecipeError(
        f"{ctx.prefix}.{out_name}: {width} input channels made by {producers[0]} with {rows} outputs; "
        f"expected equal widths or attention value heads shared by query heads"
    )


def _group_max(v: torch.Tensor, share: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(int(share.max()) + 1, dtype=v.dtype, device=v.device)
    return out.scatter_reduce(0, share.to(v.device), v, reduce="amax")


def _divide_rows(linear: torch.nn.Linear, lam: torch.Tensor) -> None:
    w = linear.weight
    w.copy_((w.double() / lam[:, None].to(w.device)).to(w.dtype))
    if linear.bias is not None:
        b = linear.bias
        b.copy_((b.double() / lam.to(b.device)).to(b.dtype))
