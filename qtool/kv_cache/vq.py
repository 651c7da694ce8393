"""Vector-quantized KV cache on the reference path (CQ-style coupled quantization, formats/vq.md "KV cache"): the
D channels of every cached key (after RoPE) and value vector of one token and one KV head are cut into groups of
`d` adjacent channels; each group is stored as a `b`-bit index into its own codebook of float16 entries, one
codebook per (layer, KV head, channel group, keys or values), fitted offline on calibration keys and values.

As the scalar cache (qtool/kv_cache/quantized.py) does, the reference encodes inside the attention function: the keys and
values it receives are replaced by the entries their codes select. An entry's nearest entry is itself, so
re-encoding earlier tokens at every decode step gives what a cache holding the codes gives."""

from __future__ import annotations

import torch
from torch import nn

from qtool.errors import CheckpointError
from qtool.kv_cache.quantized import attention_modules, use_qtool_attention
from qtool.layouts.vq.layout import index_bits, is_power_of_two

FORMAT = "vq"
FIELDS = ("key", "value")


def kv_vq_scheme(vector_size: int, entries: int) -> dict:
    return {
        "format": FORMAT,
        "vector_size": vector_size,
        "entries": entries,
        "index_bits": index_bits(entries),
        "keys": "post_rope",
        "bits_per_element": index_bits(entries) / vector_size,
    }


def encode(x: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """Codes [B, H, T, G] (int64) of x [B, H, T, D] in codebooks [H, G, E, d] (nearest entry, ties: the lower
    index), in float32: distance `n - 2 dot` with `dot = sum_i x_i c_i` and `n = sum_i c_i^2` accumulated in channel
    order, each product and sum rounded (the order the CUDA write, kernels/kv_cache/vq.cu, reproduces exactly)."""
    b, h, t, dim = x.shape
    _, g, _, d = codebooks.shape
    xv = x.float().reshape(b, h, t, g, 1, d)
    c = codebooks.float()[None, :, None]  # [1, H, 1, G, E, d]
    dot, n = xv[..., 0] * c[..., 0], c[..., 0] * c[..., 0]
    for i in range(1, d):  # in place: one [B, H, T, G, E] temporary beside `dot`
        dot += xv[..., i] * c[..., i]
        n = n + c[..., i] * c[..., i]
    return dot.mul_(-2).add_(n).argmin(dim=-1)  # n + (-2 dot): the same rounding as n - 2 dot


def decode(codes: torch.Tensor, codebooks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The vectors [B, H, T, D] the codes [B, H, T, G] select."""
    b, h, t, g = codes.shape
    d = codebooks.shape[-1]
    hi = torch.arange(h, device=codes.device)[None, :, None, None]
    gi = torch.arange(g, device=codes.device)[None, None, None, :]
    return codebooks[hi, gi, codes].reshape(b, h, t, g * d).to(dtype)


class KVCodebooks(nn.Module):
    """The codebooks of one attention module's cache, `key` and `value` [H_kv, D/d, E, d] float16. Called by the
    attention function with the keys and values [B, H_kv, T, D]; returns them as the cache holds them. While
    `captured` is a list (calibration), it records them instead and returns them unchanged."""

    stored_as_is = True  # the checkpoint writer keeps these buffers in float16

    def __init__(self, key: torch.Tensor, value: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("key", key.to(torch.float16))
        self.register_buffer("value", value.to(torch.float16))
        self.captured: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def forward(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.captured is not None:
            self.captured.append((key.detach().float(), value.detach().float()))
            return key, value
        kc, vc = self.key.to(key.device), self.value.to(value.device)
        return decode(encode(key, kc), kc, key.dtype), decode(encode(value, vc), vc, value.dtype)

    def _apply(self, fn, recurse: bool = True):
        # `model.to(dtype)` casts floating buffers; the entries are float16 values and stay float16.
        super()._apply(fn, recurse)
        for f in FIELDS:
            if getattr(self, f).dtype != torch.float16:
                setattr(self, f, getattr(self, f).to(torch.float16))
        return self

    def extra_repr(self) -> str:
        h, g, e, d = self.key.shape
        return f"kv_heads={h}, groups={g} of {d} channels, {e} entries"


def check_scheme(cfg, where: str) -> tuple[int, int]:
    """(vector_size, entries) of a vq KV cache scheme; a malformed one is a CheckpointError naming `where`."""
    ok = isinstance(cfg, dict) and cfg.get("format") == FORMAT and cfg.get("keys") == "post_rope"
    d, e = (cfg.get("vector_size"), cfg.get("entries")) if isinstance(cfg, dict) else (None, None)
    ok = (
        ok
        and isinstance(d, int)
        and not isinstance(d, bool)
        and d >= 1
        and isinstance(e, int)
        and is_power_of_two(e)
        and e <= 256
        and cfg.get("index_bits") == index_bits(e)
    )
    if not ok:
        raise CheckpointError(
            f"{where}: found {cfg!r}, expected {{format: vq, vector_size: d >= 1, entries: a power "
            f"of two up to 256, index_bits: log2 entries, keys: post_rope}}"
        )
    return d, e


def codebook_shape(module: nn.Module, vector_size: int, entries: int) -> tuple[int, int, int, int]:
    """[H_kv, D/d, E, d] for the attention module `module`."""
    cfg = module.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(module, "head_dim", None) or cfg.hidden_size // heads
    return kv_heads, head_dim // vector_size, entries, vector_size


def attach_codebooks(model: nn.Module, cfg: dict, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Take each attention module's `kv_codebooks.key`/`.value` out of the checkpoint's `tensors` and attach them;
    a missing, misshapen, mistyped or non-finite one is a CheckpointError naming the tensor."""
    d, e = check_scheme(cfg, where)
    named = [(n, m) for n, m in model.named_modules() if m in set(attention_modules(model))]
    if not named:
        raise CheckpointError(
            f"{where}: {type(model).__name__} has no attention module the KV cache scheme can "
            f"apply to; expected Llama-style self_attn modules"
        )
    for name, m in named:
        shape = codebook_shape(m, d, e)
        got = {}
        for f in FIELDS:
            key = f"{name}.kv_codebooks.{f}"
            t = tensors.pop(key, None)
            if t is None:
                raise CheckpointError(
                    f"tensor {key}: missing; the KV cache scheme (vq) expects float16 {list(shape)}"
                )
            if tuple(t.shape) != shape or t.dtype != torch.float16:
                raise CheckpointError(
                    f"tensor {key}: found {t.dtype} {list(t.shape)}, expected torch.float16 {list(shape)}"
                )
            got[f] = t
        m.kv_codebooks = KVCodebooks(got["key"], got["value"])


def install_vq_kv_cache(model: nn.Module, cfg: dict, where: str) -> None:
    """From the next forward on, every attention module's cache holds codes: each module must carry its
    codebooks (`attach_codebooks`, or the stage fitting them)."""
    check_scheme(cfg, where)
    modules = attention_modules(model)
    if not modules:
        raise CheckpointError(
            f"{where}: {type(model).__name__} has no attention module the KV cache scheme can "
            f"apply to; expected Llama-style self_attn modules"
        )
    for m in modules:
        if not isinstance(getattr(m, "kv_codebooks", None), KVCodebooks):
            raise CheckpointError(
                f"{where}: an attention module (layer {getattr(m, 'layer_idx', '?')}) has no "
                f"codebooks; expected kv_codebooks.key/value tensors for every layer"
            )
    use_qtool_attention(model)
