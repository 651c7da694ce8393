"""Values that pass a type check but break later: NaN and infinite floats, integers past int64, seeds out of range,
codecs that are not text encodings, few-shot counts a task cannot draw, outlier counts a linear cannot hold, more
calibration windows than the text has, and YAML that expands without bound. Each is refused at the boundary in one
line naming the key or flag (exit 3 for a recipe key, 2 for a flag), before any model or text is read where the
value alone decides, and leaves nothing at the output.

Exit codes: 2 usage, 3 recipe."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bad_input import assert_one_line_error, run_cli
from conftest import FAST_RECIPE, STORIES, TINY_SAMPLE

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")

USAGE, RECIPE = 2, 3

GPTQ = FAST_RECIPE


def stage(text: str) -> str:
    """GPTQ's recipe with its stage list replaced by `text` (YAML, indented as the list items)."""
    return GPTQ.replace("  - stage: gptq\n    bits: 4\n    group_size: 32\n", text)


SMOOTH = "  - stage: smooth\n{opts}  - stage: gptq\n    bits: 4\n"
OUTLIERS = "  - stage: outliers\n{opts}"


# (recipe text, extra command-line arguments, exit code, words of the error line)
CASES = {
    "damp-nan": (
        GPTQ.replace("group_size: 32", "group_size: 32\n    damp: .nan"),
        [],
        RECIPE,
        ["stages[0].damp", "found nan", "finite"],
    ),
    "damp-inf": (
        GPTQ.replace("group_size: 32", "group_size: 32\n    damp: .inf"),
        [],
        RECIPE,
        ["stages[0].damp", "found inf"],
    ),
    "damp-minus-inf": (
        GPTQ.replace("group_size: 32", "group_size: 32\n    damp: -.inf"),
        [],
        RECIPE,
        ["stages[0].damp", "found -inf"],
    ),
    "clip-ratio-nan": (
        GPTQ.replace("stage: gptq", "stage: rtn\n    clip: true\n    clip_min_ratio: .nan"),
        [],
        RECIPE,
        ["stages[0].clip_min_ratio", "found nan"],
    ),
    "smooth-alpha-nan": (
        stage(SMOOTH.format(opts="    alpha: .nan\n")),
        [],
        RECIPE,
        ["stages[0].alpha", "found nan"],
    ),
    "smooth-alpha-grid-nan": (
        stage(SMOOTH.format(opts="    alpha_grid: [0.1, .nan]\n")),
        [],
        RECIPE,
        ["stages[0].alpha_grid", "nan"],
    ),
    "outliers-nan": (
        stage(OUTLIERS.format(opts="    outliers: .nan\n")),
        [],
        RECIPE,
        ["stages[0].outliers", "found nan"],
    ),
    "outlier-multiplier-nan": (
        stage(OUTLIERS.format(opts="    overrides: [{pattern: '*.down_proj', outlier_multiplier: .nan}]\n")),
        [],
        RECIPE,
        ["stages[0].overrides[0].outlier_multiplier", "found nan"],
    ),
    "outlier-threshold-inf": (
        stage(OUTLIERS.format(opts="    threshold: .inf\n")),
        [],
        RECIPE,
        ["stages[0].threshold", "found inf"],
    ),
    "seed-above-2-63": (
        GPTQ.replace("seq_len: 32", "seq_len: 32\n  seed: 9223372036854775808"),
        [],
        RECIPE,
        ["calibration.seed", "9223372036854775808"],
    ),
    "seed-negative": (
        GPTQ.replace("seq_len: 32", "seq_len: 32\n  seed: -1"),
        [],
        RECIPE,
        ["calibration.seed", "found -1"],
    ),
    "seed-flag-huge": (
        GPTQ,
        ["--seed", "99999999999999999999"],
        USAGE,
        ["--seed", "99999999999999999999", "expected an integer in 0.."],
    ),
    "seed-flag-negative": (GPTQ, ["--seed", "-1"], USAGE, ["--seed: found -1"]),
    "rotate-seed-huge": (
        stage("  - stage: rotate\n    seed: 18446744073709551616\n  - stage: gptq\n"),
        [],
        RECIPE,
        ["stages[0].seed", "18446744073709551616"],
    ),
    "vq-seed-negative": (
        stage("  - stage: vq\n    preset: gptvq-2\n    seed: -3\n"),
        [],
        RECIPE,
        ["stages[0].seed", "found -3"],
    ),
    "num-samples-flag-zero": (
        GPTQ,
        ["--num-samples", "0"],
        USAGE,
        ["--num-samples: found 0", "expected an integer in 1..100000"],
    ),
    "seq-len-flag-tiny": (GPTQ, ["--seq-len", "2"], USAGE, ["--seq-len: found 2"]),
    "max-windows-flag-zero": (
        GPTQ + f"eval: {{text: {TINY_SAMPLE}, seq_len: 32}}\n",
        ["--max-windows", "0"],
        USAGE,
        ["--max-windows: found 0"],
    ),
    "max-windows-past-int64": (
        GPTQ + f"eval: {{text: {TINY_SAMPLE}, seq_len: 32, max_windows: 100000000000000000000}}\n",
        [],
        RECIPE,
        ["eval.max_windows", "below 2^63"],
    ),
    "num-samples-past-int64": (
        GPTQ.replace("num_samples: 2", "num_samples: 1000000000000000000000"),
        [],
        RECIPE,
        ["calibration.num_samples", "1..100000"],
    ),
    "encoding-rot13": (
        GPTQ.replace("seq_len: 32", "seq_len: 32\n  encoding: rot13"),
        [],
        RECIPE,
        ["calibration.encoding", "'rot13'", "text encoding"],
    ),
    "encoding-base64": (
        GPTQ.replace("seq_len: 32", "seq_len: 32\n  encoding: base64"),
        [],
        RECIPE,
        ["calibration.encoding", "'base64'"],
    ),
    "eval-encoding-zlib": (
        GPTQ + f"eval: {{text: {TINY_SAMPLE}, seq_len: 32, encoding: zlib}}\n",
        [],
        RECIPE,
        ["eval.encoding", "'zlib'"],
    ),
    "outliers-beyond-in-features": (
        stage(OUTLIERS.format(opts="    outliers: 1000\n")),
        [],
        RECIPE,
        ["stages[0].outliers", "1000 outlier columns", "model.layers.0.self_attn.q_proj", "64 inputs"],
    ),
    "outliers-equal-to-in-features": (
        stage(OUTLIERS.format(opts="    outliers: 64\n    targets: {include: ['*.q_proj']}\n")),
        [],
        RECIPE,
        ["stages[0].outliers", "64 outlier columns", "64 inputs"],
    ),
    "outlier-rule-beyond-in-features": (
        stage(
            OUTLIERS.format(
                opts="    outliers: 8\n    overrides: [{pattern: '*.down_proj', outliers: 172}]\n"
            )
        ),
        [],
        RECIPE,
        ["stages[0].overrides[0].outliers", "model.layers.0.mlp.down_proj", "172 inputs"],
    ),
    "outlier-multiplier-beyond-in-features": (
        stage(
            OUTLIERS.format(
                opts="    outliers: 0.5\n    overrides: [{pattern: '*.down_proj', outlier_multiplier: 2.0}]\n"
            )
        ),
        [],
        RECIPE,
        ["stages[0].overrides[0].outlier_multiplier", "172 outlier columns"],
    ),
    "windows-beyond-the-text-flag": (
        GPTQ,
        ["--num-samples", "5000"],
        USAGE,
        ["--num-samples: found 5000 windows of 32", "1882 tokens", "1850 distinct windows"],
    ),
    "windows-beyond-the-text-recipe": (
        GPTQ.replace("num_samples: 2", "num_samples: 1851"),
        [],
        RECIPE,
        ["calibration.num_samples: found 1851", "expected at most 1850"],
    ),
    "yaml-recursive-alias": ("model: &a [*a]\n", [], RECIPE, ["aliases refer to themselves"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_value_is_refused_in_one_line(tmp_path, no_work, name):
    text, args, code, words = CASES[name]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    res = run_cli(["quantize", recipe, *args, "-q"])
    assert_one_line_error(res, code, *words, output=tmp_path / "out")


def test_windows_at_the_limit_are_accepted(tmp_path):
    """The last count the refusal above allows runs (a dry run: the windows are sampled, nothing is written)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(GPTQ)
    res = run_cli(["quantize", recipe, "--num-samples", "1850", "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "out").exists()


def alias_bomb(depth: int, top: str) -> str:
    """A few hundred bytes whose aliases expand to 9^depth strings, under `top`."""
    lines = [
        "model: x",
        "stages:",
        "  - stage: gptq",
        "    a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]",
    ]
    for i in range(1, depth):
        lines.append(f"    a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    lines.append(f"    {top}: *a{depth - 1}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("depth", [6, 12])
def test_yaml_alias_bomb_is_refused_at_once(tmp_path, no_work, depth):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(alias_bomb(depth, "bits"))
    assert len(recipe.read_bytes()) < 1500
    t = time.perf_counter()
    res = run_cli(["quantize", recipe, "-q"])
    assert time.perf_counter() - t < 10
    assert_one_line_error(
        res, RECIPE, "r.yaml", "aliases expand to more than 100000 nodes", output=tmp_path / "out"
    )


def test_large_value_below_the_node_limit_is_quoted_short(tmp_path, no_work):
    """A value of 9^4 strings (within the limit) is refused as a bad `bits`, quoted in a few dozen characters."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(alias_bomb(4, "bits").replace("model: x", f"model: {STORIES}"))
    res = run_cli(["quantize", recipe, "-q"])
    line = assert_one_line_error(res, RECIPE, "stages[0].a0", "unknown option", output=tmp_path / "out")
    assert len(line) < 400, line
    recipe.write_text(
        GPTQ.replace("bits: 4", "bits: &b [[lol, lol, lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]]")
    )
    line = assert_one_line_error(run_cli(["quantize", recipe, "-q"]), RECIPE, "stages[0].bits", "...")
    assert len(line) < 400, line


def test_recipe_file_too_large_is_refused_before_reading(tmp_path, no_work):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(GPTQ + "#" * (1 << 20))
    assert_one_line_error(
        run_cli(["quantize", recipe, "-q"]), RECIPE, "r.yaml", "bytes, expected a recipe of at most 1048576"
    )


# ---- qtool eval's task values ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_item_task(tmp_path_factory) -> Path:
    """A task folder: piqa's prompt over its first three items."""
    from conftest import ASSETS

    folder = tmp_path_factory.mktemp("tasks")
    rows = (ASSETS / "data" / "zeroshot" / "piqa.jsonl").read_text().splitlines()[:3]
    (folder / "three.jsonl").write_text("\n".join(rows) + "\n")
    (folder / "three.yaml").write_text(
        f"task: three\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'three.jsonl'}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{query}}Answer:'\n"
        "doc_to_target: gold\ndoc_to_choice: choices\nmetric_list:\n  - metric: acc\n"
    )
    return folder


@pytest.mark.parametrize(
    "args, words",
    [
        (["--fewshot-seed", "-5"], ["--fewshot-seed: found -5", "0..4294967295"]),
        (["--fewshot-seed", "4294967296"], ["--fewshot-seed: found 4294967296"]),
        (["--num-fewshot", "3"], ["--num-fewshot: found 3", "task three has 3 items", "expected at most 2"]),
        (["--num-fewshot", "100000"], ["--num-fewshot: found 100000"]),
        (["--limit", "0"], ["--limit: found 0"]),
    ],
)
def test_bad_task_values(three_item_task, args, words):
    res = run_cli(
        [
            "eval",
            STORIES,
            "--tasks",
            "three",
            "--include-path",
            three_item_task,
            "--device",
            "cpu",
            *args,
            "-q",
        ]
    )
    assert_one_line_error(res, USAGE, *words)


def test_eval_encoding_that_is_not_a_text_codec():
    res = run_cli(["eval", STORIES, "--text", TINY_SAMPLE, "--seq-len", "32", "--encoding", "rot13", "-q"])
    assert_one_line_error(res, USAGE, "--encoding: found 'rot13'", "text encoding")


def test_error_line_has_a_bounded_length(tmp_path, no_work):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(GPTQ)
    res = run_cli(["quantize", recipe, "--model", "./" + "m" * 200 + "/x" * 1500, "-q"])
    line = assert_one_line_error(res, 4, "--model", "more characters)", output=tmp_path / "out")
    assert len(line) < 2100, len(line)
