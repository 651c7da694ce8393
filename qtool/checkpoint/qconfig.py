"""config.json of a qtool checkpoint as it is stored and as it is read (formats/checkpoint.md, `config.json`).

Stored: `model_type` is `"qtool"` and the model's own type is `qtool_model_type`, so a process that
has not imported qtool (plain transformers, `pipeline`, `lm_eval --model hf`, vLLM) refuses the folder at its
config ("model type `qtool` ... not recognize") instead of building the model with randomly initialised quantized
linears. The quantized layers are `config_groups`: one entry per distinct layer config (the layout's parameters)
with the `targets` it applies to, `*` standing for every decoder block's index.

Read: `native_config` gives the model's own config back (its `model_type`, the quantization_config of format
version 1 with a `layers` map of module name to layer config), for checkpoints of both forms."""

from __future__ import annotations

import copy
import json
import re

from qtool.checkpoint.manifest import QUANT_METHOD
from qtool.errors import CheckpointError

MODEL_TYPE = "qtool"
# The model's own type. A top-level key: transformers' config classes adopt a nested object holding their own
# `model_type` as the whole config (LlamaConfig.from_pretrained would build a default-sized Llama from it).
BASE_KEY = "qtool_model_type"
# 1: `layers`, a map of every quantized module to its config (with its shape); 2: `config_groups`.
CONFIG_VERSION = 2
READABLE_VERSIONS = (1, 2)
# Keys of a layer config that the model's module fixes; a group's config leaves them out.
SHAPE_KEYS = ("in_features", "out_features", "bias")
_INDEX = re.compile(r"^\d+$")


def _targets(names: list[str], num_blocks: int | None) -> list[str]:
    """Module names with the first numeric component (the decoder block) replaced by `*` where the names cover
    every block, the others as they are."""
    by_pattern: dict[str, dict[int, str]] = {}
    plain: list[str] = []
    for name in names:
        parts = name.split(".")
        at = next((i for i, p in enumerate(parts) if _INDEX.match(p)), None)
        if at is None:
            plain.append(name)
            continue
        pattern = ".".join([*parts[:at], "*", *parts[at + 1 :]])
        by_pattern.setdefault(pattern, {})[int(parts[at])] = name
    out = list(plain)
    for pattern, found in by_pattern.items():
        if num_blocks is not None and set(found) == set(range(num_blocks)):
            out.append(pattern)
        else:
            out += [found[i] for i in sorted(found)]
    return sorted(out)


def group_layers(layers: dict[str, dict], num_blocks: int | None) -> dict[str, dict]:
    """`config_groups` of `layers` (module name → layer config): one group per distinct config, without the keys
    its module fixes, in the order of each group's first module name."""
    groups: dict[str, list[str]] = {}
    for name in sorted(layers):
        scheme = {k: v for k, v in layers[name].items() if k not in SHAPE_KEYS}
        groups.setdefault(json.dumps(scheme, sort_keys=True), []).append(name)
    return {
        f"group_{i}": {**json.loads(key), "targets": _targets(names, num_blocks)}
        for i, (key, names) in enumerate(groups.items())
    }


def stored_config(config: dict, layers: dict[str, dict], schemes: dict | None) -> dict:
    """config.json's content for the model's config dict `config` (its own `model_type`), the quantized `layers`
    and the model's run-time `schemes` (the KV cache's)."""
    config = dict(config)
    config.pop("quantization_config", None)
    config[BASE_KEY] = config.get("model_type")
    config["model_type"] = MODEL_TYPE
    config["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "format_version": CONFIG_VERSION,
        **(schemes or {}),
        "config_groups": group_layers(layers, config.get("num_hidden_layers")),
    }
    return config


def _expand(targets, num_blocks, where: str, group: str) -> list[str]:
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise CheckpointError(
            f"{where}: quantization_config.config_groups.{group}.targets: found {targets!r}, expected a list "
            f"of module names"
        )
    names = []
    for t in targets:
        if "*" not in t:
            names.append(t)
            continue
        if t.count("*") != 1 or not isinstance(num_blocks, int):
            raise CheckpointError(
                f"{where}: quantization_config.config_groups.{group}.targets: {t!r}; expected one '*' for the "
                f"block index and num_hidden_layers in the config"
            )
        names += [t.replace("*", str(i)) for i in range(num_blocks)]
    return names


def native_config(raw: dict, where: str) -> dict:
    """The model's config dict from config.json's content `raw`: its own model_type, and (when it has one) a
    quantization_config of format version 1 whose `layers` maps each quantized module to its config without the
    keys its module fixes (`SHAPE_KEYS`: the loader fills them from the model). Checkpoints written as version 1
    are returned as they are."""
    qcfg = raw.get("quantization_config")
    if not isinstance(qcfg, dict):
        return raw
    raw = copy.deepcopy(raw)
    qcfg = raw["quantization_config"]
    base = raw.pop(BASE_KEY, None)
    if raw.get("model_type") == MODEL_TYPE:
        if not isinstance(base, str) or not base:
            raise CheckpointError(
                f"{where}: {BASE_KEY}: found {base!r}, expected the model's own type (e.g. 'llama') beside "
                f"model_type {MODEL_TYPE!r}"
            )
        raw["model_type"] = base
    if "config_groups" in qcfg:
        groups = qcfg.pop("config_groups")
        if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
            raise CheckpointError(
                f"{where}: quantization_config.config_groups: expected an object of group name to config"
            )
        layers: dict[str, dict] = {}
        for gname, group in groups.items():
            scheme = {k: v for k, v in group.items() if k != "targets"}
            for name in _expand(group.get("targets"), raw.get("num_hidden_layers"), where, gname):
                if name in layers:
                    raise CheckpointError(
                        f"{where}: quantization_config.config_groups: layer {name} is a target of two groups"
                    )
                layers[name] = dict(scheme)
        qcfg["layers"] = layers
        if qcfg.get("format_version") == CONFIG_VERSION:
            qcfg["format_version"] = 1
    return raw


def is_grouped(raw: dict) -> bool:
    """Whether config.json's content names its layers by groups (whose shapes the model fixes)."""
    qcfg = raw.get("quantization_config")
    return isinstance(qcfg, dict) and "config_groups" in qcfg


_CONFIG_CLASS = None


def config_class():
    """transformers' config class for model_type `qtool`: it builds the model's own config class from the folder's
    config.json (`native_config`), so AutoConfig, AutoModelForCausalLM and `pipeline` load a qtool checkpoint once
    qtool has registered it (qtool/hf_integration.py)."""
    global _CONFIG_CLASS
    if _CONFIG_CLASS is None:
        from transformers import PretrainedConfig

        class QtoolModelConfig(PretrainedConfig):
            model_type = MODEL_TYPE

            @classmethod
            def from_dict(cls, config_dict, **kwargs):
                from transformers.models.auto.configuration_auto import CONFIG_MAPPING

                where = str(config_dict.get("_name_or_path") or kwargs.get("name_or_path") or "config.json")
                native = native_config(config_dict, where)
                # transformers' quantizer gets the quantization_config as stored (qtool's reads the folder).
                native["quantization_config"] = dict(config_dict["quantization_config"])
                try:
                    base = CONFIG_MAPPING[native["model_type"]]
                except KeyError:
                    raise CheckpointError(
                        f"{where}: {BASE_KEY} {native['model_type']!r} is not a model type "
                        f"this transformers knows"
                    ) from None
                return base.from_dict(native, **kwargs)

        _CONFIG_CLASS = QtoolModelConfig
    return _CONFIG_CLASS


def register_config(configuration_auto=None) -> None:
    """Make model_type `qtool` known to transformers' AutoConfig (`configuration_auto`: the module
    transformers.models.auto.configuration_auto, passed while it is being imported); idempotent."""
    if configuration_auto is None:
        from transformers.models.auto import configuration_auto
    if MODEL_TYPE not in configuration_auto.CONFIG_MAPPING:
        configuration_auto.CONFIG_MAPPING.register(MODEL_TYPE, config_class(), exist_ok=True)
