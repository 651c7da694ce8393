"""Calibration text → token windows, deterministically (seeded), from a local .txt/.jsonl or a `datasets` source."""

from __future__ import annotations

import codecs
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from qtool import hub
from qtool.errors import InputError, RecipeError, UsageError


@dataclass(frozen=True)
class TextSource:
    source: str  # a .txt/.jsonl/.json file, a datasets folder, or a datasets name
    text_field: str = "text"
    split: str = "train"
    config: str | None = None
    encoding: str = "utf-8"  # of .txt/.jsonl/.json/.csv files


def check_encoding(name: str) -> str | None:
    """None when `name` is a text codec Python knows, else what to say about it."""
    try:
        info = codecs.lookup(name)
    except LookupError:
        info = None
    # rot13, base64, zlib and the like are codecs too, but of bytes to bytes or str to str: not a text file's.
    if info is None or not getattr(info, "_is_text_encoding", True):
        return f"found {name!r}, expected a text encoding such as utf-8, latin-1 or cp1252"
    return None


def _decode(path: Path, encoding: str) -> str:
    data = path.read_bytes()
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise InputError(
            f"{path}: not {encoding} text: byte 0x{data[e.start]:02x} at offset {e.start} ({e.reason}); "
            f"expected {encoding} (set the encoding option for other encodings: calibration.encoding, "
            f"eval.encoding, eval --encoding)"
        ) from None


def _read_jsonl(path: Path, field: str, encoding: str) -> list[str]:
    docs = []
    # A byte-order mark is not part of the first JSON object.
    for lineno, line in enumerate(_decode(path, encoding).removeprefix("\ufeff").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(
                f"{path}:{lineno}: invalid JSON at column {e.colno} ({e.msg}); expected one JSON object "
                f"per line"
            ) from None
        if not isinstance(row, dict):
            raise InputError(
                f"{path}:{lineno}: found a JSON {type(row).__name__}, expected an object with field '{field}'"
            )
        if field not in row:
            raise InputError(
                f"{path}:{lineno}: no field '{field}' (found {', '.join(sorted(row)) or 'no fields'}); "
                f"expected the text in '{field}' (--text-field or text_field names it)"
            )
        text = row[field]
        if text is not None and not isinstance(text, str):
            raise InputError(
                f"{path}:{lineno}: field '{field}' is a {type(text).__name__}, expected a string"
            )
        if text:
            docs.append(text)
    return docs


def read_documents(src: TextSource) -> list[str]:
    """The documents of a text source, in order. Local .txt and .jsonl files are decoded with `src.encoding`: a
    byte that does not decode, a garbled JSON line or a line without the text field is one error naming the file
    and the byte offset or line number."""
    path = Path(src.source)
    if path.is_file() and path.suffix == ".jsonl":
        return _read_jsonl(path, src.text_field, src.encoding)
    if path.is_file() and path.suffix not in (".json", ".parquet", ".csv"):
        return [_decode(path, src.encoding)]
    import datasets  # slow import: only when needed

    try:
        if path.is_file():
            kind = {".json": "json"}.get(path.suffix, path.suffix.lstrip("."))
            extra = {"encoding": src.encoding} if kind in ("csv", "json") else {}
            ds = datasets.load_dataset(kind, data_files=str(path), split="train", **extra)
        elif path.is_dir() and (path / "dataset_info.json").exists():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[src.split]
        else:
            hub.prepare()
            ds = datasets.load_dataset(src.source, src.config, split=src.split)
    except Exception as e:  # datasets raises many types (hub, file, schema)
        raise InputError(
            f"text source '{src.source}': cannot be read ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        ) from None
    if src.text_field not in ds.column_names:
        raise InputError(
            f"text source '{src.source}': no field '{src.text_field}'; found {', '.join(ds.column_names)}"
        )
    return [t for t in ds[src.text_field] if t]


def sample_windows(
    tokenizer,
    src: TextSource,
    num_samples: int,
    seq_len: int,
    seed: int,
    where: str = "num_samples",
    counts=None,
) -> tuple[torch.Tensor, str]:
    """`num_samples` random windows of `seq_len` tokens ([num_samples, seq_len] int64) and their sha256.

    Documents are joined with blank lines and tokenized once; window starts come from a seeded generator,
    so the same text, tokenizer and seed always give the same windows. More windows than the text has distinct
    windows are refused (`where` names the setting): they could only repeat it, at the cost of a longer run.
    `counts` (when given) gets the text's size in characters and tokens (`text_bytes`, `text_tokens`).
    """
    docs = read_documents(src)
    check_not_empty(src, docs)
    text = "\n\n".join(docs)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    if counts is not None:
        counts.text_bytes, counts.text_tokens = len(text), int(ids.numel())
    if ids.numel() < seq_len + 1:
        raise InputError(
            f"text source '{src.source}': {ids.numel()} tokens, expected at least {seq_len + 1} "
            f"for windows of {seq_len}"
        )
    distinct = ids.numel() - seq_len
    if num_samples > distinct:
        # a setting of the run, not a fault of the text: named as the flag or the recipe key that set it
        error = RecipeError if ":" in where else UsageError  # `file:key`, or a flag or an argument
        raise error(
            f"{where}: found {num_samples} windows of {seq_len} tokens, but text source '{src.source}' holds "
            f"{ids.numel()} tokens, {distinct} distinct windows; expected at most {distinct} (or more text)"
        )
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len, (num_samples,), generator=gen)
    windows = torch.stack([ids[s : s + seq_len] for s in starts.tolist()])
    digest = hashlib.sha256(windows.to(torch.int32).numpy().tobytes()).hexdigest()
    return windows, digest


def check_not_empty(src: TextSource, docs: list[str]) -> None:
    if not any(d.strip() for d in docs):
        raise InputError(
            f"text source '{src.source}': no text (empty or only whitespace); expected text to tokenize"
        )


def check_token_ids(ids: torch.Tensor, vocab_size: int, src: str, tokenizer) -> None:
    """A tokenizer from another model can produce ids beyond the embedding table, which fails deep in the forward
    pass (or, on CUDA, reads out of bounds)."""
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise InputError(
            f"text source '{src}': the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) gives token "
            f"id {int(ids.max())}, beyond the model's vocab_size {vocab_size}; expected the model's own "
            f"tokenizer"
        )
