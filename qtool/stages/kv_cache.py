"""Stage `kv_cache`: quantize the KV cache at run time (QoQ's KV4: per token and KV head, asymmetric, dynamic;
formats/qoq.md). It changes no weight; it sets a scheme of the whole model. Placed before the quantizers, it is
installed before calibration, so the blocks that follow are calibrated on attention with a quantized cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

from qtool.kv_cache.quantized import install_kv_cache, kv_scheme
from qtool.options import option
from qtool.stages.base import TransformStage, check_kv_cache_family


@dataclass
class KVCacheOptions:
    bits: Literal[4, 8] = option(
        4, help="bits per cached key/value element (per token and KV head, asymmetric)"
    )


class KVCacheStage(TransformStage):
    name = "kv_cache"
    options_cls = KVCacheOptions
    help = "quantize the KV cache at run time: per token and KV head, asymmetric, float16 scale and zero"

    def check_config(self, config, where: str) -> None:
        check_kv_cache_family(config, where, self.name)

    def apply_outer(self, model: nn.Module, adapter) -> dict | None:
        install_kv_cache(model, kv_scheme(self.options.bits), self.label)
        return None

    def model_scheme(self) -> dict | None:
        return {"kv_cache": kv_scheme(self.options.bits)}
