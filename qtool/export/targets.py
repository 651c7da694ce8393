"""The recipe's `target`: the format a checkpoint must later be exportable to. With `target: compressed-tensors`
(or its alias `vllm`), a recipe whose quantizers would produce a layer that format cannot hold (a partial group,
outlier columns, mixed precision, two-level scales, a quantized KV cache) is refused before the model loads,
naming the stage and the first such linear, instead of after the run by `qtool export`."""

from __future__ import annotations

from qtool.errors import RecipeError, UsageError

TARGETS = ("qtool", "compressed-tensors", "vllm")


def _prospective_layer(stage, k: int) -> dict:
    """The layer config `stage` will write for a linear with `k` input columns, as far as its options fix it."""
    o = stage.options
    if stage.name in ("gptq", "rtn"):
        return {
            "format": "grouped_int",
            "bits": o.bits,
            "group_size": o.group_size,
            "symmetric": o.symmetric,
            "in_features": k,
        }
    if stage.name == "progressive":
        return {
            "format": "qoq",
            "bits": o.bits,
            "group_size": o.group_size,
            "act_bits": o.act_bits,
            "in_features": k,
        }
    if stage.name == "outliers":
        return {
            "format": "quik",
            "bits": o.bits,
            "act_bits": o.act_bits,
            "group_size": None,
            "in_features": k,
            "num_outliers": o.outliers or any(getattr(v, "outliers", None) for v in o.overrides),
            "sparsity": "2:4" if o.sparsity_24 else None,
        }
    return {"format": stage.name, "in_features": k}


def check_target(recipe, config) -> None:
    """Refuse, before any weight is read, a recipe whose checkpoint its `target` format could not hold."""
    from qtool.export.compressed_tensors import layer_scheme

    if getattr(recipe, "target", "qtool") == "qtool":
        return
    where = f"{recipe.path}:target"
    for spec in recipe.stages:
        stage = spec.stage
        if stage.name == "kv_cache":
            raise RecipeError(
                f"{where}: {recipe.target}, but {stage.label} quantizes the KV cache per token at run "
                f"time; expected no kv_cache stage (the format holds no such cache)"
            )
    for q in recipe.quantizers():
        for full, lin in q.targeted_linears(config):
            k = lin.in_features
            cfg = _prospective_layer(q, k)
            g = cfg.get("group_size")
            if isinstance(g, int) and k % g:
                raise RecipeError(
                    f"{where}: {recipe.target}, but {q.label} group_size {g} leaves a partial group "
                    f"in {full} (in_features {k}); expected a group size dividing every targeted "
                    f"linear's in_features (or exclude it in targets)"
                )
            try:
                layer_scheme(full, cfg, q.label)
            except UsageError as e:
                raise RecipeError(f"{where}: {recipe.target}, but {e}") from None
