"""Zero-shot evaluation of checkpoints with lm-evaluation-harness: checkpoints -> HFLM -> result records.

`evaluate_checkpoints` is the entry point. lm-eval, torch and transformers are imported inside the
functions, so importing this module is cheap. Task names and aliases live in `tasks`, checkpoint
lookup and loading in `checkpoint`, result records and JSON in `results` (all in this package).
"""

from __future__ import annotations

import contextlib
import gc
import io
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from merit_core.devices import resolve_device
from merit_core.errors import ConfigError
from merit_core.evaluation.backends import (
    HF,
    VLLM,
    ModelArgs,
    build_split_lm,
    build_vllm,
    check_model_args,
    splits_model,
)
from merit_core.evaluation.checkpoint import (
    CheckpointRef,
    check_causal_lm,
    check_tokenizer,
    load_model_and_tokenizer,
    load_tokenizer,
    resolve_checkpoint,
    resolve_dtype,
)
from merit_core.evaluation.lm_eval_output import DEFAULT_SEED, EVAL_SECONDS, parse_seed, seed_kwargs
from merit_core.evaluation.results import CheckpointResult
from merit_core.evaluation.tasks import (
    check_counts,
    check_fewshot_docs,
    load_tasks,
    resolve_tasks,
)
from merit_core.progress import Progress, ProgressFn
from merit_core.values import in_range, parse_number

CPU_BATCH_SIZE = 8  # what batch size "auto" means on CPU (lm-eval's search for the largest one is for GPUs)
REQUEST_TYPES = ("loglikelihood", "loglikelihood_rolling", "generate_until")


@dataclass(frozen=True)
class EvalSettings:
    """What to evaluate and how; the defaults are the paper's zero-shot protocol."""

    tasks: Sequence[str]
    include_path: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    batch_size: int | str = "auto"
    limit: int | None = None
    num_fewshot: int = 0
    bootstrap_iters: int = 100000  # lm-eval's default
    trust_remote_code: bool = False  # run code shipped with a checkpoint (auto_map): only on explicit request
    verify: bool = True  # check a merit checkpoint's files against the checksums it recorded
    log_samples: bool = False  # keep lm-eval's per-document records (written by --output_path)
    seed: tuple[int | None, ...] = DEFAULT_SEED  # lm-eval's python, numpy, torch and few-shot seeds
    backend: str = HF  # lm-eval's model class: hf (HFLM) or vllm (merit_core.evaluation.backends)
    model_args: ModelArgs = ()  # lm-eval's placement keys (parallelize=True, tensor_parallel_size=2, ...)

    def validated(self) -> EvalSettings:
        """Raise ConfigError for values lm-eval would reject late or silently misread."""
        check_counts(self.limit, self.num_fewshot)
        if self.limit is not None and (
            isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1
        ):
            raise ConfigError(f"--limit must be a positive number of documents per task, got {self.limit}")
        if self.num_fewshot < 0:
            raise ConfigError(f"--num-fewshot must be 0 or more, got {self.num_fewshot}")
        if self.bootstrap_iters < 0:
            raise ConfigError(f"--bootstrap-iters must be 0 or more, got {self.bootstrap_iters}")
        parse_batch_size(self.batch_size)
        resolve_dtype(self.dtype, "cpu")  # an unknown dtype name fails before anything is loaded
        check_model_args(self.backend, self.model_args)
        for value in parse_seed(self.seed):  # numpy and torch take a seed of 32 bits
            if value is not None:
                in_range(value, 0, SEED_MAX, "--seed")
        return self


SEED_MAX = 2**32 - 1  # the largest seed numpy's legacy seeding (which lm-eval calls) accepts

EvalProgress = Progress  # the former name of eval's progress event (merit_core.progress.Progress)


def parse_batch_size(value: int | str) -> int | str:
    """'auto' or a positive int (also given as a string)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        size = parse_number(value, int, "--batch-size")  # ASCII digits only
    except ConfigError:
        raise ConfigError(f"--batch-size must be 'auto' or a positive integer, got {value!r}") from None
    if size < 1:
        raise ConfigError(f"--batch-size must be 'auto' or a positive integer, got {value!r}")
    return size


@dataclass
class _Run:
    settings: EvalSettings
    progress: ProgressFn | None
    refs: list[CheckpointRef] = field(default_factory=list)

    def report(self, stage: str, index: int | None = None, **kw: Any) -> None:
        """Report `stage` (of checkpoint `index`; None: a stage of all checkpoints at once)."""
        if self.progress is None:
            return
        if index is not None:
            kw.update(item=self.refs[index].label, index=index, count=len(self.refs))
        self.progress(Progress(stage, **kw))


def _request_size(instance: Any) -> int:
    return sum(len(a) for a in instance.args if isinstance(a, str))


def report_request_progress(lm: Any, progress: ProgressFn, min_chunk: int = 512) -> None:
    """Make `lm` score requests in chunks and report `Progress('<type> requests', done, total)` after each.

    Each request's score does not depend on the others, so the results are those of one call; the
    chunks (about 40 per call) only give the progress display something to count. Loglikelihood and
    generation requests are cut longest first, as HFLM sorts them anyway; rolling ones (which HFLM
    batches in request order) are cut in order.
    """
    for request_type in REQUEST_TYPES:
        original = getattr(lm, request_type, None)
        if original is None:
            continue

        def chunked(
            requests: list[Any], disable_tqdm: bool = False, _original: Any = original, _type: str = request_type
        ) -> list[Any]:
            total = len(requests)
            order = list(range(total))
            if _type != "loglikelihood_rolling":
                order.sort(key=lambda i: -_request_size(requests[i]))
            size = max(min_chunk, math.ceil(total / 40))
            out: list[Any] = [None] * total
            progress(Progress(f"{_type} requests", 0, total, unit="requests"))
            for start in range(0, total, size):
                part = order[start : start + size]
                for i, result in zip(part, _original([requests[i] for i in part], disable_tqdm=True)):
                    out[i] = result
                progress(Progress(f"{_type} requests", min(start + size, total), total, unit="requests"))
            return out

        setattr(lm, request_type, chunked)


def build_lm(model: Any, tokenizer: Any, batch_size: int | str, device: str) -> tuple[Any, int | str]:
    """An lm-eval HFLM around an in-memory model; 'auto' becomes a fixed size (searched once on GPU).

    A bf16/fp16 model gets its log-softmax in fp32, so perplexities keep their precision.
    """
    import torch
    from lm_eval.models.huggingface import HFLM

    if batch_size == "auto" and not device.startswith("cuda"):
        batch_size = CPU_BATCH_SIZE
    half = next(model.parameters()).dtype in (torch.bfloat16, torch.float16)
    lm = HFLM(
        pretrained=model,
        tokenizer=tokenizer,
        backend="causal",
        batch_size=batch_size,
        max_batch_size=64,
        softmax_dtype=torch.float32 if half else None,
    )
    if batch_size == "auto":
        detect = getattr(lm, "_detect_batch_size", None)
        if detect is not None:  # one search at full context length instead of one per chunk of requests
            batch_size = int(detect())
            lm.batch_size_per_gpu = batch_size
    return lm, batch_size


def count_parameters(model: Any) -> int:
    """The number of parameters of a torch model (the eval meta's "parameters")."""
    return sum(p.numel() for p in model.parameters())


def build_device_lm(
    ref: CheckpointRef, settings: EvalSettings, device: str, dtype: str, note: Callable[[str], None] | None = None
) -> tuple[Any, int | str]:
    """lm-eval's HFLM for checkpoint `ref` on one device: merit loads the model itself (safetensors
    only, `dtype`, merit's checks) and hands it over; the batch size it scores with."""
    model, tokenizer = load_model_and_tokenizer(ref, device, dtype, settings.trust_remote_code, note)
    return build_lm(model, tokenizer, parse_batch_size(settings.batch_size), device)


class LmSource(Protocol):
    """Where a Scorer gets its lm-eval model object when not from this process's device: the request
    split's workers (merit_core.evaluation.request_split)."""

    def build(self, ref: CheckpointRef) -> tuple[Any, int | str]:
        """lm-eval's model object for `ref` and the batch size each device scores with."""
        ...

    def placement(self) -> dict[str, Any]:
        """What the eval meta records of the devices: {"split": ..., "workers": [...]}."""
        ...


@contextlib.contextmanager
def silenced(enabled: bool):
    """Swallow what the libraries print: Python-level (tqdm bars, bootstrap notices) and, on file
    descriptor 2, what their subprocesses write (lm-eval runs `git describe`, which complains outside a repo)."""
    if not enabled:
        yield
        return
    sink = io.StringIO()
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.redirect_stdout(sink))
        stack.enter_context(contextlib.redirect_stderr(sink))
        try:
            saved = os.dup(2)
        except OSError:
            saved = None
        if saved is not None:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.close(devnull)

            def restore() -> None:
                os.dup2(saved, 2)
                os.close(saved)

            stack.callback(restore)
        yield


@contextlib.contextmanager
def exact_float32(device: str, dtype: str):
    """float32 on CUDA means float32 products (no TF32, whatever the process enabled), so that the
    scores equal the CPU's; the previous setting is restored afterwards."""
    if not (device.startswith("cuda") and dtype == "float32"):
        yield
        return
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def evaluate_checkpoints(
    checkpoints: Sequence[str],
    settings: EvalSettings,
    progress: ProgressFn | None = None,
    quiet: bool = False,
    note: Callable[[str], None] | None = None,
) -> list[CheckpointResult]:
    """Evaluate each checkpoint on the settings' tasks; one result record per checkpoint, in order.

    All checkpoints, task names and datasets are checked before the first model is loaded, so bad
    input fails in seconds (CheckpointError, ConfigError, DataError) rather than after a long run.
    `quiet` swallows lm-eval's own prints and bars, file descriptor 2 included: a caller drawing its
    own progress must then write to a stream it holds on a duplicate of that descriptor. `note` is
    told, one line each, what the user should know: checksums not verified (said once), weights
    that leave a config's parameters at random init.
    """
    settings = settings.validated()
    refs = check_checkpoints(checkpoints, settings, progress, note)
    scorer = Scorer(settings, refs, progress, quiet, note)
    return [scorer.score(index) for index in range(len(refs))]


def check_checkpoints(
    checkpoints: Sequence[str],
    settings: EvalSettings,
    progress: ProgressFn | None = None,
    note: Callable[[str], None] | None = None,
) -> list[CheckpointRef]:
    """Resolve and check every checkpoint (files, checksums, config, tokenizer) before any is scored;
    `note` is told once what applies to several (checksums not verified)."""
    if not checkpoints:
        raise ConfigError("no checkpoint given: pass one or more model folders, run folders or hub names")
    refs = [resolve_checkpoint(c, settings.trust_remote_code, settings.verify, progress) for c in checkpoints]
    said = sorted({n for ref in refs for n in ref.notes})
    for text in said:
        who = [ref.label for ref in refs if text in ref.notes]
        if note is not None:
            note(f"{who[0] if len(who) == 1 else f'{len(who)} checkpoints'}: {text}")
    _Run(settings, progress, refs).report("checking checkpoints")
    for ref in refs:
        check_causal_lm(ref, settings.trust_remote_code)
        check_tokenizer(ref, settings.trust_remote_code)
    return refs


class Scorer:
    """Scores checkpoints of a checked list one at a time on the settings' device, the tasks loaded
    once (in `__init__`); a worker process of merit_core.evaluation.workers holds one. With a `source`
    the model object comes from there (the request split's workers, each checkpoint's requests shared
    over their devices) and lm-eval runs here."""

    def __init__(
        self,
        settings: EvalSettings,
        refs: Sequence[CheckpointRef],
        progress: ProgressFn | None = None,
        quiet: bool = False,
        note: Callable[[str], None] | None = None,
        source: LmSource | None = None,
    ):
        self.settings = settings
        self.source = source
        self.run = _Run(settings, progress, list(refs))
        self.quiet = quiet
        self.note = note
        self.model_args = check_model_args(settings.backend, settings.model_args)
        self.split = splits_model(settings.backend, self.model_args)
        self.device = str(resolve_device(settings.device))
        self.dtype = resolve_dtype(settings.dtype, self.device)
        self.run.report("loading tasks and datasets")
        with silenced(quiet):
            self.resolved = resolve_tasks(settings.tasks, settings.include_path)
            self.task_objects = load_tasks(self.resolved)
        check_fewshot_docs(self.task_objects, settings.num_fewshot)

    def score(self, index: int) -> CheckpointResult:
        """The result record of checkpoint `index` of the list."""
        import lm_eval

        run, settings, device = self.run, self.settings, self.device
        ref = run.refs[index]
        run.report("loading model", index)
        started = time.perf_counter()
        with silenced(self.quiet), exact_float32(device, self.dtype):
            lm, batch_size = self._build(ref) if self.source is None else self.source.build(ref)

            def on_requests(event: Progress, i: int = index) -> None:
                run.report(event.stage, i, done=event.done, total=event.total, unit=event.unit)

            report_request_progress(lm, on_requests)
            out = lm_eval.simple_evaluate(
                model=lm,
                tasks=self.task_objects,
                task_manager=self.resolved.manager,
                num_fewshot=settings.num_fewshot,
                limit=settings.limit,
                bootstrap_iters=settings.bootstrap_iters,
                log_samples=settings.log_samples,
                **seed_kwargs(parse_seed(settings.seed)),
            )
        out[EVAL_SECONDS] = time.perf_counter() - started  # lm-eval's results file's total_evaluation_time_seconds
        model = getattr(lm, "model", None)
        parameters = getattr(lm, "parameter_count", None)  # the request split's: the model is in its workers
        if parameters is None and model is not None and hasattr(model, "parameters"):
            parameters = count_parameters(model)
        placement = None if self.source is None else self.source.placement()
        meta = {
            **ref.meta,
            "model_type": check_causal_lm(ref, settings.trust_remote_code).model_type,
            "parameters": parameters,
            "eval": {
                "tasks": self.resolved.names,
                "num_fewshot": settings.num_fewshot,
                "limit": settings.limit,
                "device": device if placement is None else ",".join(placement["workers"]),
                "dtype": self.dtype,
                "batch_size": batch_size,
                "bootstrap_iters": settings.bootstrap_iters,
                "seed": list(parse_seed(settings.seed)),
                "lm_eval_version": out.get("lm_eval_version"),
                "n-shot": out.get("n-shot"),
                "n-samples": out.get("n-samples"),
                "higher_is_better": out.get("higher_is_better"),
                "versions": out.get("versions"),
            },
        }
        if settings.backend != HF or self.model_args:  # the model placement lm-eval was given
            meta["eval"]["model"] = {"backend": settings.backend, **self.model_args}
        if placement is not None:  # the devices that shared this checkpoint's requests
            meta["eval"]["devices"] = placement
        record = CheckpointResult(path=ref.location, label=ref.label, results=out["results"], meta=meta, lm_eval=out)
        run.report("done", index)
        del lm, model
        _release_memory(device)
        return record

    def _build(self, ref: CheckpointRef) -> tuple[Any, int | str]:
        """lm-eval's model object for `ref` and the batch size it scores with (merit_core.evaluation.backends)."""
        settings, device, dtype = self.settings, self.device, self.dtype
        batch_size = parse_batch_size(settings.batch_size)
        trust = settings.trust_remote_code
        if settings.backend == VLLM:
            return build_vllm(ref.location, self.model_args, dtype, batch_size, trust), batch_size
        if not self.split:
            return build_device_lm(ref, settings, device, dtype, self.note)
        tokenizer = load_tokenizer(ref, trust)
        if batch_size == "auto" and not device.startswith("cuda"):
            batch_size = CPU_BATCH_SIZE
        lm = build_split_lm(
            ref.location,
            tokenizer,
            self.model_args,
            backend="causal",
            device=device,
            dtype=dtype,
            batch_size=batch_size,
            max_batch_size=64,
            trust_remote_code=trust,
            softmax_dtype="float32" if dtype in ("bfloat16", "float16") else None,
        )
        return lm, batch_size


def _release_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
