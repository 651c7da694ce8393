"""`qtool eval`: perplexity of an original model or a packed checkpoint."""

from __future__ import annotations

import torch

from qtool.console import Reporter
from qtool.recipe import EvalSpec


def run_eval(model_ref: str, *, text: str, seq_len: int, max_windows: int | None, stride: int | None,
             separator: str | None, text_field: str, split: str, batch_size: int, device: str,
             reporter: Reporter) -> dict:
    from pathlib import Path

    from qtool.checkpoint.loader import is_checkpoint, load_checkpoint, load_tokenizer
    from qtool.errors import QtoolError
    from qtool.eval.perplexity import perplexity
    from qtool.models.loading import load_model
    from qtool.pipeline import resolve_device
    from qtool.recipe import resolve_text

    dev = resolve_device(device)
    spec = EvalSpec(text=resolve_text(text, Path.cwd(), "--text"), seq_len=seq_len, max_windows=max_windows,
                    stride=stride, separator=separator, text_field=text_field, split=split, batch_size=batch_size)
    for name, value in (("--seq-len", seq_len), ("--batch-size", batch_size), ("--windows", max_windows),
                        ("--stride", stride)):
        if value is not None and value < 1:
            raise QtoolError(f"{name}: found {value}, expected a positive integer")
    dtype = torch.float32 if dev.type == "cpu" else torch.float16
    if is_checkpoint(model_ref):
        reporter.log(f"loading checkpoint {model_ref}")
        model = load_checkpoint(model_ref, device=str(dev), dtype=dtype)
        tokenizer = load_tokenizer(model_ref)
        kind = "qtool checkpoint"
    else:
        reporter.log(f"loading model {model_ref}")
        model, tokenizer, _, _ = load_model(model_ref, dtype)
        model.to(dev)
        kind = "original"
    result = perplexity(model, tokenizer, spec, dev, reporter)
    return {"model": model_ref, "kind": kind, "device": str(dev), "dtype": str(dtype).removeprefix("torch."),
            **result}
