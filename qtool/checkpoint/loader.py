"""Load a packed checkpoint into a model whose quantized linears execute the packed layouts."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from qtool.checkpoint.manifest import FORMAT_VERSION, MANIFEST_NAME, QUANT_METHOD, file_sha256
from qtool.checkpoint.writer import INDEX_NAME, WEIGHTS_NAME
from qtool.errors import CheckpointError
from qtool.models.loading import check_architecture
from qtool.runtime.layouts import LAYOUTS
from qtool.runtime.schemes import apply_model_schemes


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()


def read_manifest(path: Path) -> dict:
    mpath = path / MANIFEST_NAME
    if not mpath.is_file():
        raise CheckpointError(f"{path}: not a qtool checkpoint (no {MANIFEST_NAME})")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{mpath}: invalid JSON ({e})") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: format_version {manifest.get('format_version')!r} is unknown; "
                              f"expected {FORMAT_VERSION}")
    return manifest


def verify_files(path: Path, manifest: dict) -> None:
    for name, digest in sorted(manifest.get("files", {}).items()):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing; the manifest lists it")
        if file_sha256(f) != digest:
            raise CheckpointError(f"{f}: sha256 does not match the manifest; the file is corrupt or was modified")
    for f in path.glob("*.safetensors"):
        if f.name not in manifest.get("files", {}):
            raise CheckpointError(f"{f}: not listed in the manifest")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / INDEX_NAME
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [WEIGHTS_NAME]
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            tensors.update(load_file(str(path / name)))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path / name}: cannot read safetensors ({e})") from None
    return tensors


def load_checkpoint(path: str | Path, device: str = "cpu", dtype: torch.dtype | None = None, verify: bool = True):
    """Return the model (eval mode) on `device`; unquantized parameters in `dtype` (float32 on CPU, float16 on
    CUDA by default). Corrupt or mismatched checkpoints raise CheckpointError naming the file or tensor."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory; expected a qtool checkpoint")
    manifest = read_manifest(path)
    if verify:
        verify_files(path, manifest)
    raw_config = json.loads((path / "config.json").read_text())
    qcfg = raw_config.get("quantization_config") or {}
    if qcfg.get("quant_method") != QUANT_METHOD:
        raise CheckpointError(f"{path / 'config.json'}: quantization_config.quant_method is "
                              f"{qcfg.get('quant_method')!r}; expected {QUANT_METHOD!r}")
    if qcfg.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path / 'config.json'}: quantization_config.format_version "
                              f"{qcfg.get('format_version')!r} is unknown; expected {FORMAT_VERSION}")
    layers: dict[str, dict] = qcfg.get("layers", {})
    if dtype is None:
        dtype = torch.float16 if str(device).startswith("cuda") else torch.float32

    config = AutoConfig.from_pretrained(str(path))
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # ours, not a transformers quantizer
    check_architecture(str(path), config)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)

    tensors = read_tensors(path)
    for name, lcfg in sorted(layers.items()):
        fmt = lcfg.get("format")
        if fmt not in LAYOUTS:
            raise CheckpointError(f"{path / 'config.json'}: layer {name} has format {fmt!r}; expected one of "
                                  f"{', '.join(LAYOUTS)}")
        layout_cls, module_cls = LAYOUTS[fmt]
        parent_name, _, child = name.rpartition(".")
        try:
            old = model.get_submodule(name)
        except AttributeError:
            raise CheckpointError(f"{path / 'config.json'}: layer {name} is not a module of this model") from None
        if (getattr(old, "in_features", None), getattr(old, "out_features", None)) != (lcfg.get("in_features"),
                                                                                       lcfg.get("out_features")):
            raise CheckpointError(f"{path / 'config.json'}: layer {name} is {lcfg.get('out_features')}x"
                                  f"{lcfg.get('in_features')}; the model's module is "
                                  f"{getattr(old, 'out_features', '?')}x{getattr(old, 'in_features', '?')}")
        prefix = f"{name}."
        fields = {k[len(prefix):]: tensors.pop(k) for k in list(tensors)
                  if k.startswith(prefix) and "." not in k[len(prefix):] and k != f"{name}.bias"}
        layout = layout_cls.from_tensors(name, lcfg, fields)
        for field in sorted(set(fields) - set(layout.tensors())):
            raise CheckpointError(f"tensor {name}.{field}: not a field of layout {fmt}")
        bias = tensors.pop(f"{name}.bias", None)
        if lcfg.get("bias") and bias is None:
            raise CheckpointError(f"tensor {name}.bias: missing; the layer config says it has a bias")
        setattr(model.get_submodule(parent_name), child,
                module_cls(layout, None if bias is None else bias.to(dtype)))

    expected = dict(model.state_dict())
    for name, t in tensors.items():
        if name not in expected:
            raise CheckpointError(f"tensor {name}: not a parameter of {config.architectures[0]}")
        if tuple(t.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"tensor {name}: found shape {list(t.shape)}, expected {list(expected[name].shape)}")
    model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()},
                          strict=False, assign=True)
    model.tie_weights()
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.device.type == "meta":
            raise CheckpointError(f"tensor {name}: missing from {path}")
    apply_model_schemes(model, qcfg, str(path / "config.json"))
    model.eval()
    return model.to(device)


def load_tokenizer(path: str | Path):
    return AutoTokenizer.from_pretrained(str(path))
