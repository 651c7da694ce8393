"""The bench decoder's family shapes (qtool/bench/e2e.py) on the CPU, in float32: head_dim apart from hidden / heads,
Qwen3's per-head query/key norms and mixture-of-experts blocks. On the CPU the decoder takes its torch forms (the
GPU runs the same code with fused kernels around them), so these check the computation the bench times: a prompt's
prefill against the same tokens decoded one by one through the cache, the experts against every expert applied
to every token, the q/k norms against a per-head computation, and the whole decoder against transformers' own
Qwen3, Qwen3-MoE and Mixtral on the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qtool.bench.command as command
from qtool.bench import e2e, throughput
from tests.test_bench_plot import _e2e_report, _throughput_report

from bad_input import assert_one_line_error, run_cli

CPU = torch.device("cpu")
# head_dim 32 where hidden / heads is 16, as in Qwen3-30B-A3B (2048 / 32 heads, head_dim 128)
QWEN3 = e2e.Dims(64, 96, 2, 4, 2, 128, head_dim=32, qk_norm=True, rope_theta=1e6)
QWEN3_MOE = e2e.Dims(64, 48, 2, 4, 2, 128, head_dim=32, qk_norm=True, rope_theta=1e6, experts=4, top_k=2)
MIXTRAL = e2e.Dims(64, 48, 2, 4, 2, 128, rope_theta=1e6, experts=4, top_k=2)
SHAPES = {"qwen3": QWEN3, "qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL}


def decoder(d: e2e.Dims, seed: int = 0) -> e2e.Decoder:
    """A float32 decoder with random weights everywhere, norms included (their ones would hide a norm applied with
    the wrong weight)."""
    g = torch.Generator().manual_seed(seed)

    def linear(k: int, n: int) -> nn.Module:
        return nn.Linear(k, n, bias=False, dtype=torch.float32)

    model = e2e.Decoder(d, linear, CPU, torch.float32).eval()
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("router.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)  # routes vary from token to token
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def caches(d: e2e.Dims, batch: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (batch, d.kv_heads, length, d.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(d.layers)]


@pytest.mark.parametrize("name", list(SHAPES))
def test_prefill_equals_token_by_token_decode(name):
    """Each prefix's prefill gives the logits of decoding its tokens one at a time through the static cache (the
    rotary positions, the q/k norms and the experts' routing agree between the two paths), and both leave the same
    keys and values in the cache."""
    d = SHAPES[name]
    model = decoder(d)
    tables = model.rope_tables(32, CPU)
    ids = torch.randint(0, d.vocab, (2, 6), generator=torch.Generator().manual_seed(1))
    step = caches(d, 2, 16)
    with torch.inference_mode():
        for j in range(ids.shape[1]):
            got = model.logits(ids[:, j : j + 1], torch.tensor([j]), step, tables, decode=True)
            full = caches(d, 2, j + 1)
            want = model.logits(ids[:, : j + 1], torch.arange(j + 1), full, tables, decode=False)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert torch.equal(
            model(ids, torch.arange(6), caches(d, 2, 6), tables, decode=False), want.argmax(-1)
        )
    for (k, v), (fk, fv) in zip(step, full, strict=True):
        torch.testing.assert_close(k[:, :, :6], fk, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v[:, :, :6], fv, rtol=1e-4, atol=1e-5)
        assert not bool(k[:, :, 6:].any())


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("rows", [(3, 5), (1, 1)], ids=["prefill", "one-token"])
def test_experts_equal_the_dense_reference(name, rows):
    """The block's gathered experts equal every expert applied to every token, weighted by the router's softmax
    over its k largest probabilities renormalized to one, and by zero for the other experts."""
    d = SHAPES[name]
    blk = decoder(d).blocks[0]
    x = torch.randn(*rows, d.hidden, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got = blk.moe(x).reshape(-1, d.hidden)
    x2 = x.reshape(-1, d.hidden)
    probs = torch.softmax(x2 @ blk.router.weight.T, dim=-1)
    chosen = torch.zeros_like(probs).scatter_(1, probs.topk(d.top_k, dim=-1).indices, 1.0)
    weights = probs * chosen / (probs * chosen).sum(dim=-1, keepdim=True)
    want = torch.zeros_like(x2)
    for e, ex in enumerate(blk.experts):
        gate, up = (x2 @ ex.gate_up.weight.T).chunk(2, dim=-1)
        want += weights[:, e : e + 1] * ((F.silu(gate) * up) @ ex.down.weight.T)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if x2.shape[0] > 1:
        assert int((chosen.sum(dim=0) > 0).sum()) > d.top_k  # the rows did not all pick the same experts


def test_qk_norm_is_per_head_with_its_own_weights():
    """Each query head normalized over its head_dim by q_norm's weights, each key head by k_norm's, the values as
    they were; without q/k norms the projection passes unchanged."""
    d = QWEN3
    blk = decoder(d).blocks[0]
    qkv = (
        torch.randn(2, 3, d.heads + 2 * d.kv_heads, d.head_dim, generator=torch.Generator().manual_seed(3))
        * 4
    )
    got = blk.qk_norm(qkv)
    eps = e2e.RMSNorm.eps
    for i in range(d.heads + 2 * d.kv_heads):
        x = qkv[:, :, i]
        if i >= d.heads + d.kv_heads:
            assert torch.equal(got[:, :, i], x)
            continue
        w = blk.q_norm.weight if i < d.heads else blk.k_norm.weight
        want = x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * w
        torch.testing.assert_close(got[:, :, i], want, rtol=1e-5, atol=1e-6)
    assert got.is_contiguous()
    plain = decoder(e2e.dims_for("tiny")).blocks[0]
    assert plain.qk_norm(qkv) is qkv and not hasattr(plain, "q_norm")


def _hf_model(name: str, d: e2e.Dims, model: e2e.Decoder):
    """transformers' model of the family with the bench decoder's weights."""
    import transformers

    common = dict(
        vocab_size=d.vocab,
        hidden_size=d.hidden,
        intermediate_size=d.intermediate,
        num_hidden_layers=d.layers,
        num_attention_heads=d.heads,
        num_key_value_heads=d.kv_heads,
        rms_norm_eps=e2e.RMSNorm.eps,
        rope_parameters={"rope_type": "default", "rope_theta": d.rope_theta},
        tie_word_embeddings=False,
    )
    if name == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=d.head_dim)
    elif name == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **common,
            head_dim=d.head_dim,
            num_experts=d.experts,
            num_experts_per_tok=d.top_k,
            moe_intermediate_size=d.intermediate,
            norm_topk_prob=True,
        )
    else:
        cfg = transformers.MixtralConfig(**common, num_local_experts=d.experts, num_experts_per_tok=d.top_k)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    q_rows, kv_rows = d.heads * d.head_dim, d.kv_heads * d.head_dim
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(model.embed.weight)
        hf.model.norm.weight.copy_(model.norm.weight)
        hf.lm_head.weight.copy_(model.lm_head.weight)
        for layer, blk in zip(hf.model.layers, model.blocks, strict=True):
            att = layer.self_attn
            q, k, v = blk.qkv.weight.split([q_rows, kv_rows, kv_rows])
            att.q_proj.weight.copy_(q)
            att.k_proj.weight.copy_(k)
            att.v_proj.weight.copy_(v)
            att.o_proj.weight.copy_(blk.o.weight)
            if d.qk_norm:
                att.q_norm.weight.copy_(blk.q_norm.weight)
                att.k_norm.weight.copy_(blk.k_norm.weight)
            layer.input_layernorm.weight.copy_(blk.n1.weight)
            layer.post_attention_layernorm.weight.copy_(blk.n2.weight)
            if d.experts:
                layer.mlp.gate.weight.copy_(blk.router.weight)
                for e, ex in enumerate(blk.experts):
                    layer.mlp.experts.gate_up_proj[e].copy_(ex.gate_up.weight)  # gate rows first in both
                    layer.mlp.experts.down_proj[e].copy_(ex.down.weight)
            else:
                gate, up = blk.gate_up.weight.chunk(2)
                layer.mlp.gate_proj.weight.copy_(gate)
                layer.mlp.up_proj.weight.copy_(up)
                layer.mlp.down_proj.weight.copy_(blk.down.weight)
    return hf


@pytest.mark.parametrize("name", list(SHAPES))
def test_decoder_computes_what_transformers_computes(name):
    """The bench decoder with a family's shape is that family: transformers' model on the same weights gives the
    same last-token logits (prefill) for two prompts."""
    d = SHAPES[name]
    model = decoder(d)
    hf = _hf_model(name, d, model)
    ids = torch.randint(0, d.vocab, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        want = hf(input_ids=ids).logits[:, -1]
        got = model.logits(ids, torch.arange(7), caches(d, 2, 7), model.rope_tables(7, CPU), decode=False)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_family_shapes_as_their_configs_give_them():
    """The named shapes carry the public configs' sizes (Qwen3-8B, Mixtral-8x7B, Qwen3-30B-A3B; the MoE ones
    with 4 of their layers), and each builds into a decoder whose linears have those widths."""
    q = e2e.dims_for("qwen3-8b")
    assert (q.hidden, q.intermediate, q.layers, q.heads, q.kv_heads, q.head_dim, q.vocab) == (
        4096,
        12288,
        36,
        32,
        8,
        128,
        151936,
    )
    assert q.qk_norm and q.rope_theta == 1e6 and not q.experts
    m = e2e.dims_for("mixtral-8x7b-4l")
    assert (m.hidden, m.intermediate, m.layers, m.heads, m.kv_heads, m.head_dim, m.vocab) == (
        4096,
        14336,
        4,
        32,
        8,
        128,
        32000,
    )
    assert (m.experts, m.top_k, m.qk_norm, m.rope_theta) == (8, 2, False, 1e6)
    a = e2e.dims_for("qwen3-30b-a3b-4l")
    assert (a.hidden, a.intermediate, a.layers, a.heads, a.kv_heads, a.head_dim, a.vocab) == (
        2048,
        768,
        4,
        32,
        4,
        128,
        151936,
    )
    assert (a.experts, a.top_k, a.qk_norm) == (128, 8, True)
    assert not e2e.dims_for("qwen3-8b", qk_norm=False).qk_norm
    assert e2e.dims_for("llama-2-7b").head_dim == 128 and e2e.Dims(256, 768, 2, 4, 2, 1000).head_dim == 64
    # the widths of a (meta-device) block of the smallest real shape: q/k/v over heads x head_dim, not hidden
    shapes = []

    def record(k: int, n: int) -> nn.Module:
        shapes.append((k, n))
        return nn.Linear(k, n, bias=False, device="meta")

    blk = e2e.Block(a, record, torch.device("meta"))
    assert shapes[:2] == [(2048, (32 + 2 * 4) * 128), (32 * 128, 2048)]
    assert shapes[2:4] == [(2048, 2 * 768), (768, 2048)] and len(shapes) == 2 + 2 * 128
    assert tuple(blk.router.weight.shape) == (128, 2048) and tuple(blk.q_norm.weight.shape) == (128,)


def test_model_config_refused_in_one_line_naming_the_known_shapes(monkeypatch):
    monkeypatch.setattr(command, "_need_gpu", lambda: None)
    for args in (["e2e"], ["e2e", "--throughput"]):
        res = run_cli(["bench", *args, "--model-config", "qwen3-7b"])
        line = assert_one_line_error(res, 2, "--model-config: found 'qwen3-7b'", "expected one of")
        for known in e2e.MODEL_DIMS:
            assert known in line


def test_no_qk_norm_reaches_the_runs_and_their_titles(monkeypatch):
    """--no-qk-norm reaches both benches; a report of a shape with q/k norms run without them says so in its
    title, and a MoE report says its steps ran eagerly."""
    monkeypatch.setattr(command, "_need_gpu", lambda: None)
    seen = {}

    def fake(report):
        def run(*a, **k):
            seen.update(k)
            return report

        return run

    monkeypatch.setattr("qtool.bench.e2e.run_e2e", fake(_e2e_report(False)))
    monkeypatch.setattr("qtool.bench.throughput.run_throughput", fake(_throughput_report()))
    for args in (["e2e"], ["e2e", "--throughput", "--batches", "16,64"]):
        assert run_cli(["bench", *args, "--model-config", "qwen3-8b", "--no-qk-norm"]).exit_code == 0
        assert seen.pop("qk_norm") is False
        assert run_cli(["bench", *args, "--model-config", "qwen3-8b"]).exit_code == 0
        assert seen.pop("qk_norm") is True

    from dataclasses import asdict

    r = {**_e2e_report(False), "model": "qwen3-8b", "dims": asdict(e2e.dims_for("qwen3-8b", qk_norm=False))}
    text = e2e.format_e2e(r)
    assert "e2e qwen3-8b without q/k norms on FakeGPU" in text and "q/k norms: torch" not in text
    r["dims"]["qk_norm"] = True
    text = e2e.format_e2e(r)
    assert "e2e qwen3-8b on FakeGPU" in text and "CUDA graphs, random weights" in text
    assert "q/k norms: torch F.rms_norm per head" in text
    moe = asdict(e2e.dims_for("qwen3-30b-a3b-4l"))
    text = throughput.format_throughput(
        {**_throughput_report(), "model": "qwen3-30b-a3b-4l", "dims": moe, "cuda_graphs": False}
    )
    assert "eager (no CUDA graphs: MoE routing syncs with the host)" in text
    assert "128 experts, 8 per token, 4 layers" in text
