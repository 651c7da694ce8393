"""Stage `rotate`: block-input rotation (QServe §4.3.1, QuaRot). The residual stream h becomes h Q with Q an
orthogonal scaled Hadamard matrix, absorbed offline into the weights: the embedding rows and the output side of
each block's output linears (o_proj, down_proj) write h Q; the input side of the linears reading the stream
(q/k/v, gate/up, the head) undo it. Spreading an outlier channel over all channels flattens the activations the
input linears see, and their weights' rows, before quantization.

RMSNorm commutes with Q only once its scale is 1 (‖h Q‖ = ‖h‖, but diag(γ) and Q do not commute), so every norm's
scale is first folded into the linears it feeds, the final norm's into the head. A head tied to the embedding is
untied: the two now take different matrices (E Q and W diag(γ) Q).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from torch import nn

from qtool.errors import RecipeError
from qtool.models.adapters import Adapter, adapter_for, supported_architectures
from qtool.models.fold import fold_norm_scale, rotate_embedding, rotate_input, rotate_output, untie_head
from qtool.options import INT_LIMIT, option
from qtool.quant.hadamard import hadamard_plan, rotation
from qtool.stages.base import Targets, TransformStage


@dataclass
class RotateOptions:
    fallback: Literal["error", "random"] = option(
        "error",
        help="where no Hadamard matrix of the hidden size is known: refuse, or use a seeded random "
        "orthogonal matrix",
    )
    random_signs: bool = option(
        False,
        help="multiply the Hadamard matrix by a seeded random ±1 diagonal (QuaRot's randomized Hadamard)",
    )
    seed: int = option(
        0, min=0, max=INT_LIMIT, help="seed of the random signs and of the random orthogonal fallback"
    )


def _hidden_size(config) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "hidden_size", None)


class RotateStage(TransformStage):
    name = "rotate"
    options_cls = RotateOptions
    help = "rotate the residual stream by a scaled Hadamard matrix folded into the weights (norm scales folded first)"

    def check_config(self, config, where: str) -> None:
        if self.targets != Targets():
            found = {k: v for k, v in dataclasses.asdict(self.targets).items() if v != getattr(Targets(), k)}
            raise RecipeError(
                f"{where}.targets: found {found}; expected no targets (rotate turns the whole "
                f"residual stream, every block at once)"
            )
        archs = getattr(config, "architectures", None) or [getattr(config, "model_type", "?")]
        adapter = adapter_for(archs)
        if adapter is None:
            raise RecipeError(
                f"{where}: architecture {', '.join(archs)} is not known to rotate; expected one of "
                f"{', '.join(supported_architectures())}"
            )
        if adapter.norm_kind != "rms":
            norm = f"{adapter.block_prefix(0)}.{next(iter(adapter.norm_feeds))}"
            raise RecipeError(
                f"{where}: {norm} of {archs[0]} is a LayerNorm; rotate needs RMSNorm (a LayerNorm "
                f"subtracts the mean, which does not commute with a rotation)"
            )
        if adapter.branch_norms:
            norms = " and ".join(f"{adapter.block_prefix(0)}.{n}" for n in adapter.branch_norms)
            raise RecipeError(
                f"{where}: {archs[0]} normalizes each branch's output ({norms}) before adding it to the "
                f"residual stream; their per-channel scales do not commute with a rotation of the stream and no "
                f"linear can absorb them; expected a model without post-branch norms (drop rotate for this family)"
            )
        n = _hidden_size(config)
        if not isinstance(n, int):
            raise RecipeError(f"{where}: the model config has no hidden_size; expected an integer")
        if self.options.fallback == "error" and hadamard_plan(n) is None:
            raise RecipeError(
                f"{where}: hidden size {n} has no Hadamard matrix here (orders m·2^k with m = 1 or a "
                f"Paley order q+1, 2(q+1) for a prime q); expected such a size, or fallback: random "
                f"for a seeded random orthogonal matrix"
            )

    def apply_outer(self, model: nn.Module, adapter: Adapter) -> dict:
        o: RotateOptions = self.options
        n = _hidden_size(model.config)
        self._q, what = rotation(n, fallback=o.fallback, seed=o.seed, signs=o.random_signs)
        untied = untie_head(model, adapter.embed_path, adapter.head_path)
        head = model.get_submodule(adapter.head_path)
        fold_norm_scale(model.get_submodule(adapter.final_norm_path), [head])
        rotate_embedding(model.get_submodule(adapter.embed_path), self._q)
        rotate_input(head, self._q)
        return {"hidden_size": n, "matrix": what, "untied_head": untied}

    def apply_block_weights(self, block: nn.Module, index: int, adapter: Adapter) -> None:
        # Each edit touches one module's own weights, so the blocks can be done in any order after apply_outer.
        for norm, feeds in adapter.norm_feeds.items():
            fold_norm_scale(block.get_submodule(norm), [block.get_submodule(f) for f in feeds])
        for name in (f for feeds in adapter.norm_feeds.values() for f in feeds):
            rotate_input(block.get_submodule(name), self._q)
        for name in adapter.output_linears:
            rotate_output(block.get_submodule(name), self._q)
