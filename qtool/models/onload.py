"""Block onloading: the model as a skeleton on the meta device, its tensors read one module at a time from the
safetensors files (through the shard index) when the pipeline reaches it, and dropped back to meta after.

Host memory is then one decoder block, the modules outside the blocks (embeddings, final norm, head) and the
calibration activations, whatever the depth. The tensors get the same casts as `from_pretrained(dtype=...)` gives
them, so a run from the skeleton computes bit for bit what a run on the whole loaded model computes.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import torch
from torch import nn

from qtool.errors import InputError
from qtool.models.integrity import TensorInfo, check_finite, describe, read_tensor


class ShardReader:
    """Tensors of a local model folder by the model's parameter names, read lazily from the file holding each."""

    def __init__(self, folder: str | Path, files: dict[str, TensorInfo], config) -> None:
        self.folder = Path(folder)
        self.files = files
        prefix = getattr(config, "base_model_prefix", None) or "model"
        # Checkpoints saved from the base model (facebook/opt-*) drop the prefix the CausalLM's names carry.
        self._strip = f"{prefix}." if files and not any(n.startswith(f"{prefix}.") for n in files) else ""

    def stored_name(self, name: str) -> str:
        return name.removeprefix(self._strip) if self._strip else name

    def has(self, name: str) -> bool:
        return self.stored_name(name) in self.files

    def get(self, name: str, dtype: torch.dtype | None, pinned: bool = False) -> torch.Tensor:
        stored = self.stored_name(name)
        info = self.files.get(stored)
        if info is None:
            raise InputError(
                f"tensor {name}: missing from the weights of '{self.folder}'; expected every parameter "
                f"of the model (it would be initialised randomly)"
            )
        try:
            t = read_tensor(info, pinned)
        except MemoryError:
            raise
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise InputError(
                f"tensor {name} ({info.file}): cannot be read ({describe(e)}); expected the file "
                f"as the pre-flight checked it (was it truncated or replaced during the run?)"
            ) from None
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        return t

    def close(self) -> None:
        pass


def check_names(reader: ShardReader, meta: nn.Module, ref: str) -> None:
    """Every parameter of the model class is stored (a tied head may share the embedding's), and every stored
    tensor is a parameter: what transformers reports after a whole load, known here from the headers alone."""
    expected = dict(meta.state_dict())
    tied = _tied_names(meta)
    arch = ", ".join(meta.config.architectures or [meta.config.model_type])
    for name in sorted(expected):
        if name not in tied and not reader.has(name):
            raise InputError(
                f"tensor {name}: missing from the weights of '{ref}'; expected every parameter of "
                f"{arch} (it would be initialised randomly)"
            )
    known = {reader.stored_name(n) for n in expected}
    ignore = getattr(meta, "_keys_to_ignore_on_load_unexpected", None) or []
    for name, info in sorted(reader.files.items()):
        if name not in known and not any(re.search(p, name) for p in ignore):
            raise InputError(
                f"tensor {name} ({info.file}): not a parameter of {arch} as {ref}/config.json "
                f"describes it; expected weights of this model"
            )


def _tied_names(model: nn.Module) -> set[str]:
    """Parameter names that share storage with an earlier one once the model ties its weights (the head)."""
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if not getattr(text, "tie_word_embeddings", False):
        return set()
    out = model.get_output_embeddings()
    for name, mod in model.named_modules():
        if mod is out:
            return {f"{name}.weight"}
    return set()


def materialize(
    module: nn.Module,
    prefix: str,
    reader: ShardReader,
    dtype: torch.dtype,
    *,
    pinned: bool = False,
    check: bool = True,
) -> None:
    """Read the parameters and persistent buffers of `module` (named `prefix` in the model) that are on the meta
    device, in `dtype`, refusing any that is not finite (unless `check` is false: the caller then runs
    `check_module` where it is cheaper, on a GPU). `pinned`: into page-locked memory, for a copy to a GPU."""
    loaded = []
    for mod_name, mod in module.named_modules():
        for kind in ("_parameters", "_buffers"):
            for pname, p in list(getattr(mod, kind).items()):
                if p is None or p.device.type != "meta":
                    continue
                rel = f"{mod_name}.{pname}" if mod_name else pname
                full = f"{prefix}.{rel}" if prefix else rel
                t = reader.get(full, dtype if p.is_floating_point() else None, pinned)
                if kind == "_parameters":
                    mod._parameters[pname] = nn.Parameter(t, requires_grad=False)
                else:
                    mod._buffers[pname] = t
                loaded.append((reader.stored_name(full), t))
    if check:
        check_finite(loaded, InputError, reader.files)


def check_module(module: nn.Module, prefix: str, reader: ShardReader) -> None:
    """`materialize`'s check of the values read, run where `module` now is (the same values: they were moved,
    not computed on)."""
    check_finite(
        [(reader.stored_name(f"{prefix}.{n}" if prefix else n), t) for n, t in module.state_dict().items()],
        InputError,
        reader.files,
    )


def release(module: nn.Module) -> None:
    """Drop the parameters and buffers of `module` back to the meta device, and hand the freed memory back."""
    module.to("meta")
    trim_heap()


def trim_heap() -> None:
    """Return freed heap memory to the system. glibc keeps freed blocks of a few MB in its heap (its mmap
    threshold grows with the sizes freed), so without this a loop over blocks grows the resident set by about a
    block per iteration (measured on SmolLM2: 400 MB to 720 MB over 30 blocks, back to 400 MB when trimmed)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim  # noqa: B018  (not glibc: no malloc_trim)
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_libc = None


def outer_modules(model: nn.Module, blocks_path: str) -> list[tuple[str, nn.Module, bool]]:
    """Everything that is not a decoder block, as (name, module, whole) triples: the children beside the path to
    the blocks (whole), and the modules on that path for their own parameters only (not whole)."""
    out: list[tuple[str, nn.Module, bool]] = []
    node, path = model, ""
    for part in blocks_path.split("."):
        out.append((path, node, False))
        for name, child in node.named_children():
            if name != part:
                out.append((f"{path}.{name}" if path else name, child, True))
        node = getattr(node, part)
        path = f"{path}.{part}" if path else part
    return out


def load_outer(
    model: nn.Module, adapter, reader: ShardReader, dtype: torch.dtype, skip: tuple[str, ...] = ()
) -> None:
    """Materialize the modules outside the decoder blocks, but those named in `skip` (loaded later, when needed),
    then tie the head to the embedding as the config says."""
    tied = _tied_names(model)
    for name, mod, whole in outer_modules(model, adapter.blocks_path):
        if name in skip or (tied and mod is model.get_output_embeddings()):
            continue
        if whole:
            materialize(mod, name, reader, dtype)
            continue
        loaded = []
        for pname, p in list(mod._parameters.items()):
            if p is not None and p.device.type == "meta":
                full = f"{name}.{pname}" if name else pname
                t = reader.get(full, dtype)
                mod._parameters[pname] = nn.Parameter(t, requires_grad=False)
                loaded.append((reader.stored_name(full), t))
        check_finite(loaded, InputError, reader.files)
    if tied:
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        if embed.weight.device.type != "meta":
            head.weight = embed.weight
