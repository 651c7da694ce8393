"""`qtool eval`: perplexity and zero-shot accuracy of an original model or a packed checkpoint, or of two side by
side."""

from __future__ import annotations

import gc
import math
from contextlib import nullcontext

import torch

from qtool.console import Reporter
from qtool.recipe import EvalSpec


def check_for_eval(model_ref: str, spec: EvalSpec | None) -> None:
    """What can be checked of a model to evaluate before any weight is read: a checkpoint's manifest, file sizes,
    config.json and tokenizer (hashing every file is `qtool pack --verify`'s), or an original model's config and
    tokenizer (a folder that looks like a checkpoint but lacks its manifest is refused, never evaluated as an
    original model); and the window length against the model's context."""
    from pathlib import Path

    from qtool.checkpoint.loader import (
        check_files,
        checkpoint_config,
        is_checkpoint,
        load_tokenizer,
        read_manifest,
    )
    from qtool.models.loading import check_architecture, check_context, load_config
    from qtool.models.loading import load_tokenizer as load_model_tokenizer

    if is_checkpoint(model_ref):
        path = Path(model_ref)
        check_files(path, read_manifest(path))
        config = checkpoint_config(path)
        load_tokenizer(path)
    else:
        config = load_config(model_ref)
        check_architecture(model_ref, config)
        load_model_tokenizer(model_ref)
    if spec is not None:
        check_context(
            spec.seq_len, spec.allow_long_context, config, model_ref, "--seq-len", "--allow-long-context"
        )


def load_for_eval(
    model_ref: str,
    dev: torch.device,
    reporter: Reporter,
    max_memory: int | None = None,
    dtype: torch.dtype | None = None,
    dequantize: bool = False,
):
    """(model on `dev`, tokenizer, kind): a qtool checkpoint with its packed modules, a model another tool
    quantized (kind: its scheme; `dequantize`, or a load that fails as stored: compressed-tensors loaded as float),
    or a float model (float32 on
    the CPU, its stored dtype on a GPU, unless `dtype` says). An original model larger than `max_memory` is spread
    by accelerate over the device, host memory and disk."""
    from qtool.checkpoint.loader import is_checkpoint, load_checkpoint, load_tokenizer
    from qtool.eval.streamed import eval_dtype
    from qtool.models.loading import load_config, load_model

    if is_checkpoint(model_ref):
        reporter.log(f"loading checkpoint {model_ref}")
        dtype = dtype or (torch.float32 if dev.type == "cpu" else torch.float16)
        model = load_checkpoint(model_ref, device=str(dev), dtype=dtype)
        return model, load_tokenizer(model_ref), "qtool checkpoint"
    from qtool.errors import InputError, UsageError
    from qtool.models.loading import dequantizing_config, foreign_scheme

    reporter.log(f"loading model {model_ref}")
    config = load_config(model_ref)
    dtype = dtype or eval_dtype(config, dev)
    scheme = foreign_scheme(config)
    kind = "original" if scheme is None else f"{scheme} checkpoint"
    dequant = dequantizing_config(config) if dequantize else None
    if dequantize and scheme is not None and dequant is None:
        raise UsageError(
            f"--dequantize: '{model_ref}' is a {scheme} model; expected a compressed-tensors one (qtool loads "
            f"others only as their own library does)"
        )
    try:
        model, tokenizer, _, _ = load_model(
            model_ref, dtype, device=dev, max_memory=max_memory, quantization_config=dequant
        )
    except InputError as e:
        fallback = dequantizing_config(config) if dequant is None else None
        if fallback is None:
            raise
        # Some compressed-tensors schemes do not load as stored in some transformers versions (an asymmetric
        # export's packed zero points, formats/compressed-tensors.md); dequantized, the weights are the same.
        reporter.log(f"note: {model_ref} did not load as stored ({e}); evaluating it dequantized to float")
        model, tokenizer, _, _ = load_model(
            model_ref, dtype, device=dev, max_memory=max_memory, quantization_config=fallback
        )
        dequant = fallback
    if dequant is not None:
        kind += ", dequantized"
    return model, tokenizer, kind


def memory_for_model(dev: torch.device, max_memory: int | None) -> int:
    """What an evaluated model may take: `max_memory`, else the device's free memory (the host's on the CPU)."""
    from qtool.units import available_host

    if max_memory is not None:
        return max_memory
    return torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else available_host()


def streams(model_ref: str, dev: torch.device, max_memory: int | None) -> bool:
    """Whether an original model is too large for `memory_for_model`, so its perplexity is computed block by
    block (a local safetensors folder; other models load whole)."""
    from qtool.checkpoint.loader import is_checkpoint
    from qtool.eval.streamed import model_bytes

    if is_checkpoint(model_ref):
        return False
    size = model_bytes(model_ref, dev)
    return size is not None and size > memory_for_model(dev, max_memory)


def evaluate_loaded(
    model, tokenizer, dev: torch.device, *, spec: EvalSpec | None, suite, reporter: Reporter
) -> dict:
    """Perplexity on `spec` and/or lm-eval tasks of `suite` (a TaskSuite) for a loaded model."""
    from qtool.eval.perplexity import perplexity
    from qtool.layouts.module import reference_cache

    out: dict = {}
    with reference_cache(model) if dev.type == "cpu" else nullcontext():
        if spec is not None:
            out.update(perplexity(model, tokenizer, spec, dev, reporter))
        if suite is not None:
            from qtool.eval.zeroshot import evaluate_tasks

            out["zeroshot"] = evaluate_tasks(model, tokenizer, suite, dev, reporter)
    return out


DEFAULT_SEQ_LEN = 2048


def default_seq_len(refs: list[str]) -> int:
    """Windows of 2048 tokens, or of the shortest context among the models when that is shorter (a model whose
    config cannot be read is left to the checks that name what is wrong with it)."""
    from pathlib import Path

    from qtool.checkpoint.loader import checkpoint_config, is_checkpoint
    from qtool.errors import QtoolError
    from qtool.models.loading import load_config

    out = DEFAULT_SEQ_LEN
    for ref in refs:
        try:
            config = checkpoint_config(Path(ref)) if is_checkpoint(ref) else load_config(ref)
        except (QtoolError, OSError, ValueError):
            continue
        ctx = getattr(config, "max_position_embeddings", None)
        if isinstance(ctx, int) and 0 < ctx < out:
            out = ctx
    return out


def run_eval(
    model_refs: list[str] | str,
    *,
    text: str | None,
    seq_len: int | None,
    max_windows: int | None,
    stride: int | None,
    separator: str | None,
    text_field: str,
    split: str,
    batch_size: int | str | None,
    device: str,
    reporter: Reporter,
    tasks: str | None = None,
    limit: int | None = None,
    num_fewshot: int = 0,
    seed: int = 1234,
    data_dir: str | None = None,
    include_paths: tuple[str, ...] = (),
    encoding: str = "utf-8",
    allow_long_context: bool = False,
    max_memory: int | None = None,
    dequantize: bool = False,
) -> dict:
    """`max_memory`: bytes an evaluated model may take (default: the device's free memory, the host's on the CPU);
    a larger original model is evaluated block by block (perplexity) or spread over host memory and disk."""
    from pathlib import Path

    from qtool.calibration.data import TextSource, check_encoding, check_not_empty, read_documents
    from qtool.errors import UsageError
    from qtool.eval.zeroshot import PERPLEXITY_BATCH, TaskSuite, parse_batch_size
    from qtool.pipeline import resolve_device
    from qtool.recipe import resolve_text

    refs = [model_refs] if isinstance(model_refs, str) else list(model_refs)
    if not text and not tasks:
        raise UsageError(
            "eval: nothing to measure; expected --text FILE (perplexity) and/or --tasks LIST "
            "(zero-shot accuracy)"
        )
    bs = parse_batch_size(batch_size)
    if tasks:
        TaskSuite.check_values(limit, num_fewshot, seed)
    dev = resolve_device(device)
    spec = None
    if text:
        if seq_len is None:
            seq_len = default_seq_len(refs)
        ppl_batch = bs if isinstance(bs, int) else PERPLEXITY_BATCH
        for name, value in (("--seq-len", seq_len), ("--max-windows", max_windows), ("--stride", stride)):
            if value is not None and value < 1:
                raise UsageError(f"{name}: found {value}, expected a positive integer")
        problem = check_encoding(encoding)
        if problem:
            raise UsageError(f"--encoding: {problem}")
        spec = EvalSpec(
            text=resolve_text(text, Path.cwd(), "--text"),
            seq_len=seq_len,
            max_windows=max_windows,
            stride=stride,
            separator=separator,
            text_field=text_field,
            split=split,
            batch_size=ppl_batch,
            encoding=encoding,
            allow_long_context=allow_long_context,
        )
        if Path(spec.text).is_file():
            # Decoded (and, for jsonl, parsed) before any model loads: a bad byte fails in seconds.
            src = TextSource(spec.text, spec.text_field, spec.split, spec.config, spec.encoding)
            check_not_empty(src, read_documents(src))
    for ref in refs:
        check_for_eval(ref, spec)
    suite = None
    if tasks:
        # Tasks and data are checked (and loaded once) before any model is.
        suite = TaskSuite(
            tasks.split(","),
            limit=limit,
            num_fewshot=num_fewshot,
            batch_size=bs,
            seed=seed,
            data_dir=data_dir,
            include_paths=include_paths,
        )
    summaries = []
    try:
        for ref in refs:
            summaries.append(evaluate_one(ref, dev, spec, suite, reporter, max_memory, dequantize=dequantize))
            gc.collect()
    finally:
        if suite is not None:
            suite.close()
    if len(summaries) == 1:
        return summaries[0]
    return {"models": summaries, "comparison": compare(summaries[0], summaries[1])}


def evaluate_one(
    ref: str,
    dev: torch.device,
    spec: EvalSpec | None,
    suite,
    reporter: Reporter,
    max_memory: int | None = None,
    dtype: torch.dtype | None = None,
    dequantize: bool = False,
) -> dict:
    """One model's summary. An original model larger than the memory it may take has its perplexity computed block
    by block (qtool/eval/streamed.py) and, for zero-shot tasks, is spread over device, host memory and disk."""
    if spec is not None and streams(ref, dev, max_memory):
        from qtool.eval.streamed import eval_dtype, streamed_perplexity
        from qtool.models.loading import load_config

        reporter.log(f"evaluating {ref} block by block (larger than the memory it may take)")
        result, _ = streamed_perplexity(ref, spec, dev, reporter, dtype)
        if suite is not None:
            model, tokenizer, _ = load_for_eval(
                ref, dev, reporter, max_memory=memory_for_model(dev, max_memory), dtype=dtype
            )
            result.update(evaluate_loaded(model, tokenizer, dev, spec=None, suite=suite, reporter=reporter))
            del model
        dtype = dtype or eval_dtype(load_config(ref), dev)
        return {
            "model": ref,
            "kind": "original",
            "device": str(dev),
            "dtype": str(dtype).removeprefix("torch."),
            **result,
        }
    model, tokenizer, kind = load_for_eval(ref, dev, reporter, dtype=dtype, dequantize=dequantize)
    result = evaluate_loaded(model, tokenizer, dev, spec=spec, suite=suite, reporter=reporter)
    return {
        "model": ref,
        "kind": kind,
        "device": str(dev),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        **result,
    }


def compare(a: dict, b: dict) -> list[dict]:
    """One row per (task, metric) both models have, plus perplexity: each value, its stderr and b - a."""
    from qtool.eval.zeroshot import metrics

    rows = []
    if "perplexity" in a and "perplexity" in b:
        rows.append(
            {
                "task": "text",
                "metric": "perplexity",
                "a": a["perplexity"],
                "a_stderr": None,
                "b": b["perplexity"],
                "b_stderr": None,
                "delta": b["perplexity"] - a["perplexity"],
            }
        )
    ma = metrics(a["zeroshot"]["results"]) if "zeroshot" in a else {}
    mb = metrics(b["zeroshot"]["results"]) if "zeroshot" in b else {}
    for task in ma:
        for metric, va in ma[task].items():
            vb = mb.get(task, {}).get(metric)
            if vb is None:
                continue
            rows.append(
                {
                    "task": task,
                    "metric": metric,
                    "a": va["value"],
                    "a_stderr": va["stderr"],
                    "b": vb["value"],
                    "b_stderr": vb["stderr"],
                    "delta": vb["value"] - va["value"],
                }
            )
    return rows


def eval_record(original: dict, quantized: dict) -> dict:
    """What the manifest keeps of both models' evaluations: perplexity with its protocol, each task metric with its
    stderr and the task protocol (wall times left out, so the same recipe writes the same manifest)."""
    from qtool.eval.zeroshot import metrics

    ppl_keys = ("perplexity", "nll", "scored_tokens", "windows")
    record: dict = {"original": {}, "quantized": {}}
    if "perplexity" in quantized:
        record["protocol"] = quantized["protocol"]
        record["original"].update({k: original[k] for k in ppl_keys})
        record["quantized"].update({k: quantized[k] for k in ppl_keys})
    if "zeroshot" in quantized:
        record["tasks_protocol"] = {
            k: v for k, v in quantized["zeroshot"]["protocol"].items() if k != "seconds"
        }
        record["original"]["tasks"] = metrics(original["zeroshot"]["results"])
        record["quantized"]["tasks"] = metrics(quantized["zeroshot"]["results"])
    return record


def format_value(value: float, stderr: float | None) -> str:
    fmt = ".4f" if abs(value) < 1000 else ".4g"
    if stderr is None or not math.isfinite(stderr):
        return f"{value:{fmt}}"
    return f"{value:{fmt}} ± {stderr:{fmt}}"
