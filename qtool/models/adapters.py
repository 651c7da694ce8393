"""Architecture adapters: where a family keeps its decoder blocks and which linears each block holds, in the
order GPTQ's sequential mode quantizes them, and the structure the transforms need to stay exact (norms, the
residual stream's writers, the attention projections). One entry a family, data only; the pipeline never
hard-codes module names. docs/families.md says which stage runs on which family, and why not where it does not."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

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
    # A norm whose stored weight w scales by w + norm_offset (Gemma's RMSNorm multiplies by 1 + w).
    norm_offset: float = 0.0
    # Norms applied to a branch's output before it is added to the residual stream (Gemma's post-attention and
    # post-feedforward norms): their per-channel scales sit on the stream, so no rotation of it is exact.
    branch_norms: tuple[str, ...] = ()
    # Per-head norms of the queries and keys after their projections, before RoPE (Qwen3, Gemma 3): a key
    # channel's scale is set by the norm's shared weight, not by k_proj's rows.
    qk_norms: tuple[str, str] | None = None
    # Whether q/k/v are separate linears; a fused qkv_proj (Phi-3) leaves q_proj, k_proj and v_proj empty.
    separate_qkv: bool = True
    # Whether the model's attention runs through transformers' attention interface with the RoPE layout above, so
    # the quantized KV caches (kv_cache, vq_kv) can wrap it.
    kv_cache: bool = True
    # Mixture of experts: the experts module of a block (replaced by qtool/models/moe.py ExpertLinears), the config
    # key holding their number, the router, the norm feeding them, and a shared expert's (gate/up, down) linears and
    # its gate. `expanded(config)` lists each expert's linears.
    experts: str = ""
    experts_count: str = ""
    router: str = ""
    experts_norm: str = "post_attention_layernorm"
    shared_expert: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    shared_gate: str = ""
    # (pattern, replacement) pairs from qtool's module names to the names the family's hub checkpoints store
    # (what transformers reads, converting them as it loads): used where plain clients read an export.
    stored_names: tuple[tuple[str, str], ...] = ()
    # Found from the module tree of a model no declared adapter knows (`generic_adapter`): the blocks and their
    # linears only, for weight-only stages; its linear groups are found from a block's forward when it first runs.
    generic: bool = False

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

    def stored_name(self, name: str) -> str:
        """`name` (a module or tensor of qtool's model) as the family's hub checkpoints store it."""
        for pattern, repl in self.stored_names:
            name = re.sub(pattern, repl, name)
        return name

    def expanded(self, config) -> Adapter:
        """The adapter for a model of `config`: a mixture-of-experts family gets each expert's linears (gate and
        up, which see the tokens routed to the expert, in one group with a shared expert's; then the downs), the
        norm feeding the router and the experts, and every expert's down_proj among the residual stream's
        writers. Other families are as declared."""
        if not self.experts:
            return self
        n = getattr(config, self.experts_count)
        shared_in, shared_out = self.shared_expert
        gate_up = (
            tuple(f"{self.experts}.{e}.{p}" for e in range(n) for p in ("gate_proj", "up_proj")) + shared_in
        )
        down = tuple(f"{self.experts}.{e}.down_proj" for e in range(n)) + shared_out
        ups = {f"{self.experts}.{e}.down_proj": (f"{self.experts}.{e}.up_proj",) for e in range(n)}
        if shared_out:
            ups[shared_out[0]] = (shared_in[-1],)
        return replace(
            self,
            linear_groups=self.linear_groups + (gate_up, down),
            norm_feeds={
                **self.norm_feeds,
                self.experts_norm: (
                    self.router,
                    *gate_up,
                    *((self.shared_gate,) if self.shared_gate else ()),
                ),
            },
            output_linears=self.output_linears + down,
            smooth_producers={**self.smooth_producers, **ups},
        )


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

# Qwen3: Llama's layout with per-head RMSNorms on queries and keys (q_norm, k_norm) before RoPE; no qkv bias.
QWEN3 = replace(
    LLAMA,
    family="qwen3",
    architectures=("Qwen3ForCausalLM",),
    qk_norms=("self_attn.q_norm", "self_attn.k_norm"),
)

# Gemma 2: RMSNorm scaling by (1 + w), embeddings scaled by sqrt(hidden), GeGLU (tanh-GELU gate), a norm before
# and after both attention and MLP, attention and final logit soft-capping, sliding-window layers, head_dim set
# in the config.
GEMMA2 = replace(
    LLAMA,
    family="gemma2",
    architectures=("Gemma2ForCausalLM",),
    norm_feeds={
        "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "pre_feedforward_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
    },
    norm_offset=1.0,
    branch_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
)

# Gemma 3 (the text decoder): Gemma 2's layout with Qwen3's query and key norms (scaling by 1 + w too).
GEMMA3 = replace(
    GEMMA2,
    family="gemma3",
    architectures=("Gemma3ForCausalLM",),
    qk_norms=("self_attn.q_norm", "self_attn.k_norm"),
)

# Phi-3 and Phi-4 (Phi3ForCausalLM): one fused qkv_proj and one fused gate_up_proj, quantized as the fused linears
# they are (so the checkpoint keeps transformers' module names); the inputs of o_proj and down_proj are made by row
# slices of them.
PHI3 = Adapter(
    family="phi3",
    architectures=("Phi3ForCausalLM",),
    blocks_path="model.layers",
    linear_groups=(("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",)),
    norm_feeds={
        "input_layernorm": ("self_attn.qkv_proj",),
        "post_attention_layernorm": ("mlp.gate_up_proj",),
    },
    output_linears=("self_attn.o_proj", "mlp.down_proj"),
    q_proj="",
    k_proj="",
    v_proj="",
    separate_qkv=False,
)

# Mixture of experts: the attention of Llama (Qwen3's with its q/k norms), then a router and experts stored by
# transformers as 3-D tensors, quantized one expert linear at a time.
_MOE_ATTENTION = dict(
    linear_groups=LLAMA.linear_groups[:2],
    norm_feeds={"input_layernorm": LLAMA.norm_feeds["input_layernorm"]},
    output_linears=("self_attn.o_proj",),
    smooth_producers={"self_attn.o_proj": ("self_attn.v_proj",)},
    experts="mlp.experts",
    router="mlp.gate",
)
MIXTRAL = replace(
    LLAMA,
    family="mixtral",
    architectures=("MixtralForCausalLM",),
    experts_count="num_local_experts",
    # Mixtral checkpoints keep the original names: block_sparse_moe, experts' w1 (gate), w3 (up), w2 (down).
    stored_names=(
        (r"\.mlp\.experts\.(\d+)\.gate_proj(?=\.|$)", r".block_sparse_moe.experts.\1.w1"),
        (r"\.mlp\.experts\.(\d+)\.up_proj(?=\.|$)", r".block_sparse_moe.experts.\1.w3"),
        (r"\.mlp\.experts\.(\d+)\.down_proj(?=\.|$)", r".block_sparse_moe.experts.\1.w2"),
        (r"\.mlp\.gate(?=\.|$)", r".block_sparse_moe.gate"),
    ),
    **_MOE_ATTENTION,
)
QWEN2_MOE = replace(
    LLAMA,
    family="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    experts_count="num_experts",
    shared_expert=(
        ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
        ("mlp.shared_expert.down_proj",),
    ),
    shared_gate="mlp.shared_expert_gate",
    **_MOE_ATTENTION,
)
QWEN3_MOE = replace(
    QWEN3,
    family="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    experts_count="num_experts",
    **_MOE_ATTENTION,
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
    kv_cache=False,
)

ADAPTERS: tuple[Adapter, ...] = (LLAMA, QWEN3, GEMMA2, GEMMA3, PHI3, MIXTRAL, QWEN2_MOE, QWEN3_MOE, OPT)


def _name_of(model: nn.Module, target: nn.Module | None) -> str:
    return next((n for n, m in model.named_modules() if m is target), "") if target is not None else ""


def generic_adapter(model: nn.Module) -> Adapter | str:
    """An adapter for a decoder model no declared adapter knows, found from its module tree (the model may be on
    the meta device), for the stages that need no more than its blocks and their linears; or why none can be
    found. The blocks: the longest ModuleList of modules of one class that hold linears. Their linears, in
    registration order, form one group until a block's forward shows which take the same input (`forward_groups`).
    """
    best = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 1:
            continue
        kinds = {type(b) for b in mod}
        if len(kinds) == 1 and any(isinstance(m, nn.Linear) for m in mod[0].modules()):
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    arch = ", ".join(getattr(model.config, "architectures", None) or [model.config.model_type])
    if best is None:
        return f"{arch} has no list of repeated decoder blocks holding linear layers"
    blocks_path, blocks = best
    block = blocks[0]
    stacked = [n for n, p in block.named_parameters() if p.dim() > 2]
    if stacked:
        return (
            f"{arch} keeps weights its blocks multiply with outside linear layers ({stacked[0]}: a tensor of "
            f"{block.get_parameter(stacked[0]).dim()} dimensions, as mixture-of-experts blocks store their experts)"
        )
    linears = tuple(n for n, m in block.named_modules() if isinstance(m, nn.Linear))
    base = model.get_submodule(blocks_path.rpartition(".")[0]) if "." in blocks_path else model
    norm = next(
        (
            f"{blocks_path.rpartition('.')[0]}.{n}".lstrip(".")
            for n, m in base.named_children()
            if "Norm" in type(m).__name__
        ),
        "",
    )
    return Adapter(
        family="generic",
        architectures=tuple(getattr(model.config, "architectures", None) or ()),
        blocks_path=blocks_path,
        linear_groups=(linears,),
        embed_path=_name_of(model, model.get_input_embeddings()),
        final_norm_path=norm,
        head_path=_name_of(model, model.get_output_embeddings()),
        norm_kind="unknown",
        q_proj="",
        k_proj="",
        v_proj="",
        rope=False,
        separate_qkv=False,
        kv_cache=False,
        generic=True,
    )


def forward_groups(adapter: Adapter, block: nn.Module, x, kwargs: dict) -> Adapter:
    """`adapter` with its linear groups read from one forward of `block` on `x`: linears in the order they run,
    those that take the same input tensor (q/k/v, gate/up) in one group."""
    order: list[tuple[str, int]] = []
    keep = []

    def hook(name: str):
        def record(module, args):
            keep.append(args[0])  # alive until the pass ends, so no two inputs share an id
            order.append((name, id(args[0])))

        return record

    names = adapter.linear_names()
    handles = [block.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    try:
        import torch

        with torch.no_grad():
            block(x, **kwargs)
    finally:
        for h in handles:
            h.remove()
    groups: list[list[str]] = []
    seen: dict[int, int] = {}
    for name, ident in order:
        if any(name in g for g in groups):
            continue
        if ident in seen:
            groups[seen[ident]].append(name)
        else:
            seen[ident] = len(groups)
            groups.append([name])
    unseen = [n for n in names if not any(n in g for g in groups)]
    return replace(
        adapter, linear_groups=tuple(tuple(g) for g in groups) + ((tuple(unseen),) if unseen else ())
    )


def supported_architectures() -> list[str]:
    return sorted(a for ad in ADAPTERS for a in ad.architectures)


def adapter_for(architectures: list[str] | None) -> Adapter | None:
    for arch in architectures or []:
        for ad in ADAPTERS:
            if arch in ad.architectures:
                return ad
    return None
