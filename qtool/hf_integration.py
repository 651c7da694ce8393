"""qtool's quantization config and quantizer for transformers, so `from_pretrained(<qtool checkpoint>)`,
`transformers.pipeline` and lm-eval's `hf` model build the model through qtool's runtime (formats/checkpoint.md,
"Loading with transformers"). `import qtool` registers them (see `qtool/__init__.py`); without it transformers
does not know `quant_method: qtool`.

transformers builds the model on the meta device; before it reads the weights, every quantized linear is replaced
by a placeholder whose buffers are the layer's stored tensors (names, shapes and dtypes from the safetensors
headers), so transformers loads them as they are stored. Afterwards each placeholder becomes the layer's qtool
module through the loader's own `replace_layer`, the KV cache schemes are installed, and every tensor of the model
is checked to have come from the checkpoint: nothing is left randomly initialised."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from qtool.checkpoint.manifest import MANIFEST_NAME, QUANT_METHOD
from qtool.errors import CheckpointError, NotImplementedYet

# safetensors' dtype names (as the header stores them) → torch dtypes.
_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
# device_map values that accelerate resolves after the quantizer sees them; what they resolve to is checked after
# loading (`hf_device_map`).
_RESOLVED_LATER = ("auto", "balanced", "balanced_low_0", "sequential")


class QtoolConfig(QuantizationConfigMixin):
    """`quantization_config` of a qtool checkpoint, as stored: `format_version`, `layers` and the model's run-time
    schemes (`kv_cache`)."""

    def __init__(self, format_version: int | None = None, layers: dict | None = None, **schemes) -> None:
        schemes.pop("quant_method", None)
        self.quant_method = QUANT_METHOD
        self.format_version = format_version
        self.layers = {} if layers is None else layers
        self.schemes = schemes

    def to_dict(self) -> dict:
        return {
            "quant_method": QUANT_METHOD,
            "format_version": self.format_version,
            **copy.deepcopy(self.schemes),
            "layers": copy.deepcopy(self.layers),
        }

    def __iter__(self):
        yield from self.to_dict().items()


class _Stored(nn.Module):
    """Placeholder holding one module's stored tensors until transformers has loaded them."""

    def __init__(self, tensors: dict) -> None:
        super().__init__()
        for field, info in tensors.items():
            self.register_buffer(field, torch.empty(info.shape, dtype=_DTYPES[info.dtype], device="meta"))


def _single_device(device_map) -> bool:
    if device_map is None or isinstance(device_map, (int, torch.device)):
        return True
    if isinstance(device_map, str):
        return device_map != "disk"
    if isinstance(device_map, dict):
        devices = {str(v) for v in device_map.values()}
        return len(devices) <= 1 and "disk" not in devices
    return False


def _refuse_device_map(device_map) -> None:
    raise NotImplementedYet(
        f"device_map {device_map!r}: a qtool checkpoint loads on one device; expected None, "
        f"'cpu', 'cuda' or a map onto a single device (no offload to CPU or disk, no split)"
    )


class QtoolHfQuantizer(HfQuantizer):
    """Loads qtool checkpoints (never quantizes: `requires_calibration`)."""

    requires_calibration = True

    def __init__(self, quantization_config: QtoolConfig, **kwargs) -> None:
        super().__init__(quantization_config, **kwargs)
        self.folder: Path | None = None
        self.stored: dict = {}  # tensor name → TensorInfo (file, dtype, shape) from the safetensors headers
        self.qcfg: dict = {}

    def validate_environment(self, *args, device_map=None, **kwargs) -> None:
        if not _single_device(device_map):
            _refuse_device_map(device_map)

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        from qtool.checkpoint.loader import check_files, read_config, read_manifest
        from qtool.models.integrity import tensor_index

        if not checkpoint_files:
            raise CheckpointError(
                f"{model.config.name_or_path}: no safetensors weights; expected a qtool checkpoint folder"
            )
        folder = Path(checkpoint_files[0]).parent
        if not (folder / MANIFEST_NAME).is_file():
            raise CheckpointError(
                f"{folder}: no {MANIFEST_NAME} beside the weights; expected a whole qtool "
                f"checkpoint folder (download every file of it, then load the folder)"
            )
        check_files(folder, read_manifest(folder))
        qcfg = read_config(folder)["quantization_config"]
        stored = tensor_index(folder, CheckpointError) or {}
        self.folder, self.stored, self.qcfg = folder, stored, qcfg
        from qtool.models.loading import with_expert_linears

        with_expert_linears(model)  # a mixture of experts stores each expert's linears
        for name in sorted(qcfg.get("layers", {})):
            self._hold(model, name, folder / "config.json")
        kv = qcfg.get("kv_cache")
        if isinstance(kv, dict) and "format" in kv:  # a vector-quantized cache stores codebooks per attention
            from qtool.kv_cache.quantized import attention_modules

            attention = set(attention_modules(model))
            for name, m in list(model.named_modules()):
                if m in attention:
                    self._hold(model, f"{name}.kv_codebooks", folder / "config.json", new=True)
        return model

    def _hold(self, model, name: str, where: Path, new: bool = False) -> None:
        parent_name, _, child = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
            old = None if new else model.get_submodule(name)
        except AttributeError:
            raise CheckpointError(f"{where}: layer {name} is not a module of this model") from None
        prefix = f"{name}."
        held = _Stored(
            {
                k[len(prefix) :]: info
                for k, info in self.stored.items()
                if k.startswith(prefix) and "." not in k[len(prefix) :]
            }
        )
        # `replace_layer` checks the layer config's sizes against the module it replaces.
        held.in_features, held.out_features = (
            getattr(old, "in_features", None),
            getattr(old, "out_features", None),
        )
        setattr(parent, child, held)

    def _process_model_after_weight_loading(self, model, **kwargs):
        from qtool.checkpoint.loader import replace_layer
        from qtool.kv_cache.schemes import apply_model_schemes, attach_scheme_tensors
        from qtool.models.integrity import check_finite

        device_map = getattr(model, "hf_device_map", None)
        if device_map is not None and not _single_device(device_map):
            _refuse_device_map(device_map)
        self._check_loaded(model)
        check_finite(model.state_dict().items(), CheckpointError, self.stored)
        where = self.folder / "config.json"
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        for name, lcfg in sorted(self.qcfg.get("layers", {}).items()):
            held = dict(model.get_submodule(name).named_buffers())
            device = next(iter(held.values())).device if held else torch.device("cpu")
            bias = held.pop("bias", None)
            # The layouts validate and unpack on the CPU, as `qtool.load` does before moving the model.
            replace_layer(
                model,
                where,
                name,
                lcfg,
                {k: v.cpu() for k, v in held.items()},
                None if bias is None else bias.cpu(),
                dtype,
            )
            model.get_submodule(name).to(device)
        codebooks = {}
        for name, m in list(model.named_modules()):
            if isinstance(m, _Stored):  # only the KV codebooks are left
                codebooks.update({f"{name}.{k}": v.cpu() for k, v in m.named_buffers()})
                parent_name, _, child = name.rpartition(".")
                delattr(model.get_submodule(parent_name), child)
        attach_scheme_tensors(model, self.qcfg, codebooks, str(where))
        apply_model_schemes(model, self.qcfg, str(where))
        return model

    def _check_loaded(self, model) -> None:
        """Every tensor of the model was read from the checkpoint (a tied weight through its source), with its
        stored shape; every stored tensor has a place in the model."""
        state = model.state_dict()
        loaded = {
            (t.data_ptr(), tuple(t.shape))
            for name, t in state.items()
            if name in self.stored and t.device.type != "meta"
        }
        for name, t in state.items():
            info = self.stored.get(name)
            if info is None:
                if t.device.type == "meta" or (t.data_ptr(), tuple(t.shape)) not in loaded:
                    raise CheckpointError(
                        f"tensor {name}: missing from {self.folder}; transformers would have "
                        f"initialised it randomly"
                    )
            elif tuple(t.shape) != info.shape:
                raise CheckpointError(
                    f"tensor {name} ({info.file}): found shape {list(info.shape)}, the model "
                    f"expects {list(t.shape)}"
                )
        for name in sorted(set(self.stored) - set(state)):
            raise CheckpointError(
                f"tensor {name} ({self.stored[name].file}): not a parameter of {type(model).__name__}"
            )

    @property
    def is_trainable(self) -> bool:
        return False

    def is_serializable(self, safe_serialization=None) -> bool:
        # `save_pretrained` would write the tensors without the manifest; `qtool pack -o` copies a checkpoint.
        return False


def register(auto=None) -> None:
    """Make `quant_method: qtool` known to transformers' registry, the module `auto` (transformers.quantizers.auto,
    passed while it is being imported), and model_type `qtool` to its AutoConfig; idempotent."""
    from qtool.checkpoint.qconfig import register_config

    if auto is None:
        from transformers.quantizers import auto

    if QUANT_METHOD not in auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
        auto.register_quantization_config(QUANT_METHOD)(QtoolConfig)
    if QUANT_METHOD not in auto.AUTO_QUANTIZER_MAPPING:
        auto.register_quantizer(QUANT_METHOD)(QtoolHfQuantizer)
    register_config()
