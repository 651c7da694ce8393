"""The recipe's `target`: the format a checkpoint must later be exportable to. With `target: compressed-tensors`
(or its alias `vllm`), a recipe whose quantizers would produce a layer that format cannot hold (a partial group,
outlier columns, mixed precision, two-level scales) or whose transforms set a run-time scheme it has no place for
(a quantized KV cache) is refused before the model loads, naming the stage and the first such linear, instead of
after the run by `qtool export`. Each quantizer says what layer it will write (`planned_layer`); the exporter
judges it, as it judges a written checkpoint's."""

from __future__ import annotations

from qtool.errors import RecipeError, UsageError
from qtool.stages.base import TransformStage


def check_target(recipe, config) -> None:
    """Refuse, before any weight is read, a recipe whose checkpoint its `target` format could not hold."""
    if recipe.target == "qtool":
        return
    _check(recipe, config, recipe.target)


def export_problem(recipe, config) -> str | None:
    """Why the checkpoint of a recipe without a `target` will not export to compressed-tensors (the first stage
    and linear the format cannot hold), or None when it will."""
    if recipe.target != "qtool":
        return None
    try:
        _check(recipe, config, "compressed-tensors")
    except RecipeError as e:
        return str(e).split(": compressed-tensors, but ", 1)[-1]
    return None


def _check(recipe, config, target: str) -> None:
    from qtool.export.compressed_tensors import layer_scheme

    where = f"{recipe.path}:target"
    for spec in recipe.stages:
        stage = spec.stage
        scheme = stage.model_scheme() if isinstance(stage, TransformStage) else None
        if scheme and "kv_cache" in scheme:
            how = "with codebooks" if "format" in scheme["kv_cache"] else "per token at run time"
            raise RecipeError(
                f"{where}: {target}, but {stage.label} quantizes the KV cache {how}; expected no "
                f"{stage.name} stage (the format holds no such cache)"
            )
    for q in recipe.quantizers():
        for full, lin in q.targeted_linears(config):
            k = lin.in_features
            cfg = q.planned_layer(k)
            g = cfg.get("group_size")
            if isinstance(g, int) and k % g:
                raise RecipeError(
                    f"{where}: {target}, but {q.label} group_size {g} leaves a partial group "
                    f"in {full} (in_features {k}); expected a group size dividing every targeted "
                    f"linear's in_features (or exclude it in targets)"
                )
            try:
                layer_scheme(full, cfg, q.label)
            except UsageError as e:
                raise RecipeError(f"{where}: {target}, but {e}") from None
