"""Codebook fine-tuning of the `vq` stage (`finetune_steps`): the tunable view of a layer is the layout it came from
and trains only the entries some vector selects; on stories260K (block 0 only: its inputs are the embeddings in
every run, so errors compare on the same inputs) the tuned block's output is closer to the float block's than the
untuned one, measured from the models' hidden states, the codes and tiers stay as quantized, and the CLI (block
onloading) writes, deterministically, the same float16 codebooks, which the loader accepts; bad option values are
refused in one line before any model loads."""

from __future__ import annotations

import json

import pytest
import torch

from bad_input import assert_one_line_error, run_cli
from conftest import STORIES, TINY_SAMPLE, finetune_pair, write_recipe

RECIPE = f"""
model: {STORIES}
calibration:
  source: {TINY_SAMPLE}
  num_samples: 2
  seq_len: 64
  seed: 0
stages:
  - stage: vq
    preset: gptvq-2
    vector_size: 4
    entries: 16
    tile_rows: 32
    tile_cols: 64
    kmeans_iters: 4
    finetune_steps: {{steps}}
    finetune_lr: 0.03
    targets: {{{{include: ["model.layers.0.*"]}}}}
output: out
"""


def _layout(seed=0, n=40, k=24, d=4, e=8, z=2):
    from qtool.layouts.vq.layout import VQWeight

    g = torch.Generator().manual_seed(seed)
    # Ragged tiles (40 = 32 + 8 rows, 24 = 16 + 8 columns) and codes that leave some entries unused.
    codes = torch.randint(0, e - 2, (z, n, k // d), generator=g)
    books = torch.randn(2, 2, z, e, d, generator=g)
    return VQWeight.from_codes(codes, books, 32, 16, reindex=True)


def test_tunable_codebooks_are_the_layout_and_train_only_selected_entries():
    from qtool.quant.vq import TunableCodebooks

    layout = _layout()
    t = TunableCodebooks(layout, torch.device("cpu"))
    # Untrained, the view dequantizes bit for bit as the layout does, and stores the same codebooks.
    assert torch.equal(t(), layout.dequantize(torch.float32))
    assert torch.equal(t.layout().codebooks, layout.codebooks)

    g = torch.Generator().manual_seed(1)
    (t() * torch.randn(40, 24, generator=g)).sum().backward()
    grad = t.delta.grad
    counts = torch.zeros_like(grad[..., 0], dtype=torch.int64)
    rt, ct = layout.scope_of()
    codes = layout.codes()
    for r in range(layout.residuals):
        for n in range(layout.out_features):
            for j in range(codes.shape[2]):
                counts[rt[n], ct[j], r, codes[r, n, j]] += 1
    assert (counts == 0).any() and (counts > 0).any()
    assert torch.equal(grad.abs().sum(-1) > 0, counts > 0)

    # A moved entry: the weight and the stored codebooks (rounded to float16) follow; codes and tiers do not move.
    with torch.no_grad():
        t.delta.add_(torch.randn(t.delta.shape, generator=g))
    moved = t.layout()
    assert torch.equal(moved.codebooks, t.books().to(torch.float16))
    assert torch.equal(moved.indices, layout.indices) and torch.equal(moved.entry_tiers, layout.entry_tiers)
    assert torch.allclose(moved.dequantize(torch.float32), t(), rtol=0, atol=4e-3)


def test_finetuned_codebooks_bring_block_output_closer_and_checkpoint_matches(tmp_path):
    from qtool.checkpoint.loader import load_checkpoint

    run = finetune_pair(tmp_path, RECIPE)
    plain, tuned, tuned_recipe, windows = run.plain, run.tuned, run.tuned_recipe, run.windows
    err_plain, err_tuned = run.err_plain, run.err_tuned
    assert err_tuned < 0.9 * err_plain, (err_tuned, err_plain)

    assert plain.transforms == []
    [record] = tuned.transforms
    assert record["stage"] == "vq" and record["block"] == 0
    assert (
        record["finetune"]["kept"] and record["finetune"]["error_after"] < record["finetune"]["error_before"]
    )
    for name, a in plain.packed.items():
        b = tuned.packed[name]
        # Only the codebooks moved: the codes (and so the access counts, the order and the tiers) are as quantized.
        assert torch.equal(a.indices, b.indices) and torch.equal(a.entry_tiers, b.entry_tiers), name
        assert not torch.equal(a.codebooks, b.codebooks), name

    # The CLI (block onloading) tunes to the same float16 codebooks; the loader's checks accept them.
    res = run_cli(["quantize", tuned_recipe, "-o", tmp_path / "out", "--json"], cwd=tmp_path)
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "out" / "qtool-manifest.json").read_text())
    assert manifest["transforms"] == tuned.transforms
    loaded = load_checkpoint(tmp_path / "out")
    for name, b in tuned.packed.items():
        assert torch.equal(loaded.get_submodule(name).layout.codebooks, b.codebooks), name
    with torch.no_grad():
        assert torch.allclose(loaded(windows).logits, tuned.model(windows).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "text, words",
    [
        ("    finetune_steps: -1\n", ["stages[0].finetune_steps: found -1"]),
        ("    finetune_lr: 0\n", ["stages[0].finetune_lr: found 0"]),
        ("    finetune_samples: 0\n", ["stages[0].finetune_samples: found 0"]),
        ("    finetune_steps: many\n", ["stages[0].finetune_steps: found 'many'"]),
    ],
)
def test_bad_finetune_options(tmp_path, no_work, text, words):
    body = (
        RECIPE.format(steps=4).replace("    finetune_steps: 4\n", "").replace("    finetune_lr: 0.03\n", "")
    )
    r = write_recipe(
        tmp_path / "r.yaml", body.replace("    kmeans_iters: 4\n", "    kmeans_iters: 4\n" + text)
    )
    assert_one_line_error(
        run_cli(["quantize", r], cwd=tmp_path), 3, "r.yaml", *words, output=tmp_path / "out"
    )
