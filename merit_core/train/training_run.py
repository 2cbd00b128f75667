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
import signal
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

import torch

from merit_core.checkpoint.state import TrainerState
from merit_core.data import load_meta, open_tokens, resolve_data
from merit_core.data.meta import data_notes
from merit_core.errors import (
    ConfigError,
    InstabilityStop,
    RunInterrupted,
    TrainingDiverged,
)
from merit_core.metric_names import (
    GRAD_NORM,
    LOSS,
    LR,
    MAX_ATTENTION_LOGIT,
    STEP,
    TOKENS,
    TOKENS_PER_S,
    VAL_LOSS,
    WATCH_REWIND,
)
from merit_core.models import build_model, count_parameters, model_config
from merit_core.optim.registry import get_spec, resolve_hparams
from merit_core.train.callbacks import HANDLED_SIGNALS, STOP_SIGNALS, RunInfo, RunSummary, TrainCallbacks
from merit_core.train.checks import check_data, check_model_and_batches
from merit_core.train.config import ResolvedConfig, TrainConfig, resolve
from merit_core.train.distributed import shared
from merit_core.train.estimate import long_run_line, time_first_micro_batch, tiny_of
from merit_core.train.fsdp import check_fsdp_optimizer
from merit_core.train.hardware import device_info, mfu, peak_memory, reset_peak_memory
from merit_core.train.parallel import setup_parallel
from merit_core.train.resume import ResumePlan, check_same_data, data_info, last_records
from merit_core.train.run_folder import RunFolder
from merit_core.train.run_watch import RECORD, REWIND, STOP, RunWatch, WatchDecision
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


class TrainingRun:
    """One training run: check the input, prepare data, build, resume, then `train_loop` until done.

    The step mechanics (micro-batches, clipping, the optimizer update, evaluation) belong to the
    `Trainer` in `trainer.py`, every write into the run folder and the restore of a checkpoint to
    its `RunFolder` (run_folder.py), the judging of the precursors to its `RunWatch`
    (run_watch.py); this class keeps the cadence around them: logs, evals, checkpoints and the
    watcher's decisions on their schedule, and the callbacks a front end renders.
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
        # the run's config until the trainer is built; from then on the trainer's is the one config (`config`)
        self._config: ResolvedConfig | None = resolved.config
        self.lr_default = resolved.lr  # where a default lr came from, for on_start (None: the config gave it)
        self._config.out = parallel.broadcast_object(self._config.out)
        self.run_dir = Path(self._config.out)
        self.folder = RunFolder(self.run_dir, parallel, self.cb.on_note)  # every write into the run folder
        self.stop: str | None = None  # the name of a stop signal that arrived
        self.resume = ResumePlan()  # what --resume continues from (resume.py)
        # set once everything is built (`run`, `_first_write`) and read only after:
        self.trainer: Trainer  # built by `_build`; until then the run's config is `_config`
        self.data_info: dict[str, Any] = {}
        self.n_params = 0
        self.last_log: dict[str, Any] = {}
        self.last_eval: dict[str, Any] = {}

    @property
    def config(self) -> ResolvedConfig:
        """The run's one config: the trainer's once it is built (a rewind lowers its lr there)."""
        trainer: Trainer | None = self.__dict__.get("trainer")
        if trainer is not None:
            return trainer.config
        assert self._config is not None
        return self._config

    @property
    def last_ckpt(self) -> Path | None:
        """The newest checkpoint of this run (what a failure leaves)."""
        return self.folder.last_ckpt

    # -- checks and building, before anything is written ---------------------------------------
    def _check(self) -> ResumePlan:
        """Check the input and take the run folder; return what a resume continues from."""
        check_model_and_batches(self.config, self.parallel.world_size)
        return self.folder.take(self.config)

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

        return shared(self.parallel, prepare)

    def _build(self, data_dir: Path, meta):
        c, device = self.config, self.parallel.device
        eos = meta.eos_token_id
        mconf = model_config(c.model, vocab_size=meta.vocab_size, special_ids={"bos": eos, "eos": eos})
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = c.tf32
            torch.backends.cudnn.allow_tf32 = c.tf32
        model = build_model(mconf, seed=c.seed)
        model.to(device)
        train_tokens, val_tokens = open_tokens(data_dir, "train"), open_tokens(data_dir, "val")
        try:
            trainer = build_trainer(c, model, self.parallel, train_tokens, val_tokens, self.spec)
        except MemoryError:
            raise ConfigError("out of memory while building the model and batches; lower the batch sizes") from None
        if c.micro_batch_size is None:  # 'auto': settled here, once, before step 0; config.toml records it
            trainer.config = dataclasses.replace(c, micro_batch_size=trainer.choose_micro_batch())
        self.trainer, self._config = trainer, None  # the trainer holds the one config from here on
        ckpt = self.folder.restore(self.resume, trainer) if self.resume else None  # the wrapped model, as a rewind
        return trainer, ckpt

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> RunSummary:
        wrote = False
        try:
            self.resume = shared(self.parallel, self._check)
            data_dir, meta = self._data()
            trainer, ckpt = self._build(data_dir, meta)
            self.data_meta = meta
            self.data_info = data_info(meta)
            self.folder.tokenizer_dir = meta.tokenizer_path if meta.tokenizer_path.is_dir() else None
            self.folder.begin(self.config, ckpt, trainer.step)  # the run folder's files are written from here on
            wrote = True
            return self._train(trainer, ckpt, data_dir)
        finally:
            self.folder.release(failed_before_writing=not wrote)

    def _train(self, trainer: Trainer, ckpt: Path | None, data_dir: Path) -> RunSummary:
        c = self.config
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
            checkpoints=[p for _, p in self.folder.checkpoints()],
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
        trainer: Trainer | None = self.__dict__.get("trainer")
        step = trainer.step + 1 if trainer is not None else 1
        where = f"the last checkpoint is {self.last_ckpt}" if self.last_ckpt else "no checkpoint was written"
        again = f"; continue with: merit train --resume --out {self.run_dir}" if self.last_ckpt else ""
        return f"aborted by a second stop signal ({name}) during step {step}: that step's work is lost, {where}{again}"

    def _stop_now(self, name: str) -> NoReturn:
        step = self.trainer.step
        if step != self.folder.last_saved_step and step > 0:
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
        trainer = self.trainer
        tick = (time.perf_counter(), trainer.step)
        first_step = trainer.step
        self.folder.saved_at = time.monotonic()
        c = self.config
        watch = RunWatch(trainer, self.parallel, c.watch_every, c.on_instability) if c.watch else None
        while trainer.step < self.config.steps:
            c = self.config  # a rewind lowers the lr: read the one config afresh each step
            if stop := self._stop_requested():
                self._stop_now(stop)
            out = trainer.train_step()
            if out is None:  # a stop signal arrived between micro-batches: the step was abandoned
                self._stop_now(self._stop_requested() or "SIGTERM")
            decision = watch.after_step(out, self.folder.checkpoints) if watch is not None else None
            if decision is not None and self._act(decision):
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
        if stop and trainer.step != self.folder.last_saved_step:
            self._stop_now(stop)

    def _act(self, decision: WatchDecision) -> bool:
        """Write the watcher's record, say its warnings (not when it only records) and carry out its
        decision: True after a rewind, InstabilityStop on a stop, False when training goes on."""
        self.cb.on_watch(self._record(decision.record))
        for warning in decision.warnings if decision.action != RECORD else ():
            self.cb.on_note(warning.line())
        if decision.action == STOP:
            raise InstabilityStop(
                decision.stop_line(self.run_dir, self.config.lr),
                decision.checkpoint[1] if decision.checkpoint else None,
            )
        if decision.action != REWIND:
            return False
        self._rewind(decision)
        return True

    def _rewind(self, decision: WatchDecision) -> None:
        """Go back to the decision's checkpoint through the folder's verified restore (as --resume does)
        and continue with the lr, peak and floor, times its factor; config.toml records the new lr."""
        trainer, old = self.trainer, self.config
        assert decision.checkpoint is not None and old.lr is not None  # a rewind names one; the lr is resolved
        step, path = decision.checkpoint
        self.folder.restore(ResumePlan([path], verify=old.verify), trainer)
        factor = decision.lr_factor
        new = dataclasses.replace(old, lr=old.lr * factor, min_lr=None if old.min_lr is None else old.min_lr * factor)
        trainer.config = new
        self.folder.continue_from(new, path, step)
        self.last_log, self.last_eval = last_records(self.run_dir, path)
        self._record({WATCH_REWIND: decision.rewind_record(old.lr, new.lr)})
        self.cb.on_note(decision.rewind_line(old.lr, new.lr))

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
        due = time.monotonic() - self.folder.saved_at >= minutes * 60
        if self.parallel.world_size > 1:
            due = bool(self.parallel.all_reduce(torch.tensor(int(due), device=self.parallel.device), op="max").item())
        return due

    def _record(self, values: dict[str, Any]) -> dict[str, Any]:
        """`values` with the step and tokens, written to metrics.jsonl; returned for the callbacks."""
        step = self.trainer.step
        record = {STEP: step, TOKENS: step * self.config.tokens_per_step, **values}
        self.folder.record(record)
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

        def info() -> TrainerState:
            return TrainerState(
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

        path = self.folder.save(trainer, info)
        if self.parallel.is_main:
            self.cb.on_checkpoint(trainer.step, path)

    def _check_parameters_finite(self) -> None:
        """TrainingDiverged when an update left a non-finite parameter: such weights never become a checkpoint."""
        flags = [torch.isfinite(_local(p)).all() for p in self.trainer.model.parameters()]
        ok = torch.stack(flags).all().to(torch.int64) if flags else torch.ones((), dtype=torch.int64)
        if int(self.parallel.all_reduce(ok.to(self.parallel.device), op="min").item()):
            return
        self._diverged(f"the parameters became non-finite by step {self.trainer.step} (not saved)")

    def _diverged(self, what: str) -> None:
        """Plot what was logged and raise TrainingDiverged naming `what` and the latest checkpoint."""
        self._plot()
        # not "good": the checkpoint may be the one this run resumed from, and hold the cause
        kept = f"the latest checkpoint is {self.last_ckpt}" if self.last_ckpt else "no checkpoint was written"
        raise TrainingDiverged(
            f"training stopped: {what}; {kept}. Try a lower --lr, more warmup, or gradient clipping (grad_clip)."
        )

    def _plot(self) -> None:
        c = self.config
        self.folder.plot(f"{c.model} · {c.optimizer} · batch {c.batch_size} x {c.seq_len} · lr {c.lr:g}")


def _n_layers(model) -> int:
    return int(getattr(model.config, "num_hidden_layers", None) or model.config.n_layer)


def _local(tensor):
    """The process's own part of a parameter (a DTensor shard under fsdp), else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor
