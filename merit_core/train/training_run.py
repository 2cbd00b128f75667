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
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

from merit_core.checkpoint import runs
from merit_core.checkpoint.runs import CONFIG_FILE
from merit_core.checkpoint.state import TrainerState
from merit_core.data import load_meta, open_tokens, resolve_data
from merit_core.data.meta import data_notes
from merit_core.durable_writes import disk_full_guard
from merit_core.errors import (
    CheckpointError,
    ConfigError,
    MeritError,
    RunInterrupted,
    TrainingDiverged,
)
from merit_core.file_locks import FileLock
from merit_core.metric_names import GRAD_NORM, LOSS, LR, MAX_ATTENTION_LOGIT, STEP, TOKENS, TOKENS_PER_S, VAL_LOSS
from merit_core.metrics import MetricsLog
from merit_core.models import build_model, count_parameters, model_config
from merit_core.optim.registry import get_spec, resolve_hparams
from merit_core.train import instability
from merit_core.train.callbacks import HANDLED_SIGNALS, STOP_SIGNALS, RunInfo, RunSummary, TrainCallbacks
from merit_core.train.checkpoint import prune_checkpoints, save_checkpoint
from merit_core.train.checks import check_data, check_model_and_batches
from merit_core.train.config import TrainConfig, resolve, save_config
from merit_core.train.estimate import long_run_line, time_first_micro_batch, tiny_of
from merit_core.train.fsdp import check_fsdp_optimizer
from merit_core.train.hardware import device_info, mfu, peak_memory, reset_peak_memory
from merit_core.train.parallel import setup_parallel
from merit_core.train.plots import plot_curves
from merit_core.train.resume import (
    ResumePlan,
    check_same_data,
    data_info,
    last_records,
    load_resumable,
    plan_resume,
    to_device,
)
from merit_core.train.trackers import with_trackers
from merit_core.train.trainer import Trainer, build_trainer, compute_dtype


def run_training(config: TrainConfig, callbacks: TrainCallbacks | None = None) -> RunSummary:
    """Train as `config` says; return the summary. Raises MeritError subclasses on bad input."""
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

        self.spec = get_spec(config.optimizer)  # the run's one registry lookup: an unknown name fails here
        resolve_hparams(self.spec, **config.optimizer_args)  # unknown hyperparameters fail here, early
        if config.parallel == "fsdp":
            check_fsdp_optimizer(self.spec)
        resolved = resolve(config, parallel.world_size, self.spec, auto_micro_batch=True)
        self.config = resolved.config
        self.lr_default = resolved.lr  # where a default lr came from, for on_start (None: the config gave it)
        self.config.out = parallel.broadcast_object(self.config.out)
        self.run_dir = Path(self.config.out)
        self.lock: FileLock | None = None
        self.created: list[Path] = []  # what this run made before its first write (undone on failure)
        self.stop: str | None = None  # the name of a stop signal that arrived
        self.resume = ResumePlan()  # what --resume continues from (resume.py)
        # set once everything is built (`run`, `_first_write`) and read only after:
        self.trainer: Trainer
        self.metrics: MetricsLog
        self.tokenizer_dir: Path | None = None
        self.data_info: dict[str, Any] = {}
        self.n_params = 0
        self.last_log: dict[str, Any] = {}
        self.last_eval: dict[str, Any] = {}
        self.last_ckpt: Path | None = None  # the newest checkpoint of this run (what a failure leaves)
        self.last_saved_step: int | None = None
        self.saved_at = time.monotonic()

    # -- checks and building, before anything is written ---------------------------------------
    def _check(self) -> ResumePlan:
        """Check the input and take the run folder; return what a resume continues from."""
        c = self.config
        check_model_and_batches(c, self.parallel.world_size)
        runs.check_out(self.run_dir)
        runs.check_no_planted_links(self.run_dir)  # never write, rename or prune through a link in the run
        self._take_folder()  # a second writer stops here; what it made is undone if a check below fails
        for note in runs.recover_staging(self.run_dir):  # a rewrite killed between its renames
            self.cb.on_note(note)
        if not c.resume:
            runs.check_new_run(self.run_dir)
        return plan_resume(c, self.run_dir)

    def _take_folder(self) -> None:
        """Create the run folder and its marker if needed, and take its writer lock (RunBusy if held)."""
        missing, folder = [], self.run_dir
        while not os.path.lexists(folder) and folder != folder.parent:
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
            check_data(path, meta, c.seq_len)
            check_same_data(self.resume, c, meta)
            self.cb.on_data(meta)
            return path, meta

        return _shared(self.parallel, prepare)

    def _build(self, data_dir: Path, meta):
        c, device = self.config, self.parallel.device
        eos = meta.eos_token_id
        mconf = model_config(c.model, vocab_size=meta.vocab_size, special_ids={"bos": eos, "eos": eos})
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = c.tf32
            torch.backends.cudnn.allow_tf32 = c.tf32
        model = build_model(mconf, seed=c.seed)
        ckpt, state = load_resumable(self.resume, model, self.run_dir, self.cb.on_note) if self.resume else (None, None)
        model.to(device)
        train_tokens, val_tokens = open_tokens(data_dir, "train"), open_tokens(data_dir, "val")
        try:
            trainer = build_trainer(c, model, self.parallel, train_tokens, val_tokens, self.spec)
        except MemoryError:
            raise ConfigError("out of memory while building the model and batches; lower the batch sizes") from None
        if c.micro_batch_size is None:  # 'auto': settled here, once, before step 0; config.toml records it
            self.config = trainer.config = dataclasses.replace(c, micro_batch_size=trainer.choose_micro_batch())
        if ckpt is not None:
            try:
                trainer.load_state_dict(to_device(state, device), ckpt)
            except MeritError:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever a crafted state raises: one line, nothing moved yet
                raise CheckpointError(
                    f"{ckpt} cannot be resumed: its trainer state does not fit ({exc!r:.200})"
                ) from None
        return trainer, ckpt

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> RunSummary:
        wrote = False
        try:
            self.resume = _shared(self.parallel, self._check)
            data_dir, meta = self._data()
            self.trainer, ckpt = self._build(data_dir, meta)
            self._first_write(ckpt, meta)
            wrote = True
            return self._train(ckpt, data_dir)
        finally:
            self._release(failed_before_writing=not wrote)

    def _first_write(self, ckpt: Path | None, meta) -> None:
        """Everything is checked and built: the run folder's files are written from here on."""
        self.tokenizer_dir = meta.tokenizer_path if meta.tokenizer_path.is_dir() else None
        self.data_info = data_info(meta)
        self.data_meta = meta
        self.metrics = MetricsLog(self.run_dir)
        if self.parallel.is_main:
            with disk_full_guard(self.run_dir / CONFIG_FILE, ckpt):
                runs.remove_stale_staging(self.run_dir)
                if ckpt is not None:
                    self._set_aside_abandoned()
                save_config(self.config, self.run_dir / CONFIG_FILE)
                if ckpt is None:
                    self.metrics.reset()
                else:
                    self.metrics.truncate_after(self.trainer.step)
        self.created = []
        self.parallel.barrier()

    def _set_aside_abandoned(self) -> None:
        """Resuming from step S starts a new timeline: checkpoints past S are moved aside (and named),
        so that pruning and the next --resume never prefer them to the new ones."""
        moved = runs.set_aside_later_checkpoints(self.run_dir, self.trainer.step)
        if moved is not None:
            folder, names = moved
            self.cb.on_note(
                f"resuming from step {self.trainer.step}: the checkpoints after it ({', '.join(names)}) belong to "
                f"the abandoned timeline and were moved to {folder}"
            )

    def _train(self, ckpt: Path | None, data_dir: Path) -> RunSummary:
        trainer, c = self.trainer, self.config
        self.n_params = count_parameters(trainer.model)
        hw = device_info(self.parallel.device)
        self._estimate(trainer)
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
                lr_default=self.lr_default,
            )
        )

        for note in data_notes(self.data_meta, c.steps * c.tokens_per_step):  # once the run is under way
            self.cb.on_note(note)
        self.last_log, self.last_eval = last_records(self.run_dir, ckpt)
        self.last_ckpt = ckpt
        self.last_saved_step = trainer.step if ckpt is not None else None
        reset_peak_memory(self.parallel.device)
        start = time.perf_counter()
        start_step = trainer.step
        if self.parallel.world_size == 1:  # several processes agree on a stop between steps only
            trainer.should_stop = lambda: self.stop is not None
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
            final_loss=self.last_log.get(LOSS),
            final_val_loss=self.last_eval.get(VAL_LOSS),
            max_attention_logit=self.last_eval.get(MAX_ATTENTION_LOGIT),
            last_checkpoint=self.last_ckpt,
            resumed_from=ckpt,
            checkpoints=[p for _, p in _checkpoints(self.run_dir)],
            device=str(self.parallel.device),
            device_name=hw.name,
            compute_dtype=compute_dtype(c.dtype, self.parallel.device),
            peak_memory=peak_memory(self.parallel.device),
            # tokens/s of all processes over one device's peak times the processes
            mfu=mfu(self.n_params, tokens_per_s / self.parallel.world_size if tokens_per_s else None, hw.peak_flops),
            compile=trainer.compile_state,
        )
        self.cb.on_end(summary)
        return summary

    @contextlib.contextmanager
    def _stop_signals(self):
        """While training: SIGTERM / SIGUSR1 / SIGINT / SIGHUP ask the loop to stop after the current step (or
        micro-batch, see `Trainer.should_stop`) and checkpoint (`_stop_now`); any second stop signal aborts at
        once, the current step's work lost. A signal the process was started ignoring (`nohup`: SIGHUP)
        stays ignored. Only the main thread can do this."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {}

        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self.stop is not None and self.stop in STOP_SIGNALS:
                raise RunInterrupted(self._abort_line(name), STOP_SIGNALS[name], self.last_ckpt)
            self.stop = self.stop or name

        for name in HANDLED_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
                previous[sig] = signal.signal(sig, handler)
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    def _stop_requested(self) -> str | None:
        """The stop signal, agreed by every process (a process that got none stops with the others)."""
        self.stop = self.stop or self.cb.stop_requested()
        if self.parallel.world_size == 1:
            return self.stop

        code = list(STOP_SIGNALS).index(self.stop) + 1 if self.stop else 0
        agreed = int(self.parallel.all_reduce(torch.tensor(code, device=self.parallel.device), op="max").item())
        return list(STOP_SIGNALS)[agreed - 1] if agreed else None

    def _estimate(self, trainer) -> None:
        """Before step 1 on a CPU (one process): a run that would take more than about an hour says so in one
        line with a config that fits, and goes on only if the callbacks confirm (merit train: a terminal asks)."""
        if self.parallel.world_size != 1 or self.parallel.device.type != "cpu" or trainer.step >= self.config.steps:
            return
        line = long_run_line(time_first_micro_batch(trainer), self.config.model, tiny_of(self.config.model))
        if line is None:
            return
        self.cb.on_note(line)
        if not self.cb.confirm(line):
            raise RunInterrupted(f"not started: {line.split(';')[0]}; nothing was trained", 1)

    def _abort_line(self, name: str) -> str:
        """What a second stop signal says: nothing saved for the step under way."""
        step = self.trainer.step + 1 if self.trainer is not None else 1
        where = f"the last checkpoint is {self.last_ckpt}" if self.last_ckpt else "no checkpoint was written"
        again = f"; continue with: merit train --resume --out {self.run_dir}" if self.last_ckpt else ""
        return f"aborted by a second stop signal ({name}) during step {step}: that step's work is lost, {where}{again}"

    def _stop_now(self, name: str) -> NoReturn:
        step = self.trainer.step
        if step != self.last_saved_step and step > 0:
            self._check_finite()
            self._save()
        where = f"checkpoint {self.last_ckpt}" if self.last_ckpt else "no checkpoint (nothing trained yet)"
        again = f"; continue with: merit train --resume --out {self.run_dir}" if self.last_ckpt else ""
        why = f"{name} (the console output was closed)" if name == "SIGPIPE" else name
        raise RunInterrupted(f"stopped by {why} after step {step}: {where}{again}", STOP_SIGNALS[name], self.last_ckpt)

    def train_loop(self) -> None:
        """The cadence: a step; a log line every log_every steps; an eval and a checkpoint on their
        schedules and at the end; a stop signal honoured between steps. The throughput clock
        (`tick`) restarts after evals and checkpoints, so tokens_per_s counts training only."""
        trainer, c = self.trainer, self.config
        tick = (time.perf_counter(), trainer.step)
        first_step = trainer.step
        self.saved_at = time.monotonic()
        watch = instability.for_run(self)  # the instability watcher (None with watch off)
        while trainer.step < c.steps:
            if stop := self._stop_requested():
                self._stop_now(stop)
            out = trainer.train_step()
            if out is None:  # a stop signal arrived between micro-batches: the step was abandoned
                self._stop_now(self._stop_requested() or "SIGTERM")
            if watch is not None and watch.after_step(out):
                continue  # rewound to a checkpoint: this step's log, eval and save belong to the abandoned steps
            while trainer.notes:  # the compile time, after the first step
                self.cb.on_note(trainer.notes.pop(0))
            step, last = trainer.step, trainer.step == c.steps
            self.cb.on_step(step)
            if step % c.log_every == 0 or last:
                tick = self._log(out, tick)
            elif self.parallel.world_size == 1 and (trainer.device.type == "cpu" or step == first_step + 1):
                self.cb.on_step_loss(step, float(out.loss.item()))
            evaluate = (c.eval_every and step % c.eval_every == 0) or last
            save = (c.save_every and step % c.save_every == 0) or last or self._save_due()
            if evaluate or save:
                self._check_finite()
                if evaluate:
                    self._eval()
                if save:
                    self._save()
                tick = (time.perf_counter(), step)
        stop = self._stop_requested()
        if stop and trainer.step != self.last_saved_step:
            self._stop_now(stop)

    def _log(self, out, tick: tuple[float, int]) -> tuple[float, int]:
        """Write and report a log record (tokens/s since `tick`); return the new tick."""
        step, now = self.trainer.step, time.perf_counter()
        loss = float(self.parallel.all_reduce(out.loss, op="mean").item())
        rate = (step - tick[1]) * self.config.tokens_per_step / max(now - tick[0], 1e-9)
        self.last_log = self._record(
            {LOSS: loss, LR: out.lr, GRAD_NORM: float(out.grad_norm.item()), TOKENS_PER_S: rate}
        )
        self.cb.on_log(self.last_log)
        self._check_finite()
        return now, step

    def _save_due(self) -> bool:
        """True when --save-every-minutes has passed since the last checkpoint (agreed by every process)."""
        minutes = self.config.save_every_minutes
        if not minutes:
            return False
        due = time.monotonic() - self.saved_at >= minutes * 60
        if self.parallel.world_size > 1:
            due = bool(self.parallel.all_reduce(torch.tensor(int(due), device=self.parallel.device), op="max").item())
        return due

    def _record(self, values: dict[str, Any]) -> dict[str, Any]:
        step = self.trainer.step
        record = {STEP: step, TOKENS: step * self.config.tokens_per_step, **values}
        if self.parallel.is_main:
            with disk_full_guard(self.metrics.path, self.last_ckpt):
                self.metrics.write(record)
        return record

    def _eval(self) -> None:
        self.last_eval = self._record(self.trainer.evaluate())
        self.cb.on_eval(self.last_eval)

    def _check_finite(self) -> None:
        bad = self.trainer.first_nonfinite_step()
        if bad is None:
            return
        self._diverged(f"the loss or gradient norm became non-finite at step {bad}")

    def _save(self) -> None:
        trainer, c = self.trainer, self.config
        self._check_parameters_finite()
        staging = None
        if self.parallel.sharded_state:  # every process writes its optimizer shards into the staged folder
            staging = _shared(self.parallel, lambda: runs.begin_staging(self.run_dir, trainer.step))
        state = trainer.state_dict(staging)
        full = self.parallel.full_model_state_dict(trainer.model)
        if staging is not None:
            self.parallel.barrier()  # all shards are on disk before rank 0 renames the folder
        if self.parallel.is_main:
            info = TrainerState(
                step=trainer.step,
                tokens=trainer.step * c.tokens_per_step,
                total_steps=c.steps,
                lr=trainer.lr_for(trainer.step - 1),
                model=c.model,
                optimizer=c.optimizer,
                global_batch_size=c.batch_size,
                micro_batch_size=c.micro_batch_size,
                seq_len=c.seq_len,
                world_size=self.parallel.world_size,
                parallel=self.parallel.name,
                seed=c.seed,
                n_params=self.n_params,
                loss=self.last_log.get(LOSS),
                val_loss=self.last_eval.get(VAL_LOSS),
                max_attention_logit=self.last_eval.get(MAX_ATTENTION_LOGIT),
                **self.data_info,
            )
            target = self.run_dir / runs.step_name(trainer.step)
            with disk_full_guard(target, self.last_ckpt):
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
        flags = [torch.isfinite(_local(p)).all() for p in self.trainer.model.parameters()]
        ok = torch.stack(flags).all().to(torch.int64) if flags else torch.ones((), dtype=torch.int64)
        if int(self.parallel.all_reduce(ok.to(self.parallel.device), op="min").item()):
            return
        self._diverged(f"the parameters became non-finite by step {self.trainer.step} (not saved)")

    def _diverged(self, what: str) -> None:
        """Plot what was logged and raise TrainingDiverged naming `what` and the latest checkpoint."""
        if self.parallel.is_main:
            self._plot()
        # not "good": the checkpoint may be the one this run resumed from, and hold the cause
        kept = f"the latest checkpoint is {self.last_ckpt}" if self.last_ckpt else "no checkpoint was written"
        raise TrainingDiverged(
            f"training stopped: {what}; {kept}. Try a lower --lr, more warmup, or gradient clipping (grad_clip)."
        )

    def _plot(self) -> None:
        c = self.config
        title = f"{c.model} · {c.optimizer} · batch {c.batch_size} x {c.seq_len} · lr {c.lr:g}"
        plot_curves(self.run_dir, title=title)


def _n_layers(model) -> int:
    return int(getattr(model.config, "num_hidden_layers", None) or model.config.n_layer)


def _checkpoints(run_dir: Path):
    return runs.checkpoints(run_dir, "complete")


def _local(tensor):
    """The process's own part of a parameter (a DTensor shard under fsdp), else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor
