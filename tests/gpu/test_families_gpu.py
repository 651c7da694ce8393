"""Each family's checkpoint (mixture-of-experts ones included: every expert's linears) decodes through the kernels,
in every layout (grouped-int, QoQ with and without its 4-bit KV cache, QUIK, 2/4/16, VQ): a random-weight model of
the family, 256 wide so that every kernel path applies, quantized on the CPU and loaded on the GPU in float16 with
QTOOL_KERNELS=cuda (a kernel that does not apply is then an error, not a silent fallback to the reference), for a
24-token prompt (the GEMM paths) and two more tokens one at a time against the cache (the GEMV paths).

Two checks, because the model-level one alone cannot be tight everywhere: every packed linear's kernel output, on the
inputs the model gives it, equals its reference forward on the same input to float16 rounding; and the logits equal
the float32 CPU reference's within TOLERANCE (weight-only layouts) or NOISE_FRACTION of the quantization's own error
(layouts that quantize activations or the cache). A mixture of experts routes each token to its top-k experts, and a
token whose router logits tie to float16 rounding would take other experts on the GPU than on the CPU; the GPU's
routers are therefore handed the CPU reference's decisions, so that both run the same experts and what is compared
is the kernels."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.helpers import gpu_ready

from bad_input import run_cli
from conftest import STORIES, TINY_SAMPLE, write_recipe
from families import WIDE, build

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready())),
    pytest.mark.skipif(
        gpu_ready() is None and torch.cuda.get_device_capability() != (9, 0),
        reason="the qoq, mixed GEMM and vq GEMM kernels need Hopper",
    ),
    pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found"),
]

STAGES = {
    "grouped_int": "  - stage: gptq\n    bits: 4\n    group_size: 128\n",
    "qoq": "  - stage: progressive\n    bits: 4\n    group_size: 128\n",
    "mixed": "  - stage: mixed\n    group_size: 16\n    scale_group_size: 16\n    outlier_fraction: 0.002\n",
    "vq": "  - stage: vq\n    preset: gptvq-2\n    kmeans_iters: 4\n",
    "quik": "  - stage: outliers\n    bits: 4\n    act_bits: 4\n    outliers: 64\n",
    "qoq_kv4": "  - stage: kv_cache\n    bits: 4\n  - stage: progressive\n    bits: 4\n    group_size: 128\n",
}
# Logits tolerance. Weight-only formats: relative to the largest logit, float16 rounding. Formats that quantize
# activations (QoQ's int8 rows, QUIK's 4-bit rows) or the KV cache move a code by one step wherever the GPU's float16
# input and the CPU's float32 one round to different sides of a boundary, and the random model amplifies that; their
# logits are held to a fraction of the quantization's own error (CPU reference vs the float model) instead. With
# QUIK's 4-bit rows any such perturbation draws the quantization noise anew (the GPU and CPU logits then differ by
# about the quantization error itself), so there only the per-linear check is tight.
TOLERANCE = {"grouped_int": 2e-2, "mixed": 2e-2, "vq": 2e-2}
NOISE_FRACTION = {"qoq": 0.5, "qoq_kv4": 0.5, "quik": 1.0}
# A decoder no adapter knows (OLMo 2 here) has no declared attention structure for the KV-cache stage, which
# refuses it before loading (tests/test_families_matrix.py holds the refusal).
REFUSED = {("olmo2", "qoq_kv4")}
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
FAMILY_NAMES = ("llama3", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "olmo2")
# The experts as wide as the dense MLPs (each expert's linears then take every kernel path too).
EXPERTS = dict(moe_intermediate_size=256, shared_expert_intermediate_size=512)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    return {
        name: build(name, root / name, STORIES, **WIDE, **(EXPERTS if "moe" in name else {}))
        for name in FAMILY_NAMES
    }


@pytest.mark.parametrize("layout", sorted(STAGES))
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_family_checkpoint_decodes_through_the_kernels(tmp_path, wide, monkeypatch, name, layout):
    import qtool
    from qtool.layouts.module import PackedLinear

    if (name, layout) in REFUSED:
        pytest.skip(f"{layout} is refused on {name}")

    out = tmp_path / "ckpt"
    recipe = write_recipe(
        tmp_path / "r.yaml",
        f"model: {wide[name]}\ncalibration: {{source: {TINY_SAMPLE}, num_samples: 4, seq_len: 64}}\n"
        f"stages:\n{STAGES[layout]}settings: {{device: cpu}}\noutput: {out}\n",
    )
    res = run_cli(["quantize", recipe, "-q"])
    assert res.exit_code == 0, res.output
    ids = (torch.arange(24) * 37 % 500 + 3)[None]
    cpu = qtool.load(out)
    monkeypatch.setenv("QTOOL_KERNELS", "cuda")
    gpu = qtool.load(out, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        seq = cpu.generate(ids, max_new_tokens=2, do_sample=False)
    routers = {n: m for n, m in cpu.named_modules() if type(m).__name__.endswith("TopKRouter")}
    assert bool(routers) == (name in MOE)
    decisions: dict[str, tuple] = {}
    hooks = [
        m.register_forward_hook(lambda m, a, o, n=n: decisions.__setitem__(n, o)) for n, m in routers.items()
    ]
    with torch.no_grad():
        ref = cpu(seq).logits
    for h in hooks:
        h.remove()

    taken: dict[str, int] = dict.fromkeys(routers, 0)

    def cpu_routing(n, module, args, output):
        rows = output[0].shape[0]
        start, taken[n] = taken[n], taken[n] + rows
        return tuple(
            c[start : start + rows].to(o.device, o.dtype) for c, o in zip(decisions[n], output, strict=True)
        )

    gpu_modules = dict(gpu.named_modules())
    hooks = [
        gpu_modules[n].register_forward_hook(lambda m, a, o, n=n: cpu_routing(n, m, a, o)) for n in routers
    ]

    worst: dict[str, float] = {}

    def kernel_equals_reference(module, args, output):
        x = args[0]
        ref = module.reference_forward(x.float())
        err = (output.float() - ref).abs().max().item() / (ref.abs().max().item() + 1e-6)
        key = f"{type(module).__name__} m={x.reshape(-1, x.shape[-1]).shape[0]}"
        worst[key] = max(worst.get(key, 0.0), err)

    hooks += [
        m.register_forward_hook(kernel_equals_reference) for m in gpu.modules() if isinstance(m, PackedLinear)
    ]
    with torch.no_grad():
        # the prompt's forward (the GEMM paths), then two tokens one at a time against the cache (the GEMV paths)
        step = gpu(seq[:, :24].cuda(), use_cache=True)
        got = [step.logits.float().cpu()]
        for t in (24, 25):
            step = gpu(seq[:, t : t + 1].cuda(), past_key_values=step.past_key_values, use_cache=True)
            got.append(step.logits.float().cpu())
    for h in hooks:
        h.remove()
    print(f"\n{name} {layout} kernel vs reference per linear (max |diff| / max |ref|): {worst}")
    assert any(k.endswith(" m=1") for k in worst) and any(not k.endswith(" m=1") for k in worst), worst
    assert max(worst.values()) <= 2e-3, worst

    got = torch.cat(got, dim=1)
    assert bool(torch.isfinite(got).all())
    scale = ref.abs().amax(-1)
    per_position = ((got - ref).abs().amax(-1) / scale).flatten()
    print(f"{name} {layout} logits max |diff| / max |ref| per position: {per_position.tolist()}")
    if layout in TOLERANCE:
        assert bool((per_position <= TOLERANCE[layout]).all()), per_position
        return
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        floating = AutoModelForCausalLM.from_pretrained(wide[name], dtype=torch.float32)(seq).logits
    noise = ((ref - floating).abs().amax(-1) / scale).flatten()
    print(f"{name} {layout} quantization error per position: {noise.tolist()}")
    assert per_position.max() <= NOISE_FRACTION[layout] * noise.max(), (per_position, noise)
