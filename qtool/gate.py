"""The quality gate of `qtool eval MODEL --baseline ORIGINAL`: limits on how much worse the quantized model may be
than its baseline, checked on the same protocol in the same run. A CI pipeline stops on the gate's own exit code
(EXIT_GATE in qtool/errors.py), told apart from a run that could not measure at all."""

from __future__ import annotations

import re
from dataclasses import dataclass

from qtool.errors import UsageError

# lm-eval metrics where higher is better and values are fractions (0..1): the ones an accuracy drop is read on.
ACCURACY_METRICS = ("acc", "acc_norm")

_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%?\s*$")


def parse_percent(text: str | None, flag: str) -> float | None:
    """`5%` or `5` → 5.0; refuses negatives and anything else, naming the flag."""
    if text is None:
        return None
    m = _PERCENT.match(str(text))
    if not m:
        raise UsageError(f"{flag}: found {text!r}, expected a non-negative percentage such as 5% or 1.5")
    return float(m.group(1))


@dataclass(frozen=True)
class Gate:
    max_ppl_increase: float | None = None  # percent of the baseline's perplexity
    max_acc_drop: float | None = (
        None  # percentage points of accuracy, on every acc / acc_norm both models have
    )

    @property
    def active(self) -> bool:
        return self.max_ppl_increase is not None or self.max_acc_drop is not None

    def check_measurable(self, text: str | None, tasks: str | None) -> None:
        """Refuse a limit on something this run does not measure (before any model loads)."""
        if self.max_ppl_increase is not None and not text:
            raise UsageError("--max-ppl-increase: perplexity is not measured; expected --text FILE")
        if self.max_acc_drop is not None and not tasks:
            raise UsageError("--max-acc-drop: no task is measured; expected --tasks LIST")

    def evaluate(self, comparison: list[dict]) -> dict:
        """{"passed", "checks": [...], "failed": [...]} from `evaluate.compare`'s rows (a = baseline, b = model)."""
        checks = []
        for r in comparison:
            if r["metric"] == "perplexity" and r["task"] == "text" and self.max_ppl_increase is not None:
                change = 100.0 * (r["b"] - r["a"]) / r["a"]
                checks.append(
                    {
                        "task": r["task"],
                        "metric": "perplexity",
                        "baseline": r["a"],
                        "value": r["b"],
                        "change": round(change, 4),
                        "unit": "%",
                        "limit": self.max_ppl_increase,
                        "passed": change <= self.max_ppl_increase,
                    }
                )
            elif r["metric"] in ACCURACY_METRICS and self.max_acc_drop is not None:
                drop = 100.0 * (r["a"] - r["b"])
                checks.append(
                    {
                        "task": r["task"],
                        "metric": r["metric"],
                        "baseline": r["a"],
                        "value": r["b"],
                        "change": round(-drop, 4),
                        "unit": "points",
                        "limit": self.max_acc_drop,
                        "passed": drop <= self.max_acc_drop,
                    }
                )
        failed = [c for c in checks if not c["passed"]]
        return {
            "passed": not failed,
            "checks": checks,
            "failed": failed,
            "limits": {
                "max_ppl_increase_percent": self.max_ppl_increase,
                "max_acc_drop_points": self.max_acc_drop,
            },
        }


def describe_failure(result: dict) -> str:
    """One line naming every metric that failed, with its baseline, its value and the limit."""
    parts = []
    for c in result["failed"]:
        what = "text perplexity" if c["metric"] == "perplexity" else f"{c['task']} {c['metric']}"
        if c["unit"] == "%":
            parts.append(
                f"{what} {c['baseline']:.4f} -> {c['value']:.4f} ({c['change']:+.2f}%, limit "
                f"+{c['limit']:g}%)"
            )
        else:
            parts.append(
                f"{what} {c['baseline']:.4f} -> {c['value']:.4f} ({c['change']:+.2f} points, limit "
                f"-{c['limit']:g})"
            )
    return "quality gate failed: " + "; ".join(parts)
