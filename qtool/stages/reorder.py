"""Stage `reorder` (QoQ §4.3.3, activation-aware channel reordering): with per-group weights, a group that mixes
salient input channels (large max|X|) with quiet ones takes its scale from the salient ones and rounds the rest
coarsely. Sorting input channels by max|X| puts channels of similar salience in the same group.

Only inputs whose channels are made by a linear of the same block can be permuted for free: the permutation is
applied to the producer's output rows and the consumer's input columns, so the model computes the same function
and nothing is stored or applied at run time. Those are down_proj (with gate_proj and up_proj rows permuted alike)
and o_proj (with v_proj rows; a permutation within each head, the same for every query head sharing a KV head, as
attention mixes tokens, not channels). Residual-stream inputs (q/k/v, gate/up) are left in place: their channels
are shared by every block."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtool.stages.base import BlockContext, TransformStage
from qtool.stages.smooth import check_output_producers
from qtool.stages.smooth_attention import attention_shape, check_attention_groups


@dataclass
class ReorderOptions:
    pass


def salience_order(xmax: torch.Tensor) -> torch.Tensor:
    """Channels by decreasing max|X| (stable, so ties keep their order)."""
    return torch.argsort(xmax.float().cpu(), descending=True, stable=True)


class ReorderStage(TransformStage):
    name = "reorder"
    options_cls = ReorderOptions
    help = "sort o_proj/down_proj input channels by calibration max|X| (folded into v_proj and gate/up rows)"

    def needs_calibration(self) -> bool:
        return True

    def check_config(self, config, where: str) -> None:
        check_output_producers(config, where, self.name)
        check_attention_groups(config, where)

    def apply_block(self, ctx: BlockContext) -> dict | None:
        heads, kv, dim = attention_shape(ctx.config)
        names = [n for n in ctx.adapter.smooth_producers if self.targets.matches(f"{ctx.prefix}.{n}")]
        if not names:
            return None
        xs = ctx.capture(names)
        moved = {}
        for out_name in names:
            if not xs[out_name]:  # an expert no calibration token was routed to: nothing to order by
                continue
            producers = _producers(ctx, out_name)
            out = ctx.block.get_submodule(out_name)
            xmax = torch.cat(xs[out_name]).abs().amax(dim=0).cpu()
            if out.in_features == ctx.block.get_submodule(producers[0]).out_features:
                perm = salience_order(xmax)
                cols = perm
            else:  # o_proj under attention: permute within each KV head, shared by its query heads
                per_q = xmax.reshape(heads, dim)
                per_kv = per_q.reshape(kv, heads // kv, dim).amax(dim=1)
                within = torch.stack([salience_order(per_kv[h]) for h in range(kv)])  # [kv, dim]
                perm = (within + torch.arange(kv)[:, None] * dim).reshape(-1)
                q_within = within.repeat_interleave(heads // kv, dim=0)
                cols = (q_within + torch.arange(heads)[:, None] * dim).reshape(-1)
            with torch.no_grad():
                out.weight.copy_(out.weight[:, cols.to(out.weight.device)])
                for p in producers:
                    lin = ctx.block.get_submodule(p)
                    lin.weight.copy_(lin.weight[perm.to(lin.weight.device)])
                    if lin.bias is not None:
                        lin.bias.copy_(lin.bias[perm.to(lin.bias.device)])
            moved[out_name] = int((cols != torch.arange(cols.numel())).sum())
        return {"channels_moved": moved}


def _producers(ctx: BlockContext, out_name: str) -> tuple[str, ...]:
    """Every linear whose output rows line up with `out_name`'s input channels: the smoothing producer and, for
    a gated MLP, the gate (permuting up alone would pair the wrong gate with each channel)."""
    producers = ctx.adapter.smooth_producers[out_name]
    width = ctx.block.get_submodule(producers[0]).out_features
    # The gate beside the producer in the same module (one expert's gate, not every expert's).
    parent = producers[0].rpartition(".")[0]
    siblings = [
        n
        for group in ctx.adapter.linear_groups
        for n in group
        if producers[0] in group and n.rpartition(".")[0] == parent
    ]
    return tuple(
        dict.fromkeys(
            [
                *producers,
                *(
                    n
                    for n in siblings
                    if ctx.block.get_submodule(n).out_features == width
                    and n not in (ctx.adapter.q_proj, ctx.adapter.k_proj)
                ),
            ]
        )
    )
