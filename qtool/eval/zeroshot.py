"""Zero-shot (and few-shot) accuracy through lm-evaluation-harness, offline, on the model as loaded.

lm-eval builds the requests, batches them, scores and aggregates (acc, acc_norm, LAMBADA's last-word accuracy and
perplexity, standard errors); qtool hands it the loaded model instance and its tokenizer through lm-eval's Hugging
Face LM class, so a packed checkpoint is measured through the forward a user deploys: its CUDA kernels on a GPU,
the torch reference on CPU.

The standard tasks ship in `qtool/eval/tasks/` as lm-eval task YAMLs with lm-eval's own prompts, choices and
metrics, reading local JSONL files instead of the hub. At run time each is included from a generated YAML that
adds the absolute path of its data file (`--data-dir`, `QTOOL_ZEROSHOT_DATA`, or the shared assets beside the
checkout), and lm-eval's task manager loads them from that folder plus any `--include-path` of the user's own.
A task folder is code: lm-eval runs the Python functions its YAMLs name (`!function utils.process_docs`).

Items longer than the model's context: lm-eval's Hugging Face model truncates the context from the left and
scores the continuation; a continuation (an answer choice) longer than the context cannot be scored, and is
refused in one line naming the task and item before anything is scored.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

import torch

from qtool.console import Reporter
from qtool.errors import InputError, QtoolError, UsageError

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
DATA_ENV = "QTOOL_ZEROSHOT_DATA"

# Standard task -> (file in the data folder, keys every line must have).
STANDARD_TASKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "piqa": ("piqa.jsonl", ("query", "choices", "gold")),
    "arc_easy": ("arc_easy.jsonl", ("query", "choices", "gold")),
    "arc_challenge": ("arc_challenge.jsonl", ("query", "choices", "gold")),
    "winogrande": ("winogrande.jsonl", ("context_options", "continuation", "gold")),
    "hellaswag": ("hellaswag_val_subset1000.jsonl", ("activity_label", "ctx_a", "ctx_b", "endings", "label")),
    "lambada_openai": ("lambada_openai.jsonl", ("context", "continuation")),
}
MAX_SEED = 2**32 - 1
PERPLEXITY_BATCH = 4  # windows per forward when --batch-size is auto or not given
TASK_BATCH = 32  # lm-eval requests per forward when --batch-size is not given


def default_data_dir() -> Path:
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env).expanduser().resolve()
    assets = os.environ.get("QTOOL_ASSETS")
    if assets:
        return Path(assets).expanduser().resolve() / "data" / "zeroshot"
    # A checkout (or editable install) sits beside ../shared/assets.
    return (Path(__file__).resolve().parents[3] / "shared" / "assets" / "data" / "zeroshot").resolve()


def parse_batch_size(value: str | int | None, where: str = "--batch-size") -> int | str | None:
    if value is None or isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        if value.strip().isdigit() and int(value) >= 1:
            return int(value)
    raise UsageError(f"{where}: found {value!r}, expected a positive integer or auto")


def check_data_file(path: Path, keys: tuple[str, ...]) -> str:
    """Check every line of a task's JSONL (so a bad file fails before the model loads); return its sha256."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InputError(
            f"{path}: file not found; expected the task's JSONL (set --data-dir or {DATA_ENV})"
        ) from None
    except OSError as e:
        raise InputError(
            f"{path}: cannot be read ({e.strerror or e}); expected a readable JSONL file"
        ) from None
    lines = 0
    for n, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(
                f"{path}:{n}: found malformed JSON ({e.msg} at column {e.colno}), expected one JSON "
                f"object per line"
            ) from None
        if not isinstance(row, dict) or any(k not in row for k in keys):
            found = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
            raise InputError(f"{path}:{n}: found {found or 'no keys'}, expected keys {', '.join(keys)}")
        lines += 1
    if not lines:
        raise InputError(f"{path}: found no rows, expected one JSON object per line")
    return hashlib.sha256(raw).hexdigest()[:16]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _yaml_problem(e: BaseException) -> str:
    """A YAML error's problem and where it is (its message's first line only says what was being parsed)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is not None and problem:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    reason, position = getattr(e, "reason", None), getattr(e, "position", None)
    if reason and isinstance(position, int):  # bytes that are no text
        return f"{reason} at byte {position}"
    return f"{type(e).__name__}: {_first_line(e)}"


def _quiet_lm_eval() -> None:
    import logging

    # lm-eval logs every task it builds and every few-shot override at WARNING/INFO; qtool prints the protocol.
    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.ERROR)


@contextmanager
def _offline_datasets():
    """Nothing is downloaded while tasks load: the standard tasks read local files, and a user's task that names a
    hub dataset fails with datasets' own reason instead of fetching it."""
    import datasets

    saved = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = saved


@contextmanager
def _own_line(sink):
    """lm-eval's progress bars end without a newline when it stops: the error line that follows starts a line of
    its own."""
    try:
        yield
    except BaseException:
        if sink is sys.stderr:
            sink.write("\n")
            sink.flush()
        raise


def require_lm_eval() -> None:
    """lm-eval is the `eval` extra (it pins packages a user's other tools may pin otherwise): a one-line error
    naming the extra when it is missing."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        from qtool.errors import ResourceError

        raise ResourceError(
            "--tasks: zero-shot tasks run through lm-evaluation-harness, which is not installed; expected "
            "pip install 'qtool[eval]' (or lm-eval>=0.4.13)"
        )


class TaskSuite:
    """The requested tasks, checked and loadable by lm-eval's task manager. Use as a context manager: the generated
    task folder lives until the suite is closed."""

    def __init__(
        self,
        tasks: list[str],
        *,
        limit: int | None = None,
        num_fewshot: int = 0,
        batch_size: int | str | None = None,
        seed: int = 1234,
        data_dir: str | Path | None = None,
        include_paths: list[str] | tuple[str, ...] = (),
    ) -> None:
        self.check_values(limit, num_fewshot, seed)
        names = [t.strip() for t in tasks if t.strip()]
        if not names:
            raise UsageError(
                "--tasks: found no task names, expected a comma-separated list such as piqa,arc_easy"
            )
        self.names = list(dict.fromkeys(names))
        self.limit = limit
        self.num_fewshot = num_fewshot
        self.batch_size = parse_batch_size(batch_size) or TASK_BATCH
        self.seed = seed
        self.data_dir = Path(data_dir).expanduser().resolve() if data_dir else default_data_dir()
        self.include_paths = [Path(p).expanduser().resolve() for p in include_paths]
        for p in self.include_paths:
            if not p.is_dir():
                raise InputError(
                    f"--include-path: '{p}' is not a directory; expected a folder of lm-eval task YAMLs"
                )
        self._tmp = tempfile.TemporaryDirectory(prefix="qtool-tasks-")
        self.data: dict[str, dict] = {}
        try:
            self._prepare()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def check_values(limit: int | None, num_fewshot: int, seed: int) -> None:
        """The numbers of a task protocol, checked before anything is read."""
        if limit is not None and limit < 1:
            raise UsageError(f"--limit: found {limit}, expected a positive number of items per task")
        if num_fewshot < 0:
            raise UsageError(f"--num-fewshot: found {num_fewshot}, expected 0 or more")
        if not 0 <= seed <= MAX_SEED:
            # lm-eval seeds numpy with it, which takes 32 bits
            raise UsageError(f"--fewshot-seed: found {seed}, expected an integer in 0..{MAX_SEED}")

    def __enter__(self) -> TaskSuite:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._tmp.cleanup()

    def _check_task_files(self) -> None:
        """Every YAML under the user's task folders is one lm-eval can read: its task index skips a file that does
        not parse without a word (at debug level), and the task was then reported as unknown."""
        try:
            from lm_eval.tasks._index import TaskIndex
            from lm_eval.tasks._yaml_loader import load_yaml
        except ImportError:  # another lm-eval layout: its own messages stand
            return
        for root in self.include_paths:
            for path in TaskIndex._iter_yaml_files(root):
                # Functions stay unresolved, as lm-eval's index reads them: no task code runs here. The errors are
                # YAML's, a missing include's, or a config's that lm-eval's index cannot place.
                try:
                    TaskIndex.process_cfg(load_yaml(path, resolve_func=False, recursive=True), path, {})
                except Exception as e:
                    raise InputError(
                        f"--include-path: {path}: lm-eval cannot read this task file ({_yaml_problem(e)}); "
                        f"expected an lm-eval task YAML"
                    ) from None

    def _prepare(self) -> None:
        require_lm_eval()
        _quiet_lm_eval()
        from lm_eval.tasks import TaskManager

        self._check_task_files()
        user_tasks = (
            TaskManager(include_path=[str(p) for p in self.include_paths], include_defaults=False)
            if self.include_paths
            else None
        )
        user_names = set(user_tasks.all_tasks) if user_tasks else set()
        # Standard tasks a user's folder redefines are the user's.
        standard = [n for n in STANDARD_TASKS if n not in user_names]
        available = sorted(set(standard) | user_names)
        unknown = [n for n in self.names if n not in available]
        if unknown:
            raise UsageError(f"--tasks: unknown task {unknown[0]!r}; expected one of {', '.join(available)}")
        gen = Path(self._tmp.name)
        for name in self.names:
            if name not in standard:
                continue
            file, keys = STANDARD_TASKS[name]
            path = self.data_dir / file
            self.data[name] = {"file": str(path), "sha256": check_data_file(path, keys)}
            (gen / f"{name}.yaml").write_text(
                f"include: {json.dumps(str(TASKS_DIR / f'{name}.yaml'))}\n"
                f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(path))}\n"
            )
        self.manager = TaskManager(
            include_path=[str(gen), *map(str, self.include_paths)], include_defaults=False
        )
        # A config or data file lm-eval rejects fails here, before any model loads; so does a few-shot count the
        # task cannot draw (lm-eval would stop with an assertion in the middle of building its requests).
        for name, task in self.load().items():
            self._check_fewshot(name, task)

    def _check_fewshot(self, name: str, task) -> None:
        if not self.num_fewshot:
            return
        try:
            docs = task.fewshot_docs()
            pool = 0 if docs is None else len(docs)
        except (TypeError, ValueError):
            return  # a task whose examples are computed by its own code: lm-eval says what goes wrong
        # The examples of an item are drawn from the same split without the item itself.
        if self.num_fewshot + 1 > pool:
            raise UsageError(
                f"--num-fewshot: found {self.num_fewshot}, but task {name} has {pool} items to draw "
                f"examples from; expected at most {max(pool - 1, 0)}"
            )

    def load(self) -> dict:
        """Fresh lm-eval Task objects (requests are built into them, so each evaluation gets its own)."""
        with _offline_datasets():
            try:
                return self.manager.load(self.names)["tasks"]
            except QtoolError:
                raise
            except Exception as e:  # lm-eval and datasets raise many types; the reason is the message
                raise InputError(
                    f"--tasks: lm-eval cannot load {', '.join(self.names)} ({type(e).__name__}: "
                    f"{_first_line(e)})"
                ) from None

    def protocol(self) -> dict:
        return {
            "tasks": self.names,
            "limit": self.limit,
            "num_fewshot": self.num_fewshot,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "data": self.data,
            "include_paths": [str(p) for p in self.include_paths],
        }


def runtime_of(model: torch.nn.Module, device: torch.device) -> str:
    """Which forward the quantized linears take: their CUDA kernels, or the torch reference path."""
    from qtool.layouts.module import PackedLinear as packed

    if not any(isinstance(m, packed) for m in model.modules()):
        return "float (no packed layers)"
    from qtool.layouts.vq.module import VQLinear  # no CUDA kernel yet

    if device.type != "cuda" or all(
        isinstance(m, VQLinear) for m in model.modules() if isinstance(m, packed)
    ):
        return "torch reference"
    from qtool.cuda.compile import cupy_available, kernel_mode

    if kernel_mode() == "reference" or not cupy_available():
        return "torch reference"
    return "cuda kernels"


def _context_checked(HFLM):
    """HFLM that looks at every log-likelihood request before scoring any: a continuation longer than the model's
    context is refused (lm-eval stops on an assertion once scoring has begun: an internal error), and the
    requests whose context lm-eval will truncate from the left are counted per task."""

    class ContextChecked(HFLM):
        _instances = None

        def __init__(self, *a, sources: dict[str, str] | None = None, **k) -> None:
            super().__init__(*a, **k)
            self.sources = sources or {}  # task -> its data file, for messages
            self.truncated: dict[str, int] = {}

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            # The tokenized requests reach `_loglikelihood_tokens` in this order, without their task names.
            self._instances = requests
            try:
                return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
            finally:
                self._instances = None

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
            instances = self._instances
            if instances is not None and len(instances) == len(requests):
                self._instances = None
                self._check_lengths(instances, requests)
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)

        def _check_lengths(self, instances, requests) -> None:
            limit = self.max_length
            too_long: dict[str, list] = {}  # task -> (item, tokens) of each continuation that cannot fit
            for inst, (_, context, continuation) in zip(instances, requests, strict=True):
                task = getattr(inst, "task_name", None) or "?"
                if len(continuation) > limit:
                    too_long.setdefault(task, []).append((getattr(inst, "doc_id", -1), len(continuation)))
                elif len(context) + len(continuation) > limit + 1:
                    self.truncated[task] = self.truncated.get(task, 0) + 1
            if not too_long:
                return
            task, items = sorted(too_long.items())[0]
            item, tokens = min(items)
            where = f" ({self.sources[task]})" if task in self.sources else ""
            # Items are the task's documents in order, which --limit takes from the start.
            limit_hint = f", or --limit {item} to score the items before it" if item > 0 else ""
            others = len({i for i, _ in items}) - 1
            more = f" (and {others} later items)" if others else ""
            raise InputError(
                f"--tasks: task {task}{where}, item {item}{more}: a continuation of {tokens} tokens, longer than "
                f"the model's context of {limit}; expected at most {limit} (lm-eval truncates only the context): "
                f"a model with a longer context{limit_hint}"
            )

    return ContextChecked


def wrap_model(model, tokenizer, batch_size: int | str = TASK_BATCH, sources: dict[str, str] | None = None):
    """lm-eval's Hugging Face LM around a loaded model instance (float or packed) and its tokenizer; `truncated`
    counts, per task, the requests whose context was cut from the left to fit the model's context. `sources`: each
    task's data file, named by the refusal of an item that cannot fit."""
    _quiet_lm_eval()
    from lm_eval.models.huggingface import HFLM

    # Log-softmax in float32: float16 logits (CUDA) would otherwise be normalized in float16.
    return _context_checked(HFLM)(
        pretrained=model,
        tokenizer=tokenizer,
        batch_size=batch_size,
        softmax_dtype=torch.float32,
        sources=sources,
    )


def evaluate_tasks(
    model, tokenizer, suite: TaskSuite, device: torch.device, reporter: Reporter | None = None
) -> dict:
    import lm_eval
    from lm_eval import simple_evaluate

    t0 = time.perf_counter()
    lm = wrap_model(model, tokenizer, suite.batch_size, {t: d["file"] for t, d in suite.data.items()})
    if getattr(model, "hf_device_map", None):
        # Spread by accelerate over device, host and disk: lm-eval takes the device of the first parameter,
        # which may be on meta (offloaded); the hooks move each module's weights to `device` for its forward.
        lm._device = torch.device(device)
    if reporter:
        reporter.log(
            f"zero-shot tasks {', '.join(suite.names)} (limit {suite.limit}, {suite.num_fewshot}-shot)"
        )
    quiet = reporter is None or reporter.quiet
    # lm-eval prints (bootstrap notices) and draws tqdm bars; stdout carries only qtool's result (JSON with --json).
    sink = open(os.devnull, "w") if quiet else sys.stderr
    try:
        with redirect_stdout(sink), redirect_stderr(sink), _offline_datasets(), _own_line(sink):
            res = simple_evaluate(
                model=lm,
                tasks=list(suite.load().values()),
                num_fewshot=suite.num_fewshot,
                limit=suite.limit,
                log_samples=False,
                task_manager=suite.manager,
                random_seed=suite.seed,
                numpy_random_seed=suite.seed,
                torch_random_seed=suite.seed,
                fewshot_random_seed=suite.seed,
            )
    finally:
        if sink is not sys.stderr:
            sink.close()
    protocol = {
        **suite.protocol(),
        "batch_size": lm.batch_size if suite.batch_size == "auto" else suite.batch_size,
        "lm_eval_version": lm_eval.__version__,
        "task_versions": res["versions"],
        "device": str(device),
        "runtime": runtime_of(model, device),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if lm.truncated:
        protocol["truncated_from_left"] = dict(sorted(lm.truncated.items()))
        if reporter:
            reporter.log(
                "longer than the model's context, their context truncated from the left (as lm-eval does): "
                + ", ".join(f"{n} requests of {task}" for task, n in sorted(lm.truncated.items()))
            )
    return {
        "results": res["results"],
        "versions": res["versions"],
        "n-shot": res["n-shot"],
        "higher_is_better": res["higher_is_better"],
        "n-samples": res["n-samples"],
        "protocol": protocol,
    }


def metrics(results: dict) -> dict[str, dict[str, dict[str, float | None]]]:
    """{task: {metric: {"value", "stderr"}}} from lm-eval's results dict (keys like "acc,none", "acc_stderr,none")."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for task, row in results.items():
        for key, value in row.items():
            metric, _, filt = key.partition(",")
            if not filt or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = row.get(f"{metric}_stderr,{filt}")
            out.setdefault(task, {})[metric] = {
                "value": float(value),
                "stderr": float(stderr) if isinstance(stderr, (int, float)) else None,
            }
    return out
