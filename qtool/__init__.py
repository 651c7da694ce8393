"""qtool: quantize Hugging Face causal LMs into packed checkpoints."""

from __future__ import annotations

import importlib.abc
import sys

from qtool.version import __version__

__all__ = ["__version__", "load", "load_tokenizer", "quantize"]

# Keyword overrides of `quantize` → the recipe keys they set (the command line's flags, by their Python names).
_OVERRIDES = {
    "model": "model",
    "output": "output",
    "calibration": "calibration.source",
    "num_samples": "calibration.num_samples",
    "seq_len": "calibration.seq_len",
    "seed": "calibration.seed",
    "stats": "calibration.stats",
    "eval_windows": "eval.max_windows",
}


def load(path, device: str = "cpu", dtype=None, verify: bool = False):
    """Load a packed qtool checkpoint; quantized linears execute the packed layout (see qtool.checkpoint.loader).
    The model is a transformers model: `generate` and `transformers.pipeline` take it as it is. Files are checked
    by size and safetensors header; `verify=True` also hashes every file (as `qtool pack --verify` does)."""
    from qtool.checkpoint.loader import load_checkpoint

    return load_checkpoint(path, device=device, dtype=dtype, verify=verify)


def load_tokenizer(path):
    """The tokenizer a checkpoint carries."""
    from qtool.checkpoint.loader import load_tokenizer as _load_tokenizer

    return _load_tokenizer(path)


def quantize(recipe, *, run_eval: bool = True, overwrite: bool = False, quiet: bool = True, **overrides):
    """Run `recipe` (a YAML file) as `qtool quantize` does and return `(checkpoint path, report)`; the report is
    the dict `qtool quantize --json` prints. Keyword overrides: model, output, calibration, num_samples, seq_len,
    seed, stats, eval_windows. Errors raise qtool.errors.QtoolError (its message is the command's one line).
    Under torchrun or accelerate launch, every rank calls it; rank 0 writes the checkpoint, the other ranks get
    `(None, None)`."""
    from pathlib import Path

    from qtool.console import Reporter
    from qtool.distributed import env_rank, launched
    from qtool.errors import UsageError
    from qtool.run import run_quantize

    unknown = sorted(set(overrides) - set(_OVERRIDES))
    if unknown:
        raise UsageError(
            f"quantize: unknown override {unknown[0]!r}; expected one of {', '.join(_OVERRIDES)}"
        )
    over = {
        _OVERRIDES[k]: str(v) if k in ("model", "output", "calibration", "stats") else v
        for k, v in overrides.items()
        if v is not None
    }
    quiet = quiet or (launched() and env_rank() != 0)  # rank 0 alone logs
    report = run_quantize(
        Path(recipe), over, run_eval=run_eval, overwrite=overwrite, reporter=Reporter(quiet=quiet)
    )
    if report is None:  # a rank other than 0 of a run over several processes
        return None, None
    return Path(report["output"]), report


# `import qtool` registers qtool's quantization config and quantizer with transformers (qtool/hf_integration.py),
# so from_pretrained, pipeline and lm-eval's hf model load qtool checkpoints through qtool's runtime. Importing
# transformers' quantizer registry costs seconds, which the command line and `import qtool` alone should not pay:
# the registration runs right after transformers imports that registry, or now if it already has.
_REGISTRY = "transformers.quantizers.auto"


def _register_with_transformers(registry=None) -> None:
    from qtool.hf_integration import register

    register(registry)


class _AfterRegistryImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _REGISTRY:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            _register_with_transformers(module)

        spec.loader.exec_module = exec_and_register
        return spec


if _REGISTRY in sys.modules:
    _register_with_transformers()
elif not any(isinstance(f, _AfterRegistryImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterRegistryImport())
