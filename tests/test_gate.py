"""The quality gate of `qtool eval --baseline` (qtool/gate.py): which metric fails and why, and the option errors
refused before any model loads. The gate end to end (exit 8) runs in tests/test_ci_example.py."""

from __future__ import annotations

import pytest

from bad_input import assert_one_line_error, run_cli
from conftest import STORIES, TINY_SAMPLE


def rows(ppl=(10.0, 10.4), acc=(0.70, 0.69), acc_norm=(0.72, 0.70)):
    return [
        {"task": "text", "metric": "perplexity", "a": ppl[0], "b": ppl[1]},
        {"task": "piqa", "metric": "acc", "a": acc[0], "b": acc[1]},
        {"task": "piqa", "metric": "acc_norm", "a": acc_norm[0], "b": acc_norm[1]},
        {"task": "lambada_openai", "metric": "perplexity", "a": 20.0, "b": 90.0},
    ]


def test_gate_names_each_failed_metric():
    from qtool.gate import Gate, describe_failure

    ok = Gate(max_ppl_increase=5.0, max_acc_drop=2.5).evaluate(rows())
    assert ok["passed"] and [c["metric"] for c in ok["checks"]] == ["perplexity", "acc", "acc_norm"]
    bad = Gate(max_ppl_increase=3.0, max_acc_drop=1.5).evaluate(rows())
    assert [(c["task"], c["metric"]) for c in bad["failed"]] == [("text", "perplexity"), ("piqa", "acc_norm")]
    line = describe_failure(bad)
    assert line == (
        "quality gate failed: text perplexity 10.0000 -> 10.4000 (+4.00%, limit +3%); "
        "piqa acc_norm 0.7200 -> 0.7000 (-2.00 points, limit -1.5)"
    )
    assert Gate(max_ppl_increase=0.0).evaluate(rows(ppl=(10.0, 9.9)))["passed"]  # better is never a failure


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--max-ppl-increase", "5%"], ["nothing to compare against", "--baseline"]),
        (["--baseline", STORIES, "--max-ppl-increase", "-5%"], ["--max-ppl-increase: found '-5%'"]),
        (
            ["--baseline", STORIES, "--max-acc-drop", "1.5"],
            ["--max-acc-drop: no task is measured", "--tasks"],
        ),
        (["--baseline", STORIES, STORIES], ["given with a second model"]),
    ],
)
def test_gate_options_are_checked_before_loading(monkeypatch, args, words):
    monkeypatch.setattr("qtool.evaluate.run_eval", lambda *a, **k: pytest.fail("evaluation started"))
    extra = [] if "--tasks" in words else ["--text", TINY_SAMPLE]
    res = run_cli(["eval", STORIES, *extra, *args])
    assert_one_line_error(res, 2, *words)
