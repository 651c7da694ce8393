"""Checks of model and checkpoint files before their numbers are used: safetensors headers against the file sizes,
a shard index against its shards, config.json values against what a model class needs, and every floating-point
tensor finite.

One set of checks serves both an original Hugging Face folder and a packed qtool checkpoint; the caller passes the
error class (InputError for the first, CheckpointError for the second), so each problem is one line naming the file,
key or tensor under the right exit code. This is the one place that parses safetensors headers; `StoredTensors`
then reads one tensor at a time at the offsets the checked header gave (a plain read into a fresh buffer, not a
memory map: a map kept open counts every page read so far in the process's resident memory, so loading a model
larger than the RAM would look, and be accounted, as if it were all in memory).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from qtool.errors import QtoolError, shown

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
FLOAT_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"})
_MAX_HEADER = 100_000_000  # the safetensors library refuses larger headers too

# Config keys that size a tensor or a loop: a string, a float or a non-positive value there fails deep inside
# transformers or builds a model that silently ignores weights (num_hidden_layers: 0 loads nothing).
_POSITIVE_INTS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "ffn_dim",
    "word_embed_proj_dim",
)
_NULLABLE = frozenset({"num_key_value_heads", "head_dim"})  # null means "derive it", as transformers does

# Context-length keys, in the order transformers' configs use them.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")

# Finite checks read this many elements at a time, so a multi-GB embedding never needs a same-sized bool mask.
_FINITE_CHUNK = 1 << 24


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors' name: F32, BF16, I32, ...
    shape: tuple[int, ...]
    offset: int = 0  # of the tensor's first byte in the file
    nbytes: int = 0


def read_header(path: Path, error: type[QtoolError]) -> dict[str, TensorInfo]:
    """The tensors a safetensors file declares, after checking that the file holds every byte they need."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else 0
            raw = f.read(length) if 0 < length <= min(size - 8, _MAX_HEADER) else b""
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e})") from None
    if size < 8:
        raise error(
            f"{path}: {size} bytes, too short for safetensors; expected an 8-byte header length, a JSON header "
            f"and the tensor data"
        )
    if length > size - 8 or length > _MAX_HEADER or length == 0:
        raise error(
            f"{path}: truncated or not safetensors: the header length field says {length} bytes, the file "
            f"has {size - 8} after it"
        )
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise error(f"{path}: garbled safetensors header (not JSON); expected a safetensors file") from None
    if not isinstance(header, dict):
        raise error(
            f"{path}: garbled safetensors header (a JSON {type(header).__name__}); expected an object"
        )
    data = size - 8 - length
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = entry["dtype"]
            shape = tuple(entry["shape"])
            begin, end = entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise error(
                f"{path}: tensor {name}: garbled header entry; expected dtype, shape and data_offsets"
            ) from None
        if dtype not in _DTYPE_BYTES:
            raise error(
                f"{path}: tensor {name}: unknown dtype {dtype!r}; expected one of {', '.join(_DTYPE_BYTES)}"
            )
        if not all(isinstance(d, int) and d >= 0 for d in (*shape, begin, end)):
            raise error(
                f"{path}: tensor {name}: garbled header entry (shape {entry['shape']!r}, offsets "
                f"{entry['data_offsets']!r}); expected non-negative integers"
            )
        need = math.prod(shape) * _DTYPE_BYTES[dtype]
        if end - begin != need:
            raise error(
                f"{path}: tensor {name}: its offsets span {end - begin} bytes, its {dtype} shape {list(shape)} "
                f"needs {need}"
            )
        if end > data:
            raise error(
                f"{path}: truncated: tensor {name} ends at byte {end} of the data, the file holds {data}"
            )
        out[name] = TensorInfo(path, dtype, shape, 8 + length + begin, need)
    return out


def read_index(index: Path, error: type[QtoolError]) -> dict[str, str]:
    """The `weight_map` (tensor → shard file) of a Hugging Face shard index."""
    try:
        raw = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(
            f"{index}: invalid JSON ({_json_problem(e)}); expected a shard index with a weight_map"
        ) from None
    except OSError as e:
        raise error(f"{index}: cannot be read ({e.strerror or e})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict):
        raise error(
            f"{index}: no weight_map of tensor names to shard files; expected the Hugging Face index format"
        )
    for name, file in weight_map.items():
        if not (isinstance(file, str) and plain_file_name(file) and file.endswith(".safetensors")):
            raise error(
                f"{index}: weight_map[{shown(name)}]: found {shown(file)}, expected the name of a .safetensors "
                f"shard in the same folder (no path)"
            )
    return weight_map


def plain_file_name(name: str) -> bool:
    """Whether `name` names a file directly inside a folder: no separator, no `..`, nothing hidden or empty. File
    names read from a manifest or an index are input: `../x` would reach outside the folder."""
    return (
        bool(name)
        and name not in (".", "..")
        and not name.startswith(".")
        and not any(c in name for c in "/\\\0")
        and len(name) <= 255
    )


def tensor_index(folder: Path, error: type[QtoolError]) -> dict[str, TensorInfo] | None:
    """Every tensor of a folder's safetensors weights (one file, or shards with their index), each in exactly one
    file that holds all of its bytes. None when the folder keeps no safetensors weights (e.g. pytorch_model.bin)."""
    index = folder / INDEX_NAME
    if index.is_file():
        weight_map = read_index(index, error)
        found: dict[str, TensorInfo] = {}
        for fname in sorted(set(weight_map.values())):
            shard = folder / fname
            if not shard.is_file():
                first = next(k for k, v in sorted(weight_map.items()) if v == fname)
                raise error(
                    f"{shard}: missing; {INDEX_NAME} maps "
                    f"{sum(v == fname for v in weight_map.values())} tensors to it (e.g. {first})"
                )
            for name, info in read_header(shard, error).items():
                if name in found:
                    raise error(
                        f"tensor {name}: stored twice, in {found[name].file.name} and {fname}; expected each "
                        f"tensor in one shard"
                    )
                found[name] = info
        for name, fname in sorted(weight_map.items()):
            info = found.get(name)
            if info is None or info.file.name != fname:
                where = ", which does not hold it" if info is None else f", but it is in {info.file.name}"
                raise error(f"tensor {name}: {index} maps it to {fname}{where}")
        for name, info in sorted(found.items()):
            if name not in weight_map:
                raise error(
                    f"tensor {name}: in {info.file}, but not in {INDEX_NAME}; expected every stored tensor "
                    f"in the index"
                )
        return found
    single = folder / WEIGHTS_NAME
    if single.is_file():
        return read_header(single, error)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if shards:
        raise error(
            f"{folder}: {shards[0]} without {INDEX_NAME} or {WEIGHTS_NAME}; expected the shard index beside "
            f"the shards"
        )
    return None


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def read_tensor(info: TensorInfo, pinned: bool = False) -> torch.Tensor:
    """The tensor `info` describes, read from its file into memory of its own (OSError when the file changed
    since its header was checked and is now shorter). `pinned`: into page-locked memory, whose copy to a GPU runs
    at the bus's rate (torch caches freed page-locked blocks, so a loop over same-shaped blocks reuses them)."""
    dtype = SAFETENSORS_DTYPES[info.dtype]
    if not info.nbytes:
        return torch.empty(info.shape, dtype=dtype)
    buf = torch.empty(info.nbytes, dtype=torch.uint8, pin_memory=pinned)
    with open(info.file, "rb") as f:
        f.seek(info.offset)
        got = f.readinto(memoryview(buf.numpy()))
    if got != info.nbytes:
        raise OSError(f"truncated: {got} of {info.nbytes} bytes of its data are in the file")
    return buf.view(dtype).reshape(info.shape)


class StoredTensors(Mapping):
    """The tensors of a folder's safetensors files by name, each read when asked for (and checked finite then),
    so a caller holds one tensor beyond what it keeps. `pop` hands a tensor over and forgets its name; `device`
    moves each tensor there as it is read (the host copy is then freed)."""

    def __init__(
        self, found: dict[str, TensorInfo], error: type[QtoolError], device: str | torch.device = "cpu"
    ):
        self.files = dict(found)
        self.error = error
        self.device = torch.device(device)

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def __contains__(self, name: object) -> bool:
        return name in self.files

    def nbytes(self, name: str) -> int:
        return self.files[name].nbytes

    @property
    def meta(self) -> dict[str, torch.Tensor]:
        """Each tensor's shape and dtype, without its data."""
        return {
            n: torch.empty(i.shape, dtype=SAFETENSORS_DTYPES[i.dtype], device="meta")
            for n, i in self.files.items()
        }

    def __getitem__(self, name: str) -> torch.Tensor:
        info = self.files[name]
        try:
            t = read_tensor(info)
        except MemoryError:
            raise
        except (OSError, ValueError, RuntimeError) as e:
            raise self.error(
                f"tensor {name} ({info.file}): cannot be read ({describe(e)}); expected the file as "
                f"its header was checked (was it truncated or replaced meanwhile?)"
            ) from None
        check_finite([(name, t)], self.error, self.files)
        return t.to(self.device) if self.device.type != "cpu" else t

    _MISSING = object()

    def pop(self, name: str, default=_MISSING):
        if name not in self.files:
            if default is StoredTensors._MISSING:
                raise KeyError(name)
            return default
        t = self[name]
        del self.files[name]
        return t


def nonfinite_count(t: torch.Tensor) -> int:
    """How many elements of `t` are NaN or ±Inf (0 for integer and meta tensors); reads it chunk by chunk."""
    if not t.is_floating_point() or t.device.type == "meta" or t.numel() == 0:
        return 0
    flat = t.detach().reshape(-1)
    # isfinite has no kernels for the 8-bit float types.
    widen = t.element_size() == 1
    bad = 0
    for i in range(0, flat.numel(), _FINITE_CHUNK):
        chunk = flat[i : i + _FINITE_CHUNK]
        if widen:
            chunk = chunk.float()
        ok = torch.isfinite(chunk)
        if not bool(ok.all()):
            bad += int((~ok).sum())
    return bad


def check_finite(
    tensors: Iterable[tuple[str, torch.Tensor]],
    error: type[QtoolError],
    files: dict[str, TensorInfo] | None = None,
) -> None:
    """Refuse the first tensor holding NaN or Inf, naming it (and its file when `files` knows it)."""
    for name, t in tensors:
        bad = nonfinite_count(t)
        if bad:
            where = f" ({files[name].file})" if files and name in files else ""
            dtype = str(t.dtype).removeprefix("torch.")
            raise error(
                f"tensor {name}{where}: {bad} of {t.numel()} values are NaN or Inf (as {dtype}); expected "
                f"finite numbers"
            )


def read_config_json(path: Path, error: type[QtoolError]) -> dict:
    """config.json as a dict, with the sizes a model class builds from checked to be positive integers."""
    if not path.is_file():
        raise error(f"{path}: missing; expected the model's config.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: invalid JSON ({_json_problem(e)}); expected the model's config") from None
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e})") from None
    if not isinstance(raw, dict):
        raise error(f"{path}: found a JSON {type(raw).__name__}, expected an object of config keys")
    for key in _POSITIVE_INTS:
        if key not in raw or (raw[key] is None and key in _NULLABLE):
            continue
        v = raw[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise error(f"{path}: {key}: found {v!r}, expected a positive integer")
    arch = raw.get("architectures")
    if arch is not None and (not isinstance(arch, list) or not all(isinstance(a, str) for a in arch)):
        raise error(
            f"{path}: architectures: found {arch!r}, expected a list of class names such as "
            f'["LlamaForCausalLM"]'
        )
    _check_sizes(path, raw, error)
    return raw


# Decoder blocks are stored as `<prefix>.layers.<i>.<...>` by every architecture qtool reads (Llama, Mistral, Qwen2,
# OPT's `model.decoder.layers`), with or without the CausalLM's prefix.
_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Experts are stored one per index (`...experts.<e>.w1.weight`, as hub checkpoints of Mixtral and Qwen-MoE are), or
# fused with the expert as the first dimension of a 3-D tensor (`...experts.gate_up_proj`).
_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")

# Sizes that shape a weight. Each is some dimension of a stored tensor, or a fraction of one in a packed checkpoint;
# past this multiple of the widest stored dimension no model could have it. The margin keeps configs whose key sizes
# nothing they store (an MoE model's dense intermediate_size) clear of the check.
_SIZE_KEYS = tuple(k for k in _POSITIVE_INTS if k not in ("num_hidden_layers", "max_position_embeddings"))
_SIZE_MARGIN = 16


def _check_sizes(path: Path, raw: dict, error: type[QtoolError]) -> None:
    """Config sizes against the shapes in the safetensors headers, before any model is built from the config: that
    build (on the meta device, for names and shapes) still makes Python objects per block and per expert, which took
    minutes for num_hidden_layers: 100000, and allocates each weight for a moment, which failed in the allocator,
    naming no key, for a hidden_size of 2**40."""
    found = tensor_index(path.parent, error)
    if not found:
        return  # no safetensors weights: the loader checks what it reads
    layers = raw.get("num_hidden_layers")
    blocks = {int(m.group(1)) for name in found if (m := _BLOCK.search(name))}
    if isinstance(layers, int) and blocks and layers > max(blocks) + 1:
        raise error(
            f"{path}: num_hidden_layers: found {layers}, but the weights hold {max(blocks) + 1} decoder blocks "
            f"(layers 0-{max(blocks)}); expected {max(blocks) + 1}"
        )
    experts = {int(m.group(1)) for name in found if (m := _EXPERT.search(name))}
    fused = [info.shape[0] for name, info in found.items() if ".experts." in name and len(info.shape) == 3]
    stored = max(experts) + 1 if experts else max(fused, default=0)
    for key in _EXPERT_KEYS:
        v = raw.get(key)
        # Each expert is a module of its own once qtool unfuses them: 100,000 took minutes before any check.
        if stored and isinstance(v, int) and not isinstance(v, bool) and v > stored:
            raise error(f"{path}: {key}: found {v}, but the weights hold {stored} experts; expected {stored}")
    widest, name = max((max(info.shape, default=0), n) for n, info in found.items())
    for key in _SIZE_KEYS:
        v = raw.get(key)
        if isinstance(v, int) and v > _SIZE_MARGIN * widest:
            raise error(
                f"{path}: {key}: found {v}, but the widest stored tensor dimension is {widest} ({name}); "
                f"expected a size the weights can have"
            )


def context_length(config) -> tuple[str, int] | None:
    """(config key, tokens) of a model's context length, or None when its config names none."""
    for key in _CONTEXT_KEYS:
        v = getattr(config, key, None) if not isinstance(config, dict) else config.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return key, v
    return None


def describe(e: BaseException) -> str:
    """One line of an exception's message. Library errors often put a heading first ("Validation error for field
    'x':") and the reason on the next line; this keeps the reason."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    if len(lines) > 1 and lines[0].endswith(":"):
        return lines[1]
    return lines[0]


def _json_problem(e: Exception) -> str:
    if isinstance(e, json.JSONDecodeError):
        return f"line {e.lineno}, column {e.colno}: {e.msg}"
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 at byte {e.start}"
    return describe(e)
