"""What every recipe stage shares: targets (glob include/exclude over module names) and the weight scheme
(bits, symmetry, group size, clipping) that quantizers take as options."""

from __future__ import annotations

import fnmatch
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from qtool.calibration.stats import LinearStats
from qtool.errors import RecipeError
from qtool.layouts.base import StoredLayout
from qtool.layouts.grouped_int.layout import GroupedIntWeight
from qtool.options import option
from qtool.quant.grid import GridSpec
from qtool.quant.rtn import rtn_quantize


def _for(text: str, solver: str) -> str:
    return f"{solver}: {text}" if solver else text


# GPTQ's solver options, declared once: every stage that solves with GPTQ takes them under these names, defaults
# and ranges (`solver` prefixes the help where the stage has another solver too).
def damp_option(solver: str = "") -> Any:
    return option(
        0.01, min=0.0, max=1.0, help=_for("dampening added to diag(H), as a fraction of its mean", solver)
    )


def block_size_option(solver: str = "") -> Any:
    return option(128, min=1, max=8192, help=_for("columns per lazy batch update", solver))


def act_order_option(solver: str = "") -> Any:
    return option(False, help=_for("quantize columns in order of decreasing diag(H)", solver))


def static_groups_option(solver: str = "") -> Any:
    return option(False, help=_for("fix every group's scale (and zero) before the column loop", solver))


def sequential_option(solver: str = "") -> Any:
    return option(
        True,
        help=_for(
            "within a block, q/k/v then o then gate/up then down, each calibrated on the outputs of the already "
            "quantized linears",
            solver,
        ),
    )


def known_structure(config, where: str, stage: str, needs: str):
    """The adapter of `config`'s architecture, for a stage that needs the structure it declares (`needs` says
    what); a one-line refusal naming the architecture when no adapter knows it (weight-only recipes still run on
    such a model)."""
    from qtool.models.adapters import adapter_for, supported_architectures

    archs = getattr(config, "architectures", None) or [getattr(config, "model_type", "?")]
    adapter = adapter_for(archs)
    if adapter is None:
        raise RecipeError(
            f"{where}: architecture {', '.join(archs)} has no adapter here and {stage} needs {needs}; expected "
            f"one of {', '.join(supported_architectures())} (weight-only stages run on any decoder)"
        )
    return adapter


def check_kv_cache_family(config, where: str, stage: str) -> None:
    """Refuse a family whose attention the quantized KV caches cannot wrap (transformers' attention interface,
    RoPE pairing channel i with i + head_dim/2)."""
    from qtool.models.adapters import ADAPTERS

    adapter = known_structure(config, where, stage, "attention it can wrap")
    if not adapter.kv_cache:
        families = ", ".join(a.family for a in ADAPTERS if a.kv_cache)
        raise RecipeError(
            f"{where}: model_type {getattr(config, 'model_type', None)!r} has no KV cache scheme here; expected a "
            f"model of the families {families}"
        )


@dataclass
class Targets:
    include: list[str] = option(
        default_factory=lambda: ["*"], help="glob patterns of module names to quantize"
    )
    exclude: list[str] = option(default_factory=list, help="glob patterns of module names to leave alone")

    def matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.include) and not any(
            fnmatch.fnmatchcase(name, p) for p in self.exclude
        )


@dataclass
class WeightScheme:
    bits: int = option(4, min=2, max=8, help="bits per weight")
    symmetric: bool = option(True, help="zero point fixed at 2^(bits-1); false stores a zero point per group")
    group_size: int | None = option(
        128, min=1, help="input columns per scale; null for one scale per output row"
    )
    clip: bool = option(False, help="search the range shrink ratio minimising the layer output error")
    clip_grid: int = option(20, min=2, max=200, help="number of shrink ratios tried by clip")
    clip_min_ratio: float = option(0.5, min=0.05, max=1.0, help="smallest shrink ratio tried by clip")

    def grid_spec(self) -> GridSpec:
        return GridSpec(bits=self.bits, symmetric=self.symmetric, group_size=self.group_size)

    def planned_layer(self, in_features: int) -> dict:
        """The grouped_int layer config these options give a linear of `in_features` inputs."""
        return {
            "format": GroupedIntWeight.FORMAT,
            "bits": self.bits,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "in_features": in_features,
        }


@dataclass
class QuantResult:
    packed: StoredLayout
    dequantized: torch.Tensor  # [N, K] float32, what the packed layer computes with


class Stage(ABC):
    """What every recipe stage has: its name in recipes, its options dataclass, its targets and its place in the
    recipe, and a check of the model config that runs before any weight is loaded."""

    name: ClassVar[str]
    options_cls: ClassVar[type]
    help: ClassVar[str]

    def __init__(self, options, targets: Targets, index: int) -> None:
        self.options = options
        self.targets = targets
        self.index = index

    @property
    def label(self) -> str:
        return f"stages[{self.index}] ({self.name})"

    def needs_calibration(self) -> bool:
        """Whether this stage needs calibration data from the block-wise pipeline."""
        return False

    def check_config(self, config, where: str) -> None:
        """Refuse a model this stage cannot handle, from its config alone (before any weight is loaded); raise
        RecipeError naming `where`."""
        return None

    def distributed_problem(self) -> tuple[str, str] | None:
        """(option, message) when this stage, with its options, cannot run data-parallel over several processes
        (qtool/distributed.py: what it computes over the calibration samples is not a sum, a maximum or a list
        the ranks can combine), else None. Checked before any weight is loaded."""
        return None

    def check_calibration(self, calibration, where: str) -> None:
        """Refuse calibration settings (the recipe's CalibrationSpec) too small for what this stage fits from them;
        raise RecipeError naming `where`. Runs before any weight is loaded."""
        return None


class QuantizerStage(Stage):
    """Chooses the representation of each targeted linear and produces its packed layer (of `layout_cls`)."""

    layout_cls: ClassVar[type[StoredLayout]]

    def planned_layer(self, in_features: int) -> dict:
        """The layer config this stage will write for a linear of `in_features` inputs, as far as its options fix
        it before any weight is read (options that fix a scheme say so with their own `planned_layer`): what a
        recipe's `target:` checks against the export format."""
        plan = getattr(self.options, "planned_layer", None)
        return plan(in_features) if plan else {"format": self.layout_cls.FORMAT, "in_features": in_features}

    def needs_hessian(self) -> bool:
        return False

    def sequential(self) -> bool:
        """Whether a block's linears must see the outputs of the already-quantized linears before them."""
        return True

    def row_split(self) -> int | None:
        """The granularity (in output rows) at which `quantize_rows` gives exactly those rows of `quantize`'s
        result, its packed layout joining slices with `concat_rows`; None when rows are coupled (codebooks fitted
        over rows). With several processes a linear whose stage says so may be split by rows over the ranks
        (qtool/distributed.py)."""
        return None

    def quantize_rows(
        self, name: str, weight: torch.Tensor, stats: LinearStats | None, rows: range
    ) -> QuantResult:
        """The output rows `rows` (from and to multiples of `row_split()`) of `quantize(name, weight, stats)`.
        By default `quantize` of those rows of `weight`: a stage whose rows depend on their own weights and the
        shared statistics alone; a stage that makes choices from the whole matrix makes them here too."""
        return self.quantize(name, weight[rows.start : rows.stop], stats)

    def preview(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` [N, K] as round-to-nearest under this stage's scheme leaves it (float32): what transforms that
        search their parameters (smoothing strength) measure the quantization error with."""
        spec = getattr(self.options, "grid_spec", None)
        if spec is None:
            return weight
        codes, scales, zeros = rtn_quantize(weight.float(), spec())
        return (
            GroupedIntWeight.from_codes(codes, scales, zeros, spec())
            .dequantize(torch.float32)
            .to(weight.device)
        )

    def preview_activations(self, x: torch.Tensor) -> torch.Tensor:
        """The input rows [T, K] as this stage's run-time activation quantization leaves them (identity for
        weight-only schemes)."""
        return x

    def targeted_linears(self, config):
        """(full name, linear) of every linear this stage targets in a model of `config`, built on the meta device
        (shapes only, no weight read): what `check_config` checks layer shapes against before loading. Nothing
        for a model whose blocks cannot be found (that is refused when the model loads)."""
        from transformers import AutoModelForCausalLM  # recipe parsing alone never loads it

        from qtool.models.loading import adapter_of, with_expert_linears

        adapter = adapter_of(config)
        if isinstance(adapter, str):
            return
        with torch.device("meta"):
            model = with_expert_linears(AutoModelForCausalLM.from_config(config))
        for i, block in enumerate(adapter.blocks(model)):
            for rel in adapter.linear_names():
                full = f"{adapter.block_prefix(i)}.{rel}"
                if self.targets.matches(full):
                    yield full, block.get_submodule(rel)

    def layer_problem(self, n: int, k: int) -> tuple[str, str] | None:
        """(recipe key, message with `{}` where the linear's name goes) for an `n` x `k` linear this stage cannot
        quantize, else None: checked per targeted linear before loading (`check_layers`) and again as each is
        quantized (`refuse_layer`)."""
        return None

    def check_layers(self, config, where: str) -> None:
        """Refuse the first targeted linear of `config` that `layer_problem` names, before any weight is loaded."""
        for full, lin in self.targeted_linears(config):
            problem = self.layer_problem(lin.out_features, lin.in_features)
            if problem is not None:
                key, msg = problem
                raise RecipeError(
                    f"{where}.{key}: "
                    + msg.format(f"targeted linear {full}")
                    + " (or exclude the linear in targets)" * ("exclude" not in msg)
                )

    def refuse_layer(self, name: str, n: int, k: int) -> None:
        """Refuse linear `name` of `n` x `k` if `layer_problem` names it (models whose config did not show it)."""
        problem = self.layer_problem(n, k)
        if problem is not None:
            key, msg = problem
            raise RecipeError(f"stages[{self.index}].{key}: " + msg.format(f"linear {name}"))

    def attention_objective(self, rel: str, adapter) -> str | None:
        """ "q"/"k" when the linear `rel` of a block should be quantized against the attention output's error (the
        pipeline then passes `quantize` a per-row `score`), else None."""
        return None

    def finetunes(self) -> bool:
        """Whether `finetune_block` runs once a block's linears are quantized (the pipeline then keeps the float
        block's outputs on the calibration inputs)."""
        return False

    def finetune_block(
        self,
        block: nn.Module,
        layouts: dict[str, object],
        originals: dict[str, torch.Tensor],
        inputs: list[torch.Tensor],
        kwargs: dict,
        targets: list[torch.Tensor],
    ) -> tuple[dict[str, object], dict | None]:
        """Refine the packed layers of this stage's linears in `block` (by name relative to it; `originals`: their
        float weights before quantization) so that the block's outputs on `inputs` come closer to `targets`,
        the float block's. Return the new layouts by the same names and what to record in the manifest."""
        return layouts, None

    @abstractmethod
    def quantize(self, name: str, weight: torch.Tensor, stats: LinearStats | None) -> QuantResult: ...


class BlockContext:
    """What a transform sees of one decoder block in the block-wise pipeline: the block (on the compute device),
    its calibration inputs and keyword arguments, and the quantizer stage claiming each of its linears."""

    def __init__(
        self,
        block: nn.Module,
        index: int,
        prefix: str,
        adapter,
        config,
        inputs: list[torch.Tensor],
        kwargs: dict,
        quantizers: dict[str, QuantizerStage],
        world=None,
    ) -> None:
        self.block = block
        self.index = index
        self.prefix = prefix
        self.adapter = adapter
        self.config = config
        self.inputs = inputs
        self.kwargs = kwargs
        self.quantizers = quantizers  # relative linear name -> stage
        self.world = world  # qtool/distributed.py World: `inputs` are this rank's share of the samples

    def gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-sample tensors of this rank's share, with every other rank's, in sample order (what one process
        running all samples would hold)."""
        return tensors if self.world is None else self.world.gather(tensors)

    def capture(self, names: list[str], outputs: bool = False) -> dict[str, list[torch.Tensor]]:
        """The inputs (or outputs) of the named submodules over all calibration samples (every rank's), flattened
        to [tokens, features] per sample. One forward of the block per sample of this rank."""
        got: dict[str, list[torch.Tensor]] = {n: [] for n in names}

        def make_hook(n: str):
            def hook(module, args, output):
                t = output if outputs else args[0]
                t = t[0] if isinstance(t, tuple) else t
                got[n].append(t.detach().reshape(-1, t.shape[-1]).float())

            return hook

        handles = [self.block.get_submodule(n).register_forward_hook(make_hook(n)) for n in names]
        try:
            with torch.no_grad():
                for x in self.inputs:
                    self.block(x, **self.kwargs)
        finally:
            for h in handles:
                h.remove()
        return {n: self.gather(t) for n, t in got.items()}


class TransformStage(Stage):
    """Rewrites the float model without changing what it computes (up to float error), before the quantizers see
    it: `apply_outer` once before the block loop, on what lies outside the decoder blocks; then, as each block is
    loaded, `apply_block_weights` (weights only) and `apply_block` (with the block's calibration inputs), in recipe
    order, before that block's linears are quantized. The split lets a run that reads one block at a time from the
    weight files (the others stay on the meta device) transform the model as it goes. `needs_calibration`: whether
    `apply_block` needs the block's calibration inputs."""

    def apply_model(self, model: nn.Module, adapter) -> dict | None:
        """Transform the weights of a whole loaded model (what `apply_outer` and every block's
        `apply_block_weights` do); return what to record in the manifest."""
        info = self.apply_outer(model, adapter)
        for i, block in enumerate(adapter.blocks(model)):
            self.apply_block_weights(block, i, adapter)
        return info

    def apply_outer(self, model: nn.Module, adapter) -> dict | None:
        """Before the block loop: transform the modules outside the decoder blocks (embeddings, final norm, head)
        and set what the blocks need (module attributes, this stage's own state). The blocks' weights may be on
        the meta device: never read them here. Return what to record in the manifest."""
        return None

    def apply_block_weights(self, block: nn.Module, index: int, adapter) -> None:
        """Transform one loaded block's weights, without calibration data, as `apply_model` would."""
        return None

    def apply_block(self, ctx: BlockContext) -> dict | None:
        """Transform one block with its calibration inputs; return what to record in the manifest."""
        return None

    def model_scheme(self) -> dict | None:
        """A run-time scheme of the whole model this stage sets (e.g. the KV cache), stored in the checkpoint's
        quantization_config under the returned mapping's keys."""
        return None


class HessianStage(QuantizerStage):
    """A stage that solves with each linear's input Hessian (GPTQ and the stages built on it): it needs
    calibration statistics with Hessians, and its `sequential` option decides the order within a block."""

    def needs_calibration(self) -> bool:
        return True

    def needs_hessian(self) -> bool:
        return True

    def sequential(self) -> bool:
        return self.options.sequential
