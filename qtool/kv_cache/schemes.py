"""Run-time schemes of a whole model (not of one linear), stored beside `layers` in the checkpoint's
quantization_config: the KV cache's. The loader and the pipeline install them through `apply_model_schemes`, so
a key the runtime does not know is refused rather than silently ignored."""

from __future__ import annotations

from torch import nn

from qtool.errors import CheckpointError

# Keys of quantization_config that are not model schemes.
RESERVED = ("quant_method", "format_version", "layers")


def apply_model_schemes(model: nn.Module, qcfg: dict, where: str) -> None:
    for key, value in qcfg.items():
        if key in RESERVED:
            continue
        if key == "kv_cache" and isinstance(value, dict) and "format" in value:
            from qtool.kv_cache.vq import install_vq_kv_cache

            install_vq_kv_cache(model, value, f"{where}: quantization_config.kv_cache")
        elif key == "kv_cache":
            from qtool.kv_cache.quantized import install_kv_cache

            install_kv_cache(model, value, f"{where}: quantization_config.kv_cache")
        else:
            raise CheckpointError(
                f"{where}: quantization_config.{key} is not a scheme this qtool knows; expected "
                f"one of {', '.join(RESERVED)}, kv_cache"
            )


def attach_scheme_tensors(model: nn.Module, qcfg: dict, tensors: dict, where: str) -> None:
    """Move the tensors a model scheme stores (the vector-quantized KV cache's codebooks) from the checkpoint's
    `tensors` into the model, before the remaining tensors are matched against the model's parameters."""
    value = qcfg.get("kv_cache")
    if isinstance(value, dict) and "format" in value:
        from qtool.kv_cache.vq import attach_codebooks

        attach_codebooks(model, value, tensors, f"{where}: quantization_config.kv_cache")
