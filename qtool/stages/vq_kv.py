"""Stage `vq_kv`: a vector-quantized KV cache (CQ-style coupled quantization, as VQ-LLM's attention kernels read
it; formats/vq.md "KV cache"). Per layer, KV head and group of `vector_size` adjacent channels, one codebook of
`entries` float16 entries for the keys (after RoPE) and one for the values, fitted by k-means on the calibration
keys and values that reach the attention function. Presets: `cq-2` (groups of 4 channels, 256 entries: 2 bits per
element) and `cq-4` (groups of 2, 256 entries: 4 bits).

It changes no weight. Placed before the quantizers, it fits a block's codebooks on that block's calibration inputs
before the block's linears are quantized, so they and the blocks that follow are calibrated on attention over the
quantized cache. CQ's Fisher-weighted centroid objective is not implemented (plain k-means)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from qtool.errors import RecipeError
from qtool.kv_cache.quantized import attention_modules, use_qtool_attention
from qtool.kv_cache.vq import KVCodebooks, codebook_shape, kv_vq_scheme
from qtool.layouts.vq.layout import is_power_of_two
from qtool.options import INT_LIMIT, option
from qtool.quant.vq import kmeans_batched
from qtool.stages.base import BlockContext, TransformStage, check_kv_cache_family

PRESETS = {"cq-2": 4, "cq-4": 2}  # vector size; both with 256 entries


@dataclass
class VQKVOptions:
    preset: Literal["cq-2", "cq-4"] | None = option(
        "cq-2",
        help="cq-2 (groups of 4 channels) or cq-4 (groups of 2): the vector_size the recipe leaves out",
    )
    vector_size: int | None = option(None, min=1, max=16, help="adjacent channels per coded group")
    entries: int = option(
        256, min=2, max=256, help="entries per codebook, a power of two (8-bit codes at most)"
    )
    kmeans_iters: int = option(20, min=1, max=1000, help="Lloyd iterations per codebook")
    seed: int = option(
        0, min=0, max=INT_LIMIT, help="seed of the k-means initialisation (mixed with each layer's index)"
    )

    def validate(self) -> tuple[str, str] | None:
        if self.vector_size is None:
            if self.preset is None:
                return "vector_size", "missing; expected a value, or a preset (cq-2, cq-4) that sets it"
            self.vector_size = PRESETS[self.preset]
        if not is_power_of_two(self.entries):
            return "entries", (
                f"found {self.entries}; expected a power of two >= 2 (codes are stored at log2(entries) bits)"
            )
        return None


class VQKVStage(TransformStage):
    name = "vq_kv"
    options_cls = VQKVOptions
    help = (
        "vector-quantize the KV cache: per KV head and channel group, k-means codebooks fitted on calibration"
    )

    def needs_calibration(self) -> bool:
        return True

    def check_config(self, config, where: str) -> None:
        check_kv_cache_family(config, where, self.name)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        d = self.options.vector_size
        if head_dim % d:
            raise RecipeError(
                f"{where}.vector_size: found {d}, but the model's head_dim is {head_dim}; expected a "
                f"divisor of it"
            )

    def check_calibration(self, calibration, where: str) -> None:
        """Every codebook is fitted on one vector per calibration token: at least `entries` tokens are needed."""
        tokens = calibration.num_samples * calibration.seq_len
        if tokens < self.options.entries:
            raise RecipeError(
                f"{where}.entries: found {self.options.entries}, but the calibration holds "
                f"{tokens} tokens (num_samples {calibration.num_samples} x seq_len "
                f"{calibration.seq_len}), one vector per codebook each, too few to fit it; expected "
                f"at least {self.options.entries} calibration tokens"
            )

    def apply_outer(self, model: nn.Module, adapter) -> dict | None:
        if not attention_modules(model):
            raise RecipeError(
                f"{self.label}: {type(model).__name__} has no attention module whose KV cache can be "
                f"quantized; expected Llama-style self_attn modules"
            )
        # The blocks are calibrated through the quantizing attention wrapper; a module without codebooks yet (its
        # block not reached) passes its keys and values through unchanged.
        use_qtool_attention(model)
        return None

    def apply_block(self, ctx: BlockContext) -> dict | None:
        o: VQKVOptions = self.options
        attn = ctx.block.get_submodule(ctx.adapter.attention_path)
        h, g, e, d = codebook_shape(attn, o.vector_size, o.entries)
        device = ctx.inputs[0].device
        books = KVCodebooks(torch.zeros(h, g, e, d), torch.zeros(h, g, e, d)).to(device)
        books.captured = []
        attn.kv_codebooks = books
        try:
            with torch.no_grad():
                for x in ctx.inputs:
                    ctx.block(x, **ctx.kwargs)
            captured = books.captured
        finally:
            books.captured = None
        gen = torch.Generator().manual_seed(
            (o.seed * 1_000_003 + zlib.crc32(ctx.prefix.encode())) % (1 << 63)
        )
        fitted = []
        for which in range(2):  # keys, then values: [B, H, T, D] per sample, of every rank
            x = torch.cat(
                [
                    c.permute(1, 0, 2, 3).reshape(h, -1, g * d)
                    for c in ctx.gather([c[which] for c in captured])
                ],
                dim=1,
            )
            x = x.reshape(h, -1, g, d).permute(0, 2, 1, 3).reshape(h * g, -1, d).cpu()
            fitted.append(kmeans_batched(x, e, o.kmeans_iters, gen).reshape(h, g, e, d).to(torch.float16))
        books.key.copy_(fitted[0])
        books.value.copy_(fitted[1])
        return None

    def model_scheme(self) -> dict | None:
        return {"kv_cache": kv_vq_scheme(self.options.vector_size, self.options.entries)}
