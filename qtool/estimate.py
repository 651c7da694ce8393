"""Pre-flight of a quantize run: what it will need (peak host memory, peak GPU memory, output size on disk, time)
from the model's config and shapes alone, and a refusal when this machine cannot do it.

Memory is counted term by term from what the pipeline holds at its two peaks: inside the block loop (the modules
outside the blocks, one block, the calibration activations and the block's next outputs, one group's Hessians
and the solver's copies, one sample's forward) and while writing (one shard and its serialized copy). The host
figure starts from this process's own resident memory at the time of the check (libraries and tokenizer loaded),
so the estimate is calibrated on this machine. The activations go where they fit (the compute device, else host
memory, else disk: `choose_place`), and only that place counts them. Time uses a matrix-multiply rate measured
here on the compute device, applied to each block's multiply count (forwards, Hessian updates, the GPTQ solve): a
rough figure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qtool.calibration.store import choose_place
from qtool.errors import QtoolError, ResourceError
from qtool.models.loading import config_dtype
from qtool.units import format_size

_GB = 1e9


@dataclass
class Estimate:
    host_bytes: int
    gpu_bytes: int | None
    output_bytes: int | None
    seconds: float | None
    terms: dict[str, int]
    num_blocks: int
    activation_bytes: int
    block_bytes: int
    hessian_bytes: int
    activations: str = "device"  # where the activations between blocks are kept (qtool/calibration/store.py)
    time_terms: dict[str, float] | None = None  # what `seconds` adds up (the dry run's, once measured)

    def summary(self) -> dict:
        return {
            "estimate": {
                "peak_host_bytes": self.host_bytes,
                "peak_gpu_bytes": self.gpu_bytes,
                "output_bytes": self.output_bytes,
                "seconds": None if self.seconds is None else round(self.seconds, 1),
                "num_blocks": self.num_blocks,
                "activations": self.activations,
                "terms": self.terms,
                **({"time_terms": self.time_terms} if self.time_terms else {}),
            }
        }


_DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "F32": 4,
    "I32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100_000_000:
            raise ValueError("header too large")
        return json.loads(f.read(n))


def model_tensor_shapes(model_dir: str | Path) -> dict[str, tuple[str, list[int]]] | None:
    """{name: (dtype, shape)} of a local model's safetensors files, read from their headers only; None when the
    model is not a local folder of readable safetensors files (the estimate is then skipped, not guessed)."""
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors")) if d.is_dir() else []
    if not files:
        return None
    out: dict[str, tuple[str, list[int]]] = {}
    try:
        for f in files:
            for name, info in _safetensors_header(f).items():
                if name != "__metadata__":
                    out[name] = (info["dtype"], list(info["shape"]))
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None  # a broken model file is reported by the loader, with its own message
    return out


def _shape_numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _block_linears(config) -> tuple[object, list[str]] | None:
    from qtool.models.loading import adapter_of

    adapter = adapter_of(config)
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(adapter, str) or not isinstance(layers, int):
        return None
    return adapter, [
        f"{adapter.block_prefix(i)}.{rel}" for i in range(layers) for rel in adapter.linear_names()
    ]


def checkpoint_bytes(recipe, config) -> int | None:
    """At least how many bytes the checkpoint of `recipe` takes: the model's tensors as stored, with the linears
    each quantizer claims at its bits per weight (scales and outlier columns left out)."""
    shapes = model_tensor_shapes(recipe.model)
    found = _block_linears(config)
    if shapes is None or found is None:
        return None
    _, linears = found
    bits: dict[str, int] = {}
    for name in linears:
        for q in recipe.quantizers():
            if q.targets.matches(name):
                b = getattr(q.options, "bits", None) or 2
                bits[f"{name}.weight"] = min(b, 4) if getattr(q.options, "overrides", None) else b
                break
    total = 0
    for name, (dtype, shape) in shapes.items():
        n = _shape_numel(shape)
        total += n * bits[name] // 8 if name in bits else n * _DTYPE_BYTES.get(dtype, 1)
    return total


def stats_bytes(model: str, config, hessians: bool) -> int | None:
    """At least how many bytes a stats file takes: per linear two float32 vectors, and the K x K Hessian."""
    shapes = model_tensor_shapes(model)
    found = _block_linears(config)
    if shapes is None or found is None:
        return None
    total = 0
    for name in found[1]:
        if f"{name}.weight" in shapes:
            k = shapes[f"{name}.weight"][1][-1]
            total += 8 * k + (4 * k * k if hessians else 0)
    return total


def current_rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _numel(params) -> int:
    seen: set[int] = set()
    n = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def estimate(
    recipe, prepared, device: torch.device, mode: str, timing: bool = False, samples: int | None = None
) -> Estimate:
    """`timing`: also estimate the time (measures the device's multiply rate for about 0.2 s). `samples`: the
    calibration windows this process holds (its share in a run over several processes; default all)."""
    from qtool.models.loading import adapter_of
    from qtool.pipeline import compute_dtype

    config = prepared.config
    meta = prepared.meta
    adapter = adapter_of(config)
    original = config_dtype(config)
    dtype = compute_dtype(recipe.settings.dtype, device, original)
    dsize = torch.empty((), dtype=dtype).element_size()
    osize = torch.empty((), dtype=original).element_size()
    blocks = adapter.blocks(meta)
    block_params = _numel(blocks[0].parameters())
    all_params = _numel(meta.parameters())
    if getattr(config, "tie_word_embeddings", False):  # the head is the embedding
        all_params -= _numel(meta.get_output_embeddings().parameters())
    outer_params = all_params - block_params * len(blocks)
    hidden = config.hidden_size
    inter = getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None) or 4 * hidden
    heads = config.num_attention_heads
    cal = recipe.calibration
    if cal is not None and recipe.needs_calibration():
        samples, seq = (cal.num_samples if samples is None else samples), cal.seq_len
    else:
        samples, seq = 0, 0

    # Hessians: one K x K float32 per linear of a group, the largest group (sequential GPTQ); the solver holds
    # about three more K x K and two N x K float32 copies of the linear it solves.
    widths = {rel: blocks[0].get_submodule(rel) for rel in adapter.linear_names()}
    hessian = 0
    if recipe.needs_calibration():
        groups = adapter.linear_groups
        hessian = max(sum(4 * widths[r].in_features ** 2 for r in g) for g in groups)
        hessian += max(
            3 * 4 * m.in_features**2 + 2 * 4 * m.in_features * m.out_features for m in widths.values()
        )
    acts = 2 * samples * seq * hidden * dsize  # the inputs and the block's outputs while they are computed
    forward = seq * (3 * inter + 4 * hidden) * dsize + heads * seq * seq * 4
    block = block_params * dsize
    out_bytes = checkpoint_bytes(recipe, config)
    shard = min(recipe.max_shard_bytes(), out_bytes or recipe.max_shard_bytes())
    outer_c, outer_o = outer_params * dsize, outer_params * osize
    base = current_rss()

    on_gpu = device.type == "cuda"
    if mode == "whole":
        model_c = all_params * dsize
        loop_host = model_c + (0 if on_gpu else acts + hessian + forward + block)
        write_host = model_c + (out_bytes or 0) + shard
    else:
        loop_host = outer_c + block + (0 if on_gpu else block + acts + hessian + forward)
        write_host = outer_o + shard  # the float modules are dropped once the checkpoint's copies are made
    # The activations stay on the compute device while it holds them beside the block's other terms,
    # else in host memory, else on disk; away from the device, one sample's input and output are there at a time.
    gpu_rest = block * 2 + hessian + forward
    one = 2 * seq * hidden * dsize
    host_rest = base + max(loop_host - (0 if on_gpu else acts), write_host)
    if on_gpu:
        room = torch.cuda.get_device_properties(device).total_memory - gpu_rest
    else:
        room = host_memory() - host_rest
    place = choose_place(acts, device, room, host_memory() - host_rest) if acts else "device"
    if place == "host":
        loop_host += acts
    elif place == "disk" and not on_gpu:
        loop_host += one - acts
    terms = {
        "process": base,
        "outside_blocks": outer_c,
        "one_block": block,
        "activations": acts,
        "hessians_and_solver": hessian,
        "forward": forward,
        "write_shard": shard,
    }
    host = base + max(loop_host, write_host)
    gpu = gpu_rest + (acts if place == "device" else one) if on_gpu else None
    seconds = (
        _seconds(device, dtype, len(blocks), block_params, widths, samples, seq, hidden) if timing else None
    )
    return Estimate(host, gpu, out_bytes, seconds, terms, len(blocks), acts, block, hessian, place)


def _matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """Multiply-adds per second of a [512, 1024] x [1024, 1024] product on `device`, timed for about 0.2 s."""
    a = torch.randn(512, 1024, device=device, dtype=dtype)
    b = torch.randn(1024, 1024, device=device, dtype=dtype)
    a @ b
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.2:
        a @ b
        n += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return n * 512 * 1024 * 1024 / (time.perf_counter() - t0)


def _seconds(device, dtype, num_blocks, block_params, widths, samples, seq, hidden) -> float | None:
    tokens = samples * seq
    # About 3.5 forwards of each block per sample (the sequential groups stop early, then the outputs), the
    # Hessian updates (tokens x K^2 per linear) and the solve (about 3 K^3 + 2 N K^2 per linear).
    macs = 3.5 * tokens * block_params + 3.5 * samples * seq * seq * hidden
    for m in widths.values():
        k, n = m.in_features, m.out_features
        macs += (tokens * k * k if tokens else 0) + 3 * k**3 + 2 * n * k * k
    try:
        rate = _matmul_rate(device, dtype if dtype != torch.float64 else torch.float32)
    except RuntimeError:
        return None
    return num_blocks * macs / rate


def check_fits(est: Estimate, recipe, out: Path) -> None:
    """Refuse, in one line with the reason and what to change, a run this machine cannot hold."""
    cal = recipe.calibration
    shape = f"{cal.num_samples} x {cal.seq_len} calibration tokens" if cal is not None else "no calibration"
    have = host_memory()
    if est.activations == "disk":
        where = Path(os.path.abspath(out)).parent
        while not where.exists():
            where = where.parent
        free = shutil.disk_usage(where).free
        if est.activation_bytes > free:
            raise ResourceError(
                f"needs about {format_size(est.activation_bytes)} for the activations of {shape}, more "
                f"than the host memory ({format_size(have)}) and the free disk beside the output "
                f"({format_size(free)} in {where}) hold; lower --num-samples or --seq-len"
            )
    if est.host_bytes > have:
        raise ResourceError(
            f"needs about {format_size(est.host_bytes)} host memory ({format_size(est.activation_bytes)} of "
            f"activations for {shape}, {format_size(est.block_bytes)} per block, "
            f"{format_size(est.hessian_bytes)} of Hessians); this machine has {format_size(have)}; lower "
            f"--num-samples or --seq-len"
        )
    if est.gpu_bytes is not None:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        if est.gpu_bytes > total:
            raise ResourceError(
                f"needs about {format_size(est.gpu_bytes)} GPU memory for one block's weights, Hessians "
                f"and the activations of {shape}; this GPU has {format_size(total)}; lower "
                f"--num-samples or --seq-len"
            )


# ---- the dry run's figures, once the pre-flight has read the text ------------------------------------------------

# A block is timed on this machine when the multiply-count model puts its quantization under this many seconds
# (a larger one is costly to time, and its time is then mostly multiplies, which that model counts).
MEASURE_SECONDS = 3.0


def high_water_rss() -> int:
    """This process's peak resident memory so far, in bytes."""
    from qtool.console import peak_rss_mb

    return int(peak_rss_mb() * 2**20)


def refine(
    est: Estimate,
    recipe,
    prepared,
    device: torch.device,
    run_eval: bool,
    samples: int | None = None,
) -> Estimate:
    """`est` (made before the text was read) with what the dry run then measured here: the host peak includes
    tokenizing the calibration text (this process's high-water mark), the evaluation's (its text tokenized the same
    way, scaled by its size, and the models it loads), and the time comes from quantizing one block of the model's
    shapes (random weights) with the recipe's own stages on one and on a few calibration windows, scaled to the
    run; a block too large to time quickly falls back to the multiply count. Rough either way: the machine's load
    changes, and zero-shot tasks are not counted."""
    from qtool.pipeline import compute_dtype

    cal, ev = recipe.calibration, recipe.eval
    samples = (
        (cal.num_samples if samples is None else samples)
        if cal is not None and recipe.needs_calibration()
        else 0
    )
    dtype = compute_dtype(recipe.settings.dtype, device, config_dtype(prepared.config))
    dsize = torch.empty((), dtype=dtype).element_size()
    base, now = est.terms["process"], current_rss()
    # Tokenizing holds several copies of the text per token (normalized strings, offsets) for a moment.
    transient = max(high_water_rss() - base, 0)
    per_char = transient / prepared.text_bytes if prepared.text_bytes else 0.0
    host = max(high_water_rss(), now + est.host_bytes - base)
    evaluated = run_eval and ev is not None and ev.text is not None
    ev_chars = _text_chars(ev.text) if evaluated else 0
    if evaluated:
        params = _numel(prepared.meta.parameters())
        logits = 3 * min(ev.batch_size, 64) * ev.seq_len * prepared.config.vocab_size * 4
        # Two models' weights: the original, then the checkpoint with a dense copy of its quantized linears (the
        # reference path). Text split at a separator is tokenized in pieces, whose peak measured about half the
        # whole's.
        share = 0.5 if ev.separator is not None else 1.0
        host = max(host, now + int(per_char * ev_chars * share) + 2 * params * dsize + logits)
    terms = {**est.terms, "tokenizing": transient}

    seconds, parts = est.seconds, None
    timed = _time_block(recipe, prepared, device, dtype, samples) if seconds is not None else None
    if timed is not None:
        capture, fixed, per_sample, block_fwd, model_fwd = timed
        n = est.num_blocks
        parts = {
            # the run's pre-flight: without the dry run's own measuring of this machine
            "preflight": prepared.seconds - prepared.check_seconds,
            "calibration": capture * samples,
            "blocks": n * (fixed + per_sample * samples),
        }
        if evaluated:
            per_token = prepared.text_tokens / prepared.text_bytes if prepared.text_bytes else 0.25
            stride = ev.stride or ev.seq_len
            windows = max(1, int(ev_chars * per_token) // stride)
            if ev.max_windows is not None:
                windows = min(windows, ev.max_windows)
            tokenizing = prepared.tokenize_seconds * ev_chars / max(prepared.text_bytes, 1)
            scale = ev.seq_len / (cal.seq_len if cal is not None else 128)  # measured on calibration windows
            parts["eval"] = 2 * (tokenizing + windows * scale * (model_fwd + (n - 1) * block_fwd))
        parts = {k: round(v, 2) for k, v in parts.items()}
        seconds = sum(parts.values())
    elif seconds is not None:
        seconds += prepared.seconds - prepared.check_seconds
    return dataclasses.replace(est, host_bytes=int(host), seconds=seconds, terms=terms, time_terms=parts)


def _text_chars(ref: str) -> int:
    p = Path(ref)
    if p.is_file():
        return p.stat().st_size
    return 0  # a datasets name: its size is not known before it is read


def _time_block(recipe, prepared, device: torch.device, dtype: torch.dtype, samples: int):
    """(seconds per calibration window of the capture, of a block's quantization without and per window, of one
    block's forward and of the whole model's per window) measured on a one-block copy of the model with random
    weights; None when that copy is too large to time in a few seconds, or a stage refuses its random weights."""
    import copy

    from transformers import AutoModelForCausalLM

    from qtool.calibration.capture import block_output, capture_block_inputs
    from qtool.models.loading import adapter_of, with_expert_linears
    from qtool.pipeline import _Blocks

    config, meta = prepared.config, prepared.meta
    adapter = adapter_of(config)
    if isinstance(adapter, str):
        return None  # no adapter: the pre-flight has refused the model already
    n = config.num_hidden_layers
    blocks = adapter.blocks(meta)
    block_params = _numel(blocks[0].parameters())
    outer = _numel(meta.parameters()) - block_params * n
    dsize = torch.empty((), dtype=dtype).element_size()
    if (block_params + outer) * dsize > min(2 * 2**30, host_memory() // 8):
        return None
    seq = recipe.calibration.seq_len if recipe.calibration is not None else 128
    widths = {rel: blocks[0].get_submodule(rel) for rel in adapter.linear_names()}
    guess = _seconds(device, dtype, 1, block_params, widths, min(samples, 4) or 1, seq, config.hidden_size)
    if guess is None or guess > MEASURE_SECONDS:
        return None
    one = copy.deepcopy(config)
    one.num_hidden_layers = 1
    for key in ("layer_types",):  # per-layer lists some configs carry
        if isinstance(getattr(one, key, None), list):
            setattr(one, key, getattr(one, key)[:1])
    try:
        torch.manual_seed(0)
        replica = with_expert_linears(AutoModelForCausalLM.from_config(one, dtype=dtype)).eval()
        run = _Blocks(recipe, adapter, replica.config, n, device)
        run.apply_outer(replica)
        # the block whose linears the stages claim most of
        index = max(
            range(n), key=lambda i: sum(f"{adapter.block_prefix(i)}.{r}" in run.assignment for r in widths)
        )
        if prepared.windows is not None:
            windows = prepared.windows[: max(1, min(samples, 4))]
        else:
            windows = torch.randint(0, config.vocab_size, (1, seq))
        block = adapter.blocks(replica)[0]

        def clock(fn) -> float:
            best = float("inf")
            for _ in range(2):  # the faster of two: the first pays for warming up
                t = time.perf_counter()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                best = min(best, time.perf_counter() - t)
            return best

        out: dict = {}

        def capture():
            out["inputs"], out["kwargs"] = capture_block_inputs(
                replica, adapter.blocks(replica), windows, device
            )

        capture_s = clock(capture) / len(windows)
        inputs, kwargs = out["inputs"], out["kwargs"][0]  # the replica's one block

        b = block.to(device)
        with torch.no_grad():
            block_fwd = clock(lambda: block_output(b(inputs[0], **kwargs)))

        def quantize(k: int) -> tuple[float, float]:
            """(seconds, of which in the statistics passes) of quantizing the block on `k` windows."""
            c = copy.deepcopy(block).to(device)
            stats = run.seconds["stats_s"]
            t = time.perf_counter()
            for tr in run.transforms:
                tr.apply_block_weights(c, index, adapter)
            run.quantize(c, index, inputs[:k], kwargs, [])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter() - t, run.seconds["stats_s"] - stats

        quantize(1)  # warming up (first calls, allocations)
        k = len(inputs)
        total, stats = quantize(k)
        # Per window: the statistics passes, and the block's output when a later block needs it; the rest (the
        # solves) is the block's, whatever the number of windows.
        out_fwd = block_fwd if index < run.last_needing else 0.0
        per_sample = stats / k + out_fwd
        fixed = max(total - k * per_sample, 0.0)
        with torch.no_grad():  # per window, in a batch of them as perplexity runs them
            replica.to(device)
            model_fwd = clock(lambda: replica(windows.to(device), use_cache=False)) / len(windows)
    except (RuntimeError, ValueError, TypeError, AttributeError, QtoolError):
        return None  # the estimate then counts multiplies; the run itself says what is wrong
    return capture_s, fixed, per_sample, block_fwd, model_fwd
