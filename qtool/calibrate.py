"""`qtool calibrate`: input statistics of every decoder-block linear of the original model."""

from __future__ import annotations

from pathlib import Path

import torch

from qtool.console import Reporter
from qtool.errors import RecipeError, UsageError
from qtool.estimate import stats_bytes
from qtool.output import Output, check_output, reserve_output


def run_calibrate(
    recipe_path: Path | None, overrides: dict, out: Path, *, hessians: bool, device: str, reporter: Reporter
) -> dict:
    from qtool.calibration.data import TextSource, check_token_ids, sample_windows
    from qtool.models.loading import check_architecture, check_context, load_config, load_tokenizer
    from qtool.pipeline import resolve_device
    from qtool.recipe import CalibrationSpec, load_recipe, validate_recipe

    if recipe_path is not None:
        recipe = load_recipe(recipe_path, overrides)
        model_ref, cal = recipe.model, recipe.calibration
    else:
        if "model" not in overrides or "calibration.source" not in overrides:
            raise UsageError("calibrate: expected a RECIPE or both --model and --calibration")
        raw = {"model": overrides["model"], "stages": [{"stage": "rtn"}]}
        recipe = validate_recipe(raw, "command line", Path.cwd(), overrides)
        model_ref, cal = recipe.model, recipe.calibration
    if cal is None:
        raise RecipeError(f"{recipe_path}:calibration: missing; expected calibration data")
    assert isinstance(cal, CalibrationSpec)
    # The output first: a refusal costs no model or text read.
    inputs = {"model": model_ref, "calibration text": cal.source, "recipe": recipe_path}
    check_output(out, directory=False, overwrite=True, inputs=inputs)
    dev = resolve_device(device)
    # Config, context length, tokenizer and text first: they fail in seconds, before any weight is read.
    config = load_config(model_ref)
    check_architecture(model_ref, config)
    check_context(
        cal.seq_len,
        cal.allow_long_context,
        config,
        model_ref,
        recipe.origins.get("calibration.seq_len", "calibration.seq_len"),
        "calibration.allow_long_context: true",
    )
    tokenizer = load_tokenizer(model_ref)
    windows, digest = sample_windows(
        tokenizer,
        TextSource(cal.source, cal.text_field, cal.split, cal.config, cal.encoding),
        cal.num_samples,
        cal.seq_len,
        cal.seed,
        recipe.origins.get("calibration.num_samples", "calibration.num_samples"),
    )
    check_token_ids(windows, config.vocab_size, cal.source, tokenizer)
    # The stats file is checked (and its temporary created) before the model loads; it is replaced as before.
    needs = stats_bytes(model_ref, config, hessians)
    with reserve_output(
        out, directory=False, overwrite=True, needs_bytes=needs, log=reporter.log, inputs=inputs
    ) as reserved:
        return _calibrate(
            model_ref, cal, out, reserved, dev, windows, digest, hessians=hessians, reporter=reporter
        )


def _calibrate(
    model_ref: str,
    cal,
    out: Path,
    reserved: Output,
    dev: torch.device,
    windows: torch.Tensor,
    digest: str,
    *,
    hessians: bool,
    reporter: Reporter,
) -> dict:
    from qtool.calibration.capture import block_output, capture_block_inputs
    from qtool.calibration.stats import LinearStats, save_stats
    from qtool.models.loading import load_model

    dtype = torch.float32 if dev.type == "cpu" else torch.float16
    model, _, adapter, _ = load_model(model_ref, dtype)
    blocks = adapter.blocks(model)
    inputs, kwargs = capture_block_inputs(model, blocks, windows, dev)
    stats: dict[str, LinearStats] = {}
    for i in reporter.track(range(len(blocks)), total=len(blocks), description="calibrating blocks"):
        block = blocks[i].to(dev)
        local = {
            rel: LinearStats(block.get_submodule(rel).in_features, hessians, dev)
            for rel in adapter.linear_names()
        }
        handles = [
            block.get_submodule(rel).register_forward_hook(lambda m, a, o, s=local[rel]: s.update(a[0]))
            for rel in adapter.linear_names()
        ]
        with torch.no_grad():
            inputs = [block_output(block(x, **kwargs[i])) for x in inputs]
        for h in handles:
            h.remove()
        stats.update({f"{adapter.block_prefix(i)}.{rel}": s for rel, s in local.items()})
        blocks[i] = block.to("cpu")
    stamp = {
        "model": model_ref,
        "source": cal.source,
        "num_samples": cal.num_samples,
        "seq_len": cal.seq_len,
        "seed": cal.seed,
        "data_sha256": digest,
        "hessians": hessians,
    }
    save_stats(out, stats, stamp, reserved=reserved)
    summary = {"output": str(out), "linears": len(stats), "tokens": int(windows.numel()), **stamp}
    if reserved.removed_leftovers:
        summary["removed_leftovers"] = [str(p) for p in reserved.removed_leftovers]
    return summary
