"""`qtool quantize`: recipe → block-wise pipeline → (optional perplexity and zero-shot accuracy) → packed checkpoint."""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import torch

from qtool.checkpoint.writer import bits_per_weight, collect_tensors, write_checkpoint
from qtool.console import Reporter
from qtool.errors import RecipeError
from qtool.output import Output, checkpoint_bytes, reserve_output
from qtool.recipe import load_recipe


def run_quantize(recipe_path: Path, overrides: dict, *, run_eval: bool, overwrite: bool, reporter: Reporter) -> dict:
    from qtool.pipeline import preflight, resolve_device

    recipe = load_recipe(recipe_path, overrides)
    if recipe.output is None:
        raise RecipeError(f"{recipe_path}:output: missing; expected a checkpoint directory (or pass --output)")
    out = Path(recipe.output)
    device = resolve_device(recipe.settings.device)
    # Before the original model's perplexity: bad input (a model the stages refuse, a seq_len beyond the context,
    # a broken weight file, undecodable text) must fail in seconds, not after an eval.
    prepared = preflight(recipe)
    # The output is checked (and its temporary created) before any work, and removed if the run does not finish.
    with reserve_output(out, directory=True, overwrite=overwrite,
                        needs_bytes=checkpoint_bytes(recipe, prepared.config), log=reporter.log) as reserved:
        return _quantize(recipe, out, reserved, device, prepared, run_eval=run_eval, reporter=reporter)


def _quantize(recipe, out: Path, reserved: Output, device: torch.device, prepared, *, run_eval: bool,
              reporter: Reporter) -> dict:
    from qtool.eval.zeroshot import TaskSuite
    from qtool.evaluate import eval_record, evaluate_loaded
    from qtool.models.loading import load_model
    from qtool.pipeline import compute_dtype, quantize_model

    ev_result = None
    suite = None
    if run_eval and recipe.eval is not None and recipe.eval.tasks:
        # The tasks' data is checked before any model loads.
        suite = TaskSuite(recipe.eval.tasks, limit=recipe.eval.limit, num_fewshot=recipe.eval.num_fewshot,
                          batch_size=recipe.eval.task_batch_size, data_dir=recipe.eval.data_dir)
    ppl_spec = recipe.eval if recipe.eval is not None and recipe.eval.text is not None else None
    if run_eval and recipe.eval is not None:
        model, tokenizer, _, original = load_model(recipe.model, torch.float32)
        model.to(compute_dtype(recipe.settings.dtype, device, original)).to(device)
        reporter.log("evaluating the original model")
        fp = evaluate_loaded(model, tokenizer, device, spec=ppl_spec, suite=suite, reporter=reporter)
        del model
        gc.collect()

    qm = quantize_model(recipe, reporter, prepared)

    if run_eval and recipe.eval is not None:
        reporter.log("evaluating the quantized model")
        qm.model.to(device)
        q = evaluate_loaded(qm.model, qm.tokenizer, device, spec=ppl_spec, suite=suite, reporter=reporter)
        qm.model.to("cpu")
        ev_result = eval_record(fp, q)
        if suite is not None:
            suite.close()

    tensors = collect_tensors(qm.model, qm.packed, qm.original_dtype)
    layers = {name: p.layer_config(getattr(qm.model.get_submodule(name), "bias", None) is not None)
              for name, p in sorted(qm.packed.items())}
    config = qm.model.config.to_dict()
    config["dtype"] = str(qm.original_dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    bpw = bits_per_weight(qm.packed, tensors)
    manifest_extra = {
        "bits_per_weight": bpw,
        "calibration": qm.calibration,
        "seed": recipe.calibration.seed if recipe.calibration else None,
        "stages": [s.stage.name for s in recipe.stages],
        "transforms": qm.transforms,
        "eval": ev_result,
    }
    write_checkpoint(out, tensors=tensors, config=config, layers=layers, model_schemes=qm.model_schemes,
                     tokenizer=qm.tokenizer,
                     recipe_as_run=recipe.as_run, manifest_extra=manifest_extra,
                     max_shard_bytes=recipe.max_shard_bytes(), reserved=reserved)
    reporter.log(f"wrote {out}")
    return {
        "output": str(out),
        **({"removed_leftovers": [str(p) for p in reserved.removed_leftovers]} if reserved.removed_leftovers else {}),
        "model": recipe.model,
        "quantized_linears": len(qm.packed),
        "bits_per_weight": bpw,
        "calibration": qm.calibration,
        "eval": ev_result,
        "timings": {k: round(v, 3) for k, v in qm.timings.items()},
        "peak_rss_mb": round(qm.peak_rss_mb, 1),
        "device": str(device),
        "recipe": recipe.as_run,
        "settings": dataclasses.asdict(recipe.settings),
    }
