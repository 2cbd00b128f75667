"""`run_training(config)`: a whole training run, from config to run directory.

The library entry point behind `merit train` (and the runs of `merit compare`): it checks the
input before writing anything, prepares the data, builds model and optimizer, resumes if
asked, trains with periodic logs / evals / checkpoints, and reports progress through
`TrainCallbacks` so that a front end can render it. Under torchrun every process calls it;
only the main process writes files and calls the callbacks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from merit_core import runs
from merit_core.errors import CheckpointError, ConfigError, DataError, MeritError
from merit_core.models import build_model, context_length, count_parameters, model_config
from merit_core.models.limits import check_model_config, check_model_size
from merit_core.progress import Progress
from merit_core.runs import CONFIG_FILE, RunInterrupted
from merit_core.train.config import TrainConfig, resolve, save_config
from merit_core.train.hardware import device_info, mfu, peak_memory, reset_peak_memory
from merit_core.train.metrics import METRICS_FILE, MetricsLog, read_metrics
from merit_core.train.plots import plot_curves

# Signals that stop training gracefully (finish the step, checkpoint, exit) and the exit code each gives.
STOP_SIGNALS = {"SIGTERM": 143, "SIGUSR1": 143, "SIGINT": 130}
MAX_BATCH_BYTES = 8 << 30  # token windows held at once (a micro-batch, the validation set)


class ResumeMismatch(CheckpointError):
    """The checkpoint was trained with other settings than this run has (not a corrupt checkpoint)."""


@dataclass
class RunInfo:
    """What a run is about to do (given to `TrainCallbacks.on_start`)."""

    run_dir: Path
    config: TrainConfig
    n_params: int
    n_layers: int
    start_step: int
    total_steps: int
    tokens_per_step: int
    world_size: int
    device: str
    data_dir: Path
    resumed_from: Path | None = None
    device_name: str = ""  # 'NVIDIA H200', or the CPU model
    compute_dtype: str = "float32"  # what the matrix products run in: 'bfloat16' (autocast) or 'float32'
    tf32: bool = False  # whether float32 matrix products may use TF32 (CUDA only)
    peak_flops: float | None = None  # the device's dense bf16 peak, for MFU (None on CPU)
    device_memory: int | None = None  # bytes of GPU memory (None on CPU)


@dataclass
class RunSummary:
    """How a run ended (`config` is the resolved config: actual lr, steps, micro-batch, out)."""

    run_dir: Path
    config: TrainConfig
    steps: int
    tokens: int
    n_params: int
    elapsed_s: float
    tokens_per_s: float | None
    final_loss: float | None
    final_val_loss: float | None
    max_attention_logit: list[float] | None
    last_checkpoint: Path | None
    resumed_from: Path | None = None
    checkpoints: list[Path] = field(default_factory=list)
    device: str = ""  # 'cuda:0', 'cpu'
    device_name: str = ""
    compute_dtype: str = "float32"
    peak_memory: int | None = None  # bytes: GPU memory allocated at peak, or the process's peak RSS on CPU
    mfu: float | None = None  # 6 * n_params * tokens_per_s / the device's bf16 peak (None on CPU)


class TrainCallbacks:
    """Progress hooks; override what you need. Called on the main process only."""

    def on_prepare(self, event: Progress) -> None:
        """Data preparation progress (merit_core.progress.Progress: `done` of `total` units of `stage`)."""

    def on_data(self, meta) -> None:
        """The prepared data is ready (`meta`: merit_core.data.DataMeta)."""

    def on_start(self, info: RunInfo) -> None:
        """Everything is built and checked; training starts at `info.start_step`."""

    def on_log(self, record: dict[str, Any]) -> None:
        """A log line: step, tokens, loss, lr, grad_norm, tokens_per_s."""

    def on_eval(self, record: dict[str, Any]) -> None:
        """An eval line: step, tokens, val_loss, max_attention_logit (per layer)."""

    def on_checkpoint(self, step: int, path: Path) -> None:
        """A checkpoint was written."""

    def on_end(self, summary: RunSummary) -> None:
        """The run finished normally."""

    def on_note(self, message: str) -> None:
        """Something the user should know that is not an error (one line), e.g. a resume fallback."""


def run_training(config: TrainConfig, callbacks: TrainCallbacks | None = None) -> RunSummary:
    """Train as `config` says; return the summary. Raises MeritError subclasses on bad input."""
    from merit_core.train.parallel import setup_parallel
    from merit_core.train.trackers import with_trackers  # trackers imports this module

    tracked = with_trackers(config.report_to, callbacks)  # a missing tracker package fails here, before any work
    parallel = setup_parallel(config.parallel, config.device, config.dtype)
    failed = True
    try:
        summary = TrainingRun(config, tracked, parallel).run()
        failed = False
        return summary
    finally:
        tracked.close(failed)
        parallel.close()


def _shared(parallel, fn: Callable[[], Any]) -> Any:
    """Run `fn` on the main process and give its result (or its MeritError) to every process."""
    result: Any = None
    if parallel.is_main:
        try:
            result = ("ok", fn())
        except MeritError as exc:
            result = ("error", exc)
    result = parallel.broadcast_object(result)
    if result[0] == "error":
        raise result[1]
    return result[1]


class TrainingRun:
    """One training run: check the input, prepare data, build, resume, then `train_loop` until done.

    The step mechanics (micro-batches, clipping, the optimizer update, evaluation) belong to the
    `Trainer` in `trainer.py`; this class owns the run around them: logs, evals and checkpoints
    on their cadence, and the callbacks a front end renders.
    """

    def __init__(self, config: TrainConfig, callbacks: TrainCallbacks, parallel):
        self.parallel = parallel
        self.cb = callbacks if parallel.is_main else TrainCallbacks()
        if config.resume_from and not config.resume:
            config = dataclasses.replace(config, resume=True)
        if config.resume and config.out is None:
            raise ConfigError("resume needs the run folder: give --out RUN_DIR")
        from merit_core.optim import canonical_name, default_hparams, resolve_hparams

        config = dataclasses.replace(config, optimizer=canonical_name(config.optimizer))
        resolve_hparams(config.optimizer, **config.optimizer_args)  # unknown hyperparameters fail here, early
        if config.parallel == "fsdp":
            from merit_core.train.fsdp import check_fsdp_optimizer

            check_fsdp_optimizer(config.optimizer)
        self.config = resolve(config, parallel.world_size, default_hparams(config.optimizer), auto_micro_batch=True)
        self.config.out = parallel.broadcast_object(self.config.out)
        self.run_dir = Path(self.config.out)
        self.lock: runs.FileLock | None = None
        self.created: list[Path] = []  # what this run made before its first write (undone on failure)
        self.stop: str | None = None  # the name of a stop signal that arrived
        self.resume_info: dict[str, Any] | None = None  # trainer_state.json of the checkpoint to resume
        self.resume_ckpt: Path | None = None

    # -- checks and building, before anything is written ---------------------------------------
    def _check(self) -> list[Path]:
        """Check the input and take the run folder; return the checkpoints to resume from, newest first."""
        c = self.config
        try:
            mconf = model_config(c.model)
        except MeritError:
            raise
        except Exception as exc:  # transformers' own config validation (types, values)
            raise ConfigError(f"model {c.model} is not a usable config: {_first_line(exc)}") from None
        check_model_config(mconf, c.model)
        check_model_size(mconf, c.model, bytes_per_parameter=8)  # built on the host: weights and gradients
        context = context_length(mconf)
        if c.seq_len > context:
            raise ConfigError(f"seq_len {c.seq_len} is beyond the context of {c.model} ({context} tokens)")
        micro = c.micro_batch_size or c.batch_size // self.parallel.world_size  # 'auto' tries the whole batch first
        windows = max(micro, c.eval_batches * c.eval_batch_size) * (c.seq_len + 1) * 8
        if windows > MAX_BATCH_BYTES:
            raise ConfigError(
                f"batch sizes too large: {windows / 2**30:.0f} GiB of token windows at once "
                "(micro_batch_size or eval_batches x eval_batch_size, times seq_len); lower them"
            )
        runs.check_out(self.run_dir)
        self._take_folder()  # a second writer stops here; what it made is undone if a check below fails
        if not c.resume and runs.checkpoints(self.run_dir, "complete"):
            raise ConfigError(
                f"{self.run_dir} already holds checkpoints; pass --resume to continue that run or choose another --out"
            )
        candidates = self._resume_candidates() if c.resume else []
        if candidates:
            self._check_resumable(candidates)
            self._check_metrics()
        return candidates

    def _resume_candidates(self) -> list[Path]:
        c = self.config
        if c.resume_from:
            given = Path(c.resume_from).expanduser()
            path = given if given.is_dir() else self.run_dir / c.resume_from
            if not runs.is_complete(path):
                found = ", ".join(p.name for _, p in runs.checkpoints(self.run_dir)) or "none"
                raise CheckpointError(
                    f"--resume-from {c.resume_from}: not a complete checkpoint of {self.run_dir} (complete: {found})"
                )
            return [path]
        found = [p for _, p in reversed(runs.checkpoints(self.run_dir, "complete"))]
        if not found:
            raise CheckpointError(
                f"nothing to resume: {self.run_dir} has no complete checkpoint; drop --resume to start a new run"
            )
        return found

    def _check_metrics(self) -> None:
        try:
            read_metrics(self.run_dir)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise CheckpointError(
                f"{self.run_dir / METRICS_FILE} is not a metrics log ({_first_line(exc)[:80]}); "
                "move it away to resume (training restarts its log from the checkpoint)"
            ) from None

    def _take_folder(self) -> None:
        """Create the run folder and its marker if needed, and take its writer lock (RunBusy if held)."""
        missing, folder = [], self.run_dir
        while not folder.exists() and folder != folder.parent:
            missing.append(folder)
            folder = folder.parent
        self.created.extend(reversed(missing))  # outermost first
        if not missing and not (self.run_dir / runs.RUN_MARKER).exists():
            self.created.append(self.run_dir / runs.RUN_MARKER)
        runs.mark_run(self.run_dir)
        self.lock = runs.lock_run(self.run_dir)

    def _release(self, failed_before_writing: bool) -> None:
        """Drop the lock; after a failure before the first write, also remove what `_take_folder` made."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if failed_before_writing:
            for path in reversed(self.created):
                with contextlib.suppress(OSError):
                    if path == self.run_dir:
                        (path / runs.RUN_MARKER).unlink(missing_ok=True)
                    path.rmdir() if path.is_dir() else path.unlink()  # a folder only when nothing else is in it
        self.created = []

    def _data(self):
        from merit_core.data import load_meta, resolve_data
        from merit_core.train.batches import check_split_length

        c = self.config

        def prepare():
            path = Path(
                resolve_data(
                    c.data,
                    tokenizer=c.tokenizer,
                    vocab_size=c.vocab_size,
                    progress=self.cb.on_prepare,
                    text_column=c.text_column,
                    dataset_config=c.data_config,
                )
            )
            meta = load_meta(path)
            check_split_length(meta.train_tokens, c.seq_len, f"train split of {path}")
            check_split_length(meta.val_tokens, c.seq_len, f"validation split of {path}")
            _check_token_ids(path, meta)
            if self.resume_info is not None:
                self._check_same_data(meta)
            self.cb.on_data(meta)
            return path, meta

        return _shared(self.parallel, prepare)

    def _build(self, data_dir: Path, meta, candidates: list[Path]):
        import torch

        from merit_core.data import open_tokens
        from merit_core.train.trainer import build_trainer

        c, device = self.config, self.parallel.device
        eos = meta.eos_token_id
        mconf = model_config(c.model, vocab_size=meta.vocab_size, special_ids={"bos": eos, "eos": eos})
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = c.tf32
            torch.backends.cudnn.allow_tf32 = c.tf32
        model = build_model(mconf, seed=c.seed)
        ckpt, state = self._load_resumable(model, candidates, meta) if candidates else (None, None)
        model.to(device)
        train_tokens, val_tokens = open_tokens(data_dir, "train"), open_tokens(data_dir, "val")
        try:
            trainer = build_trainer(c, model, self.parallel, train_tokens, val_tokens)
        except MemoryError:
            raise ConfigError("out of memory while building the model and batches; lower the batch sizes") from None
        trainer.choose_micro_batch()  # 'auto' -> a size, before step 0; config.toml records it
        if ckpt is not None:
            try:
                trainer.load_state_dict(_to_device(state, device), ckpt)
            except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as exc:
                raise CheckpointError(
                    f"{ckpt} cannot be resumed: its trainer state does not fit ({exc!r:.200})"
                ) from None
        return trainer, ckpt

    def _load_resumable(self, model, candidates: list[Path], meta) -> tuple[Path, dict[str, Any]]:
        """Load the newest candidate that loads into `model`; say in one line when that is not the latest."""
        from merit_core.train.checkpoint import load_model_weights, load_trainer_state, read_trainer_info

        failures: list[str] = []
        for ckpt in candidates:
            try:
                read_trainer_info(ckpt)
                state = load_trainer_state(ckpt, map_location="cpu")
                _check_trainer_state(state, ckpt)
                load_model_weights(model, ckpt)
            except CheckpointError as exc:
                failures.append(f"{ckpt.name}: {exc}")
                continue
            if failures:
                self.cb.on_note(f"{candidates[0]} does not load ({failures[0]}); resuming from {ckpt} instead")
            return ckpt, state
        raise CheckpointError(f"no checkpoint of {self.run_dir} loads: {'; '.join(failures)}"[:600])

    def _check_resumable(self, candidates: list[Path]) -> None:
        """ResumeMismatch when the run's checkpoints were trained with other settings (the newest
        readable trainer_state.json speaks for the run; data and tokenizer are checked in `_data`)."""
        c = self.config
        for ckpt in candidates:
            info = runs.read_trainer_state(ckpt, strict=False)
            if info:
                break
        else:
            self.resume_info, self.resume_ckpt = None, None
            return
        self.resume_info, self.resume_ckpt = info, ckpt
        expected = {"model": c.model, "optimizer": c.optimizer, "global_batch_size": c.batch_size, "seq_len": c.seq_len}
        for key, value in expected.items():
            if info.get(key) != value:
                raise ResumeMismatch(
                    f"{ckpt} was trained with {key} = {info.get(key)!r}, "
                    f"but this run has {value!r}; resume with the run's own settings"
                )
        if not c.allow_changes and info.get("seed") is not None and info.get("seed") != c.seed:
            raise ResumeMismatch(
                f"{ckpt} was trained with another seed ({info.get('seed')} -> {c.seed}); resume with the run's own "
                "seed, or pass --allow-changes to continue anyway"
            )

    def _check_same_data(self, meta) -> None:
        if self.config.allow_changes:
            return
        now = {"data": _data_identity(meta), "tokenizer": _tokenizer_digest(meta)}
        for key, value in now.items():
            saved = self.resume_info.get(key)
            if saved is not None and saved != value:
                raise ResumeMismatch(
                    f"{self.resume_ckpt} was trained with another {key} than {meta.path}; resume with the run's own "
                    f"{key}, or pass --allow-changes to continue anyway"
                )

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> RunSummary:
        wrote = False
        try:
            candidates = _shared(self.parallel, self._check)
            data_dir, meta = self._data()
            self.trainer, ckpt = self._build(data_dir, meta, candidates)
            self._first_write(ckpt, meta)
            wrote = True
            return self._train(ckpt, data_dir)
        finally:
            self._release(failed_before_writing=not wrote)

    def _first_write(self, ckpt: Path | None, meta) -> None:
        """Everything is checked and built: the run folder's files are written from here on."""
        self.tokenizer_dir = meta.tokenizer_path if meta.tokenizer_path.is_dir() else None
        self.data_info = {"data": _data_identity(meta), "tokenizer": _tokenizer_digest(meta)}
        self.metrics = MetricsLog(self.run_dir)
        if self.parallel.is_main:
            with runs.disk_full_guard(self.run_dir / CONFIG_FILE, ckpt):
                runs.remove_stale_staging(self.run_dir)
                save_config(self.config, self.run_dir / CONFIG_FILE)
                if ckpt is None:
                    self.metrics.reset()
                else:
                    self.metrics.truncate_after(self.trainer.step)
        self.created = []
        self.parallel.barrier()

    def _train(self, ckpt: Path | None, data_dir: Path) -> RunSummary:
        from merit_core.train.trainer import compute_dtype

        trainer, c = self.trainer, self.config
        self.n_params = count_parameters(trainer.model)
        hw = device_info(self.parallel.device)
        self.cb.on_start(
            RunInfo(
                run_dir=self.run_dir,
                config=c,
                n_params=self.n_params,
                n_layers=_n_layers(trainer.model),
                start_step=trainer.step,
                total_steps=c.steps,
                tokens_per_step=c.tokens_per_step,
                world_size=self.parallel.world_size,
                device=str(self.parallel.device),
                data_dir=data_dir,
                resumed_from=ckpt,
                device_name=hw.name,
                compute_dtype=compute_dtype(c.dtype, self.parallel.device),
                tf32=c.tf32 and self.parallel.device.type == "cuda",
                peak_flops=hw.peak_flops,
                device_memory=hw.total_memory,
            )
        )
        previous = read_metrics(self.run_dir) if ckpt is not None else []
        self.last_log = next((r for r in reversed(previous) if "loss" in r), {})
        self.last_eval = next((r for r in reversed(previous) if "val_loss" in r), {})
        self.last_ckpt = ckpt
        self.last_saved_step = trainer.step if ckpt is not None else None
        reset_peak_memory(self.parallel.device)
        start = time.perf_counter()
        start_step = trainer.step
        with self._stop_signals():
            if trainer.step == 0 and c.eval_every:
                self._eval()
            self.train_loop()
        elapsed = time.perf_counter() - start
        if self.parallel.is_main:
            self._plot()
        trained_tokens = (trainer.step - start_step) * c.tokens_per_step
        tokens_per_s = trained_tokens / elapsed if trained_tokens else None
        summary = RunSummary(
            run_dir=self.run_dir,
            config=c,
            steps=trainer.step,
            tokens=trainer.step * c.tokens_per_step,
            n_params=self.n_params,
            elapsed_s=elapsed,
            tokens_per_s=tokens_per_s,
            final_loss=self.last_log.get("loss"),
            final_val_loss=self.last_eval.get("val_loss"),
            max_attention_logit=self.last_eval.get("max_attention_logit"),
            last_checkpoint=self.last_ckpt,
            resumed_from=ckpt,
            checkpoints=[p for _, p in _checkpoints(self.run_dir)],
            device=str(self.parallel.device),
            device_name=hw.name,
            compute_dtype=compute_dtype(c.dtype, self.parallel.device),
            peak_memory=peak_memory(self.parallel.device),
            # tokens/s of all processes over one device's peak times the processes
            mfu=mfu(self.n_params, tokens_per_s / self.parallel.world_size if tokens_per_s else None, hw.peak_flops),
        )
        self.cb.on_end(summary)
        return summary

    @contextlib.contextmanager
    def _stop_signals(self):
        """While training: SIGTERM / SIGUSR1 / SIGINT ask the loop to stop after the current step and
        checkpoint (`_stop_now`); a second SIGINT interrupts at once. Only the main thread can do this."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {}

        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self.stop == "SIGINT" and name == "SIGINT":
                raise KeyboardInterrupt
            self.stop = self.stop or name

        for name in STOP_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                previous[sig] = signal.signal(sig, handler)
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    def _stop_requested(self) -> str | None:
        """The stop signal, agreed by every process (a process that got none stops with the others)."""
        if self.parallel.world_size == 1:
            return self.stop
        import torch

        code = list(STOP_SIGNALS).index(self.stop) + 1 if self.stop else 0
        agreed = int(self.parallel.all_reduce(torch.tensor(code, device=self.parallel.device), op="max").item())
        return list(STOP_SIGNALS)[agreed - 1] if agreed else None

    def _stop_now(self, name: str) -> None:
        step = self.trainer.step
        if step != self.last_saved_step and step > 0:
            self._check_finite()
            self._save()
        where = f"checkpoint {self.last_ckpt}" if self.last_ckpt else "no checkpoint (nothing trained yet)"
        again = f"; continue with: merit train --resume --out {self.run_dir}" if self.last_ckpt else ""
        raise RunInterrupted(f"stopped by {name} after step {step}: {where}{again}", STOP_SIGNALS[name], self.last_ckpt)

    def train_loop(self) -> None:
        trainer, c = self.trainer, self.config
        tick, tick_step = time.perf_counter(), trainer.step
        self.saved_at = time.monotonic()
        while trainer.step < c.steps:
            stop = self._stop_requested()
            if stop:
                self._stop_now(stop)
            out = trainer.train_step()
            step = trainer.step
            last = step == c.steps
            if step % c.log_every == 0 or last:
                loss = float(self.parallel.all_reduce(out.loss, op="mean").item())
                now = time.perf_counter()
                rate = (step - tick_step) * c.tokens_per_step / max(now - tick, 1e-9)
                self.last_log = self._record(
                    {"loss": loss, "lr": out.lr, "grad_norm": float(out.grad_norm.item()), "tokens_per_s": rate}
                )
                self.cb.on_log(self.last_log)
                self._check_finite()
                tick, tick_step = now, step
            evaluate = (c.eval_every and step % c.eval_every == 0) or last
            save = (c.save_every and step % c.save_every == 0) or last or self._save_due()
            if evaluate or save:
                self._check_finite()
                if evaluate:
                    self._eval()
                if save:
                    self._save()
                tick, tick_step = time.perf_counter(), step
        stop = self._stop_requested()
        if stop and trainer.step != self.last_saved_step:
            self._stop_now(stop)

    def _save_due(self) -> bool:
        """True when --save-every-minutes has passed since the last checkpoint (agreed by every process)."""
        minutes = self.config.save_every_minutes
        if not minutes:
            return False
        due = time.monotonic() - self.saved_at >= minutes * 60
        if self.parallel.world_size > 1:
            import torch

            due = bool(self.parallel.all_reduce(torch.tensor(int(due), device=self.parallel.device), op="max").item())
        return due

    def _record(self, values: dict[str, Any]) -> dict[str, Any]:
        step = self.trainer.step
        record = {"step": step, "tokens": step * self.config.tokens_per_step, **values}
        if self.parallel.is_main:
            with runs.disk_full_guard(self.metrics.path, getattr(self, "last_ckpt", None)):
                self.metrics.write(record)
        return record

    def _eval(self) -> None:
        self.last_eval = self._record(self.trainer.evaluate())
        self.cb.on_eval(self.last_eval)

    def _check_finite(self) -> None:
        from merit_core.train.trainer import TrainingDiverged

        bad = self.trainer.first_nonfinite_step()
        if bad is None:
            return
        if self.parallel.is_main:
            self._plot()
        kept = f"the last good checkpoint is {self.last_ckpt}" if self.last_ckpt else "no checkpoint was written"
        raise TrainingDiverged(
            f"training stopped: the loss or gradient norm became non-finite at step {bad}; {kept}. "
            "Try a lower --lr, more warmup, or gradient clipping (grad_clip)."
        )

    def _save(self) -> None:
        from merit_core.train.checkpoint import begin_checkpoint, prune_checkpoints, save_checkpoint

        trainer, c = self.trainer, self.config
        self._check_parameters_finite()
        staging = None
        if self.parallel.sharded_state:  # every process writes its optimizer shards into the staged folder
            staging = _shared(self.parallel, lambda: begin_checkpoint(self.run_dir, trainer.step))
        state = trainer.state_dict(staging)
        full = self.parallel.full_model_state_dict(trainer.model)
        if staging is not None:
            self.parallel.barrier()  # all shards are on disk before rank 0 renames the folder
        if self.parallel.is_main:
            info = {
                "step": trainer.step,
                "tokens": trainer.step * c.tokens_per_step,
                "total_steps": c.steps,
                "lr": trainer.lr_for(trainer.step - 1),
                "model": c.model,
                "optimizer": c.optimizer,
                "global_batch_size": c.batch_size,
                "micro_batch_size": c.micro_batch_size,
                "seq_len": c.seq_len,
                "world_size": self.parallel.world_size,
                "parallel": self.parallel.name,
                "seed": c.seed,
                "n_params": self.n_params,
                "loss": self.last_log.get("loss"),
                "val_loss": self.last_eval.get("val_loss"),
                "max_attention_logit": self.last_eval.get("max_attention_logit"),
                **self.data_info,
            }
            target = self.run_dir / runs.step_name(trainer.step)
            with runs.disk_full_guard(target, self.last_ckpt):
                try:
                    path = save_checkpoint(
                        self.run_dir,
                        trainer.step,
                        model=trainer.model,
                        state_dict=full,
                        tokenizer_dir=self.tokenizer_dir,
                        info=info,
                        state=state,
                        staging=staging,
                    )
                except BaseException:
                    runs.remove_stale_staging(self.run_dir)  # we hold the lock: the staged folder is ours
                    raise
            prune_checkpoints(self.run_dir, c.keep_checkpoints)
            self.last_ckpt = path
            self.cb.on_checkpoint(trainer.step, path)
        self.last_ckpt = self.parallel.broadcast_object(self.last_ckpt)
        self.last_saved_step = trainer.step
        self.saved_at = time.monotonic()

    def _check_parameters_finite(self) -> None:
        """TrainingDiverged when an update left a non-finite parameter: such weights never become a checkpoint."""
        import torch

        from merit_core.train.trainer import TrainingDiverged

        flags = [torch.isfinite(_local(p)).all() for p in self.trainer.model.parameters()]
        ok = torch.stack(flags).all().to(torch.int64) if flags else torch.ones((), dtype=torch.int64)
        if int(self.parallel.all_reduce(ok.to(self.parallel.device), op="min").item()):
            return
        if self.parallel.is_main:
            self._plot()
        kept = f"the last good checkpoint is {self.last_ckpt}" if self.last_ckpt else "no checkpoint was written"
        raise TrainingDiverged(
            f"training stopped: the parameters became non-finite by step {self.trainer.step} (not saved); {kept}. "
            "Try a lower --lr, more warmup, or gradient clipping (grad_clip)."
        )

    def _plot(self) -> None:
        c = self.config
        title = f"{c.model} · {c.optimizer} · batch {c.batch_size} x {c.seq_len} · lr {c.lr:g}"
        plot_curves(self.run_dir, title=title)


def _n_layers(model) -> int:
    return int(getattr(model.config, "num_hidden_layers", None) or model.config.n_layer)


def _checkpoints(run_dir: Path):
    return runs.checkpoints(run_dir, "complete")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _local(tensor):
    """The process's own part of a parameter (a DTensor shard under fsdp), else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _to_device(state: Any, device) -> Any:
    """trainer_state.pt was read on the CPU; optimizer tensors go to `device` (RNG states stay put)."""
    import torch

    if isinstance(state, dict):
        return {k: (v if k == "rng" else _to_device(v, device)) for k, v in state.items()}
    if isinstance(state, list):
        return [_to_device(v, device) for v in state]
    if isinstance(state, torch.Tensor):
        return state.to(device)
    return state


def _check_trainer_state(state: Any, ckpt: Path) -> None:
    """CheckpointError unless trainer_state.pt has the shape a resume needs (checked before anything is applied)."""
    import torch

    try:
        ok = (
            isinstance(state, dict)
            and isinstance(state["step"], int)
            and isinstance(state["optimizer"], dict)
            and isinstance(state["rng"]["torch"], torch.Tensor)
            and state["rng"]["torch"].dtype == torch.uint8
            and state["rng"]["torch"].shape == torch.get_rng_state().shape
        )
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{ckpt / runs.STATE_PT} is not a merit trainer state (step, optimizer, rng)")


def _data_identity(meta) -> dict[str, Any]:
    """What identifies the training data of a run, whatever folder it is read from."""
    return {
        "source": meta.source,
        "train_tokens": meta.train_tokens,
        "val_tokens": meta.val_tokens,
        "vocab_size": meta.vocab_size,
    }


def _tokenizer_digest(meta) -> str | None:
    """sha256 over the prepared data's tokenizer files (None when it has no tokenizer folder)."""
    folder = meta.tokenizer_path
    files = runs.tokenizer_files(folder) if folder.is_dir() else []
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _check_token_ids(path: Path, meta, sample: int = 1 << 22) -> None:
    """DataError when token ids reach the vocabulary size (all of val, the first `sample` train tokens)."""
    import numpy as np

    from merit_core.data import open_tokens

    for split, limit in (("val", None), ("train", sample)):
        tokens = open_tokens(path, split)
        top = int(np.max(tokens[:limit])) if len(tokens) else 0
        if top >= meta.vocab_size:
            raise DataError(
                f"prepared data {path} has token id {top} in {split}.bin but vocab_size {meta.vocab_size}; "
                "prepare it again"
            )
