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


def source_metadata(model_ref: str | None) -> dict:
    """What the card takes from the source model: its hub id (`base_model`, only for a hub id: a local folder has
    none) and the `license` of its own model card (README.md in the folder, or in the hub cache), or None."""
    from huggingface_hub import ModelCard

    if not model_ref:
        return {"base_model": None, "license": None}
    local = Path(model_ref).expanduser()
    readme = local / "README.md" if local.is_dir() else None
    if readme is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model_ref, "README.md")
            readme = Path(cached) if isinstance(cached, str) else None
        except ValueError:  # not a repo id
            readme = None
    license_ = None
    if readme is not None and readme.is_file():
        try:
            license_ = ModelCard.load(readme).data.license
        except Exception:  # a card that is not valid YAML front matter has no license to take
            license_ = None
    is_hub_id = not local.exists() and not model_ref.startswith(("/", ".", "~")) and "/" in model_ref
    return {"base_model": model_ref if is_hub_id else None, "license": license_}


def model_card(manifest: dict, config: dict, recipe: dict | None, export: dict | None = None) -> str:
    """The card's Markdown through huggingface_hub's ModelCard: metadata (license and base_model from the source,
    pipeline_tag, library, tags), the quantization table, the measured quality, the recipe and how to load it. It
    names no folder: the same recipe and seed give the same card wherever the checkpoint is written (CHECKPOINT
    stands for this folder). `export` ({"format", "library"}, optionally "needs": the package transformers needs
    for it, "vllm": a remark on vLLM's support) makes it the card of an export of the checkpoint."""
    import yaml
    from huggingface_hub import ModelCard, ModelCardData

    name = "CHECKPOINT" if export is None else "EXPORT"
    base = _name((recipe or {}).get("model"))
    source = manifest.get("source") or {}
    qcfg = config.get("quantization_config", {})
    stages = (recipe or {}).get("stages") or [{"stage": s} for s in manifest.get("stages", [])]
    methods = sorted({str(s.get("stage")) for s in stages})
    data = ModelCardData(
        license=source.get("license"),
        base_model=source.get("base_model"),
        base_model_relation="quantized" if source.get("base_model") else None,
        pipeline_tag="text-generation",
        library_name="qtool" if export is None else export["library"],
        tags=["qtool", "quantized", *methods] + ([export["format"]] if export else []),
    )
    bpw = manifest.get("bits_per_weight") or {}
    cal = manifest.get("calibration")
    title = f"# {base}, quantized by qtool" + (f" ({export['format']} export)" if export else "")
    lines = [
        title,
        "",
        f"`{base}` quantized with qtool {manifest.get('packages', {}).get('qtool', '?')} "
        "(`recipe.yaml` holds the recipe as run; `qtool-manifest.json` the file hashes and provenance)."
        if export is None
        else f"`{base}` quantized with qtool and exported losslessly to {export['format']} "
        "(`qtool-export.json` names the source checkpoint, its manifest hash and every file's sha256).",
        "",
        "## Quantization",
        "",
        "| | |",
        "|---|---|",
        f"| base model | `{base}` |",
        f"| license | {source.get('license') or 'not stated by the source model'} |",
        f"| method | {'; '.join(_stage(s) for s in stages) or '-'} |",
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
    if recipe:
        lines += ["", "## Recipe", "", "```yaml", yaml.safe_dump(recipe, sort_keys=False).rstrip(), "```"]
    lines += ["", "## Load", ""]
    if export is None:
        lines += [
            "```python",
            "import qtool",
            "",
            f'model = qtool.load("{name}")  # this folder; device="cuda" runs the packed layers\' CUDA kernels',
            f'tokenizer = qtool.load_tokenizer("{name}")',
            "```",
            "",
            "With qtool imported, transformers loads it through qtool's runtime as well "
            f'(`import qtool` then `AutoModelForCausalLM.from_pretrained("{name}")`, `pipeline("text-generation", '
            f'model="{name}")`, lm-eval\'s `hf` model). Without qtool, transformers, `pipeline`, lm-eval and vLLM '
            "refuse the folder (its config.json says model type `qtool`) rather than load it wrongly.",
            "",
            "For clients without qtool (transformers, vLLM), schemes that compressed-tensors expresses "
            f"export losslessly: `qtool export {name} --format compressed-tensors -o {name}-ct` (the command "
            "refuses the others, naming the first layer; formats/compressed-tensors.md).",
        ]
    else:
        lines += [
            "```python",
            "from transformers import AutoModelForCausalLM",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{name}")  # needs the '
            f"{export.get('needs', 'compressed-tensors')} package",
            "```",
            "",
            f'vLLM: `LLM("{name}")`{export.get("vllm", "")}. No qtool is needed to load it.',
        ]
    content = f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n"
    return str(ModelCard(content))
