"""Zero-shot accuracy through lm-evaluation-harness: bad input, the manifest record of `quantize` with an `eval.tasks`
section, the two-model table, the reference-path cache, lm-eval's log-likelihood against `qtool eval --text`, and
SmolLM2 on the first PIQA items (the real-model check: a broken scorer lands near chance)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import ASSETS, STORIES, TINY_SAMPLE, write_recipe

ZEROSHOT = ASSETS / "data" / "zeroshot"


def _fail(res, code: int) -> str:
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qtool: error: "), res.stderr
    return lines[0]


def _data_dir(tmp_path: Path, piqa_lines: list[str]) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    (d / "piqa.jsonl").write_text("".join(piqa_lines))
    return d


def _piqa_lines(n: int) -> list[str]:
    with open(ZEROSHOT / "piqa.jsonl") as f:
        return [next(f) for _ in range(n)]


def test_unknown_task_lists_the_available_ones(cli):
    line = _fail(cli("eval", STORIES, "--tasks", "piqa,no_such_task", "--device", "cpu"), code=2)
    assert "'no_such_task'" in line
    for name in ("piqa", "arc_easy", "arc_challenge", "winogrande", "hellaswag", "lambada_openai"):
        assert name in line


def test_missing_data_file_is_named(cli, tmp_path):
    line = _fail(
        cli("eval", STORIES, "--tasks", "arc_easy", "--data-dir", tmp_path, "--device", "cpu"), code=4
    )
    assert str(tmp_path / "arc_easy.jsonl") in line and "not found" in line


def test_malformed_jsonl_line_names_file_and_line(cli, tmp_path):
    d = _data_dir(tmp_path, [*_piqa_lines(3), '{"query": "Question: x\\n", "choices": ["a", "b"]\n'])
    line = _fail(cli("eval", STORIES, "--tasks", "piqa", "--data-dir", d, "--device", "cpu"), code=4)
    assert f"{d / 'piqa.jsonl'}:4:" in line and "malformed JSON" in line
    (d / "piqa.jsonl").write_text("".join([*_piqa_lines(2), '{"query": "Question: x\\n", "gold": 0}\n']))
    line = _fail(cli("eval", STORIES, "--tasks", "piqa", "--data-dir", d, "--device", "cpu"), code=4)
    assert f"{d / 'piqa.jsonl'}:3:" in line and "expected keys query, choices, gold" in line


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--tasks", "piqa", "--limit", "0"], "--limit: found 0"),
        (["--tasks", "piqa", "--limit", "-3"], "--limit: found -3"),
        (["--tasks", "piqa", "--batch-size", "many"], "--batch-size: found 'many'"),
        ([], "expected --text FILE (perplexity) and/or --tasks LIST"),
    ],
)
def test_bad_options(cli, args, expected):
    assert expected in _fail(cli("eval", STORIES, "--device", "cpu", *args), code=2)


def test_task_yaml_rejected_by_lm_eval_is_one_line(cli, tmp_path):
    data = _data_dir(tmp_path, _piqa_lines(4)) / "piqa.jsonl"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "bad.yaml").write_text(
        f"task: my_bad\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {data}}}}}\n"
        "output_type: ranking\ntest_split: test\ndoc_to_text: q\n"
    )
    line = _fail(
        cli("eval", STORIES, "--tasks", "my_bad", "--include-path", tasks, "--device", "cpu"), code=4
    )
    assert "lm-eval cannot load my_bad" in line and "output_type 'ranking'" in line


def test_recipe_eval_needs_text_or_tasks(cli, tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        f"model: {STORIES}\nstages: [{{stage: rtn, bits: 4}}]\n"
        f"eval: {{limit: 5}}\noutput: {tmp_path / 'out'}\n",
    )
    line = _fail(cli("quantize", recipe), code=3)
    assert "eval.text: missing" in line and "tasks" in line
    recipe.write_text(recipe.read_text().replace("{limit: 5}", "{tasks: piqa}"))
    assert "eval.tasks: found 'piqa', expected a list of" in _fail(cli("quantize", recipe), code=3)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """stories260K, RTN W4 g32, quantized with an `eval:` section of two tasks (8 items each) and a text."""
    from click.testing import CliRunner

    from qtool.cli import cli

    tmp = tmp_path_factory.mktemp("zs")
    recipe = write_recipe(
        tmp / "r.yaml",
        f"model: {STORIES}\nstages: [{{stage: rtn, bits: 4, group_size: 32}}]\n"
        f"eval:\n  tasks: [piqa, lambada_openai]\n  limit: 8\n"
        f"  text: {TINY_SAMPLE}\n  seq_len: 128\n"
        f"output: {tmp / 'ckpt'}\n",
    )
    res = CliRunner().invoke(cli, ["quantize", str(recipe), "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return tmp / "ckpt", json.loads(res.stdout)


def test_quantize_records_both_models_accuracy(quantized):
    ckpt, summary = quantized
    from qtool.checkpoint.manifest import portable

    ev = json.loads((ckpt / "qtool-manifest.json").read_text())["eval"]
    # The manifest names the data files; the run's report has their paths.
    assert ev == json.loads(json.dumps(portable(summary["eval"])))
    assert summary["eval"]["tasks_protocol"]["data"]["piqa"]["file"] == str(ZEROSHOT / "piqa.jsonl")
    for model in ("original", "quantized"):
        assert ev[model]["perplexity"] > 1
        assert set(ev[model]["tasks"]) == {"piqa", "lambada_openai"}
        assert set(ev[model]["tasks"]["piqa"]) == {"acc", "acc_norm"}
        assert set(ev[model]["tasks"]["lambada_openai"]) == {"acc", "perplexity"}
        for metric in ("acc", "acc_norm"):
            v = ev[model]["tasks"]["piqa"][metric]
            # 8 items: accuracy is a multiple of 1/8 with the binomial stderr lm-eval reports.
            assert v["value"] * 8 == pytest.approx(round(v["value"] * 8))
            assert v["stderr"] == pytest.approx((v["value"] * (1 - v["value"]) / 7) ** 0.5)
    p = ev["tasks_protocol"]
    assert (p["limit"], p["num_fewshot"], p["runtime"], p["device"]) == (8, 0, "torch reference", "cpu")
    assert p["task_versions"] == {"piqa": 1.0, "lambada_openai": 1.0} and p["lm_eval_version"]
    assert p["data"]["piqa"]["file"] == "piqa.jsonl"


def test_two_models_one_table(cli, quantized, tmp_path):
    ckpt, _ = quantized
    tasks = tmp_path / "tasks"  # a user's task over local data, beside a standard one
    tasks.mkdir()
    data = _data_dir(tmp_path, _piqa_lines(6)) / "piqa.jsonl"
    (tasks / "mine.yaml").write_text(
        f"task: my_piqa\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {data}}}}}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{query}}Answer:'\n"
        "doc_to_target: gold\ndoc_to_choice: choices\nmetric_list: [{metric: acc}]\n"
    )
    res = cli(
        "eval",
        STORIES,
        ckpt,
        "--tasks",
        "my_piqa,piqa",
        "--limit",
        "6",
        "--include-path",
        tasks,
        "--device",
        "cpu",
        "--json",
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    a, b = out["models"]
    assert (a["kind"], b["kind"]) == ("original", "qtool checkpoint")
    assert b["zeroshot"]["protocol"]["runtime"] == "torch reference"
    assert a["zeroshot"]["protocol"]["runtime"] == "float (no packed layers)"
    rows = {(r["task"], r["metric"]): r for r in out["comparison"]}
    assert set(rows) == {("my_piqa", "acc"), ("piqa", "acc"), ("piqa", "acc_norm")}
    for (task, metric), r in rows.items():
        assert r["a"] == a["zeroshot"]["results"][task][f"{metric},none"]
        assert r["delta"] == pytest.approx(r["b"] - r["a"])
    # The user's task has the standard prompt on the same items: the same scores.
    assert rows[("my_piqa", "acc")]["a"] == rows[("piqa", "acc")]["a"]
    assert rows[("my_piqa", "acc")]["b"] == rows[("piqa", "acc")]["b"]
    table = cli("eval", STORIES, ckpt, "--tasks", "piqa", "--limit", "6", "--device", "cpu", "-q")
    assert table.exit_code == 0 and "B - A" in table.stdout and "acc_norm" in table.stdout


def test_reference_cache_keeps_results_and_is_dropped(quantized):
    from qtool.checkpoint.loader import load_checkpoint
    from qtool.layouts.module import PackedLinear, reference_cache

    model = load_checkpoint(quantized[0])
    x = torch.randint(0, 512, (2, 40))
    with torch.no_grad():
        plain = model(x).logits
        with reference_cache(model) as n:
            cached = [model(x).logits for _ in range(2)]
            filled = [m for m in model.modules() if isinstance(m, PackedLinear) and m._scoped]
    assert n == 35 and len(filled) == 35
    assert all(torch.equal(plain, c) for c in cached)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert all(not m._keep_scoped and not any(k[0] == "dense" for k in m._derived) for m in packed)


def test_lm_eval_loglikelihood_equals_perplexity_nll(cli, quantized, tmp_path):
    """The wrapper scores a text's tokens exactly as `qtool eval --text` does (same tokens, same NLL)."""
    from lm_eval.api.instance import Instance

    from qtool.checkpoint.loader import load_checkpoint, load_tokenizer
    from qtool.eval.zeroshot import wrap_model

    ckpt = quantized[0]
    doc = TINY_SAMPLE.read_text().split("<|endoftext|>")[0].strip()
    (tmp_path / "doc.txt").write_text(doc)
    tok = load_tokenizer(ckpt)
    ids = tok(doc).input_ids  # BOS + the story, as `--separator` tokenizes each document
    lm = wrap_model(load_checkpoint(ckpt), tok, batch_size=1)
    assert [lm.prefix_token_id, *lm.tok_encode(doc, add_special_tokens=False)] == ids
    # An empty context is lm-eval's "score the continuation after the prefix token (BOS)": the task path.
    ((ll, _),) = lm.loglikelihood([Instance("loglikelihood", {}, ("", doc), 0)])
    res = cli(
        "eval",
        ckpt,
        "--text",
        tmp_path / "doc.txt",
        "--separator",
        "<|endoftext|>",
        "--seq-len",
        len(ids),
        "--device",
        "cpu",
        "--json",
    )
    assert res.exit_code == 0, res.output
    ppl = json.loads(res.stdout)
    assert ppl["scored_tokens"] == len(ids) - 1
    assert -ll == pytest.approx(ppl["nll"] * ppl["scored_tokens"], rel=1e-5)


@pytest.mark.slow
def test_smollm2_piqa_above_chance(cli, smollm2, tmp_path):
    """SmolLM2-135M scores 0.645 on the first 200 PIQA items (MANIFEST.md); on the first 40 it must be clearly above
    the 0.5 of a scorer that does not read the model."""
    shutil.copy(ZEROSHOT / "piqa.jsonl", tmp_path / "piqa.jsonl")
    res = cli(
        "eval",
        smollm2,
        "--tasks",
        "piqa",
        "--limit",
        "40",
        "--data-dir",
        tmp_path,
        "--device",
        "cpu",
        "--json",
    )
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)["zeroshot"]["results"]["piqa"]
    assert r["acc,none"] >= 0.6 and r["acc_norm,none"] >= 0.6
