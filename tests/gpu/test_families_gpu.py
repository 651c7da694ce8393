"""Each family's checkpoint (mixture-of-experts ones included: every expert's linears) decodes through the kernels: a random-weight model of the family, 256 wide so that every
kernel path applies, quantized on the CPU and loaded on the GPU in float16 with QTOOL_KERNELS=cuda (a kernel that
does not apply is then an error, not a silent fallback to the reference), gives the CPU reference's logits to
float16 rounding, for a 24-token prompt (the GEMM paths) and for each step of a greedy decode (one token: the
GEMV paths)."""

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
}
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
        ref = cpu(ids).logits
        got = gpu(ids.cuda()).logits.float().cpu()
        gen = gpu.generate(
            ids.cuda(), max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        # the first step is the prompt's forward; the next two run one token each against the cache
        got_steps = torch.stack([step.float().cpu() for step in gen.logits[1:]], dim=1)
        ref_steps = cpu(gen.sequences.cpu()).logits[:, 24:26]
    for a, b in ((got, ref), (got_steps, ref_steps)):
        assert bool(torch.isfinite(a).all())
        assert (a - b).abs().max() <= 2e-2 * b.abs().max(), ((a - b).abs().max(), b.abs().max())
