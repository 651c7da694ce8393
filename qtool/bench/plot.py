"""The PNG every `qtool bench` subcommand writes with `--plot PATH`: ratios to one reference (cuBLAS FP16 for the
matmul benches), one panel per shape or per measured quantity, ours as solid lines or bars and the peers (cuBLAS
INT8/FP8, torchao int4) dashed or hatched. Each subcommand's module turns its report into a `Figure`; this module
alone draws and writes it."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from qtool.bench.stats import BenchError


@dataclass
class Panel:
    title: str
    x: list  # numbers (kind "line", log2 axis) or category labels (kind "bar")
    series: dict[str, list[float | None]]  # name -> one ratio per x; None where it was not measured
    kind: str = "line"
    xlabel: str = ""
    peers: tuple[str, ...] = ()  # series drawn as references, not as ours
    # a panel over another reference than the figure's: what its line at 1.0 is, and its y label
    reference: str = ""
    ylabel: str = ""


@dataclass
class Figure:
    title: str
    ylabel: str
    reference: str  # what the line at 1.0 is
    panels: list[Panel] = field(default_factory=list)


def _value(v: float | None) -> float:
    return math.nan if v is None else float(v)


def _draw(ax, p: Panel, reference: str) -> None:
    if p.kind == "bar":
        names = list(p.series)
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(p.x))]
            ax.bar(
                xs,
                [_value(v) for v in p.series[name]],
                width,
                label=name,
                hatch="//" if name in p.peers else None,
                alpha=0.6 if name in p.peers else 1.0,
            )
        ax.set_xticks(range(len(p.x)))
        ax.set_xticklabels([str(x) for x in p.x], fontsize=7, rotation=30 if len(p.x) > 4 else 0)
    else:
        for name, ys in p.series.items():
            ax.plot(
                p.x,
                [_value(v) for v in ys],
                label=name,
                marker="o",
                markersize=3,
                linestyle="--" if name in p.peers else "-",
                linewidth=1.0 if name in p.peers else 1.6,
            )
        if p.x and all(isinstance(x, (int, float)) and x > 0 for x in p.x):
            ax.set_xscale("log", base=2)
            ax.set_xticks(p.x)
            ax.set_xticklabels([str(x) for x in p.x], fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8, label=f"{p.reference or reference} (1.0)")
    ax.set_title(p.title, fontsize=9)
    if p.xlabel:
        ax.set_xlabel(p.xlabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3)


def pyplot():
    """matplotlib's pyplot on the file-only backend (no display needed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError(
            "--plot: matplotlib is not installed; expected pip install 'qtool[plot]' (or matplotlib>=3.7), "
            "or drop --plot"
        ) from None
    return plt


def write(fig: Figure, path: str) -> None:
    """Draw `fig` and write it as a PNG at `path` (through a temporary sibling: a PNG appears only whole)."""
    plt = pyplot()
    panels = fig.panels or [Panel("no results", [], {})]
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    widest = max(len(p.x) for p in panels)
    figure, axes = plt.subplots(
        rows, cols, figsize=(max(6.0, 0.5 * widest) * cols, 3.6 * rows), squeeze=False
    )
    for ax, p in zip(axes.flat, panels, strict=False):
        _draw(ax, p, fig.reference)
        ax.set_ylabel(p.ylabel or fig.ylabel, fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for ax in list(axes.flat)[1 : len(panels)]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    figure.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=7, frameon=False)
    figure.suptitle(fig.title, fontsize=10)
    figure.tight_layout(rect=(0, 0.04 + 0.025 * (-(-len(labels) // 4)), 1, 0.96))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        figure.savefig(tmp, dpi=120, format="png")
        os.replace(tmp, out)
    finally:
        plt.close(figure)
        tmp.unlink(missing_ok=True)
