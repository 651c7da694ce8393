"""The vector-quantized KV cache (qtool/kv_cache/vq.py): codes against brute-force nearest entries, the
cache read back is a fixed point (re-encoding cached tokens at every step changes nothing), the attention path
reads the codes, and the loader's one-line errors for the codebook tensors and the scheme."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from qtool.errors import CheckpointError
from qtool.kv_cache.schemes import apply_model_schemes, attach_scheme_tensors
from qtool.kv_cache.vq import KVCodebooks, decode, encode, kv_vq_scheme


def _books(h=2, g=4, e=16, d=2, seed=0):
    return torch.randn(h, g, e, d, generator=torch.Generator().manual_seed(seed)).half()


def test_codes_are_the_nearest_entries_and_a_fixed_point():
    books = _books()
    x = torch.randn(3, 2, 5, 8)
    codes = encode(x, books)
    c = books.float()
    for b in range(3):
        for h in range(2):
            for t in range(5):
                for g in range(4):
                    v = x[b, h, t, 2 * g : 2 * g + 2]
                    assert codes[b, h, t, g] == (c[h, g] - v).pow(2).sum(1).argmin()
    cached = decode(codes, books, torch.float32)
    assert torch.equal(encode(cached, books), codes)
    mod = KVCodebooks(books, _books(seed=1))
    k, v = mod(x, x)
    k2, v2 = mod(k, v)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    assert mod.to(torch.bfloat16).key.dtype == torch.float16


def _tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


def _tensors(model, d=4, e=16):
    out = {}
    for i in range(2):
        out[f"model.layers.{i}.self_attn.kv_codebooks.key"] = _books(2, 8 // d, e, d, seed=i)
        out[f"model.layers.{i}.self_attn.kv_codebooks.value"] = _books(2, 8 // d, e, d, seed=10 + i)
    return out


def test_attention_reads_the_codes():
    model = _tiny()
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fp = model(ids).logits
    qcfg = {"kv_cache": kv_vq_scheme(4, 16)}
    tensors = _tensors(model)
    attach_scheme_tensors(model, qcfg, tensors, "cfg")
    assert not tensors  # all taken
    apply_model_schemes(model, qcfg, "cfg")
    seen = []
    mod = model.model.layers[0].self_attn.kv_codebooks
    mod.register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        q = model(ids).logits
    assert len(seen) == 1 and not torch.allclose(q, fp, atol=1e-3)
    k, _ = seen[0]
    assert torch.equal(encode(decode(encode(k, mod.key), mod.key, k.dtype), mod.key), encode(k, mod.key))


@pytest.mark.parametrize(
    "mutate, words",
    [
        (
            lambda t: t.pop("model.layers.1.self_attn.kv_codebooks.value"),
            ["tensor model.layers.1.self_attn.kv_codebooks.value: missing", "float16 [2, 2, 16, 4]"],
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.kv_codebooks.key": _books(2, 4, 16, 2)}),
            [
                "tensor model.layers.0.self_attn.kv_codebooks.key: found torch.float16 [2, 4, 16, 2]",
                "[2, 2, 16, 4]",
            ],
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.kv_codebooks.key": _books(2, 2, 16, 4).float()}),
            ["kv_codebooks.key: found torch.float32"],
        ),
    ],
)
def test_loader_errors_name_the_tensor(mutate, words):
    model = _tiny()
    tensors = _tensors(model)
    mutate(tensors)
    with pytest.raises(CheckpointError) as e:
        attach_scheme_tensors(model, {"kv_cache": kv_vq_scheme(4, 16)}, tensors, "cfg")
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "scheme",
    [
        {**kv_vq_scheme(4, 16), "entries": 12},
        {**kv_vq_scheme(4, 16), "index_bits": 8},
        {**kv_vq_scheme(4, 16), "keys": "pre_rope"},
        {**kv_vq_scheme(4, 16), "entries": 512, "index_bits": 9},
    ],
)
def test_bad_schemes_are_refused(scheme):
    with pytest.raises(CheckpointError, match="quantization_config.kv_cache: found .*expected \\{format: vq"):
        attach_scheme_tensors(_tiny(), {"kv_cache": scheme}, {}, "cfg")


def test_codebooks_must_be_attached_before_install():
    with pytest.raises(CheckpointError, match="has no codebooks"):
        apply_model_schemes(_tiny(), {"kv_cache": kv_vq_scheme(4, 16)}, "cfg")
