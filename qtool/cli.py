"""The `qtool` command line: calibrate, quantize, pack, eval, bench."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import click

from qtool.console import Reporter
from qtool.errors import NotImplementedYet
from qtool.failure import JSON_KEY, QtoolGroup
from qtool.version import __version__

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def output_options(f):
    """--json, --quiet, --verbose on every command; builds the Reporter passed as `reporter`."""

    @click.option(
        "--json", "json_mode", is_flag=True, help="Print a machine-readable JSON summary on stdout."
    )
    @click.option("-q", "--quiet", is_flag=True, help="Only print results and errors.")
    @click.option("-v", "--verbose", is_flag=True, help="Print more detail while working.")
    @functools.wraps(f)
    def wrapper(*args, json_mode: bool, quiet: bool, verbose: bool, **kwargs):
        click.get_current_context().meta[JSON_KEY] = json_mode  # errors are then also JSON objects on stdout
        _quiet_libraries()
        from qtool.distributed import env_rank, launched

        command = click.get_current_context().info_name
        size = int(os.environ.get("WORLD_SIZE") or 1)
        if launched() and size > 1 and command != "quantize":
            from qtool.errors import UsageError

            # N copies of one command would each do all the work and race to write the same output.
            raise UsageError(
                f"qtool {command}: started by a launcher as rank {env_rank()} of {size} processes; "
                f"expected one process (qtool quantize alone runs over several)"
            )
        # Under a launcher with several processes, rank 0 alone logs and shows progress (errors: every rank).
        quiet = quiet or (launched() and env_rank() != 0)
        return f(*args, reporter=Reporter(quiet=quiet, verbose=verbose, json_mode=json_mode), **kwargs)

    wrapper.qtool_json_option = True
    return wrapper


def _quiet_libraries() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    import huggingface_hub

    # A retried request logs a warning per attempt; the error that ends it is qtool's one line.
    huggingface_hub.utils.logging.set_verbosity_error()
    try:
        import datasets

        datasets.utils.logging.set_verbosity_error()
        datasets.disable_progress_bars()
    except ImportError:
        pass


def emit(reporter: Reporter, summary: dict, rows: list[tuple[str, str]], title: str) -> None:
    from qtool import interrupts

    # A signal during the last steps is reported instead of the summary (one JSON object on stdout, never two).
    interrupts.final_check()
    if reporter.json_mode:
        click.echo(json.dumps(summary, indent=2, sort_keys=True, default=str))
        return
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows:
        table.add_row(k, v)
    reporter.out.print(table)


@click.group(
    cls=QtoolGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110}
)
@click.version_option(__version__, prog_name="qtool")
def cli() -> None:
    """Quantize Hugging Face causal LMs into packed checkpoints, and measure them.

    \b
    Typical use:
      qtool quantize recipes/gptq-w4a16-g128.yaml --model meta-llama/Llama-2-7b-hf -o out/llama2-7b-w4
      qtool eval out/llama2-7b-w4 --text wikitext2.txt --seq-len 2048
    """


def _recipe_overrides(model, output, calibration, num_samples, seq_len, seed, stats) -> dict:
    over = {
        "model": model,
        "output": output,
        "calibration.source": calibration,
        "calibration.num_samples": num_samples,
        "calibration.seq_len": seq_len,
        "calibration.seed": seed,
        "calibration.stats": stats,
    }
    return {k: v for k, v in over.items() if v is not None}


def device_option(what: str):
    return click.option(
        "--device", default="auto", show_default=True, help=f"auto, cpu, cuda or cuda:N: {what}."
    )


def _given(name: str) -> bool:
    from click.core import ParameterSource

    return click.get_current_context().get_parameter_source(name) is not ParameterSource.DEFAULT


def recipe_override_options(f):
    for opt in reversed(
        [
            click.option("--model", help="Model directory or hub id (overrides the recipe's `model`)."),
            click.option(
                "--calibration",
                help="Calibration text: .txt/.jsonl file or datasets name (overrides `calibration.source`).",
            ),
            click.option(
                "--num-samples", type=int, help="Calibration windows (overrides `calibration.num_samples`)."
            ),
            click.option(
                "--seq-len", type=int, help="Tokens per calibration window (overrides `calibration.seq_len`)."
            ),
            click.option(
                "--seed", type=int, help="Calibration sampling seed (overrides `calibration.seed`)."
            ),
        ]
    ):
        f = opt(f)
    return f


@cli.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@recipe_override_options
@click.option("-o", "--output", help="Checkpoint directory to write (overrides the recipe's `output`).")
@click.option("--stats", help="Stats file from `qtool calibrate` (overrides `calibration.stats`).")
@click.option(
    "--eval/--no-eval",
    "run_eval",
    default=True,
    show_default=True,
    help="Measure perplexity of the original and the quantized model when the recipe has an `eval` section.",
)
@click.option(
    "--max-windows",
    "--eval-windows",
    "max_windows",
    type=int,
    help="Evaluate only the first N windows (overrides `eval.max_windows`; --eval-windows is its old name).",
)
@device_option("the compute device of the block-wise pipeline (overrides `settings.device`)")
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace an existing output directory (and discard the work folder of an interrupted run).",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue an interrupted or killed run from its last finished block "
    "(same recipe, model and calibration data).",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Check the recipe, model files and calibration data and print the "
    "estimated peak memory, output size and time, without loading "
    "weights.",
)
@click.option(
    "--whole-model",
    is_flag=True,
    help="Load the whole model into host memory (default: one block at a "
    "time from the weight files, unless the recipe evaluates).",
)
@output_options
def quantize(
    recipe: Path,
    model,
    calibration,
    num_samples,
    seq_len,
    seed,
    output,
    stats,
    run_eval,
    max_windows,
    device,
    overwrite,
    resume,
    dry_run,
    whole_model,
    reporter: Reporter,
) -> None:
    """Run RECIPE: read the model block by block, run its stages, write a packed checkpoint.

    The recipe is validated completely before any model is loaded. The checkpoint directory appears only when
    it is complete, with recipe.yaml (as run) and a manifest of file hashes beside the tensors. While it runs,
    finished blocks are kept in a `.NAME.partial` folder beside the output, from which --resume continues.
    """
    from qtool.api import run as api_quantize

    _, summary = api_quantize(
        recipe,
        tokenizer=None,
        quiet=False,
        keyword_names=False,
        model=model,
        calibration=calibration,
        output=output,
        num_samples=num_samples,
        seq_len=seq_len,
        seed=seed,
        stats=stats,
        max_windows=max_windows,
        device=None if device == "auto" and not _given("device") else device,
        run_eval=run_eval,
        overwrite=overwrite,
        reporter=reporter,
        resume=resume,
        dry_run=dry_run,
        whole_model=whole_model,
    )
    if summary is None:  # a rank other than 0 of a run over several processes: rank 0 reports
        return
    if dry_run:
        from qtool.units import format_size

        est = summary["estimate"]

        def gb(v) -> str:
            return "-" if v is None else format_size(v)

        rows = [
            ("model", summary["model"]),
            ("mode", "block by block" if summary["mode"] == "blocks" else "whole model in memory"),
            ("device", summary["device"]),
            ("blocks", str(est["num_blocks"])),
            ("peak host memory", f"about {gb(est['peak_host_bytes'])}"),
            ("peak GPU memory", f"about {gb(est['peak_gpu_bytes'])}" if est["peak_gpu_bytes"] else "-"),
            ("output size", f"at least {gb(est['output_bytes'])}"),
            ("time", "-" if est["seconds"] is None else f"about {est['seconds']:.0f} s (rough)"),
        ]
        emit(reporter, summary, rows, "qtool quantize --dry-run")
        return
    rows = [
        ("checkpoint", summary["output"]),
        ("quantized linears", str(summary["quantized_linears"])),
        (
            "bits per weight",
            f"{summary['bits_per_weight']['quantized_linears']:.3f} (linears), "
            f"{summary['bits_per_weight']['all_parameters']:.3f} (all)",
        ),
        ("wall time", f"{summary['timings']['total_s']:.1f} s"),
        ("peak RSS", f"{summary['peak_rss_mb']:.0f} MB"),
    ]
    if "peak_gpu_mb" in summary:
        rows.append(("peak GPU memory", f"{summary['peak_gpu_mb']:.0f} MB"))
    reported = summary["bits_per_weight"].get("reported_layers")
    if reported:  # layouts whose paper counts bits its own way (mixed-2-4-16: Eq. 10)
        rows.insert(3, ("bits per weight (paper)", ", ".join(f"{v:.3f} ({k})" for k, v in reported.items())))
    ev = summary.get("eval")
    if ev and "protocol" in ev:
        rows.append(("perplexity (original)", f"{ev['original']['perplexity']:.4f}"))
        rows.append(("perplexity (quantized)", f"{ev['quantized']['perplexity']:.4f}"))
        p = ev["protocol"]
        rows.append(
            (
                "protocol",
                f"{Path(p['text']).name}, {ev['quantized']['windows']} windows x {p['seq_len']}, "
                f"stride {p['stride']}",
            )
        )
    if ev and "tasks_protocol" in ev:
        from qtool.evaluate import format_value

        for task, ms in ev["quantized"]["tasks"].items():
            for metric, v in ms.items():
                o = ev["original"]["tasks"].get(task, {}).get(metric)
                before = format_value(o["value"], o["stderr"]) if o else "-"
                rows.append((f"{task} {metric}", f"{before} → {format_value(v['value'], v['stderr'])}"))
        p = ev["tasks_protocol"]
        rows.append(
            (
                "task protocol",
                f"limit {p['limit'] or 'none'}, {p['num_fewshot']}-shot, lm-eval "
                f"{p['lm_eval_version']}, {p['runtime']} on {p['device']}",
            )
        )
    emit(reporter, summary, rows, "qtool quantize")


@cli.command()
@click.argument("recipe", required=False, type=click.Path(dir_okay=False, path_type=Path))
@recipe_override_options
@click.option(
    "-o",
    "--output",
    "stats_out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Stats file to write (safetensors).",
)
@click.option(
    "--hessians/--no-hessians",
    default=False,
    show_default=True,
    help="Also store each linear's input Hessian (K×K floats per linear).",
)
@device_option("where the original model runs")
@output_options
def calibrate(
    recipe, model, calibration, num_samples, seq_len, seed, stats_out, hessians, device, reporter: Reporter
) -> None:
    """Collect per-linear input statistics of the original model into a stats file.

    For every linear in the decoder blocks: per-channel absmax and mean square, token count and optionally the
    Hessian, stamped with the calibration data hash and settings. Model and calibration come from RECIPE and/or
    --model/--calibration; `quantize --stats` reuses the file.
    """
    from qtool.calibrate import run_calibrate

    overrides = _recipe_overrides(model, None, calibration, num_samples, seq_len, seed, None)
    summary = run_calibrate(recipe, overrides, stats_out, hessians=hessians, device=device, reporter=reporter)
    emit(
        reporter,
        summary,
        [
            ("stats file", summary["output"]),
            ("linears", str(summary["linears"])),
            ("tokens", str(summary["tokens"])),
            ("data sha256", summary["data_sha256"][:16]),
        ],
        "qtool calibrate",
    )


@cli.command("eval")
@click.argument("model")
@click.argument("model_b", required=False)
@click.option(
    "--text", required=False, help="Text to score: .txt/.jsonl file, datasets folder or datasets name."
)
@click.option(
    "--seq-len",
    type=int,
    default=None,
    help="Tokens per window (default: 2048, or the model's context length when shorter).",
)
@click.option(
    "--max-windows",
    "--windows",
    "max_windows",
    type=int,
    help="Score only the first N windows (--windows: its old name).",
)
@click.option("--stride", type=int, help="Tokens between window starts (default: seq-len, no overlap).")
@click.option("--separator", help="Split the text into documents here; each is tokenized with BOS.")
@click.option("--text-field", default="text", show_default=True, help="Field holding text in jsonl/datasets.")
@click.option("--split", default="test", show_default=True, help="datasets split.")
@click.option(
    "--encoding", default="utf-8", show_default=True, help="Text encoding of a .txt/.jsonl --text file."
)
@click.option(
    "--allow-long-context",
    is_flag=True,
    help="Allow --seq-len beyond the model's context length (refused otherwise).",
)
@click.option(
    "--tasks",
    help="Zero-shot tasks through lm-evaluation-harness, comma-separated: piqa, arc_easy, "
    "arc_challenge, winogrande, hellaswag, lambada_openai, or tasks of --include-path.",
)
@click.option("--limit", type=int, help="Score only the first N items of each task.")
@click.option("--num-fewshot", type=int, default=0, show_default=True, help="Examples in each task prompt.")
@click.option(
    "--batch-size",
    help="Windows (perplexity, default 4) or lm-eval requests (tasks, default 32) per "
    "forward pass; auto lets lm-eval find the largest that fits.",
)
@device_option("where the models run")
@click.option(
    "--fewshot-seed",
    type=int,
    default=1234,
    show_default=True,
    help="lm-eval's seeds (few-shot sampling). --seed is the calibration seed of quantize and calibrate.",
)
@click.option("--seed", "old_seed", type=int, hidden=True)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    help="Folder of the standard tasks' JSONL files "
    "(default: $QTOOL_ZEROSHOT_DATA, else "
    "../shared/assets/data/zeroshot).",
)
@click.option(
    "--include-path",
    multiple=True,
    type=click.Path(file_okay=False),
    help="Folder of your own lm-eval task YAMLs over local data (repeatable). It is code: "
    "lm-eval runs the Python functions its YAMLs name (!function).",
)
@click.option(
    "--max-memory",
    help="Memory an evaluated model may take on the device (host memory on the CPU), e.g. "
    "20GB (default: what is free). A larger original model's perplexity is computed "
    "block by block; for tasks it is spread over host memory and disk.",
)
@click.option(
    "--recipe",
    "recipe_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Take the protocol (text, seq-len, windows, stride, separator, tasks, ...) from this recipe's `eval` "
    "section and the baseline from its `model`, as `qtool quantize` measured them; flags given here win.",
)
@click.option(
    "--dequantize",
    is_flag=True,
    help="Load a compressed-tensors model dequantized to float (as the export's asymmetric schemes need with "
    "some transformers versions; tried by itself, with a note, when the model does not load as stored).",
)
@click.option("--baseline", help="Evaluate this model too (the original) and compare MODEL against it.")
@click.option(
    "--max-ppl-increase",
    help="Quality gate: fail (exit 8) when MODEL's perplexity exceeds the "
    "baseline's by more than this percentage, e.g. 5%.",
)
@click.option(
    "--max-acc-drop",
    help="Quality gate: fail (exit 8) when any task's acc or acc_norm is more than this "
    "many percentage points below the baseline's, e.g. 1.5.",
)
@output_options
def eval_cmd(
    model,
    model_b,
    text,
    seq_len,
    max_windows,
    stride,
    separator,
    text_field,
    split,
    encoding,
    allow_long_context,
    tasks,
    limit,
    num_fewshot,
    batch_size,
    device,
    fewshot_seed,
    old_seed,
    data_dir,
    include_path,
    max_memory,
    recipe_path,
    dequantize,
    baseline,
    max_ppl_increase,
    max_acc_drop,
    reporter: Reporter,
) -> None:
    """Perplexity and zero-shot accuracy of MODEL (a qtool checkpoint, a model directory or a hub id), or of MODEL
    and MODEL_B side by side with the difference.

    \b
    The protocol (windows and token hash; lm-eval version, task versions, limit, few-shot count, device and whether
    the packed layers ran their CUDA kernels or the torch reference) is printed and stored in the JSON result.
      qtool eval out/smollm2-gptq --tasks piqa,arc_easy --limit 200
      qtool eval .cache/models/smollm2-135m out/smollm2-gptq --tasks piqa --text wikitext2.txt --seq-len 512

    \b
    Quality gate (exit 8 when it fails, naming each metric; the results are printed first):
      qtool eval out/smollm2-gptq --baseline .cache/models/smollm2-135m --text wikitext2.txt \\
          --max-ppl-increase 5% --tasks piqa --max-acc-drop 1.5
    """
    from qtool.api import evaluate as api_evaluate
    from qtool.errors import GateFailed, UsageError
    from qtool.gate import describe_failure
    from qtool.units import parse_size

    if old_seed is not None:
        raise UsageError(
            "--seed: qtool eval calls lm-eval's few-shot seed --fewshot-seed; --seed is the calibration seed "
            "of qtool quantize and qtool calibrate"
        )
    memory = None
    if max_memory is not None:
        try:
            memory = parse_size(max_memory)
        except ValueError:
            raise UsageError(f"--max-memory: found {max_memory!r}, expected a size such as 20GB") from None
    # Flags left at their defaults give way to the recipe's protocol; flags given win.
    protocol = {
        name: value
        for name, value in (
            ("text", text),
            ("seq_len", seq_len),
            ("max_windows", max_windows),
            ("stride", stride),
            ("separator", separator),
            ("text_field", text_field),
            ("split", split),
            ("encoding", encoding),
            ("tasks", tasks),
            ("limit", limit),
            ("num_fewshot", num_fewshot),
            ("data_dir", data_dir),
        )
        if recipe_path is None or _given(name)
    }
    summary = api_evaluate(
        model,
        model_b,
        baseline=baseline,
        recipe=recipe_path,
        max_ppl_increase=max_ppl_increase,
        max_acc_drop=max_acc_drop,
        device=device,
        batch_size=batch_size,
        fewshot_seed=fewshot_seed,
        include_paths=include_path,
        max_memory=memory,
        allow_long_context=allow_long_context,
        dequantize=dequantize,
        reporter=reporter,
        **protocol,
    )
    refs = summary["models"] if "models" in summary else [summary]
    gate_active = "gate" in summary
    if reporter.json_mode:
        emit(reporter, summary, [], "qtool eval")
    elif len(refs) == 1:
        _print_eval(reporter, summary)
    else:
        _print_comparison(reporter, summary)
        if gate_active:
            reporter.out.print(
                "gate: "
                + "; ".join(
                    f"{c['task']} {c['metric']} {c['change']:+.2f}{'%' if c['unit'] == '%' else ' points'} "
                    f"({'ok' if c['passed'] else 'FAILED'})"
                    for c in summary["gate"]["checks"]
                )
            )
    if gate_active and not summary["gate"]["passed"]:
        if (
            reporter.json_mode
        ):  # stdout already holds the summary, with its gate object: no second JSON object
            click.echo(f"qtool: error: {describe_failure(summary['gate'])}", err=True)
            click.get_current_context().exit(GateFailed.exit_code)
        raise GateFailed(describe_failure(summary["gate"]))


def _protocol_rows(summary: dict) -> list[tuple[str, str]]:
    rows = []
    if "perplexity" in summary:
        p = summary["protocol"]
        rows += [
            ("perplexity", f"{summary['perplexity']:.4f}"),
            ("text", p["text"]),
            ("windows", f"{summary['windows']} x {p['seq_len']} tokens, stride {p['stride']}"),
            ("scored tokens", str(summary["scored_tokens"])),
            ("tokenizer", p["tokenizer"]),
        ]
    if "zeroshot" in summary:
        z = summary["zeroshot"]["protocol"]
        rows += [
            (
                "tasks",
                f"limit {z['limit'] or 'none'}, {z['num_fewshot']}-shot, batch {z['batch_size']}, "
                f"lm-eval {z['lm_eval_version']}",
            ),
            ("runtime", f"{z['runtime']} on {z['device']}"),
            ("task seconds", f"{z['seconds']:.1f}"),
        ]
    return rows


def _print_eval(reporter: Reporter, summary: dict) -> None:
    from rich.table import Table

    from qtool.eval.zeroshot import metrics
    from qtool.evaluate import format_value

    emit(
        reporter,
        summary,
        [("model", summary["model"]), *_protocol_rows(summary), ("seconds", f"{_seconds(summary):.1f}")],
        "qtool eval",
    )
    if "zeroshot" in summary:
        table = Table(title="zero-shot", title_justify="left")
        for col in ("task", "metric", "value ± stderr"):
            table.add_column(col)
        for task, ms in metrics(summary["zeroshot"]["results"]).items():
            for metric, v in ms.items():
                table.add_row(task, metric, format_value(v["value"], v["stderr"]))
        reporter.out.print(table)


def _seconds(summary: dict) -> float:
    return summary.get("seconds", 0.0) + summary.get("zeroshot", {}).get("protocol", {}).get("seconds", 0.0)


def _print_comparison(reporter: Reporter, summary: dict) -> None:
    from rich.table import Table

    from qtool import interrupts

    interrupts.final_check()

    from qtool.evaluate import format_value

    a, b = summary["models"]
    table = Table(
        title=f"qtool eval: A = {a['model']} ({a['kind']}), B = {b['model']} ({b['kind']})",
        title_justify="left",
    )
    for col in ("task", "metric", "A", "B", "B - A"):
        table.add_column(col)
    for r in summary["comparison"]:
        table.add_row(
            r["task"],
            r["metric"],
            format_value(r["a"], r["a_stderr"]),
            format_value(r["b"], r["b_stderr"]),
            f"{r['delta']:+.4f}",
        )
    reporter.out.print(table)
    for label, s in (("A", a), ("B", b)):
        reporter.out.print(
            f"{label}: "
            + "; ".join(
                f"{k} {v}" for k, v in _protocol_rows(s) if k in ("runtime", "tasks", "text", "windows")
            )
            + f"; {_seconds(s):.1f} s"
        )


@cli.command()
@click.argument("checkpoint", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write a re-packed copy here (default: only verify).",
)
@click.option(
    "--max-shard-size", default="5GB", show_default=True, help="Largest safetensors file in the copy."
)
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
@click.option(
    "--verify/--quick",
    default=True,
    show_default=True,
    help="--verify: hash every file against the manifest and read every tensor. --quick: only what "
    "every load checks (file sizes, safetensors headers, configs, tokenizer); no tensor is read.",
)
@output_options
def pack(checkpoint: Path, output, max_shard_size, overwrite, verify: bool, reporter: Reporter) -> None:
    """Verify a packed CHECKPOINT (hashes, layouts, tensor shapes) and optionally re-pack it (e.g. re-shard).

    Prints the quantized layers, their layouts and the bits per weight. Loading a checkpoint (qtool eval,
    qtool.load, from_pretrained) checks file sizes and headers only; the full hashes are checked here.
    """
    from qtool.repack import run_pack

    summary = run_pack(checkpoint, output, max_shard_size, overwrite, reporter, verify=verify)

    def shown(k, v):  # per-layer bits (mixed-2-4-16) stay in the JSON only
        return (
            {b: x for b, x in v.items() if b != "layers"}
            if k == "bits_per_weight" and isinstance(v, dict)
            else v
        )

    emit(
        reporter, summary, [(k, str(shown(k, v))) for k, v in summary.items() if k != "layouts"], "qtool pack"
    )


@cli.command()
@click.argument("checkpoint", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["compressed-tensors", "gptq"]),
    required=True,
    help="Target format: compressed-tensors (transformers with compressed-tensors, vLLM) or gptq (qweight, "
    "qzeros, scales, g_idx: GPTQModel, transformers' GPTQ integration, vLLM).",
)
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder to write the exported model into.",
)
@click.option(
    "--max-shard-size", default="5GB", show_default=True, help="Largest safetensors file of the export."
)
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
@output_options
def export(checkpoint: Path, fmt, output: Path, max_shard_size, overwrite, reporter: Reporter) -> None:
    """Write a verified qtool CHECKPOINT in another library's format, for clients without qtool.

    \b
    Only schemes the format expresses exactly are exported (formats/compressed-tensors.md, formats/gptq.md); the
    first layer it cannot hold (outlier columns, mixed precision, two-level scales, a partial group, a quantized
    KV cache) is refused before anything is written.
      qtool export out/smollm2-gptq --format compressed-tensors -o out/smollm2-gptq-ct
      qtool export out/smollm2-gptq --format gptq -o out/smollm2-gptq-gptq
    """
    from qtool.api import export as api_export

    summary = api_export(
        checkpoint, output, format=fmt, max_shard_size=max_shard_size, overwrite=overwrite, reporter=reporter
    )
    emit(
        reporter,
        summary,
        [
            ("output", summary["output"]),
            ("format", f"{fmt} ({summary['compression_format']})"),
            ("quantized layers", str(summary["quantized_layers"])),
            *[(k, f"{v} layers") for k, v in summary["schemes"].items()],
            ("left in float", _names(summary["ignored"])),
        ],
        "qtool export",
    )


def _names(names: list[str]) -> str:
    if len(names) <= 4:
        return ", ".join(names) or "-"
    return f"{len(names)} linears: {', '.join(names[:2])}, ..., {names[-1]}"


def _bench_stub():
    @cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    def bench() -> None:
        """Time the packed kernels against cuBLAS FP16/INT8/FP8 baselines (needs a CUDA GPU)."""
        raise NotImplementedYet("bench: kernel and end-to-end benchmarks are not implemented yet")


try:
    from qtool.bench.command import bench as _bench

    cli.add_command(_bench)
except ImportError:
    _bench_stub()


def main() -> None:
    cli(prog_name="qtool")


if __name__ == "__main__":
    main()
