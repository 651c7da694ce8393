"""`qtool quantize`: recipe → block-wise pipeline → (optional perplexity and zero-shot accuracy) → packed checkpoint."""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import time
from pathlib import Path

import torch

from qtool.checkpoint.writer import (
    bits_per_weight,
    collect_tensors,
    source_generation_config,
    write_checkpoint,
)
from qtool.console import Reporter, process_age
from qtool.errors import InputError, Interrupted, RecipeError, UsageError
from qtool.estimate import checkpoint_bytes
from qtool.output import Output, check_output, reserve_output
from qtool.recipe import load_recipe


def resolve_recipe(source, overrides: dict, names: dict[str, str] | None = None):
    """A validated Recipe from a YAML file's path, a dict of the same keys (paths in it relative to the working
    directory) or a Recipe (re-validated with `overrides` applied). `names`: how errors name each override."""
    import copy

    from qtool.recipe import Recipe, validate_recipe

    if isinstance(source, Recipe):
        base = source.path.resolve().parent if source.path is not None else Path.cwd()
        label = str(source.path) if source.path is not None else "recipe"
        return validate_recipe(copy.deepcopy(source.as_run), label, base, overrides, source.path, names)
    if isinstance(source, dict):
        return validate_recipe(copy.deepcopy(source), "recipe", Path.cwd(), overrides, None, names)
    return load_recipe(Path(source), overrides, names)


def run_quantize(
    recipe_path,
    overrides: dict,
    *,
    run_eval: bool,
    overwrite: bool,
    reporter: Reporter,
    resume: bool = False,
    dry_run: bool = False,
    whole_model: bool = False,
    names: dict[str, str] | None = None,
) -> dict | None:
    """`names`: how errors name each override (default: its command-line flag). `resume`: go on from the work folder a killed or interrupted run left beside the output. `dry_run`: check
    everything and estimate the run's memory, size and time without reading a weight. `whole_model`: load the
    whole model into host memory instead of reading one block at a time from the weight files. Returns the
    summary (None on the ranks other than 0 of a run over several processes)."""
    from qtool.distributed import session
    from qtool.pipeline import resolve_device

    startup = process_age()
    if resume and overwrite:
        raise UsageError(
            "--resume with --overwrite: expected one or the other (--resume goes on from the work folder and "
            "replaces the output only if the interrupted run was started with --overwrite; --overwrite "
            "discards the work folder and starts over)"
        )
    recipe = resolve_recipe(recipe_path, overrides, names)
    if recipe.output is None:
        raise RecipeError(
            f"{recipe.path or 'recipe'}:output: missing; expected a checkpoint directory (or pass --output)"
        )
    if "output" not in overrides:
        _check_recipe_output(recipe.path, recipe.output)
    # Under torchrun or accelerate launch, every rank runs this function on its share of the calibration
    # samples (qtool/distributed.py); rank 0 alone touches the output and returns the summary.
    t = time.perf_counter()
    with session(resolve_device(recipe.settings.device)) as world:
        if world.joined:
            _check_world(
                world,
                recipe,
                resume=resume,
                dry_run=dry_run,
                whole_model=whole_model,
                overwrite=overwrite,
                run_eval=run_eval,
            )
        joined = time.perf_counter() - t if world.joined else None
        summary = _run_quantize(
            recipe,
            world,
            run_eval=run_eval,
            overwrite=overwrite,
            reporter=reporter,
            resume=resume,
            dry_run=dry_run,
            whole_model=whole_model,
        )
    if summary is not None and "timings" in summary:
        extra = {"startup_s": startup, "join_s": joined}
        summary["timings"].update({k: round(v, 3) for k, v in extra.items() if v is not None})
    return summary


def _check_recipe_output(recipe_path: Path | None, output: str) -> None:
    """A recipe's `output` must resolve inside the recipe's folder or the working directory (a recipe given as a
    dict: the working directory): a recipe passed around (or written by someone else) must not write wherever it
    likes, such as a system folder when run as root. The command line's -o (qtool.quantize's `output`) writes
    anywhere."""
    out = Path(os.path.realpath(output))
    cwd = Path(os.path.realpath(Path.cwd()))
    if recipe_path is None:
        if out != cwd and cwd not in out.parents:
            raise RecipeError(
                f"recipe:output: resolves to '{out}', outside the working directory ({cwd}); expected a path "
                f"under it, or output= to write there"
            )
        return
    allowed = [Path(os.path.realpath(Path(recipe_path).parent)), cwd]
    if not any(out == a or a in out.parents for a in allowed):
        raise RecipeError(
            f"{recipe_path}:output: resolves to '{out}', outside the recipe's folder ({allowed[0]}) and the "
            f"working directory ({allowed[1]}); expected a path under one of them, or --output to write there"
        )


def _inputs(recipe) -> dict[str, str | None]:
    """What a quantize run reads, by what it is: its output may be none of them, hold none and lie in none."""
    cal, ev = recipe.calibration, recipe.eval
    return {
        "recipe": str(recipe.path) if recipe.path is not None else None,
        "model": recipe.model,
        "calibration text": cal.source if cal is not None else None,
        "stats file": cal.stats if cal is not None else None,
        "evaluation text": ev.text if ev is not None else None,
        "task data folder": ev.data_dir if ev is not None else None,
    }


def _check_world(world, recipe, **flags) -> None:
    """What a run over several processes needs before any weight is read: the same recipe, model and options on
    every rank, a model read block by block, stages whose statistics the ranks can combine, a sample per rank."""
    from qtool.models.loading import load_config

    world.check_same({"recipe": recipe.as_run, "config": load_config(recipe.model).to_dict(), "flags": flags})
    if flags["whole_model"]:
        raise UsageError(
            f"--whole-model: found with {world.size} processes; expected one process (several "
            f"processes read the model block by block)"
        )
    for spec in recipe.stages:
        problem = spec.stage.distributed_problem()
        if problem is not None:
            raise RecipeError(f"stages[{spec.stage.index}].{problem[0]}: {problem[1]}")
    cal = recipe.calibration
    if cal is not None and recipe.needs_calibration() and cal.num_samples < world.size:
        raise RecipeError(
            f"calibration.num_samples: found {cal.num_samples} for {world.size} processes; expected "
            f"at least one calibration window per process"
        )


def _run_quantize(
    recipe,
    world,
    *,
    run_eval: bool,
    overwrite: bool,
    reporter: Reporter,
    resume: bool,
    dry_run: bool,
    whole_model: bool,
) -> dict | None:
    from qtool.checkpoint.partial import Work, partial_path
    from qtool.estimate import check_fits, estimate
    from qtool.onloaded import can_onload, quantize_onloaded
    from qtool.pipeline import preflight, resolve_device

    out = Path(recipe.output)
    partial = partial_path(Path(os.path.abspath(out)))
    state = None
    if world.is_main:  # the work folder and the output are rank 0's; its refusals reach the other ranks
        _check_work_folder(
            out, partial, resume=resume, overwrite=overwrite, dry_run=dry_run, whole_model=whole_model
        )
        if resume and not dry_run:
            state = Work.verify(partial)
    # A resumed run replaces an existing output as the run it continues would have.
    replace = overwrite or bool(state and state["overwrite"])
    if world.is_main:  # before a model or a text is read: a refused output costs a second, not a pre-flight
        check_output(out, directory=True, overwrite=replace, resume=resume, inputs=_inputs(recipe))
    device = resolve_device(recipe.settings.device)
    plan: dict = {}

    def check_memory(prepared) -> None:
        # Before the calibration text is read: what the run needs against what this machine has.
        plan["mode"] = "whole" if whole_model or not can_onload(recipe, prepared) else "blocks"
        if plan["mode"] == "whole" and world.joined:
            raise InputError(
                f"model '{recipe.model}': not a local folder of safetensors weights, which runs over "
                f"{world.size} processes read block by block; expected one (or one process)"
            )
        cal = recipe.calibration
        share = len(world.share(cal.num_samples)) if cal is not None and world.joined else None
        plan["estimate"] = estimate(recipe, prepared, device, plan["mode"], timing=dry_run, samples=share)
        check_fits(plan["estimate"], recipe, out)
        prepared.activations = plan["estimate"].activations
        # beside the output, on its disk; one folder per rank
        prepared.offload_dir = partial.with_name(
            f".{out.name}.activations" + (f".{world.rank}" if world.rank else "")
        )

    # Before the original model's perplexity: bad input (a model the stages refuse, a seq_len beyond the context,
    # a broken weight file, undecodable text) must fail in seconds, not after an eval.
    prepared = preflight(recipe, before_data=check_memory)

    def warn_export() -> None:
        # Once, when the run has succeeded (an error stays the only line of a failed run).
        if prepared.export_problem is not None:
            reporter.log(
                f"warning: this checkpoint will not export to compressed-tensors (transformers and vLLM without "
                f"qtool): {prepared.export_problem}; `target: compressed-tensors` in the recipe refuses such a "
                f"run before it starts"
            )

    if dry_run:
        if not world.is_main:
            return None
        from qtool.estimate import refine

        share = (
            len(world.share(recipe.calibration.num_samples)) if world.joined and recipe.calibration else None
        )
        plan["estimate"] = refine(plan["estimate"], recipe, prepared, device, run_eval, share)
        warn_export()
        return {
            "output": str(out),
            "model": recipe.model,
            "dry_run": True,
            "mode": plan["mode"],
            "device": str(device),
            **plan["estimate"].summary(),
        }
    if not world.is_main:
        quantize_onloaded(recipe, reporter, prepared, partial, resume=resume, world=world, overwrite=replace)
        return None
    if partial.is_dir() and not resume:
        shutil.rmtree(partial)  # --overwrite: a stale work folder is discarded, never reused
    if resume:  # refused before anything beside the output is touched
        from qtool.models.loading import config_dtype
        from qtool.onloaded import identity
        from qtool.pipeline import compute_dtype

        dtype = compute_dtype(recipe.settings.dtype, device, config_dtype(prepared.config))
        ident = identity(recipe, prepared, dtype, device, prepared.config.num_hidden_layers)
        Work.check_identity(partial, state, ident)
    # The output is checked (and its temporary created) before any work, and removed if the run does not finish.
    from qtool.distributed import on_abort

    with (
        reserve_output(
            out,
            directory=True,
            overwrite=replace,
            resume=resume,
            needs_bytes=checkpoint_bytes(recipe, prepared.config),
            log=reporter.log,
            inputs=_inputs(recipe),
        ) as reserved,
        on_abort(reserved.discard),
        on_abort(lambda: _drop_unfinished(partial)),
    ):
        if plan["mode"] == "blocks":
            summary = _quantize_onloaded(
                recipe,
                out,
                reserved,
                device,
                prepared,
                partial,
                resume=resume,
                overwrite=replace,
                run_eval=run_eval,
                reporter=reporter,
                world=world,
            )
        else:
            summary = _quantize(recipe, out, reserved, device, prepared, run_eval=run_eval, reporter=reporter)
    warn_export()
    return summary


def _drop_unfinished(partial: Path) -> None:
    """Remove a work folder that holds no finished block: nothing in it is worth resuming. One whose state does
    not parse is left as it is (the refusal that names it says that --overwrite discards it)."""
    from qtool.checkpoint.partial import Work
    from qtool.errors import CheckpointError

    if not partial.is_dir():
        return
    try:
        state = Work.load_state(partial)
    except CheckpointError:
        return
    if state is None or state["next_block"] == 0:
        shutil.rmtree(partial, ignore_errors=True)


def _check_work_folder(
    out: Path, partial: Path, *, resume: bool, overwrite: bool, dry_run: bool, whole_model: bool
) -> None:
    """Refuse a --resume without a work folder, and a work folder left beside the output without --resume or
    --overwrite."""
    from qtool.checkpoint.partial import STATE, Work

    if resume and not dry_run:
        if whole_model:
            raise UsageError(
                "--resume: a run with --whole-model keeps no work folder; expected a block-by-block run"
            )
        if not partial.is_dir():
            raise UsageError(
                f"--resume: nothing to resume for output '{out}' (no '{partial.name}' beside it); "
                f"expected the output of an interrupted run (run without --resume to start one)"
            )
    elif partial.is_dir() and not overwrite and not dry_run:
        state = Work.read_state(partial)
        if state:
            done = f"{state['next_block']} of {state['identity']['num_blocks']} finished blocks"
        elif (partial / STATE).exists():
            done = f"a {STATE} this version cannot read"
        else:
            done = "no finished block"
        raise UsageError(
            f"output '{out}': '{partial.name}' beside it holds {done} of an interrupted run; pass "
            f"--resume to continue it, or --overwrite to discard it and start over"
        )


def _eval_suite(recipe, run_eval: bool):
    from qtool.eval.zeroshot import TaskSuite

    if run_eval and recipe.eval is not None and recipe.eval.tasks:
        return TaskSuite(
            recipe.eval.tasks,
            limit=recipe.eval.limit,
            num_fewshot=recipe.eval.num_fewshot,
            batch_size=recipe.eval.task_batch_size,
            data_dir=recipe.eval.data_dir,
        )
    return None


def _evaluate_original(recipe, device: torch.device, suite, reporter: Reporter) -> dict:
    """The original model's evaluation under the recipe's protocol, in the run's compute dtype: whole when it fits
    the device, block by block (perplexity) when it does not (qtool/eval/streamed.py)."""
    from qtool.evaluate import evaluate_one
    from qtool.models.loading import config_dtype, load_config
    from qtool.pipeline import compute_dtype

    spec = recipe.eval if recipe.eval.text is not None else None
    dtype = compute_dtype(recipe.settings.dtype, device, config_dtype(load_config(recipe.model)))
    reporter.log("evaluating the original model")
    return evaluate_one(recipe.model, device, spec, suite, reporter, dtype=dtype)


def _quantize_onloaded(
    recipe,
    out: Path,
    reserved: Output,
    device: torch.device,
    prepared,
    partial: Path,
    *,
    resume: bool,
    overwrite: bool,
    run_eval: bool,
    reporter: Reporter,
    world,
) -> dict:
    suite = _eval_suite(recipe, run_eval)
    try:
        return _onloaded(
            recipe,
            out,
            reserved,
            device,
            prepared,
            partial,
            resume=resume,
            overwrite=overwrite,
            run_eval=run_eval,
            suite=suite,
            reporter=reporter,
            world=world,
        )
    finally:
        if suite is not None:
            suite.close()


def _onloaded(
    recipe,
    out: Path,
    reserved: Output,
    device: torch.device,
    prepared,
    partial: Path,
    *,
    resume: bool,
    overwrite: bool,
    run_eval: bool,
    suite,
    reporter: Reporter,
    world,
) -> dict:
    from qtool.onloaded import quantize_onloaded

    evaluate, record = None, {"eval": None}
    if run_eval and recipe.eval is not None:
        fp = _evaluate_original(recipe, device, suite, reporter)
        evaluator = _checkpoint_evaluator(recipe, device, fp, suite, prepared.tokenizer, reporter)

        def evaluate(folder: Path) -> dict:
            record["eval"] = evaluator(folder)  # the report keeps the full paths the manifest shortens
            return record["eval"]

        gc.collect()
    try:
        run = quantize_onloaded(
            recipe,
            reporter,
            prepared,
            partial,
            resume=resume,
            world=world,
            overwrite=overwrite,
            checked=resume,
        )
    except BaseException:
        _drop_unfinished(partial)
        raise
    config, bpw, manifest_extra = _checkpoint_fields(
        recipe,
        dict(run.config),
        run.original_dtype,
        run.packed,
        run.tensors.meta,
        run.calibration,
        run.transforms,
        None,
    )
    t = time.perf_counter()
    try:
        write_checkpoint(
            out,
            tensors=run.tensors,
            config=config,
            layers=run.layers,
            model_schemes=run.model_schemes,
            tokenizer=run.tokenizer,
            generation_config=source_generation_config(recipe.model),
            recipe_as_run=recipe.as_run,
            manifest_extra=manifest_extra,
            max_shard_bytes=recipe.max_shard_bytes(),
            reserved=reserved,
            evaluate=evaluate,
        )
    except KeyboardInterrupt as e:
        raise Interrupted(
            f"interrupted while writing the checkpoint; all {run.work.next_block} blocks are kept in "
            f"'{run.work.folder}'; run the same command with --resume to write it",
            e,
        ) from None
    run.timings["write_s"] = time.perf_counter() - t
    run.work.remove()
    reporter.log(f"wrote {out}")
    return {
        "output": str(out),
        **(
            {"removed_leftovers": [str(p) for p in reserved.removed_leftovers]}
            if reserved.removed_leftovers
            else {}
        ),
        "model": recipe.model,
        "mode": "blocks",
        "activations": prepared.activations,
        **({"resumed_at_block": run.resumed_at} if run.resumed_at else {}),
        "quantized_linears": len(run.packed),
        "bits_per_weight": bpw,
        "calibration": run.calibration,
        "eval": record["eval"],
        "timings": {k: round(v, 3) for k, v in run.timings.items()},
        "peak_rss_mb": round(run.peak_rss_mb, 1),
        **_peak_gpu(device),
        "device": str(device),
        "world_size": world.size,
        "ranks": run.ranks,
        "recipe": recipe.as_run,
        "settings": dataclasses.asdict(recipe.settings),
        # null: the checkpoint exports to compressed-tensors; else why not (`qtool export` would refuse it)
        "export_problem": prepared.export_problem,
    }


def _checkpoint_evaluator(recipe, device: torch.device, fp: dict, suite, tokenizer, reporter: Reporter):
    """What evaluates the written checkpoint (loaded from the writer's folder one tensor at a time) and returns
    the manifest's record of both evaluations. `tokenizer`: the original model's, so the protocol names it (the
    checkpoint's is a copy, in a temporary folder)."""
    from qtool.checkpoint.loader import load_checkpoint
    from qtool.evaluate import eval_record, evaluate_loaded
    from qtool.models.loading import config_dtype, load_config
    from qtool.pipeline import compute_dtype

    spec = recipe.eval if recipe.eval.text is not None else None
    dtype = compute_dtype(recipe.settings.dtype, device, config_dtype(load_config(recipe.model)))

    def evaluate(folder: Path) -> dict:
        reporter.log("evaluating the quantized model")
        model = load_checkpoint(folder, device=str(device), dtype=dtype, verify=False)
        q = evaluate_loaded(model, tokenizer, device, spec=spec, suite=suite, reporter=reporter)
        del model
        gc.collect()
        return eval_record(fp, q)

    return evaluate


def _checkpoint_fields(
    recipe, config: dict, original_dtype, packed, tensors, calibration, transforms, ev_result
) -> tuple[dict, dict, dict]:
    """config.json (with the original dtype), bits per weight and the manifest's run fields, the same for the
    block-by-block and the whole-model run."""
    config["dtype"] = str(original_dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    bpw = bits_per_weight(packed, tensors)
    from qtool.checkpoint.card import source_metadata

    return (
        config,
        bpw,
        {
            "bits_per_weight": bpw,
            "calibration": calibration,
            "seed": recipe.calibration.seed if recipe.calibration else None,
            "stages": [s.stage.name for s in recipe.stages],
            "transforms": transforms,
            "eval": ev_result,
            "source": source_metadata(recipe.model),
        },
    )


def _peak_gpu(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {"peak_gpu_mb": round(torch.cuda.max_memory_allocated(device) / 2**20, 1)}


def _quantize(
    recipe, out: Path, reserved: Output, device: torch.device, prepared, *, run_eval: bool, reporter: Reporter
) -> dict:
    from qtool.evaluate import eval_record, evaluate_loaded
    from qtool.pipeline import quantize_model

    ev_result = None
    suite = _eval_suite(recipe, run_eval)  # the tasks' data is checked before any model loads
    ppl_spec = recipe.eval if recipe.eval is not None and recipe.eval.text is not None else None
    if run_eval and recipe.eval is not None:
        fp = _evaluate_original(recipe, device, suite, reporter)
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
    layers = {
        name: p.layer_config(getattr(qm.model.get_submodule(name), "bias", None) is not None)
        for name, p in sorted(qm.packed.items())
    }
    config, bpw, manifest_extra = _checkpoint_fields(
        recipe,
        qm.model.config.to_diff_dict(),
        qm.original_dtype,
        qm.packed,
        tensors,
        qm.calibration,
        qm.transforms,
        ev_result,
    )
    t = time.perf_counter()
    write_checkpoint(
        out,
        tensors=tensors,
        config=config,
        layers=layers,
        model_schemes=qm.model_schemes,
        tokenizer=qm.tokenizer,
        generation_config=source_generation_config(recipe.model),
        recipe_as_run=recipe.as_run,
        manifest_extra=manifest_extra,
        max_shard_bytes=recipe.max_shard_bytes(),
        reserved=reserved,
    )
    qm.timings["write_s"] = time.perf_counter() - t
    reporter.log(f"wrote {out}")
    return {
        "output": str(out),
        **(
            {"removed_leftovers": [str(p) for p in reserved.removed_leftovers]}
            if reserved.removed_leftovers
            else {}
        ),
        "model": recipe.model,
        "mode": "whole",
        "activations": prepared.activations,
        "quantized_linears": len(qm.packed),
        "bits_per_weight": bpw,
        "calibration": qm.calibration,
        "eval": ev_result,
        "timings": {k: round(v, 3) for k, v in qm.timings.items()},
        "peak_rss_mb": round(qm.peak_rss_mb, 1),
        **_peak_gpu(device),
        "device": str(device),
        "world_size": 1,
        "recipe": recipe.as_run,
        "settings": dataclasses.asdict(recipe.settings),
        # null: the checkpoint exports to compressed-tensors; else why not (`qtool export` would refuse it)
        "export_problem": prepared.export_problem,
    }
