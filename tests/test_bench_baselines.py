"""The baselines the bench reports compare against, on the CPU: each `--throughput` row names the attention it
runs, and every format's throughput is given over the better of the two FP8 rows (FP8 cache through qtool's
kernel, FP16 cache through torch SDPA), at its best batch and at each batch, computed from synthetic runs whose
ratios are known; `e2e` and `attention` tables name the attention their rows run."""

from __future__ import annotations

import re

import pytest

from qtool.bench import attention as ab
from qtool.bench import e2e
from qtool.bench import throughput as tp
from tests.test_bench_plot import _attention_report, _e2e_report
from tests.test_bench_plot import throughput_run as _run

KV4 = "qtool KV4 kernel (tensor cores)"
FP8_KERNEL = "qtool FP8-cache kernel (CUDA cores)"
# fp8-sdpa is the better FP8 row at batch 16, fp8 (twice the sequences in its cache) at 64 and at its best; no FP8
# row fits at 256
RUNS = {
    "fp16": _run({16: 1000.0, 64: None, 256: None}, tp.SDPA_ATTENTION),
    "fp8": _run({16: 1200.0, 64: 2400.0, 256: None}, FP8_KERNEL),
    "fp8-sdpa": _run({16: 1500.0, 64: 2000.0, 256: None}, tp.SDPA_ATTENTION),
    "w4a8kv4": _run({16: 3000.0, 64: 6000.0, 256: 9000.0}, KV4),
}


def _report(runs: dict) -> dict:
    return {
        "schema": tp.THROUGHPUT_SCHEMA,
        "model": "tiny",
        "prompt_tokens": 1024,
        "new_tokens": 512,
        "device": "FakeGPU",
        "runs": runs,
        **tp.ratios(runs),
    }


def test_ratios_over_the_better_fp8_row_at_best_and_at_each_batch():
    r = tp.ratios(RUNS)
    assert r["best"]["w4a8kv4"] == {"batch": 256, "tokens_per_s": 9000.0}
    assert r["best_fp8"] == {"variant": "fp8", "batch": 64, "tokens_per_s": 2400.0}
    assert r["speedup_vs_best_fp8_at_best"] == pytest.approx(
        {"fp16": 1000 / 2400, "fp8": 1.0, "fp8-sdpa": 2000 / 2400, "w4a8kv4": 9000 / 2400}
    )
    assert r["speedup_vs_fp16_at_best"]["w4a8kv4"] == pytest.approx(9.0)
    assert r["best_fp8_at_batch"] == {
        "16": {"variant": "fp8-sdpa", "tokens_per_s": 1500.0},
        "64": {"variant": "fp8", "tokens_per_s": 2400.0},
    }
    # where the format or both FP8 rows do not fit there is no ratio
    assert r["speedup_vs_best_fp8_at_batch"] == {
        "fp16": pytest.approx({"16": 1000 / 1500}),
        "fp8": pytest.approx({"16": 1200 / 1500, "64": 1.0}),
        "fp8-sdpa": pytest.approx({"16": 1.0, "64": 2000 / 2400}),
        "w4a8kv4": pytest.approx({"16": 2.0, "64": 2.5}),
    }


@pytest.mark.parametrize("fp8", ["fp8", "fp8-sdpa"])
def test_one_fp8_row_is_the_reference_by_itself(fp8):
    other = "fp8-sdpa" if fp8 == "fp8" else "fp8"
    runs = {v: run for v, run in RUNS.items() if v != other}
    r = tp.ratios(runs)
    assert r["best_fp8"]["variant"] == fp8
    assert {e["variant"] for e in r["best_fp8_at_batch"].values()} == {fp8}
    want = 6000.0 / RUNS[fp8]["decode"]["64"]["tokens_per_s"]
    assert r["speedup_vs_best_fp8_at_batch"]["w4a8kv4"]["64"] == pytest.approx(want)


def test_no_fp8_row_no_fp8_ratios():
    r = tp.ratios({v: RUNS[v] for v in ("fp16", "w4a8kv4")})
    assert not {k for k in r if "fp8" in k}
    text = tp.format_throughput(_report({v: RUNS[v] for v in ("fp16", "w4a8kv4")}))
    assert "vs best FP8" not in text and "better of fp8" not in text
    assert re.search(
        r"^ *w4a8kv4 +qtool KV4 kernel \(tensor cores\) +3000 +6000 +9000\* +256 +9000 +9\.00x +1\.00",
        text,
        re.M,
    )


def test_throughput_table_names_each_rows_attention_and_the_fp8_ratios():
    text = tp.format_throughput(_report(RUNS))
    rows = {
        "fp16": r"torch SDPA \(FP16 cache\) +1000\* +- +- +16 +1000 +1\.00x +0\.42x",
        "fp8": r"qtool FP8-cache kernel \(CUDA cores\) +1200 +2400\* +- +64 +2400 +2\.40x +1\.00x",
        "fp8-sdpa": r"torch SDPA \(FP16 cache\) +1500 +2000\* +- +64 +2000 +2\.00x +0\.83x",
        "w4a8kv4": r"qtool KV4 kernel \(tensor cores\) +3000 +6000 +9000\* +256 +9000 +9\.00x +3\.75x",
    }
    for v, cells in rows.items():
        assert re.search(rf"^ *{v} +{cells} +1\.00$", text, re.M), (v, text)
    assert "vs best FP8: best tok/s over the better FP8 row's, fp8 at batch 64 (2400 tok/s)" in text
    # the per-batch table: batches where an FP8 row fits, the better row named under each
    assert re.search(r"^ *format +b16 +b64$", text, re.M), text
    assert re.search(r"^ *w4a8kv4 +2\.00x +2\.50x$", text, re.M), text
    assert re.search(r"^ *fp16 +0\.67x +-$", text, re.M), text
    assert re.search(r"^ *\(better FP8 row\) +fp8-sdpa +fp8$", text, re.M), text


def test_report_without_recorded_attention_says_so():
    old = {v: {k: x for k, x in run.items() if k != "attention"} for v, run in RUNS.items()}
    assert "not recorded" in tp.format_throughput(_report(old))


@pytest.mark.parametrize(
    "variant, heads, kv_heads, head_dim, name",
    [
        ("fp16", 32, 8, 128, tp.SDPA_ATTENTION),
        ("fp8-sdpa", 32, 8, 128, tp.SDPA_ATTENTION),
        ("w4a16", 32, 32, 128, tp.SDPA_ATTENTION),
        ("fp8", 32, 8, 128, "qtool FP8-cache kernel (CUDA cores)"),
        ("w4a8kv4", 32, 8, 128, "qtool KV4 kernel (tensor cores)"),
        ("w4a8kv4", 32, 32, 128, "qtool KV4 kernel (tensor cores)"),
        ("w4a8kv4", 32, 32, 96, "qtool KV4 kernel (CUDA cores)"),
        ("w4a8cq2", 32, 8, 128, "qtool CQ-2 kernel"),
    ],
)
def test_attention_names(variant, heads, kv_heads, head_dim, name):
    assert tp.attention_name(variant, heads, kv_heads, head_dim) == name


def test_both_fp8_rows_are_default_variants():
    import qtool.bench.command as command

    opt = next(p for p in command.bench.commands["e2e"].params if p.name == "variants")
    assert {"fp8", "fp8-sdpa"} <= set(opt.default.split(","))
    assert set(opt.default.split(",")) <= set(tp.VARIANTS)
    assert tp.KV_MODE["fp8-sdpa"] == "fp16" and tp.KV_MODE["fp8"] == "fp8"


def test_e2e_table_names_the_attention_of_every_row_and_the_decode_span():
    text = e2e.format_e2e(_e2e_report(True))
    assert "random weights; attention in every row: torch SDPA (FP16 cache)" in text
    assert "decode steps at position 64 of the static cache: attention over the 65 positions up to it" in text
    old = {k: v for k, v in _e2e_report(True).items() if k not in ("attention", "decode_span")}
    text = e2e.format_e2e(old)
    assert "attention in every row: not recorded" in text and "decode steps at" not in text


def test_attention_table_names_each_rows_attention():
    r = _attention_report()
    names = (
        "fp16-sdpa = torch SDPA (flash), FP16 cache; fp8 = qtool FP8-cache kernel (CUDA cores); int4 = qtool"
    )
    # from the heads of a report that did not record the names (H 4 on KVH 2: KV4 on the tensor cores) ...
    assert f"attention: {names} KV4 kernel (tensor cores)" in ab.format_attention(r)
    assert "speedup over torch SDPA (flash) on an FP16 cache" in ab.format_attention(r)
    # ... and as recorded (head dim 96: KV4 on the CUDA cores)
    r["attention"] = ab.attention_names(["fp16-sdpa", "fp8", "int4"], 32, 32, 96, "flash")
    assert f"attention: {names} KV4 kernel (CUDA cores)" in ab.format_attention(r)
    assert ab.attention_names(["cq2", "cq4", "cq2-lut", "int4-fma", "int8"], 32, 8, 128, "flash") == {
        "cq2": "qtool CQ-2 kernel (dispatched form)",
        "cq4": "qtool CQ-4 kernel (dispatched form)",
        "cq2-lut": "qtool CQ-2 kernel (lut form)",
        "int4-fma": "qtool KV4 kernel (CUDA cores)",
        "int8": "qtool INT8-cache kernel (CUDA cores)",
    }
    assert "fp16" not in ab.ROWS
