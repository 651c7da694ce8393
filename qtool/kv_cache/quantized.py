"""Quantized KV cache on the reference path (QoQ's KV4, formats/qoq.md "KV cache"): every cached key and value
vector of one token and one KV head is quantized on its own, asymmetrically, with a float16 scale and a float16
(unrounded) zero point, after RoPE.

The reference quantizes inside the attention function, through transformers' attention interface: the keys and
values it receives (the cache's whole content after this step's update) are replaced by their dequantized codes.
A vector already on its grid maps to itself, so re-quantizing earlier tokens at every decode step gives what a
cache holding the codes gives; the memory saving itself is the CUDA runtime's. Queries are never quantized."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from qtool.errors import CheckpointError

KV_BITS = (4, 8)
# Attention implementations the quantizing wrapper delegates to, each with the mask format it expects.
_BASES = ("sdpa", "eager")


class KVCodes(NamedTuple):
    codes: torch.Tensor  # uint8 [..., D] in [0, 2^bits - 1]
    scale: torch.Tensor  # float16 [..., 1]
    zero: torch.Tensor  # float16 [..., 1]


def quantize_kv(x: torch.Tensor, bits: int) -> KVCodes:
    """Per-vector asymmetric quantization over the last dimension: `scale = (max - min) / (2^b - 1)` and
    `zero = -min / scale`, both rounded to float16 (1 and `-min` for a constant vector), then
    `q = clamp(round_half_even(x / scale + zero), 0, 2^b - 1)` in float32 with the float16 values."""
    maxq = (1 << bits) - 1
    xf = x.float()
    lo = xf.amin(dim=-1, keepdim=True)
    hi = xf.amax(dim=-1, keepdim=True)
    flat = hi <= lo
    # Divisions by tensors, never by Python numbers: torch on CUDA turns `t / number` into `t * (1 / number)`,
    # which rounds differently from the division the format specifies (and the CUDA cache write performs).
    scale = torch.where(flat, torch.ones_like(lo), (hi - lo) / torch.full_like(lo, maxq)).to(torch.float16)
    # A scale that underflows float16 would divide by zero: the smallest subnormal keeps the codes finite.
    scale = torch.where(scale == 0, torch.full_like(scale, 2.0**-24), scale)
    zero = torch.where(flat, -lo, -lo / scale.float()).to(torch.float16)
    q = torch.clamp(torch.round(xf / scale.float() + zero.float()), 0, maxq)
    return KVCodes(q.to(torch.uint8), scale, zero)


def dequantize_kv(c: KVCodes, dtype: torch.dtype) -> torch.Tensor:
    return ((c.codes.float() - c.zero.float()) * c.scale.float()).to(dtype)


def fake_quantize_kv(x: torch.Tensor, bits: int) -> torch.Tensor:
    return dequantize_kv(quantize_kv(x, bits), x.dtype)


def _attention(base: str):
    def attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        bits = getattr(module, "qtool_kv_bits", None)
        if bits is not None:
            key, value = fake_quantize_kv(key, bits), fake_quantize_kv(value, bits)
        codebooks = getattr(module, "kv_codebooks", None)  # the vector-quantized cache (qtool/kv_cache/vq.py)
        if codebooks is not None:
            key, value = codebooks(key, value)
        if base == "eager":
            from transformers.models.llama.modeling_llama import eager_attention_forward

            fn = eager_attention_forward
        else:
            fn = ALL_ATTENTION_FUNCTIONS[base]
        return fn(module, query, key, value, attention_mask, **kwargs)

    return attention


def implementation_name(base: str) -> str:
    return f"qtool_kv_{base}"


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for base in _BASES:
        AttentionInterface.register(implementation_name(base), _attention(base))
        AttentionMaskInterface.register(implementation_name(base), ALL_MASK_ATTENTION_FUNCTIONS[base])


def check_scheme(cfg, where: str) -> int:
    if (
        not isinstance(cfg, dict)
        or cfg.get("bits") not in KV_BITS
        or cfg.get("granularity", "head") != "head"
        or cfg.get("symmetric", False) is not False
    ):
        raise CheckpointError(
            f"{where}: found {cfg!r}, expected {{bits: 4 or 8, granularity: head, symmetric: false}}"
        )
    return int(cfg["bits"])


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules transformers hands to the attention function (they carry `layer_idx`)."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "layer_idx")
        and hasattr(m, "config")
        and any(hasattr(m, p) for p in ("k_proj", "qkv_proj"))
    ]


def install_kv_cache(model: nn.Module, cfg: dict, where: str) -> None:
    """Quantize the KV cache of every attention module of `model` as `cfg` says, from the next forward on."""
    bits = check_scheme(cfg, where)
    modules = attention_modules(model)
    if not modules:
        raise CheckpointError(
            f"{where}: {type(model).__name__} has no attention module the KV cache scheme can "
            f"apply to; expected Llama-style self_attn modules"
        )
    for m in modules:
        m.qtool_kv_bits = bits
    use_qtool_attention(model)


def use_qtool_attention(model: nn.Module) -> None:
    """Route `model`'s attention through the quantizing wrapper of its current implementation (sdpa or eager)."""
    _register()
    current = model.config._attn_implementation
    if not str(current).startswith("qtool_kv_"):
        model.set_attn_implementation(implementation_name(current if current in _BASES else "sdpa"))


def kv_scheme(bits: int) -> dict:
    return {"bits": bits, "granularity": "head", "symmetric": False}
