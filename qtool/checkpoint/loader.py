"""Load a packed checkpoint into a model whose quantized linears execute the packed layouts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from qtool.checkpoint.manifest import FORMAT_VERSION, MANIFEST_NAME, QUANT_METHOD, file_sha256
from qtool.checkpoint.qconfig import READABLE_VERSIONS, is_grouped, native_config, register_config
from qtool.errors import CheckpointError, shown
from qtool.kv_cache.schemes import apply_model_schemes, attach_scheme_tensors
from qtool.layouts.registry import LAYOUTS
from qtool.models.integrity import (
    FLOAT_DTYPES,
    SAFETENSORS_DTYPES,
    StoredTensors,
    describe,
    plain_file_name,
    read_config_json,
    tensor_index,
)
from qtool.models.loading import check_architecture, config_dtype, with_expert_linears
from qtool.models.loading import load_tokenizer as _load_tokenizer


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()


def read_manifest(path: Path) -> dict:
    mpath = path / MANIFEST_NAME
    if not mpath.is_file():
        raise CheckpointError(f"{path}: not a qtool checkpoint (no {MANIFEST_NAME})")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{mpath}: invalid JSON ({describe(e)})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{mpath}: found a JSON {type(manifest).__name__}, expected an object")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{mpath}: format_version {manifest.get('format_version')!r} is unknown; "
            f"expected {FORMAT_VERSION}"
        )
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(
            f"{mpath}: files: found {type(files).__name__}, expected an object of file name to sha256"
        )
    for name, digest in files.items():
        # The names are joined to the checkpoint's folder and read: one with a path could reach any file.
        if not plain_file_name(name) or name == MANIFEST_NAME:
            raise CheckpointError(
                f"{mpath}: files: found the entry {shown(name)}, expected the name of a file inside the "
                f"checkpoint folder (no path, no '..')"
            )
        # "" is what the writer's provisional manifest holds while the checkpoint is evaluated (sizes only).
        if not isinstance(digest, str) or not (digest == "" or _SHA256.fullmatch(digest)):
            raise CheckpointError(
                f"{mpath}: files[{shown(name)}]: found {shown(digest)}, expected a sha256 hex digest"
            )
    sizes = manifest.get("sizes", {})
    if not isinstance(sizes, dict):
        raise CheckpointError(
            f"{mpath}: sizes: found {type(sizes).__name__}, expected an object of file name to bytes"
        )
    for name, size in sizes.items():
        if name not in files:
            raise CheckpointError(f"{mpath}: sizes: found the entry {shown(name)}, which files does not list")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CheckpointError(
                f"{mpath}: sizes[{shown(name)}]: found {shown(size)}, expected a number of bytes"
            )
    return manifest


_SHA256 = re.compile(r"[0-9a-f]{64}")


def check_figures(path: Path, manifest: dict, figures: dict) -> None:
    """The manifest's bits per weight against `figures`, the same figures computed from the checkpoint's own
    layouts and tensors: the manifest is not hashed, so a hand-edited figure would otherwise be printed beside
    "verified"."""
    mpath = path / MANIFEST_NAME
    recorded = manifest.get("bits_per_weight")
    if not isinstance(recorded, dict):
        raise CheckpointError(f"{mpath}: bits_per_weight: found {shown(recorded)}, expected {shown(figures)}")
    for key in sorted(set(recorded) | set(figures)):
        if recorded.get(key) != figures.get(key):
            found, expected = recorded.get(key), figures.get(key)
            if isinstance(found, dict) and isinstance(expected, dict):  # per layer: name the first layer
                layer = next(k for k in sorted(set(found) | set(expected)) if found.get(k) != expected.get(k))
                key, found, expected = f"{key}.{layer}", found.get(layer), expected.get(layer)
            raise CheckpointError(
                f"{mpath}: bits_per_weight.{key}: found {shown(found)}, the checkpoint's tensors give "
                f"{shown(expected)}; expected the figures as written (was the manifest edited?)"
            )


def check_files(path: Path, manifest: dict) -> None:
    """What every load checks without reading the files' content: each file the manifest lists exists with the
    size it records (manifests written before sizes were recorded: exists), and every safetensors file is listed.
    The tensors' headers are checked when they are read. `verify_files` adds the full hashes."""
    sizes = manifest.get("sizes") or {}
    for name in sorted(manifest.get("files", {})):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing; the manifest lists it")
        if name in sizes and f.stat().st_size != sizes[name]:
            raise CheckpointError(
                f"{f}: {f.stat().st_size} bytes, the manifest records {sizes[name]}; the file is "
                f"truncated or was modified"
            )
    for f in path.glob("*.safetensors"):
        if f.name not in manifest.get("files", {}):
            raise CheckpointError(f"{f}: not listed in the manifest")


def verify_files(path: Path, manifest: dict) -> None:
    """`check_files` and every file's sha256 against the manifest (reads every byte: `qtool pack --verify`)."""
    check_files(path, manifest)
    for name, digest in sorted(manifest.get("files", {}).items()):
        f = path / name
        if file_sha256(f) != digest:
            raise CheckpointError(
                f"{f}: sha256 does not match the manifest; the file is corrupt or was modified"
            )


def read_tensors(path: Path, device: str | torch.device = "cpu") -> StoredTensors:
    """Every stored tensor by name, after the files' headers and index were checked; each is read when asked for
    (onto `device`), and a NaN or Inf in it (a norm, an embedding, a scale) is refused then, naming the tensor and
    its file."""
    found = tensor_index(path, CheckpointError)
    if found is None:
        raise CheckpointError(f"{path}: no model.safetensors (or shards with model.safetensors.index.json)")
    return StoredTensors(found, CheckpointError, device)


def read_config(path: Path) -> dict:
    """config.json of a checkpoint as the model's own config (`qconfig.native_config`), with its
    quantization_config checked and, for every quantized layer, a config holding its shape (`in_features`,
    `out_features`, `bias`: from the model's module where config.json groups the layers)."""
    cfile = path / "config.json"
    stored = read_config_json(cfile, CheckpointError)
    qcfg = stored.get("quantization_config")
    if not isinstance(qcfg, dict) or qcfg.get("quant_method") != QUANT_METHOD:
        found = qcfg.get("quant_method") if isinstance(qcfg, dict) else qcfg
        raise CheckpointError(
            f"{cfile}: quantization_config.quant_method is {found!r}; expected {QUANT_METHOD!r}"
        )
    if qcfg.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{cfile}: quantization_config.format_version {qcfg.get('format_version')!r} is "
            f"unknown; expected one of {', '.join(map(str, READABLE_VERSIONS))}"
        )
    raw = native_config(stored, str(cfile))
    qcfg = raw["quantization_config"]
    layers = qcfg.get("layers", {})
    if not isinstance(layers, dict) or not all(isinstance(v, dict) for v in layers.values()):
        raise CheckpointError(
            f"{cfile}: quantization_config.layers: expected an object of module name to layer config"
        )
    if is_grouped(stored):
        _fill_shapes(cfile, raw, layers)
    return raw


def _fill_shapes(cfile: Path, raw: dict, layers: dict[str, dict]) -> None:
    """Each grouped layer's in_features, out_features and bias, from its module in a meta-device model built from
    the config (no weight is allocated)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    plain = {k: v for k, v in raw.items() if k != "quantization_config"}
    try:
        config = CONFIG_MAPPING[plain["model_type"]].from_dict(plain)
        with init_empty_weights():
            # The same modules the loader builds (a mixture of experts' per-expert linears included).
            model = with_expert_linears(AutoModelForCausalLM.from_config(config))
    except MemoryError:
        raise
    except Exception as e:  # transformers raises many types for one bad config
        raise CheckpointError(f"{cfile}: not a usable model config ({describe(e)})") from None
    for name, lcfg in layers.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise CheckpointError(
                f"{cfile}: quantization_config.config_groups: target {name} is not a module of "
                f"{type(model).__name__}"
            ) from None
        if not isinstance(module, nn.Linear):
            raise CheckpointError(
                f"{cfile}: quantization_config.config_groups: target {name} is a "
                f"{type(module).__name__}; expected a linear layer"
            )
        lcfg.update(
            in_features=module.in_features, out_features=module.out_features, bias=module.bias is not None
        )


def checkpoint_config(path: Path):
    """The transformers config of a checkpoint (its quantization_config, which is ours, removed)."""
    read_config(path)
    register_config()  # model_type `qtool`
    try:
        config = AutoConfig.from_pretrained(str(path))
    except MemoryError:
        raise
    except Exception as e:  # transformers and huggingface_hub raise many types for one bad config
        raise CheckpointError(f"{path / 'config.json'}: not a usable model config ({describe(e)})") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # ours, not a transformers quantizer
    return config


def replace_layer(
    model,
    where: Path,
    name: str,
    lcfg: dict,
    fields: dict[str, torch.Tensor],
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> None:
    """Put the quantized module of layer `name` (its config `lcfg`, its stored `fields`) in place of the model's
    linear; the layout validates the tensors. Shared by `load_checkpoint` and transformers' loading
    (qtool/hf_integration.py), so both build the same modules."""
    fmt = lcfg.get("format")
    if fmt not in LAYOUTS:
        raise CheckpointError(
            f"{where}: layer {name} has format {fmt!r}; expected one of {', '.join(LAYOUTS)}"
        )
    module_cls = LAYOUTS[fmt]
    layout_cls = module_cls.layout_cls
    parent_name, _, child = name.rpartition(".")
    try:
        old = model.get_submodule(name)
    except AttributeError:
        raise CheckpointError(f"{where}: layer {name} is not a module of this model") from None
    if (getattr(old, "in_features", None), getattr(old, "out_features", None)) != (
        lcfg.get("in_features"),
        lcfg.get("out_features"),
    ):
        raise CheckpointError(
            f"{where}: layer {name} is {lcfg.get('out_features')}x{lcfg.get('in_features')}; the "
            f"model's module is {getattr(old, 'out_features', '?')}x{getattr(old, 'in_features', '?')}"
        )
    try:
        layout = layout_cls.from_tensors(name, lcfg, fields)
    except CheckpointError as e:
        if "found" not in str(e) or not str(e).startswith(f"tensor {name}."):
            raise
        # A stored tensor's shape disagrees with the layer's shape, which the model's config fixes.
        raise CheckpointError(
            f"{e} ({where}: layer {name} is {lcfg.get('in_features')}x{lcfg.get('out_features')} "
            f"(in x out) by the model's config)"
        ) from None
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{where}: layer {name}: its {fmt} config is incomplete or of the wrong type "
            f"({type(e).__name__}: {describe(e)})"
        ) from None
    for field in sorted(set(fields) - set(layout.tensors())):
        raise CheckpointError(f"tensor {name}.{field}: not a field of layout {fmt}")
    if lcfg.get("bias") and bias is None:
        raise CheckpointError(f"tensor {name}.bias: missing; the layer config says it has a bias")
    setattr(
        model.get_submodule(parent_name), child, module_cls(layout, None if bias is None else bias.to(dtype))
    )


def load_checkpoint(
    path: str | Path, device: str = "cpu", dtype: torch.dtype | None = None, verify: bool = False
):
    """Return the model (eval mode) on `device`; unquantized parameters in `dtype` (float32 on CPU, float16 on
    CUDA by default). Corrupt or mismatched checkpoints raise CheckpointError naming the file or tensor. Files are
    checked by size and safetensors header; `verify` also hashes every file against the manifest."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory; expected a qtool checkpoint")
    manifest = read_manifest(path)
    (verify_files if verify else check_files)(path, manifest)
    qcfg = read_config(path)["quantization_config"]
    layers: dict[str, dict] = qcfg.get("layers", {})
    if dtype is None:
        dtype = torch.float16 if str(device).startswith("cuda") else torch.float32

    config = checkpoint_config(path)
    check_architecture(str(path), config)
    # The writer stores every tensor it does not quantize in the model's dtype; another float dtype is an edit.
    # (Read before the model is built: building it in `dtype` sets the config's dtype to that.)
    stored = config_dtype(config)
    try:
        with init_empty_weights():
            model = with_expert_linears(AutoModelForCausalLM.from_config(config, dtype=dtype))
    except MemoryError:
        raise
    except Exception as e:  # a config that passed its own validation can still fail to build
        raise CheckpointError(
            f"{path / 'config.json'}: cannot build {config.architectures[0]} from it ({describe(e)})"
        ) from None

    # Tensors are read one at a time, onto `device`: host memory holds one tensor beyond what is on the CPU.
    tensors = read_tensors(path, device)
    for name, lcfg in sorted(layers.items()):
        prefix = f"{name}."
        fields = {
            k[len(prefix) :]: tensors.pop(k)
            for k in list(tensors)
            if k.startswith(prefix) and "." not in k[len(prefix) :] and k != f"{name}.bias"
        }
        replace_layer(
            model, path / "config.json", name, lcfg, fields, tensors.pop(f"{name}.bias", None), dtype
        )

    attach_scheme_tensors(model, qcfg, tensors, str(path / "config.json"))
    expected = dict(model.state_dict())
    # Names, shapes and kinds from the headers, before the first of these tensors is read.
    for name, info in tensors.files.items():
        if name not in expected:
            raise CheckpointError(f"tensor {name}: not a parameter of {config.architectures[0]}")
        if info.shape != tuple(expected[name].shape):
            raise CheckpointError(
                f"tensor {name}: found shape {list(info.shape)}, expected {list(expected[name].shape)}"
            )
        if info.dtype in FLOAT_DTYPES and SAFETENSORS_DTYPES[info.dtype] != stored:
            raise CheckpointError(
                f"tensor {name}: found dtype {str(SAFETENSORS_DTYPES[info.dtype]).removeprefix('torch.')}, "
                f"expected {str(stored).removeprefix('torch.')} (the dtype in {path / 'config.json'}, in which "
                f"qtool stores every tensor it does not quantize)"
            )
        if expected[name].is_floating_point() != (info.dtype in FLOAT_DTYPES):
            raise CheckpointError(
                f"tensor {name}: found dtype "
                f"{str(SAFETENSORS_DTYPES[info.dtype]).removeprefix('torch.')}, "
                f"expected {'a floating-point' if expected[name].is_floating_point() else 'an integer'}"
                f" tensor"
            )
    for name in list(tensors):
        t = tensors.pop(name)
        mod_name, _, leaf = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        t = t.to(dtype) if t.is_floating_point() else t
        if leaf in mod._parameters:
            mod._parameters[leaf] = nn.Parameter(t, requires_grad=False)
        else:
            mod._buffers[leaf] = t
        del t
    model.tie_weights()
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.device.type == "meta":
            raise CheckpointError(f"tensor {name}: missing from {path}")
    apply_model_schemes(model, qcfg, str(path / "config.json"))
    model.eval()
    return model.to(device)


def load_tokenizer(path: str | Path):
    """The tokenizer a checkpoint carries; a missing or garbled one is a CheckpointError naming the file."""
    return _load_tokenizer(path, CheckpointError)
