"""qtool: quantize Hugging Face causal LMs into packed checkpoints."""

import importlib.abc as _abc
import sys as _sys
import types as _types

from qtool.version import __version__

__all__ = ["Recipe", "__version__", "evaluate", "export", "load", "load_recipe", "load_tokenizer", "quantize"]


def quantize(recipe=None, **kwargs):
    """Quantize a model as `qtool quantize` does; returns `(checkpoint path, report)`. See qtool.api.quantize."""
    from qtool.api import quantize as _quantize

    return _quantize(recipe, **kwargs)


def evaluate(model, model_b=None, **kwargs) -> dict:
    """Perplexity and zero-shot accuracy as `qtool eval` measures them. See qtool.api.evaluate."""
    from qtool.api import evaluate as _evaluate

    return _evaluate(model, model_b, **kwargs)


def export(checkpoint, output, **kwargs) -> dict:
    """Write a checkpoint in another library's format (compressed-tensors, gptq), as `qtool export` does. See
    qtool.api.export."""
    from qtool.api import export as _export

    return _export(checkpoint, output, **kwargs)


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
    from qtool.api import load as _load

    return _load(path, device=device, dtype=dtype, verify=verify)


def load_tokenizer(path):
    """The tokenizer a checkpoint (or a model folder) carries, from that folder only: a path is never looked up on
    the hub. Raises qtool.errors.UsageError for a `path` that is not a str or os.PathLike, CheckpointError for one
    that is not a folder or holds no loadable tokenizer."""
    from qtool.api import load_tokenizer as _load_tokenizer

    return _load_tokenizer(path)


def load_recipe(path, **overrides):
    """A validated recipe (`qtool.Recipe`) from a YAML file; `quantize(recipe=...)` takes it as it is."""
    from qtool.recipe import load_recipe as _load_recipe

    return _load_recipe(path, overrides)


def __getattr__(name: str):
    if name == "Recipe":  # imported on first use: qtool.recipe imports torch, `import qtool` alone does not
        from qtool.recipe import Recipe

        return Recipe
    raise AttributeError(f"module 'qtool' has no attribute {name!r}")


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


# `qtool.evaluate` and `qtool.export` are API functions and also the names of submodules (qtool/evaluate.py,
# qtool/export/). Importing a submodule sets the package's attribute to it; the package keeps the name callable by
# making such a submodule call its function, so `qtool.evaluate(...)` works before and after
# `import qtool.evaluate`, and `qtool.evaluate.run_eval` still names the module's function.
_API = {"evaluate": evaluate, "export": export}


class _CallableModule(_types.ModuleType):
    def __call__(self, *args, **kwargs):
        return _API[self.__name__.rpartition(".")[2]](*args, **kwargs)


class _Package(_types.ModuleType):
    def __setattr__(self, name, value) -> None:
        if name in _API and isinstance(value, _types.ModuleType) and not isinstance(value, _CallableModule):
            value.__class__ = _CallableModule
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package


_install_hooks()
