"""Load a Hugging Face causal LM (local directory or hub id) and its adapter, strictly.

transformers initialises a missing weight randomly and says so only in a warning (which qtool's quiet logging
hides), so a folder missing a tensor would quantize and evaluate "fine". Here every weight must be present,
expected, of the config's shape and finite, or loading fails with one line naming the tensor; the files are
checked (headers, shard index, config.json, tokenizer) before any weight is read.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from qtool import hub
from qtool.errors import CheckpointError, InputError, QtoolError, RecipeError, UsageError
from qtool.models.adapters import Adapter, adapter_for, generic_adapter, supported_architectures
from qtool.models.integrity import (
    FLOAT_DTYPES,
    TensorInfo,
    check_finite,
    context_length,
    describe,
    read_config_json,
    tensor_index,
)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# Files one of which a local tokenizer needs (fast tokenizers, sentencepiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def is_hub_id(ref: str, base: Path | None = None) -> bool:
    """A reference that is not an existing path (relative to `base` or the working directory) and looks like
    `org/name`."""
    if ref.startswith((".", "/", "~")) or not _HUB_ID.match(ref):
        return False
    return not os.path.exists(ref) and not (base is not None and (base / ref).exists())


def _refuse_missing_path(ref: str, what: str, error: type[QtoolError] = InputError) -> None:
    """A reference that is not an existing folder and not shaped as a hub id (`org/name`) is a path that does not
    exist: it is never sent to the hub."""
    if not is_hub_id(ref):
        raise error(
            f"{what} '{ref}': no such folder; expected a model directory or a hub id such as "
            f"meta-llama/Llama-2-7b-hf"
        )


def checkpoint_mark(folder: Path) -> str | None:
    """Why `folder` looks like a packed qtool checkpoint (its manifest, its quantization_config, a qtool recipe
    beside it), or None."""
    from qtool.checkpoint.manifest import MANIFEST_NAME, QUANT_METHOD

    if (folder / MANIFEST_NAME).is_file():
        return f"it has {MANIFEST_NAME}"
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raw = None
    qcfg = raw.get("quantization_config") if isinstance(raw, dict) else None
    if isinstance(qcfg, dict) and qcfg.get("quant_method") == QUANT_METHOD:
        return f"its config.json has quantization_config.quant_method {QUANT_METHOD!r}"
    if isinstance(raw, dict) and raw.get("model_type") == QUANT_METHOD:
        return f"its config.json has model_type {QUANT_METHOD!r}"
    recipe = folder / "recipe.yaml"
    if recipe.is_file():
        import yaml

        try:
            as_run = yaml.safe_load(recipe.read_text(encoding="utf-8"))
        except (OSError, ValueError, yaml.YAMLError):
            as_run = None
        # A recipe as qtool writes it beside a checkpoint; any other recipe.yaml in a model folder is not a mark.
        if isinstance(as_run, dict) and "stages" in as_run and "model" in as_run:
            return "it holds the recipe.yaml of a qtool run"
    return None


def refuse_checkpoint(folder: Path, packed_tensor: str | None = None) -> None:
    """An original model was asked for: refuse a packed checkpoint, and a folder that looks like one without its
    manifest (its packed tensors would be ignored and the quantized linears come up randomly initialised)."""
    from qtool.checkpoint.manifest import MANIFEST_NAME

    if (folder / MANIFEST_NAME).is_file():
        raise InputError(
            f"model '{folder}': a packed qtool checkpoint; expected an original (float) model folder "
            f"or hub id"
        )
    mark = checkpoint_mark(folder) or (f"it stores packed tensor {packed_tensor}" if packed_tensor else None)
    if mark:
        raise CheckpointError(
            f"{folder}: looks like a qtool checkpoint ({mark}) but has no {MANIFEST_NAME}; "
            f"expected a complete checkpoint (write it again with qtool quantize or qtool pack)"
        )


def load_config(ref: str) -> PretrainedConfig:
    """The config of an original model. A local folder's config.json is checked first (JSON, sizes are positive
    integers), and a folder holding a qtool checkpoint is refused."""
    folder = Path(ref)
    local = folder.is_dir()
    if local:
        refuse_checkpoint(folder)
        read_config_json(folder / "config.json", InputError)
    else:
        _refuse_missing_path(ref, "model")
        hub.prepare()
    try:
        return AutoConfig.from_pretrained(ref)
    except MemoryError:
        raise
    except Exception as e:  # transformers and huggingface_hub raise many types for one bad config
        if local:
            raise InputError(f"{folder / 'config.json'}: not a usable model config ({describe(e)})") from None
        offline = "; the hub cannot be reached from here" if not hub.prepare() else ""
        raise InputError(
            f"model '{ref}': cannot read its config ({describe(e)}{offline}); expected a model directory "
            f"with config.json or a reachable hub id"
        ) from None


def adapter_of(config: PretrainedConfig) -> Adapter | str:
    """The declared adapter of `config`'s architecture, or one found from the module tree of the model it builds
    (weight-only stages run on it), or why there is none."""
    adapter = adapter_for(getattr(config, "architectures", None))
    if adapter is not None:
        if adapter.experts and (
            getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1
        ):
            return (
                f"{config.architectures[0]} mixes dense and mixture-of-experts blocks (mlp_only_layers "
                f"{getattr(config, 'mlp_only_layers', None)}, decoder_sparse_step "
                f"{getattr(config, 'decoder_sparse_step', 1)}); qtool expects every block alike"
            )
        return adapter.expanded(config)
    key = config.to_json_string(use_diff=False)
    if key not in _GENERIC:  # building the model on the meta device takes a while for a large one
        _GENERIC[key] = generic_adapter(meta_model(config, "model config", QtoolError))
    return _GENERIC[key]


_GENERIC: dict[str, Adapter | str] = {}


def with_expert_linears(model):
    """`model` with each block's experts as linears (qtool/models/moe.py) where its family is a mixture of
    experts; other models as they are."""
    adapter = adapter_for(getattr(model.config, "architectures", None))
    if adapter is not None and adapter.experts:
        from qtool.models.moe import unfuse_experts

        unfuse_experts(model, adapter.blocks(model), adapter.experts)
    return model


def check_architecture(ref: str, config: PretrainedConfig) -> Adapter:
    adapter = adapter_of(config)
    if isinstance(adapter, str):
        found = ", ".join(getattr(config, "architectures", None) or [config.model_type])
        raise QtoolError(
            f"model '{ref}': architecture {found} is not supported: {adapter}; expected one of "
            f"{', '.join(supported_architectures())}, or a decoder whose blocks hold linear layers"
        )
    return adapter


def config_dtype(config: PretrainedConfig) -> torch.dtype:
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dt, str):
        dt = getattr(torch, dt)
    return dt


def check_context(
    seq_len: int, allow: bool, config: PretrainedConfig, ref: str, where: str, allow_hint: str
) -> None:
    """Refuse windows longer than the model's context (positions it was never trained on give meaningless numbers,
    and a huge seq_len runs for minutes before anything fails), unless the user explicitly allowed it. `where` is
    the recipe key or the flag the value came from; a flag makes it a usage error."""
    found = context_length(config)
    if found is None or allow or seq_len <= found[1]:
        return
    key, n = found
    error = RecipeError if ":" in where else UsageError  # `file:key`, or a flag or an argument
    raise error(
        f"{where}: found {seq_len} tokens, beyond the context of '{ref}' ({key} {n} in its config.json); "
        f"expected at most {n}, or {allow_hint} to run past it"
    )


def load_tokenizer(ref: str | Path, error: type[QtoolError] = InputError):
    """The tokenizer beside a model or checkpoint; a missing or garbled one is one line naming the folder or file."""
    folder = Path(ref)
    if folder.is_dir():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            f = folder / name
            if f.is_file():
                try:
                    json.loads(f.read_text(encoding="utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise error(f"{f}: invalid JSON ({describe(e)}); expected a tokenizer file") from None
        if not any((folder / n).is_file() for n in TOKENIZER_FILES):
            raise error(
                f"{folder}: no tokenizer (none of {', '.join(TOKENIZER_FILES)}); expected the tokenizer "
                f"files beside config.json"
            )
    else:
        _refuse_missing_path(str(ref), "tokenizer", error)
        hub.prepare()
    try:
        return AutoTokenizer.from_pretrained(str(ref))
    except MemoryError:
        raise
    except Exception as e:  # tokenizers' Rust errors are plain Exceptions
        raise error(f"{ref}: the tokenizer cannot be loaded ({describe(e)})") from None


def meta_model(config: PretrainedConfig, where: str, error: type[QtoolError]):
    """The model class built from `config` without memory for its weights (for names and shapes)."""
    from accelerate import init_empty_weights

    try:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
    except MemoryError:
        raise
    except Exception as e:  # a config that passed its own validation can still fail to build
        raise error(
            f"{where}: cannot build {', '.join(config.architectures or [config.model_type])} from it "
            f"({describe(e)})"
        ) from None
    return with_expert_linears(model)


def check_weight_files(ref: str, config: PretrainedConfig, meta=None) -> dict[str, TensorInfo] | None:
    """Before any weight is read: the safetensors files are whole and consistent with their index, and every tensor
    the model class knows has the shape config.json implies and a floating-point dtype. Returns tensor → file (None
    for hub ids and folders without safetensors, which transformers checks while loading)."""
    folder = Path(ref)
    if not folder.is_dir():
        return None
    found = tensor_index(folder, InputError)
    if found is None:
        if not any(folder.glob("pytorch_model*.bin")):
            raise InputError(
                f"{folder}: no weights; expected model.safetensors (or shards with "
                f"model.safetensors.index.json)"
            )
        return None
    packed = sorted(n for n in found if n.endswith(".qweight"))
    if packed:
        refuse_checkpoint(folder, packed[0])
    if meta is None:
        meta = meta_model(config, str(folder / "config.json"), InputError)
    expected = meta.state_dict()
    prefix = getattr(config, "base_model_prefix", None) or "model"
    # Checkpoints saved from the base model (facebook/opt-*) drop the prefix that the CausalLM's names carry;
    # transformers adds it back, so do the same before comparing.
    add_prefix = (
        bool(found)
        and not any(n.startswith(f"{prefix}.") for n in found)
        and any(k.startswith(f"{prefix}.") for k in expected)
    )
    for name, info in sorted(found.items()):
        want = expected.get(f"{prefix}.{name}" if add_prefix else name)
        if want is None:
            continue  # unexpected names are judged after loading, by transformers' own ignore lists
        if info.shape != tuple(want.shape):
            raise InputError(
                f"tensor {name} ({info.file}): found shape {list(info.shape)}, expected "
                f"{list(want.shape)} from {folder / 'config.json'}"
            )
        if want.is_floating_point() and info.dtype not in FLOAT_DTYPES:
            raise InputError(
                f"tensor {name} ({info.file}): found dtype {info.dtype}, expected a floating-point tensor"
            )
    return found


def check_loading_info(
    ref: str, info: dict, files: dict[str, TensorInfo] | None, config: PretrainedConfig
) -> None:
    arch = ", ".join(config.architectures or [config.model_type])
    for name in sorted(info.get("missing_keys") or ()):
        raise InputError(
            f"tensor {name}: missing from the weights of '{ref}'; expected every parameter of {arch} "
            f"(it would be initialised randomly)"
        )
    for name in sorted(info.get("unexpected_keys") or ()):
        where = f" ({files[name].file})" if files and name in files else ""
        raise InputError(
            f"tensor {name}{where}: not a parameter of {arch} as {ref}/config.json describes it; "
            f"expected weights of this model"
        )
    for item in sorted(info.get("mismatched_keys") or (), key=str):
        name = item[0] if isinstance(item, (tuple, list)) else item
        raise InputError(f"tensor {name}: its shape does not match {ref}/config.json")
    for msg in info.get("error_msgs") or ():
        raise InputError(f"model '{ref}': {describe(Exception(msg))}")


def unique_tensors(model: torch.nn.Module):
    """(name, tensor) of the state dict with tied weights once, under their first name."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        yield name, t


def foreign_scheme(config) -> str | None:
    """A label for the quantization of a model another tool wrote (compressed-tensors, GPTQ, AWQ, bitsandbytes):
    method and bits, e.g. "compressed-tensors W4A16 g64 asym"; None for a model without a quantization_config."""
    qcfg = getattr(config, "quantization_config", None)
    if qcfg is None:
        return None
    q = qcfg if isinstance(qcfg, dict) else qcfg.to_dict()
    method = str(q.get("quant_method") or "quantized")
    if method == "compressed-tensors":
        labels = []
        for group in (q.get("config_groups") or {}).values():
            w, a = group.get("weights") or {}, group.get("input_activations") or {}
            label = f"W{w.get('num_bits', '?')}A{a.get('num_bits', 16) if a else 16}"
            if w.get("strategy") == "group" and w.get("group_size"):
                label += f" g{w['group_size']}"
            elif w.get("strategy"):
                label += f" per {w['strategy']}"
            label += " sym" if w.get("symmetric", True) else " asym"
            labels.append(label)
        return f"compressed-tensors {', '.join(sorted(set(labels))) or q.get('format', '')}".strip()
    bits = q.get("bits") or q.get("w_bit")
    group = q.get("group_size") or q.get("q_group_size")
    label = method + (f" W{bits}" if bits else "") + (f" g{group}" if group and group > 0 else "")
    if "sym" in q:
        label += " sym" if q["sym"] else " asym"
    return label


def dequantizing_config(config):
    """transformers' quantization config that loads a model of `config` dequantized to float (compressed-tensors
    only), or None when qtool knows no such load for its method."""
    qcfg = getattr(config, "quantization_config", None)
    q = qcfg if isinstance(qcfg, dict) or qcfg is None else qcfg.to_dict()
    if not q or q.get("quant_method") != "compressed-tensors":
        return None
    from transformers import CompressedTensorsConfig

    try:
        return CompressedTensorsConfig(dequantize=True)
    except TypeError:  # transformers before 5.20 names it the other way round
        return CompressedTensorsConfig(run_compressed=False)


def load_model(
    ref: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    max_memory: int | None = None,
    quantization_config=None,
):
    """Return (model in `dtype`, tokenizer, adapter, original parameter dtype): on the CPU, or read straight onto
    `device`. With `max_memory` (bytes on `device`), accelerate places what does not fit in host memory, then on
    disk (its hooks bring each module's weights to `device` for its forward). `quantization_config` replaces a
    quantized model's own (`dequantizing_config`: loaded as float)."""
    config = load_config(ref)
    adapter = check_architecture(ref, config)
    original = config_dtype(config)
    tokenizer = load_tokenizer(ref, InputError)
    files = check_weight_files(ref, config)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    placement: dict = {}
    if max_memory is not None:
        import atexit
        import shutil
        import tempfile

        from qtool.units import available_host

        budget = (
            {dev.index or 0: max_memory, "cpu": available_host()}
            if dev.type == "cuda"
            else {"cpu": max_memory}
        )
        folder = tempfile.mkdtemp(prefix="qtool-offload-", dir=os.environ.get("QTOOL_OFFLOAD_DIR"))
        atexit.register(shutil.rmtree, folder, True)
        placement = {"device_map": "auto", "max_memory": budget, "offload_folder": folder}
    elif dev.type != "cpu":
        placement = {"device_map": {"": str(dev)}}
    try:
        extra = {} if quantization_config is None else {"quantization_config": quantization_config}
        model, info = AutoModelForCausalLM.from_pretrained(
            ref, dtype=dtype, low_cpu_mem_usage=True, output_loading_info=True, **placement, **extra
        )
    except MemoryError:
        raise
    except Exception as e:  # the files were checked above; what is left is transformers' to describe
        raise InputError(f"model '{ref}': cannot be loaded ({describe(e)})") from None
    check_loading_info(ref, info, files, config)
    check_finite(unique_tensors(model), InputError, files)
    model.eval()
    return with_expert_linears(model), tokenizer, adapter, original


def resolve_path(ref: str, base: Path) -> str:
    """Resolve a local reference relative to `base` (the recipe's folder); hub ids pass through."""
    if is_hub_id(ref, base):
        return ref
    p = Path(os.path.expanduser(ref))
    return str(p if p.is_absolute() else (base / p).resolve())
