"""The bench decoder's family shapes (qtool/bench/e2e.py) on the CPU, in float32: head_dim apart from hidden / heads,
Qwen3's per-head query/key norms, mixture-of-experts blocks and Gemma 2's block (GeGLU, branch norms, scaled
embeddings, final soft-capping, tied embeddings). On the CPU the decoder takes its torch forms (the GPU runs the
same code with fused kernels around them), so these check the computation the bench times: a prompt's prefill
against the same tokens decoded one by one through the cache, the experts against every expert applied to every
token, the q/k norms against a per-head computation, and the whole decoder against transformers' own Qwen3,
Qwen3-MoE, Mixtral and Gemma 2 on the same weights."""

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
# head_dim 32 over 4 heads of hidden 64, as Gemma 2 9B's 256 over 16 heads of 3584; a final cap of 5 rather than
# 30 so that the tiny model's logits (about 1) are visibly bent by it
GEMMA2 = e2e.Dims(
    64,
    96,
    2,
    4,
    2,
    128,
    head_dim=32,
    geglu=True,
    post_norms=True,
    embed_scale=True,
    final_softcap=5.0,
    tie_embeddings=True,
    attn_softcap=50.0,
    sliding_window=4096,
)
SHAPES = {"qwen3": QWEN3, "qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL, "gemma2": GEMMA2}


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


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_decode_span_equals_the_masked_form_over_the_static_cache(kv_heads):
    """A one-token decode step given `span` (its position + 1: SDPA over the cache's first positions, no mask)
    gives the logits and cache of the masked form over the whole static cache, whose positions past the step hold
    values that either form would pick up if it read them; a span one short (the step's own key left out) or one
    long (a stale position read) gives other logits."""
    d = e2e.Dims(64, 96, 2, 4, kv_heads, 128)
    model = decoder(d)
    tables = model.rope_tables(32, CPU)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, d.vocab, (3, 1), generator=g)
    shape = (3, kv_heads, 16, d.head_dim)
    stale = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(d.layers)]
    pos = 9

    def step(span):
        cache = [(k.clone(), v.clone()) for k, v in stale]
        with torch.inference_mode():
            out = model.logits(ids, torch.tensor([pos]), cache, tables, decode=True, span=span)
        return out, cache

    want, want_cache = step(None)
    got, got_cache = step(pos + 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the later layers' keys and values come from the earlier layers' attention, equal up to rounding
    for (k, v), (wk, wv) in zip(got_cache, want_cache, strict=True):
        torch.testing.assert_close(k, wk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, wv, rtol=1e-5, atol=1e-5)
    for wrong in (pos, pos + 2):
        assert float((step(wrong)[0] - want).abs().max()) > 1e-3, wrong
    with pytest.raises(ValueError, match="span: found 17, expected 1 to 16"):
        step(17)
    with pytest.raises(ValueError, match="span: found a value for a prefill"):
        model.logits(ids, torch.tensor([0]), stale, tables, decode=False, span=1)


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
    """transformers' model of the family with the bench decoder's weights. Gemma 2's norms scale by (1 + w)
    where the bench's scale by w, so its norm weights are the bench's less one."""
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
    elif name == "gemma2":
        # The bench leaves attention logit soft-capping out (its attention kernels have none), so transformers'
        # is switched off here too; sliding_window 4096 is longer than the prompt, so every layer attends as a
        # full one, as the bench's do.
        cfg = transformers.Gemma2Config(
            **{**common, "tie_word_embeddings": True},
            head_dim=d.head_dim,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=d.head_dim,
            attn_logit_softcapping=None,
            final_logit_softcapping=d.final_softcap,
            sliding_window=d.sliding_window,
        )
    else:
        cfg = transformers.MixtralConfig(**common, num_local_experts=d.experts, num_experts_per_tok=d.top_k)
    gemma = name == "gemma2"
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    q_rows, kv_rows = d.heads * d.head_dim, d.kv_heads * d.head_dim

    def norm(w: torch.Tensor) -> torch.Tensor:
        return w - 1 if gemma else w

    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(model.embed.weight)
        hf.model.norm.weight.copy_(norm(model.norm.weight))
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
            layer.input_layernorm.weight.copy_(norm(blk.n1.weight))
            if gemma:  # Gemma's post_attention_layernorm normalizes attention's output; its MLP's input norm
                # is pre_feedforward_layernorm
                layer.post_attention_layernorm.weight.copy_(norm(blk.post_attn_norm.weight))
                layer.pre_feedforward_layernorm.weight.copy_(norm(blk.n2.weight))
                layer.post_feedforward_layernorm.weight.copy_(norm(blk.post_mlp_norm.weight))
            else:
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


def test_gemma_2_9b_as_its_config_gives_it():
    """gemma-2-9b carries the public config's sizes (google/gemma-2-9b config.json: 3584 hidden, 14336 MLP, 42
    layers, 16 heads of 256 over 8 KV heads, 256000 tokens, tied embeddings, caps 50 and 30, window 4096), and
    --llama-block keeps every size while dropping the Gemma pieces the bench runs (not the recorded ones)."""
    g = e2e.dims_for("gemma-2-9b")
    assert (g.hidden, g.intermediate, g.layers, g.heads, g.kv_heads, g.head_dim, g.vocab) == (
        3584,
        14336,
        42,
        16,
        8,
        256,
        256000,
    )
    assert g.geglu and g.post_norms and g.embed_scale and g.tie_embeddings and not g.qk_norm
    assert (g.final_softcap, g.attn_softcap, g.sliding_window, g.rope_theta) == (30.0, 50.0, 4096, 10000.0)
    plain = e2e.dims_for("gemma-2-9b", llama_block=True)
    assert plain == e2e.Dims(
        3584,
        14336,
        42,
        16,
        8,
        256000,
        head_dim=256,
        tie_embeddings=True,
        attn_softcap=50.0,
        sliding_window=4096,
    )
    assert e2e.dims_for("qwen3-8b", llama_block=True) == e2e.dims_for("qwen3-8b")
    shapes = []

    def record(k: int, n: int) -> nn.Module:
        shapes.append((k, n))
        return nn.Linear(k, n, bias=False, device="meta")

    meta = torch.device("meta")
    blk = e2e.Block(g, record, meta)
    assert shapes == [(3584, (16 + 2 * 8) * 256), (16 * 256, 3584), (3584, 2 * 14336), (14336, 3584)]
    assert tuple(blk.post_attn_norm.weight.shape) == tuple(blk.post_mlp_norm.weight.shape) == (3584,)
    assert not hasattr(e2e.Block(plain, record, meta), "post_attn_norm")
    model = decoder(GEMMA2)
    assert model.lm_head.weight is model.embed.weight
    assert e2e.weight_bytes(model) == sum(p.numel() * 4 for p in model.parameters())


def test_llama_block_reaches_the_runs_and_the_reports_say_what_is_left_out(monkeypatch):
    """--llama-block reaches both benches; a Gemma report names its unfused pieces, says that attention
    soft-capping is left out and whether its sequences stay within the sliding window, and a --llama-block
    report says so in its title."""
    monkeypatch.setattr(command, "_need_gpu", lambda: None)
    seen = {}

    def fake(report):
        def run(*a, **k):
            seen.update(k)
            return report

        return run

    monkeypatch.setattr("qtool.bench.e2e.run_e2e", fake(_e2e_report(False)))
    monkeypatch.setattr("qtool.bench.throughput.run_throughput", fake(_throughput_report()))
    tp = ["e2e", "--throughput", "--batches", "16,64", "--variants", "fp16,w4a16,w4a8kv4"]
    for args in (["e2e"], tp):
        assert run_cli(["bench", *args, "--model-config", "gemma-2-9b", "--llama-block"]).exit_code == 0
        assert seen.pop("llama_block") is True
        assert run_cli(["bench", *args, "--model-config", "gemma-2-9b"]).exit_code == 0
        assert seen.pop("llama_block") is False

    from dataclasses import asdict

    r = {**_e2e_report(False), "model": "gemma-2-9b", "dims": asdict(e2e.dims_for("gemma-2-9b"))}
    text = e2e.format_e2e(r)
    assert "e2e gemma-2-9b on FakeGPU" in text
    assert "GeGLU: torch F.gelu(gate, tanh) * up" in text and "post-MLP norms: torch F.rms_norm" in text
    assert "final logits soft-capped at 30" in text
    assert "-- attention logit soft-capping (50) left out" in text
    assert "-- sliding-window layers (4096) run as full attention: the same over these 2048 positions" in text
    r["dims"] = asdict(e2e.dims_for("gemma-2-9b", llama_block=True))
    text = e2e.format_e2e(r)
    assert "e2e gemma-2-9b with Llama's block (SwiGLU, no branch norms) on FakeGPU" in text
    assert "GeGLU" not in text and "soft-capped" not in text and "soft-capping (50) left out" in text
    long = {**_throughput_report(), "model": "gemma-2-9b", "dims": asdict(e2e.dims_for("gemma-2-9b"))}
    long["prompt_tokens"] = 4096
    text = throughput.format_throughput(long)
    assert (
        "sliding-window layers (4096) run as full attention over 4608 positions: more than the model" in text
    )


def test_kv_caches_that_cannot_hold_gemmas_heads_are_refused_before_any_run(monkeypatch):
    """The FP8 cache's kernels take head_dim up to 128 and the CQ-2 cache's 64 or 128: --throughput of a
    head_dim-256 shape with either is refused in one line, before a model is built."""
    monkeypatch.setattr(command, "_need_gpu", lambda: None)
    monkeypatch.setattr(
        "qtool.bench.throughput.run_throughput", lambda *a, **k: pytest.fail("ran a refused variant")
    )
    args = ["bench", "e2e", "--throughput", "--model-config", "gemma-2-9b", "--variants"]
    res = run_cli([*args, "fp16,fp8,w4a16"])
    assert_one_line_error(res, 2, "--variants: fp8 cannot run gemma-2-9b", "up to 128", "leave it out")
    res = run_cli([*args, "fp16,w4a8cq2"])
    assert_one_line_error(res, 2, "--variants: w4a8cq2 cannot run gemma-2-9b", "64 or 128")
    for v in throughput.VARIANTS:
        assert throughput.head_dim_refusal(v, 128) is None
