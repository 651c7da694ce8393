"""qtool: quantize Hugging Face causal LMs into packed checkpoints."""

import importlib.abc as _abc
import sys as _sys

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


_PATHS = ("model", "output", "calibration", "stats")
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
    """Load a packed qtool checkpoint; quantized linears execute the packed layout (see qtool.checkpoint.loader).
    The model is a transformers model: `generate` and `transformers.pipeline` take it as it is. Files are checked
    by size and safetensors header; `verify=True` also hashes every file (as `qtool pack --verify` does).

    `path`: a checkpoint folder (a str or os.PathLike; never looked up on the hub). `device`: 'cpu', 'cuda' or
    'cuda:N'. `dtype`: of the tensors left in floating point, None (float32 on the CPU, float16 on a GPU),
    'float32', 'float16', 'bfloat16', 'float64' or that torch dtype.

    Raises qtool.errors.UsageError for an argument of the wrong type or value and ResourceError for a CUDA device
    this machine does not have (both naming the argument), CheckpointError for a folder that is not a complete,
    intact qtool checkpoint (naming the file, key or tensor); every one a QtoolError whose message is the one line
    `qtool` would print."""
    from qtool.checkpoint.loader import load_checkpoint

    path = _path("load", "path", path, "a checkpoint folder")
    device = _device(device)
    dtype = _dtype(dtype)
    verify = _flag("load", "verify", verify)
    return load_checkpoint(path, device=device, dtype=dtype, verify=verify)


def load_tokenizer(path):
    """The tokenizer a checkpoint (or a model folder) carries, from that folder only: a path is never looked up on
    the hub. Raises qtool.errors.UsageError for a `path` that is not a str or os.PathLike, CheckpointError for one
    that is not a folder or holds no loadable tokenizer."""
    from pathlib import Path

    from qtool.checkpoint.loader import load_tokenizer as _load_tokenizer
    from qtool.errors import CheckpointError

    path = _path("load_tokenizer", "path", path, "a checkpoint folder")
    if not Path(path).is_dir():
        raise CheckpointError(f"{path}: not a directory; expected a qtool checkpoint (or model) folder")
    return _load_tokenizer(path)


def quantize(recipe, *, run_eval: bool = True, overwrite: bool = False, quiet: bool = True, **overrides):
    """Run `recipe` (a YAML file) as `qtool quantize` does and return `(checkpoint path, report)`; the report is
    the dict `qtool quantize --json` prints. Keyword overrides: model, output, calibration, stats (paths or, for
    model and calibration, hub and datasets names), num_samples, seq_len, seed, eval_windows (integers); `output`
    may be anywhere, as the command line's -o. Under torchrun or accelerate launch, every rank calls it; rank 0
    writes the checkpoint, the other ranks get `(None, None)`.

    Raises qtool.errors.QtoolError, whose message is the command's one line and whose class is its exit code's:
    UsageError for an argument of the wrong type or value (naming it: `num_samples`, not the recipe key) or an
    output that exists or is one of the inputs, RecipeError for an invalid recipe, InputError for a missing or
    broken model or text, ResourceError when the machine cannot hold the run, Interrupted on Ctrl-C with finished
    blocks kept. A KeyboardInterrupt before any block finished propagates as it is."""
    from pathlib import Path

    from qtool.console import Reporter
    from qtool.distributed import env_rank, launched
    from qtool.errors import UsageError, shown
    from qtool.run import run_quantize

    unknown = sorted(set(overrides) - set(_OVERRIDES))
    if unknown:
        raise UsageError(
            f"quantize: unknown override {unknown[0]!r}; expected one of {', '.join(_OVERRIDES)}"
        )
    recipe = _path("quantize", "recipe", recipe, "a recipe file")
    run_eval = _flag("quantize", "run_eval", run_eval)
    overwrite = _flag("quantize", "overwrite", overwrite)
    quiet = _flag("quantize", "quiet", quiet)
    for name, value in overrides.items():
        if value is None:
            continue
        if name in _PATHS:
            _path("quantize", name, value, "a path" if name in ("output", "stats") else "a path or a name")
        elif isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"quantize({name}): found {shown(value)}, expected an integer")
    over = {_OVERRIDES[k]: str(v) if k in _PATHS else v for k, v in overrides.items() if v is not None}
    names = {_OVERRIDES[k]: f"quantize({k})" for k in overrides}
    quiet = quiet or (launched() and env_rank() != 0)  # rank 0 alone logs
    report = run_quantize(
        Path(recipe),
        over,
        run_eval=run_eval,
        overwrite=overwrite,
        reporter=Reporter(quiet=quiet),
        names=names,
    )
    if report is None:  # a rank other than 0 of a run over several processes
        return None, None
    return Path(report["output"]), report


# `import qtool` registers qtool's quantization config and quantizer with transformers (qtool/hf_integration.py)
# and model_type `qtool` with its AutoConfig (qtool/checkpoint/qconfig.py), so from_pretrained, pipeline and
# lm-eval's hf model load qtool checkpoints through qtool's runtime. Importing transformers' registries costs
# seconds, which the command line and `import qtool` alone should not pay: each registration runs right after
# transformers imports its registry, or now if it already has.
def _register_quantizer(module=None) -> None:
    from qtool.hf_integration import register

    register(module)


def _register_config(module=None) -> None:
    from qtool.checkpoint.qconfig import register_config

    register_config(module)


_HOOKS = {
    "transformers.quantizers.auto": _register_quantizer,
    "transformers.models.auto.configuration_auto": _register_config,
}


class _AfterRegistryImport(_abc.MetaPathFinder):
    """Runs a registry's hook right after transformers has imported that registry."""

    def __init__(self, names=None) -> None:
        self.waiting = set(_HOOKS if names is None else names)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.waiting:
            return None
        self.waiting.discard(fullname)
        if not self.waiting:
            _sys.meta_path.remove(self)
        for finder in _sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            _HOOKS[fullname](module)

        spec.loader.exec_module = exec_and_register
        return spec


def _install_hooks() -> None:
    pending = [name for name in _HOOKS if name not in _sys.modules]
    for name in _HOOKS:
        if name in _sys.modules:
            _HOOKS[name]()
    if pending and not any(isinstance(f, _AfterRegistryImport) for f in _sys.meta_path):
        _sys.meta_path.insert(0, _AfterRegistryImport(pending))


def __dir__() -> list[str]:
    return sorted(__all__)


_install_hooks()
