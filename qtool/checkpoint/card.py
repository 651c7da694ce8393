"""The model card (`README.md`) written into every checkpoint folder, generated from what the manifest, the config
and the recipe as run record: base model, method and bits, calibration, measured quality, how to load it. Nothing
in it is not in those files; machine paths are reduced to their last component (a card travels with the
checkpoint, the machine that wrote it does not)."""

from __future__ import annotations

from pathlib import Path

_STAGE_KEYS = ("bits", "act_bits", "group_size", "symmetric", "act_order", "outliers", "solver", "alpha")


def _name(ref: str | None) -> str:
    if not ref:
        return "-"
    return Path(ref).name if ref.startswith(("/", ".", "~")) else ref


def _stage(stage: dict) -> str:
    opts = ", ".join(f"{k} {stage[k]}" for k in _STAGE_KEYS if k in stage and stage[k] is not None)
    targets = stage.get("targets") or {}
    scope = "; ".join(f"{k} {', '.join(v)}" for k, v in targets.items() if v)
    return f"`{stage['stage']}`" + (f" ({opts})" if opts else "") + (f", {scope}" if scope else "")


def _layouts(layers: dict) -> str:
    counts: dict[str, int] = {}
    for cfg in layers.values():
        key = cfg.get("format", "?")
        if "bits" in cfg:
            key += f" W{cfg['bits']}"
        if "act_bits" in cfg:
            key += f"A{cfg['act_bits']}"
        if "group_size" in cfg:
            key += f" g{cfg['group_size']}" if cfg["group_size"] else " per channel"
        if "symmetric" in cfg:
            key += " sym" if cfg["symmetric"] else " asym"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} x {k}" for k, n in sorted(counts.items()))


def _eval_rows(ev: dict) -> list[str]:
    rows = []
    if "protocol" in ev:
        p = ev["protocol"]
        rows.append(
            f"| perplexity ({_name(p.get('text'))}, {ev['quantized'].get('windows')} windows x "
            f"{p.get('seq_len')} tokens) | {ev['original']['perplexity']:.4f} | "
            f"{ev['quantized']['perplexity']:.4f} |"
        )
    for task, metrics in ev.get("quantized", {}).get("tasks", {}).items():
        for metric, v in metrics.items():
            o = ev.get("original", {}).get("tasks", {}).get(task, {}).get(metric)
            rows.append(
                f"| {task} {metric} | {o['value']:.4f} | {v['value']:.4f} |"
                if o
                else f"| {task} {metric} | - | {v['value']:.4f} |"
            )
    return rows


def model_card(manifest: dict, config: dict, recipe: dict | None) -> str:
    """The card's Markdown. It names no folder: the same recipe and seed give the same card wherever the checkpoint
    is written (CHECKPOINT stands for this folder)."""
    name = "CHECKPOINT"
    base = _name((recipe or {}).get("model"))
    qcfg = config.get("quantization_config", {})
    stages = (recipe or {}).get("stages") or [{"stage": s} for s in manifest.get("stages", [])]
    bpw = manifest.get("bits_per_weight") or {}
    cal = manifest.get("calibration")
    lines = [
        "---",
        "library_name: qtool",
        f"base_model: {base}",
        "tags: [qtool, quantized" + "".join(f", {s['stage']}" for s in stages) + "]",
        "---",
        "",
        f"# {base}, quantized by qtool",
        "",
        f"`{base}` quantized with qtool {manifest.get('packages', {}).get('qtool', '')} "
        f"(`recipe.yaml` holds the recipe as run; `qtool-manifest.json` the file hashes and provenance).",
        "",
        "| | |",
        "|---|---|",
        f"| base model | `{base}` |",
        f"| method | {'; '.join(_stage(s) for s in stages)} |",
        f"| quantized layers | {_layouts(qcfg.get('layers', {}))} |",
    ]
    if "kv_cache" in qcfg:
        lines.append(f"| KV cache | {qcfg['kv_cache'].get('bits')}-bit |")
    if bpw:
        lines.append(
            f"| bits per weight | {bpw.get('quantized_linears')} (quantized linears), "
            f"{bpw.get('all_parameters')} (all parameters) |"
        )
    if cal:
        lines.append(
            f"| calibration | {_name(cal.get('source'))}: {cal.get('num_samples')} windows x "
            f"{cal.get('seq_len')} tokens, seed {cal.get('seed')}, data sha256 "
            f"{str(cal.get('data_sha256', ''))[:16]} |"
        )
    else:
        lines.append("| calibration | none (no stage needed data) |")
    lines += ["", "## Measured quality", ""]
    ev = manifest.get("eval")
    rows = _eval_rows(ev) if ev else []
    if rows:
        lines += ["| metric | original | quantized |", "|---|---|---|", *rows]
        tp = ev.get("tasks_protocol")
        if tp:
            lines += [
                "",
                f"Tasks: limit {tp.get('limit') or 'none'}, {tp.get('num_fewshot')}-shot, lm-eval "
                f"{tp.get('lm_eval_version')}, {tp.get('runtime')} on {tp.get('device')}.",
            ]
    else:
        lines.append(
            f"Not measured when it was written: `qtool eval {name} --baseline {base} --text FILE` "
            f"measures it against the original."
        )
    lines += [
        "",
        "## Load",
        "",
        "```python",
        "import qtool",
        "",
        f'model = qtool.load("{name}")  # this folder; device="cuda" runs the packed layers\' CUDA kernels',
        f'tokenizer = qtool.load_tokenizer("{name}")',
        "```",
        "",
        "With qtool imported, transformers loads it through qtool's runtime as well "
        f'(`import qtool` then `AutoModelForCausalLM.from_pretrained("{name}")`, `pipeline("text-generation", '
        f'model="{name}")`, lm-eval\'s `hf` model).',
        "",
        "For clients without qtool (transformers, vLLM), schemes that compressed-tensors expresses "
        f"export losslessly: `qtool export {name} --format compressed-tensors -o {name}-ct` (the command "
        "refuses the others, naming the first layer; formats/compressed-tensors.md).",
        "",
    ]
    return "\n".join(lines)
