"""Calibration text → token windows, deterministically (seeded), from a local .txt/.jsonl or a `datasets` source."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from qtool.errors import QtoolError


@dataclass(frozen=True)
class TextSource:
    source: str  # a .txt/.jsonl/.json file, a datasets folder, or a datasets name
    text_field: str = "text"
    split: str = "train"
    config: str | None = None


def read_documents(src: TextSource) -> list[str]:
    """The documents of a text source, in order."""
    path = Path(src.source)
    if path.is_file() and path.suffix not in (".jsonl", ".json", ".parquet", ".csv"):
        return [path.read_text(encoding="utf-8")]
    import datasets  # slow import: only when needed

    try:
        if path.is_file():
            kind = {".jsonl": "json", ".json": "json"}.get(path.suffix, path.suffix.lstrip("."))
            ds = datasets.load_dataset(kind, data_files=str(path), split="train")
        elif path.is_dir() and (path / "dataset_info.json").exists():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[src.split]
        else:
            ds = datasets.load_dataset(src.source, src.config, split=src.split)
    except Exception as e:  # datasets raises many types (hub, file, schema)
        raise QtoolError(f"text source '{src.source}': cannot be read ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if src.text_field not in ds.column_names:
        raise QtoolError(f"text source '{src.source}': no field '{src.text_field}'; found {', '.join(ds.column_names)}")
    return [t for t in ds[src.text_field] if t]


def sample_windows(tokenizer, src: TextSource, num_samples: int, seq_len: int, seed: int) -> tuple[torch.Tensor, str]:
    """`num_samples` random windows of `seq_len` tokens ([num_samples, seq_len] int64) and their sha256.

    Documents are joined with blank lines and tokenized once; window starts come from a seeded generator,
    so the same text, tokenizer and seed always give the same windows.
    """
    docs = read_documents(src)
    ids = tokenizer("\n\n".join(docs), add_special_tokens=False, return_tensors="pt").input_ids[0]
    if ids.numel() < seq_len + 1:
        raise QtoolError(f"text source '{src.source}': {ids.numel()} tokens, expected at least {seq_len + 1} "
                         f"for windows of {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len, (num_samples,), generator=gen)
    windows = torch.stack([ids[s:s + seq_len] for s in starts.tolist()])
    digest = hashlib.sha256(windows.to(torch.int32).numpy().tobytes()).hexdigest()
    return windows, digest
