"""The Python API (`qtool.quantize`, `qtool.evaluate`, `qtool.export`, `qtool.load`): what the commands do, as
functions, with their arguments checked. The command line calls these with its parsed flags; each returns the dict
its command prints with --json."""

from __future__ import annotations

import tempfile
from pathlib import Path

from qtool.console import Reporter
from qtool.errors import UsageError

# Keyword overrides of `quantize` → the recipe keys they set (the command line's flags, by their Python names).
OVERRIDES = {
    "model": "model",
    "output": "output",
    "calibration": "calibration.source",
    "num_samples": "calibration.num_samples",
    "seq_len": "calibration.seq_len",
    "seed": "calibration.seed",
    "stats": "calibration.stats",
    "max_windows": "eval.max_windows",
    "device": "settings.device",
}
# Names the overrides had before (eval_windows: the quantize command's --eval-windows).
_ALIASES = {"eval_windows": "max_windows"}


# Overrides that are paths (or, for model and calibration, hub and datasets names); the others are integers but
# `device`, a device name.
_PATHS = ("model", "output", "calibration", "stats")


def _is_model_object(model) -> bool:
    return hasattr(model, "save_pretrained") and hasattr(model, "config")


_DTYPES = ("float32", "float16", "bfloat16", "float64")


def _path(func: str, name: str, value, what: str):
    """`value` when it is a path (str or os.PathLike, not empty), else a UsageError naming the argument."""
    import os

    from qtool.errors import UsageError, shown

    if isinstance(value, (str, os.PathLike)) and os.fspath(value) not in ("", b""):
        return value
    raise UsageError(f"{func}({name}): found {shown(value)}, expected {what} (a str or os.PathLike path)")


def _flag(func: str, name: str, value) -> bool:
    from qtool.errors import UsageError, shown

    if not isinstance(value, bool):
        raise UsageError(f"{func}({name}): found {shown(value)}, expected True or False")
    return value


def _device(value):
    """The torch device `load` puts the model on: cpu, cuda or cuda:N, refused in one line when it is none of
    them or when no such CUDA device is there (torch would raise its own RuntimeError or AssertionError)."""
    import re

    import torch

    from qtool.errors import ResourceError, UsageError, shown

    name = str(value) if isinstance(value, torch.device) else value
    if not isinstance(name, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise UsageError(f"load(device): found {shown(value)}, expected 'cpu', 'cuda' or 'cuda:N'")
    if name.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(name.partition(":")[2] or 0)
        if index >= count:
            have = f"{count} CUDA device{'s' if count != 1 else ''}" if count else "no CUDA device"
            raise ResourceError(f"load(device): found {name!r}, but this machine has {have}; expected 'cpu'")
    return name


def _dtype(value):
    import torch

    from qtool.errors import UsageError, shown

    if value is None:
        return None
    if isinstance(value, torch.dtype) and str(value).removeprefix("torch.") in _DTYPES:
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return getattr(torch, value.removeprefix("torch."))
    raise UsageError(
        f"load(dtype): found {shown(value)}, expected None (the default), {', '.join(_DTYPES)} or that torch dtype"
    )


def load(path, device: str = "cpu", dtype=None, verify: bool = False):
    """`qtool.load`: the arguments checked, then the checkpoint loaded (qtool.checkpoint.loader)."""
    from qtool.checkpoint.loader import load_checkpoint

    path = _path("load", "path", path, "a checkpoint folder")
    device = _device(device)
    dtype = _dtype(dtype)
    verify = _flag("load", "verify", verify)
    return load_checkpoint(path, device=device, dtype=dtype, verify=verify)


def load_tokenizer(path):
    """`qtool.load_tokenizer`: from the folder only, never the hub."""
    from qtool.checkpoint.loader import load_tokenizer as _load_tokenizer
    from qtool.errors import CheckpointError

    path = _path("load_tokenizer", "path", path, "a checkpoint folder")
    if not Path(path).is_dir():
        raise CheckpointError(f"{path}: not a directory; expected a qtool checkpoint (or model) folder")
    return _load_tokenizer(path)


def _is_pathlike(value) -> bool:
    import os

    return isinstance(value, (str, os.PathLike))


def _save_model(model, tokenizer, folder: Path) -> str:
    """An in-memory transformers model (and its tokenizer) as a model folder the pipeline reads block by block."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        ref = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
        if not ref:
            raise UsageError("quantize: model is an in-memory model without a name; expected tokenizer=...")
        tokenizer = AutoTokenizer.from_pretrained(ref)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _save_texts(texts, folder: Path) -> str:
    """Calibration texts given as a list of strings, as a text file of documents (one window source)."""
    if not all(isinstance(t, str) for t in texts) or not texts:
        from qtool.errors import shown

        raise UsageError(f"quantize(calibration): found {shown(texts)}, expected a non-empty list of strings")
    path = folder / "calibration.txt"
    path.write_text("\n\n".join(texts), encoding="utf-8")
    return str(path)


def quantize(
    recipe=None,
    *,
    model=None,
    calibration=None,
    tokenizer=None,
    run_eval: bool = True,
    overwrite: bool = False,
    resume: bool = False,
    dry_run: bool = False,
    whole_model: bool = False,
    quiet: bool = True,
    reporter: Reporter | None = None,
    **overrides,
):
    """Quantize a model as `qtool quantize` does and return `(checkpoint path, report)`, the report being the dict
    `qtool quantize --json` prints.

    `recipe`: a YAML file's path, a dict of the same keys (paths in it relative to the working directory), or a
    `qtool.Recipe`. `model`: a model folder or hub id, or an in-memory transformers model (saved to a temporary
    folder first, with `tokenizer` or the one of its `name_or_path`), in place of the recipe's. `calibration`: a
    .txt/.jsonl file or a datasets name, or a list of strings, in place of the recipe's source. Other keyword
    overrides are the command's flags: output, num_samples, seq_len, seed, stats, max_windows, device. Under
    torchrun or accelerate launch, every
    rank calls it; rank 0 writes the checkpoint, the other ranks get `(None, None)`. A path is never looked up on
    the hub; `output` may be anywhere, as the command line's -o.

    Raises qtool.errors.QtoolError, whose message is the command's one line and whose class is its exit code's:
    UsageError for an argument of the wrong type or value (naming it: `num_samples`, not the recipe key) or an
    output that exists or is one of the inputs, RecipeError for an invalid recipe, InputError for a missing or
    broken model or text, ResourceError when the machine cannot hold the run, Interrupted on Ctrl-C with finished
    blocks kept. A KeyboardInterrupt before any block finished propagates as it is.

    >>> path, report = qtool.quantize(model="stories260K", recipe={"stages": [{"stage": "rtn", "bits": 4,
    ...     "group_size": 4}], "output": "out/s"})  # doctest: +SKIP
    """
    return run(
        recipe,
        model=model,
        calibration=calibration,
        tokenizer=tokenizer,
        run_eval=run_eval,
        overwrite=overwrite,
        resume=resume,
        dry_run=dry_run,
        whole_model=whole_model,
        quiet=quiet,
        reporter=reporter,
        keyword_names=True,
        **overrides,
    )


def run(
    recipe,
    *,
    model,
    calibration,
    tokenizer,
    run_eval: bool,
    overwrite: bool,
    resume: bool,
    dry_run: bool,
    whole_model: bool,
    quiet: bool,
    reporter: Reporter | None,
    keyword_names: bool,
    **overrides,
):
    """`quantize`, and what `qtool quantize` runs: with `keyword_names` an error names an override by its keyword
    (`quantize(num_samples)`), without it by the command's flag (`--num-samples`)."""
    from qtool.distributed import env_rank, launched
    from qtool.errors import shown
    from qtool.recipe import Recipe
    from qtool.run import run_quantize

    if not isinstance(recipe, (dict, Recipe)):
        if recipe is None or not _is_pathlike(recipe):
            raise UsageError(
                f"quantize(recipe): found {shown(recipe)}, expected a recipe file (a str or os.PathLike path), "
                f"a dict or a qtool.Recipe"
            )
    for name, value in (
        ("run_eval", run_eval),
        ("overwrite", overwrite),
        ("resume", resume),
        ("dry_run", dry_run),
        ("whole_model", whole_model),
        ("quiet", quiet),
    ):
        _flag("quantize", name, value)
    given = {
        _ALIASES.get(k, k): k for k in overrides
    }  # each override's canonical name -> the caller's keyword
    overrides = {_ALIASES.get(k, k): v for k, v in overrides.items()}
    unknown = sorted(set(overrides) - set(OVERRIDES))
    if unknown:
        raise UsageError(
            f"quantize: unknown override {given[unknown[0]]!r}; expected one of model, calibration, tokenizer, "
            f"{', '.join(k for k in OVERRIDES if k not in ('model', 'calibration'))}"
        )
    given.update({k: k for k in ("model", "calibration")})
    for name, value in {**overrides, "model": model, "calibration": calibration}.items():
        if value is None or (name == "model" and _is_model_object(value)):
            continue
        if name == "calibration" and isinstance(value, (list, tuple)):
            continue
        if name in _PATHS:
            _path(
                "quantize",
                given[name],
                value,
                "a path" if name in ("output", "stats") else "a path or a name",
            )
        elif name == "device":
            if not isinstance(value, str):
                raise UsageError(
                    f"quantize(device): found {shown(value)}, expected 'auto', 'cpu', 'cuda' or 'cuda:N'"
                )
        elif isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"quantize({given[name]}): found {shown(value)}, expected an integer")
    with tempfile.TemporaryDirectory(prefix="qtool-api-") as tmp:
        if _is_model_object(model):
            model = _save_model(model, tokenizer, Path(tmp) / "model")
        if isinstance(calibration, (list, tuple)):
            calibration = _save_texts(list(calibration), Path(tmp))
        values = {**overrides, "model": model, "calibration": calibration}
        over = {OVERRIDES[k]: str(v) if k in _PATHS else v for k, v in values.items() if v is not None}
        names = None
        if keyword_names:
            names = {OVERRIDES[k]: f"quantize({given[k]})" for k, v in values.items() if v is not None}
        if reporter is None:
            reporter = Reporter(quiet=quiet or (launched() and env_rank() != 0))  # rank 0 alone logs
        report = run_quantize(
            recipe,
            over,
            run_eval=run_eval,
            overwrite=overwrite,
            reporter=reporter,
            resume=resume,
            dry_run=dry_run,
            whole_model=whole_model,
            names=names,
        )
    if report is None:  # a rank other than 0 of a run over several processes
        return None, None
    return Path(report["output"]), report


def recipe_protocol(recipe) -> dict:
    """A recipe's `eval` section as `evaluate` arguments (paths resolved against the recipe file, as quantize
    resolves them) and its model as the baseline."""
    from qtool.run import resolve_recipe

    r = resolve_recipe(recipe, {})
    ev = r.eval
    if ev is None:
        raise UsageError(f"--recipe {r.path or 'recipe'}: the recipe has no eval section; expected one")
    return {
        "baseline": r.model,
        "text": ev.text,
        "seq_len": ev.seq_len,
        "max_windows": ev.max_windows,
        "stride": ev.stride,
        "separator": ev.separator,
        "text_field": ev.text_field,
        "split": ev.split,
        "encoding": ev.encoding,
        "tasks": ",".join(ev.tasks) if ev.tasks else None,
        "limit": ev.limit,
        "num_fewshot": ev.num_fewshot,
        "data_dir": ev.data_dir,
    }


_EVAL_DEFAULTS = {
    "text": None,
    "seq_len": None,
    "max_windows": None,
    "stride": None,
    "separator": None,
    "text_field": "text",
    "split": "test",
    "encoding": "utf-8",
    "tasks": None,
    "limit": None,
    "num_fewshot": 0,
    "data_dir": None,
}


def evaluate(
    model,
    model_b=None,
    *,
    baseline=None,
    recipe=None,
    max_ppl_increase=None,
    max_acc_drop=None,
    device: str = "auto",
    batch_size=None,
    fewshot_seed: int = 1234,
    include_paths=(),
    max_memory=None,
    allow_long_context: bool = False,
    dequantize: bool = False,
    quiet: bool = True,
    reporter: Reporter | None = None,
    **protocol,
) -> dict:
    """Perplexity and/or zero-shot accuracy as `qtool eval` measures them; returns the dict `qtool eval --json`
    prints (with two models: both summaries and their comparison; with a gate: its `gate` object).

    `model` (and `model_b`, or `baseline`: the original to compare against): a qtool checkpoint, a model folder or
    a hub id. The protocol: text, seq_len, max_windows, stride, separator, text_field, split, encoding, tasks
    (comma-separated or a list), limit, num_fewshot, data_dir; `recipe` (a path, dict or Recipe) supplies every
    one not given, and the baseline, from its eval section. `max_ppl_increase` ("5%") and `max_acc_drop` ("1.5")
    gate the comparison: the result's `gate.passed` says whether it held (the command exits 8 when not).

    >>> result = qtool.evaluate("out/q", recipe="recipes/quickstart-stories260k.yaml",
    ...                         max_ppl_increase="10%")  # doctest: +SKIP
    >>> result["gate"]["passed"]  # doctest: +SKIP
    True
    """
    from qtool.evaluate import run_eval
    from qtool.gate import Gate, parse_percent

    unknown = sorted(set(protocol) - set(_EVAL_DEFAULTS))
    if unknown:
        raise UsageError(
            f"evaluate: unknown argument {unknown[0]!r}; expected one of {', '.join(_EVAL_DEFAULTS)}"
        )
    if isinstance(protocol.get("tasks"), (list, tuple)):
        protocol["tasks"] = ",".join(protocol["tasks"])
    gate = Gate(
        parse_percent(max_ppl_increase, "--max-ppl-increase"), parse_percent(max_acc_drop, "--max-acc-drop")
    )
    p = dict(_EVAL_DEFAULTS)
    if recipe is not None:
        from_recipe = recipe_protocol(recipe)
        p.update({k: v for k, v in from_recipe.items() if k in p})
        if baseline is None and model_b is None and gate.active:
            baseline = from_recipe["baseline"]
    p.update({k: v for k, v in protocol.items() if v is not None})
    if baseline is not None and model_b is not None:
        raise UsageError(
            f"--baseline {baseline}: given with a second model {model_b}; expected one or the other"
        )
    refs = [baseline, model] if baseline is not None else [model] if model_b is None else [model, model_b]
    refs = [str(r) for r in refs]
    if gate.active:
        if len(refs) == 1:
            raise UsageError(
                "--max-ppl-increase/--max-acc-drop: nothing to compare against; expected --baseline ORIGINAL"
            )
        gate.check_measurable(p["text"], p["tasks"])
    summary = run_eval(
        refs,
        batch_size=batch_size,
        device=device,
        reporter=reporter or Reporter(quiet=quiet),
        seed=fewshot_seed,
        include_paths=tuple(include_paths),
        allow_long_context=allow_long_context,
        max_memory=max_memory,
        dequantize=dequantize,
        **p,
    )
    if gate.active:
        summary["gate"] = gate.evaluate(summary["comparison"])
    return summary


def export(
    checkpoint,
    output,
    *,
    format: str = "compressed-tensors",
    max_shard_size: str = "5GB",
    overwrite: bool = False,
    quiet: bool = True,
    reporter: Reporter | None = None,
) -> dict:
    """Write a verified qtool checkpoint in another library's format (`qtool export`): `format` is
    "compressed-tensors" (formats/compressed-tensors.md) or "gptq" (formats/gptq.md). Returns the dict
    `qtool export --json` prints. Exact or refused: a layer the format cannot hold raises
    qtool.errors.UsageError naming it, before anything is written.

    >>> qtool.export("out/q", "out/q-ct")["compression_format"]  # doctest: +SKIP
    'pack-quantized'
    """
    reporter = reporter or Reporter(quiet=quiet)
    if format == "gptq":
        from qtool.export.gptq import run_export as run_gptq

        return run_gptq(Path(checkpoint), Path(output), max_shard_size, overwrite, reporter)
    from qtool.export.compressed_tensors import run_export

    return run_export(Path(checkpoint), Path(output), format, max_shard_size, overwrite, reporter)
