"""Architecture adapters: where a family keeps its decoder blocks and which linears each block holds, in the
order GPTQ's sequential mode quantizes them. The pipeline never hard-codes module names."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass(frozen=True)
class Adapter:
    family: str
    architectures: tuple[str, ...]
    blocks_path: str  # attribute path from the CausalLM to the ModuleList of decoder blocks
    # Linears of one block (names relative to the block), in groups that see the same input, in forward order.
    linear_groups: tuple[tuple[str, ...], ...]
    # Norm → the linears it feeds (for smoothing/rotation transforms).
    norm_feeds: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        obj = model
        for part in self.blocks_path.split("."):
            obj = getattr(obj, part)
        return obj

    def block_prefix(self, index: int) -> str:
        return f"{self.blocks_path}.{index}"

    def linear_names(self) -> list[str]:
        return [n for group in self.linear_groups for n in group]


LLAMA = Adapter(
    family="llama",
    architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
    blocks_path="model.layers",
    linear_groups=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    ),
    norm_feeds={
        "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
    },
)

OPT = Adapter(
    family="opt",
    architectures=("OPTForCausalLM",),
    blocks_path="model.decoder.layers",
    linear_groups=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.out_proj",),
        ("fc1",),
        ("fc2",),
    ),
    norm_feeds={
        "self_attn_layer_norm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "final_layer_norm": ("fc1",),
    },
)

ADAPTERS: tuple[Adapter, ...] = (LLAMA, OPT)


def supported_architectures() -> list[str]:
    return sorted(a for ad in ADAPTERS for a in ad.architectures)


def adapter_for(architectures: list[str] | None) -> Adapter | None:
    for arch in architectures or []:
        for ad in ADAPTERS:
            if arch in ad.architectures:
                return ad
    return None
