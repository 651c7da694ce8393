"""Stage `smooth_attention` (QoQ §4.2, Eqs. 7-9): keys have a few large channels in every head, which a 4-bit KV
cache cannot represent next to the small ones. Scaling key channel i down by λ_i and the matching query channel up
by λ_i leaves every attention score unchanged (q·k = (qΛ)·(kΛ⁻¹)); the scaling is folded into the weights, so it
costs nothing at run time.

λ_i = max|K_i|^α over the calibration tokens, keys taken after RoPE, per KV head. RoPE rotates channel i with
channel i + D/2, so the two must share λ (Eq. 9): λ_i = λ_{i+D/2} = max(max|K_i|, max|K_{i+D/2}|)^α; then the
scaling commutes with the rotation. Under GQA the query heads that read one KV head take that head's λ.

Where a per-head RMSNorm normalizes queries and keys after their projections (Qwen3, Gemma 3), scaling k_proj's
rows would be undone by the norm: λ is folded into the norms' weights instead (after the normalization, before
RoPE). Those weights are shared by every head, so λ is too: the largest over the KV heads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtool.errors import RecipeError
from qtool.options import option
from qtool.stages.base import BlockContext, TransformStage, known_structure


@dataclass
class SmoothAttentionOptions:
    alpha: float = option(0.5, min=0.0, max=1.0, help="migration strength: λ = max|K|^alpha")


def attention_shape(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a transformers config."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv, dim


def check_attention_groups(config, where: str) -> None:
    """Query heads must come in equal groups per KV head: the transforms give a KV channel's factor (or
    permutation) to every query head of its group."""
    heads, kv, _ = attention_shape(config)
    if heads % kv:
        raise RecipeError(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}; "
            f"expected query heads in equal groups per KV head"
        )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def key_absmax(ctx: BlockContext, kv_heads: int, dim: int) -> torch.Tensor:
    """max |K| per KV channel [kv_heads, dim] over the calibration tokens, after the key norm and RoPE where the
    model has them."""
    k_name = ctx.adapter.qk_norms[1] if ctx.adapter.qk_norms else ctx.adapter.k_proj
    keys = ctx.capture([k_name], outputs=True)[k_name]
    rope = ctx.kwargs.get("position_embeddings") if ctx.adapter.rope else None
    amax = torch.zeros(kv_heads, dim, device=keys[0].device)
    for k in keys:
        k = k.reshape(-1, kv_heads, dim)
        if rope is not None:
            cos, sin = (t.reshape(-1, 1, dim).float().to(k.device) for t in rope)
            k = k * cos + rotate_half(k) * sin
        amax = torch.maximum(amax, k.abs().amax(dim=0))
    return amax


class SmoothAttentionStage(TransformStage):
    name = "smooth_attention"
    options_cls = SmoothAttentionOptions
    help = (
        "SmoothAttention: scale key channels by max|K|^-alpha (RoPE pairs shared) and queries by the inverse"
    )

    def needs_calibration(self) -> bool:
        return True

    def check_config(self, config, where: str) -> None:
        adapter = known_structure(
            config, where, self.name, "the query and key projections and their RoPE layout"
        )
        if not adapter.separate_qkv:
            raise RecipeError(
                f"{where}: {config.architectures[0]} computes queries, keys and values in one fused qkv_proj; "
                f"expected separate q_proj and k_proj (drop smooth_attention for this family)"
            )
        check_attention_groups(config, where)
        _, _, dim = attention_shape(config)
        if dim % 2 and adapter.rope:
            raise RecipeError(
                f"{where}: head_dim {dim} is odd; expected an even head dim (RoPE pairs channel i "
                f"with i + head_dim/2)"
            )

    def apply_block(self, ctx: BlockContext) -> dict | None:
        heads, kv, dim = attention_shape(ctx.config)
        amax = key_absmax(ctx, kv, dim).double()
        if ctx.adapter.rope:
            half = dim // 2
            pair = torch.maximum(amax[:, :half], amax[:, half:])
            amax = torch.cat((pair, pair), dim=1)
        if ctx.adapter.qk_norms:
            amax = amax.amax(dim=0, keepdim=True)  # the norms' weights are shared by every head
        # A channel that never fires keeps λ = 1 rather than dividing by zero.
        lam = torch.where(amax > 0, amax.clamp(min=1e-5).pow(self.options.alpha), torch.ones_like(amax))
        if ctx.adapter.qk_norms:
            q_norm, k_norm = (ctx.block.get_submodule(n) for n in ctx.adapter.qk_norms)
            with torch.no_grad():
                _scale_norm(q_norm, lam[0], ctx.adapter.norm_offset)
                _scale_norm(k_norm, 1.0 / lam[0], ctx.adapter.norm_offset)
            return {"key_absmax_max": round(float(amax.max()), 4), "lambda_max": round(float(lam.max()), 4)}
        q = ctx.block.get_submodule(ctx.adapter.q_proj)
        k = ctx.block.get_submodule(ctx.adapter.k_proj)
        lam_q = lam.repeat_interleave(heads // kv, dim=0).reshape(-1)
        lam_k = lam.reshape(-1)
        with torch.no_grad():
            _scale_rows(q, lam_q)
            _scale_rows(k, 1.0 / lam_k)
        return {"key_absmax_max": round(float(amax.max()), 4), "lambda_max": round(float(lam.max()), 4)}


def _scale_norm(norm: torch.nn.Module, factor: torch.Tensor, offset: float) -> None:
    """Multiply the scale a norm applies to channel j by factor[j]: its weight w scales by w + offset."""
    w = norm.weight
    w.copy_(((w.double() + offset) * factor.to(w.device) - offset).to(w.dtype))


def _scale_rows(linear: torch.nn.Linear, factor: torch.Tensor) -> None:
    """Multiply output channel j of `linear` (weight row and bias) by factor[j], computed in float64."""
    w = linear.weight
    w.copy_((w.double() * factor[:, None].to(w.device)).to(w.dtype))
    if linear.bias is not None:
        b = linear.bias
        b.copy_((b.double() * factor.to(b.device)).to(b.dtype))
