"""Mixture of experts (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE), on random-weight models of each
family's own config class (4 experts, 2 routed per token): each expert's linears compute what transformers' experts
module computes; each expert's statistics come from the tokens routed to it (or, with `expert_tokens: all`, from
every token), the counts are in the run's summary and manifest, and an expert no token reached is refused for a
Hessian solver in one line naming it."""

from __future__ import annotations

import json

import pytest
import torch

from bad_input import assert_one_line_error, run_cli
from conftest import STORIES, TINY_SAMPLE, write_recipe
from families import MOE

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")

GPTQ = "  - stage: gptq\n    bits: 4\n    group_size: 32\n"


def _recipe(tmp_path, model, calibration: str = "", samples: int = 4, seq: int = 64):
    return write_recipe(
        tmp_path / "r.yaml",
        f"model: {model}\ncalibration: {{source: {TINY_SAMPLE}, num_samples: {samples}, seq_len: {seq}"
        f"{calibration}}}\nstages:\n{GPTQ}output: {tmp_path / 'ckpt'}\n",
    )


@pytest.mark.parametrize("name", list(MOE))
def test_expert_linears_compute_what_transformers_computes(family, name):
    from transformers import AutoModelForCausalLM

    from qtool.models.loading import load_model
    from qtool.models.moe import ExpertLinears

    path = family(name)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours, _, adapter, _ = load_model(str(path), torch.float32)
    assert isinstance(ours.get_submodule(f"{adapter.block_prefix(0)}.{adapter.experts}"), ExpertLinears)
    assert f"{adapter.experts}.3.down_proj" in adapter.linear_names()
    ids = (torch.arange(40) * 37 % 500 + 3)[None]
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


@pytest.mark.parametrize("name", list(MOE))
def test_tokens_per_expert_are_reported_and_routed_or_all(tmp_path, family, name):
    res = run_cli(["quantize", _recipe(tmp_path, family(name))])
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "ckpt" / "qtool-manifest.json").read_text())
    routed = manifest["calibration"]["expert_tokens"]
    assert set(routed["per_block"]) == {f"model.layers.{i}.mlp.experts" for i in range(2)}
    for counts in routed["per_block"].values():
        assert len(counts) == 4 and sum(counts) == 2 * 4 * 64  # each token goes to 2 of the 4 experts
    assert routed["fewest"] == min(c for per in routed["per_block"].values() for c in per)
    if routed["below_input_width"]:  # fewer tokens than the 64 inputs: the run said so
        assert "experts saw fewer tokens than their 64 inputs" in res.stderr
    res = run_cli(
        ["quantize", _recipe(tmp_path, family(name), ", expert_tokens: all"), "--json", "--overwrite"]
    )
    assert res.exit_code == 0, res.output
    every = json.loads(res.stdout)["calibration"]["expert_tokens"]  # the summary has them too
    assert all(c == 4 * 64 for per in every["per_block"].values() for c in per)


def test_an_expert_no_token_reached_is_refused_naming_it(tmp_path, family, monkeypatch):
    """A router that never picks expert 3: GPTQ has no Hessian for it, so the run stops naming the linear; with
    expert_tokens: all it quantizes."""
    from transformers.models.mixtral import modeling_mixtral

    route = modeling_mixtral.MixtralTopKRouter.forward

    def never_three(self, hidden_states):
        saved = self.weight.data[3].clone()
        self.weight.data[3] = -1e4 * torch.sign(hidden_states.reshape(-1, self.hidden_dim).mean(0))
        try:
            return route(self, hidden_states)
        finally:
            self.weight.data[3] = saved

    monkeypatch.setattr(modeling_mixtral.MixtralTopKRouter, "forward", never_three)
    res = run_cli(["quantize", _recipe(tmp_path, family("mixtral"), samples=1, seq=16), "-q"])
    assert_one_line_error(
        res, 3, "calibration.expert_tokens", "model.layers.0.mlp.experts.3.gate_proj saw no calibration token"
    )
    res = run_cli(["quantize", _recipe(tmp_path, family("mixtral"), ", expert_tokens: all", 1, 16), "-q"])
    assert res.exit_code == 0, res.output


def test_dense_and_expert_blocks_mixed_are_refused(tmp_path, no_work):
    import transformers
    from transformers import AutoTokenizer

    from families import COMMON

    config = transformers.Qwen2MoeConfig(
        **{**COMMON, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        mlp_only_layers=[1],
    )
    config.architectures = ["Qwen2MoeForCausalLM"]
    config.save_pretrained(tmp_path / "m")
    AutoTokenizer.from_pretrained(STORIES).save_pretrained(tmp_path / "m")
    res = run_cli(["quantize", _recipe(tmp_path, tmp_path / "m")])
    assert_one_line_error(res, 4, "mixes dense and mixture-of-experts blocks", "mlp_only_layers [1]")


@pytest.mark.parametrize("name", list(MOE))
def test_export_loads_in_plain_transformers_as_qtool_loads_it(tmp_path, family, name):
    """The compressed-tensors export of each MoE family, read by transformers in a process that never imports
    qtool (Mixtral's experts under the hub names transformers converts), gives qtool.load's logits."""
    import subprocess
    import sys

    import qtool

    assert run_cli(["quantize", _recipe(tmp_path, family(name)), "-q"]).exit_code == 0
    res = run_cli(
        ["export", tmp_path / "ckpt", "--format", "compressed-tensors", "-o", tmp_path / "ct", "-q"]
    )
    assert res.exit_code == 0, res.output
    ids = (torch.arange(30) * 37 % 500 + 3)[None]
    torch.save(ids, tmp_path / "ids.pt")
    code = (
        "import sys, torch\nfrom transformers import AutoModelForCausalLM\n"
        "m, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, output_loading_info=True)\n"
        "assert not info['missing_keys'] and not info['unexpected_keys'], info\n"
        "assert 'qtool' not in sys.modules\n"
        "with torch.no_grad():\n    torch.save(m(torch.load(sys.argv[2])).logits, sys.argv[3])\n"
    )
    subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(tmp_path / "ct"),
            str(tmp_path / "ids.pt"),
            str(tmp_path / "out.pt"),
        ],
        check=True,
        capture_output=True,
    )
    with torch.no_grad():
        ours = qtool.load(tmp_path / "ckpt")(ids).logits
    assert torch.equal(torch.load(tmp_path / "out.pt"), ours)
