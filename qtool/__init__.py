"""qtool: quantize Hugging Face causal LMs into packed checkpoints."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "load", "load_tokenizer", "quantize"]

# Keyword overrides of `quantize` → the recipe keys they set (the command line's flags, by their Python names).
_OVERRIDES = {"model": "model", "output": "output", "calibration": "calibration.source",
              "num_samples": "calibration.num_samples", "seq_len": "calibration.seq_len", "seed": "calibration.seed",
              "stats": "calibration.stats", "eval_windows": "eval.max_windows"}


def load(path, device: str = "cpu", dtype=None, verify: bool = True):
    """Load a packed qtool checkpoint; quantized linears execute the packed layout (see qtool.checkpoint.loader).
    The model is a transformers model: `generate` and `transformers.pipeline` take it as it is."""
    from qtool.checkpoint.loader import load_checkpoint

    return load_checkpoint(path, device=device, dtype=dtype, verify=verify)


def load_tokenizer(path):
    """The tokenizer a checkpoint carries."""
    from qtool.checkpoint.loader import load_tokenizer as _load_tokenizer

    return _load_tokenizer(path)


def quantize(recipe, *, run_eval: bool = True, overwrite: bool = False, quiet: bool = True, **overrides):
    """Run `recipe` (a YAML file) as `qtool quantize` does and return `(checkpoint path, report)`; the report is
    the dict `qtool quantize --json` prints. Keyword overrides: model, output, calibration, num_samples, seq_len,
    seed, stats, eval_windows. Errors raise qtool.errors.QtoolError (its message is the command's one line)."""
    from pathlib import Path

    from qtool.console import Reporter
    from qtool.errors import UsageError
    from qtool.run import run_quantize

    unknown = sorted(set(overrides) - set(_OVERRIDES))
    if unknown:
        raise UsageError(f"quantize: unknown override {unknown[0]!r}; expected one of {', '.join(_OVERRIDES)}")
    over = {_OVERRIDES[k]: str(v) if k in ("model", "output", "calibration", "stats") else v
            for k, v in overrides.items() if v is not None}
    report = run_quantize(Path(recipe), over, run_eval=run_eval, overwrite=overwrite, reporter=Reporter(quiet=quiet))
    return Path(report["output"]), report

