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
    # Where the residual stream starts and ends (attribute paths from the CausalLM).
    embed_path: str = "model.embed_tokens"
    final_norm_path: str = "model.norm"
    head_path: str = "lm_head"
    # "rms": RMSNorm (scale only); "layer": LayerNorm (mean subtraction, scale and shift).
    norm_kind: str = "rms"
    # The linears that write into the residual stream (each block's output modules).
    output_linears: tuple[str, ...] = ()
    # Output module → the linears producing its input channel by channel, through an operation that commutes
    # with a positive per-channel scale (attention's value path, the elementwise gate·up product, ReLU).
    smooth_producers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # The attention module and its query/key/value projections (relative to the block).
    attention_path: str = "self_attn"
    q_proj: str = "self_attn.q_proj"
    k_proj: str = "self_attn.k_proj"
    v_proj: str = "self_attn.v_proj"
    # Whether attention applies rotary embeddings pairing channel i with i + head_dim/2 (HF `rotate_half`).
    rope: bool = True

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        obj = model
        for part in self.blocks_path.split("."):
            obj = getattr(obj, part)
        return obj

    def block_prefix(self, index: int) -> str:
        return f"{self.blocks_path}.{index}"

    def module(self, model: nn.Module, path: str) -> nn.Module:
        return model.get_submodule(path)

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
    output_linears=("self_attn.o_proj", "mlp.down_proj"),
    smooth_producers={"self_attn.o_proj": ("self_attn.v_proj",), "mlp.down_proj": ("mlp.up_proj",)},
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
    embed_path="model.decoder.embed_tokens",
    final_norm_path="model.decoder.final_layer_norm",
    norm_kind="layer",
    output_linears=("self_attn.out_proj", "fc2"),
    smooth_producers={"self_attn.out_proj": ("self_attn.v_proj",), "fc2": ("fc1",)},
    rope=False,
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
