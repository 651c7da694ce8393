"""Perplexity of an original model larger than the memory it is evaluated in, block by block.

The model is a skeleton on the meta device (as in block onloading, qtool/models/onload.py). Every group of
windows that `perplexity` would run in one forward first goes through the embedding; then each decoder block is
read from the weight files, run over the hidden states of every group, and dropped; last, the final norm and the
head score the groups through the model's own forward (its blocks replaced by a stand-in that returns each
group's last hidden states), with the same protocol code as a whole-model evaluation. Each group runs the same
operations on the same shapes as it would in the whole model, so the result is that of the whole-model path.

Why block streaming rather than accelerate's device map with offload: the windows of a perplexity evaluation
are independent, so all of them can pass through one block before the next block is read, and every weight is
read from disk once per evaluation. An offloaded device map reads every offloaded weight again for each batch of
windows. What stays in memory is one block, the modules outside the blocks and the hidden states of all windows
(windows x seq_len x hidden_size in the evaluation dtype), kept by an `ActivationStore` on the device, in host
memory or on disk, whichever holds them (qtool/calibration/store.py).
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import torch
from torch import nn

from qtool.calibration.capture import BlockKwargs, StopForward, block_output, blocks_standing_aside
from qtool.calibration.store import ActivationStore
from qtool.console import Reporter
from qtool.errors import InputError
from qtool.eval.perplexity import eval_tokens, perplexity, window_groups
from qtool.models.loading import (
    adapter_of,
    check_architecture,
    check_weight_files,
    config_dtype,
    load_config,
    load_tokenizer,
    meta_model,
)
from qtool.models.onload import ShardReader, check_names, load_outer, materialize, release
from qtool.recipe import EvalSpec


def eval_dtype(config, device: torch.device) -> torch.dtype:
    """float32 on the CPU (its half-precision matmuls are slow), the stored dtype on a GPU."""
    return torch.float32 if device.type == "cpu" else config_dtype(config)


def model_bytes(ref: str, device: torch.device) -> int | None:
    """Bytes of an original local safetensors model's weights in the dtype it is evaluated in (None when it is a
    hub id or keeps no safetensors weights: only a whole load reads those)."""
    folder = Path(ref)
    if not folder.is_dir():
        return None
    config = load_config(ref)
    files = check_weight_files(ref, config)
    if files is None:
        return None
    size = torch.empty((), dtype=eval_dtype(config, device)).element_size()
    return sum(int(torch.Size(info.shape).numel()) for info in files.values()) * size


class _Replay(nn.Module):
    """Stands for the decoder blocks once they have all run: returns each group's last hidden states, in order."""

    def __init__(self, outputs: ActivationStore, device: torch.device, as_tuple: bool) -> None:
        super().__init__()
        self.pending = deque(range(len(outputs)))
        self.outputs, self.device, self.as_tuple = outputs, device, as_tuple

    def forward(self, hidden_states, *args, **kwargs):
        h = self.outputs.take(self.pending.popleft(), self.device)
        return (h,) if self.as_tuple else h


@torch.no_grad()
def streamed_perplexity(
    ref: str, spec: EvalSpec, device: torch.device, reporter: Reporter, dtype: torch.dtype | None = None
) -> tuple[dict, object]:
    """(the perplexity result, the tokenizer) of the original model at `ref` (a local safetensors folder), its
    weights in `dtype` (default `eval_dtype`)."""
    t0 = time.perf_counter()
    config = load_config(ref)
    check_architecture(ref, config)
    adapter = adapter_of(config)
    tokenizer = load_tokenizer(ref, InputError)
    skeleton = meta_model(config, f"model '{ref}' config", InputError)
    files = check_weight_files(ref, config, skeleton)
    if files is None:
        raise InputError(
            f"model '{ref}': no safetensors weights to read block by block; expected a local folder "
            f"with model.safetensors (or shards with model.safetensors.index.json)"
        )
    reader = ShardReader(ref, files, config)
    check_names(reader, skeleton, ref)
    skeleton.eval()
    dtype = dtype or eval_dtype(config, device)
    ids = eval_tokens(config, tokenizer, spec)
    _, batches = window_groups(ids, spec)
    groups = [g for groups in batches for g in groups]
    blocks = adapter.blocks(skeleton)
    tail = (adapter.final_norm_path, adapter.head_path)

    # The embedding (and whatever else precedes the blocks) on the device: each group's inputs of block 0.
    load_outer(skeleton, adapter, reader, dtype, skip=tail)
    _materialized_to(skeleton, device)
    size = torch.empty((), dtype=dtype).element_size()
    need = sum(len(g) * (g[0][1] - g[0][0]) for g in groups) * config.hidden_size * size
    # The device keeps room for one block beside them (and its working memory, of the order of a block).
    room = None
    if device.type == "cuda":
        block_bytes = sum(p.numel() for p in blocks[0].parameters()) * size
        room = max(torch.cuda.mem_get_info(device)[0] - 4 * block_bytes, 0)
    hidden = ActivationStore.for_budget(need, device, device_room=room)
    # Windows of one shape share their masks and positions: each block's keyword arguments by batch shape.
    kwargs: dict[tuple[int, ...], BlockKwargs] = {}
    key: list[tuple[int, ...]] = []

    def seen(i: int, h: torch.Tensor, kw: dict) -> None:
        shape = tuple(h.shape)
        if i == 0:
            hidden.append(h)
            key.append(shape)
        kwargs.setdefault(shape, BlockKwargs(device)).add(i, kw)

    with blocks_standing_aside(blocks, seen):
        for group in groups:
            try:
                skeleton(torch.stack([ids[b:e] for b, e, _ in group]).to(device), use_cache=False)
            except StopForward:
                pass

    as_tuple = False
    for i in reporter.track(range(len(blocks)), len(blocks), "blocks"):
        block = blocks[i]
        materialize(block, adapter.block_prefix(i), reader, dtype)
        block.to(device)
        for g in range(len(groups)):
            out = block(hidden.take(g, device), **kwargs[key[g]].per_block[i])
            as_tuple = isinstance(out, tuple)
            hidden.put(g, block_output(out))
            del out
        release(block)
    kwargs.clear()

    load_outer(skeleton, adapter, reader, dtype)
    reader.close()
    parent, _, attr = adapter.blocks_path.rpartition(".")
    setattr(skeleton.get_submodule(parent), attr, nn.ModuleList([_Replay(hidden, device, as_tuple)]))
    skeleton.to(device)
    result = perplexity(skeleton, tokenizer, spec, device, reporter, ids=ids, graphs=False)
    hidden.close()
    release(skeleton)
    result["seconds"] = round(time.perf_counter() - t0, 3)
    result["streamed"] = {"blocks": len(blocks), "hidden_states": hidden.where}
    return result, tokenizer


def _materialized_to(model: nn.Module, device: torch.device) -> None:
    """Move every parameter and buffer that holds data (not the meta blocks) to `device`, tied ones once."""
    if device.type == "cpu":
        return
    moved: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for kind in ("_parameters", "_buffers"):
            table = getattr(mod, kind)
            for name, t in list(table.items()):
                if t is None or t.device.type == "meta" or t.device == device:
                    continue
                if id(t) not in moved:
                    moved[id(t)] = (
                        nn.Parameter(t.to(device), requires_grad=False)
                        if kind == "_parameters"
                        else t.to(device)
                    )
                table[name] = moved[id(t)]
