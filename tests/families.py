"""Random-weight models of the families qtool declares (and two it does not), built from each family's own
transformers config class at small sizes, written to disk with the stories260K tokenizer (512 tokens) and loaded
through the normal path. The weights are drawn here with a seeded generator, not by the library's initialisation,
so they stay the same across transformers versions."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# name -> (config class name, overrides, whether its norms scale by 1 + w)
FAMILIES = {
    # Llama 3.x: llama3 RoPE scaling, tied embeddings (3.2), a vocabulary larger than the tokenizer's
    "llama3": (
        "LlamaConfig",
        dict(
            vocab_size=1024,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        False,
    ),
    "qwen3": ("Qwen3Config", dict(head_dim=32), False),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=32,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=32,
        ),
        True,
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=32,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=32,
        ),
        True,
    ),
    "phi3": ("Phi3Config", dict(), False),
}
# Mixture of experts: 4 experts, 2 routed per token (Qwen2-MoE with a shared expert and its gate).
MOE = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2), False),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=128,
        ),
        False,
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=32),
        False,
    ),
}
# Families without an adapter: the generic fallback runs weight-only recipes on them.
GENERIC = {
    "olmo2": ("Olmo2Config", dict(), False),
    "granite": ("GraniteConfig", dict(), False),
}


# Widths every kernel path takes (multiples of 128), for the GPU tests.
WIDE = dict(hidden_size=256, intermediate_size=512, head_dim=64)


def build(name: str, out: Path, tokenizer_from: Path, **sizes) -> Path:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cls_name, overrides, offset_norms = {**FAMILIES, **MOE, **GENERIC}[name]
    config = getattr(transformers, cls_name)(**{**COMMON, **overrides, **sizes})
    model = AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pname, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
            elif "norm" in pname and offset_norms:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))  # scales by 1 + w
            elif "norm" in pname:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    model.eval().save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(out)
    return out
