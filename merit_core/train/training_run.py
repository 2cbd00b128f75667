"""`run_training(config)`: a whole training run, from config to run directory.

The library entry point behind `merit train` (and the runs of `merit compare`): it checks the
input before writing anything, prepares the data, builds model and optimizer, resumes if
asked, trains with periodic logs / evals / checkpoints, and reports progress through
`TrainCallbacks` so that a front end can render it. Under torchrun every process calls it;
only the main process writes files and calls the callbacks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from merit_core.errors import CheckpointError, ConfigError, MeritError
from merit_core.train.config import TrainConfig, resolve, save_config

CONFIG_FILE = "config.toml"


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

    def on_prepare(self, stage: str, done: int, total: int | None) -> None:
        """Data preparation progress: `done` of `total` (None: unknown) units of `stage`."""

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


def run_training(config: TrainConfig, callbacks: TrainCallbacks | None = None) -> RunSummary:
    """Train as `config` says; return the summary. Raises MeritError subclasses on bad input."""
    from merit_core.train.distributed import setup_parallel

    parallel = setup_parallel(config.parallel, config.device, config.dtype)
    try:
        return TrainingRun(config, callbacks or TrainCallbacks(), parallel).run()
    finally:
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

    # -- checks and building, before anything is written ---------------------------------------
    def _check(self):
        from merit_core.models import context_length, model_config
        from merit_core.train.checkpoint import latest_checkpoint, list_checkpoints

        c = self.config
        context = context_length(model_config(c.model))
        if c.seq_len > context:
            raise ConfigError(f"seq_len {c.seq_len} is beyond the context of {c.model} ({context} tokens)")
        if c.resume:
            ckpt = latest_checkpoint(self.run_dir)
            if ckpt is None:
                raise CheckpointError(
                    f"nothing to resume: {self.run_dir} has no complete checkpoint; drop --resume to start a new run"
                )
            return ckpt
        if list_checkpoints(self.run_dir):
            raise ConfigError(
                f"{self.run_dir} already holds checkpoints; pass --resume to continue that run or choose another --out"
            )
        return None

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
            self.cb.on_data(meta)
            return path, meta

        return _shared(self.parallel, prepare)

    def _build(self, data_dir: Path, meta, ckpt: Path | None):
        import torch

        from merit_core.data import open_tokens
        from merit_core.models import build_model, model_config
        from merit_core.train.checkpoint import load_model_weights, load_trainer_state, read_trainer_info
        from merit_core.train.trainer import build_trainer

        c, device = self.config, self.parallel.device
        eos = meta.eos_token_id
        mconf = model_config(c.model, vocab_size=meta.vocab_size, special_ids={"bos": eos, "eos": eos})
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = c.tf32
            torch.backends.cudnn.allow_tf32 = c.tf32
        model = build_model(mconf, seed=c.seed)
        if ckpt is not None:
            self._check_resumable(read_trainer_info(ckpt), ckpt)
            load_model_weights(model, ckpt)
        model.to(device)
        train_tokens, val_tokens = open_tokens(data_dir, "train"), open_tokens(data_dir, "val")
        trainer = build_trainer(c, model, self.parallel, train_tokens, val_tokens)
        trainer.choose_micro_batch()  # 'auto' -> a size, before step 0; config.toml records it
        if ckpt is not None:
            trainer.load_state_dict(load_trainer_state(ckpt, map_location=device), ckpt)
        return trainer

    def _check_resumable(self, info: dict[str, Any], ckpt: Path) -> None:
        c = self.config
        expected = {"model": c.model, "optimizer": c.optimizer, "global_batch_size": c.batch_size, "seq_len": c.seq_len}
        for key, value in expected.items():
            if info.get(key) != value:
                raise CheckpointError(
                    f"{ckpt} was trained with {key} = {info.get(key)!r}, "
                    f"but this run has {value!r}; resume with the run's own settings"
                )

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> RunSummary:
        from merit_core.models import count_parameters
        from merit_core.train.checkpoint import remove_partial
        from merit_core.train.hardware import device_info, mfu, peak_memory, reset_peak_memory
        from merit_core.train.metrics import MetricsLog, read_metrics
        from merit_core.train.trainer import compute_dtype

        ckpt = _shared(self.parallel, self._check)
        data_dir, meta = self._data()
        self.trainer = trainer = self._build(data_dir, meta, ckpt)
        self.tokenizer_dir = meta.tokenizer_path if meta.tokenizer_path.is_dir() else None
        c = self.config
        self.metrics = MetricsLog(self.run_dir)
        if self.parallel.is_main:  # the first write: all input has been checked
            self.run_dir.mkdir(parents=True, exist_ok=True)
            remove_partial(self.run_dir)
            save_config(c, self.run_dir / CONFIG_FILE)
            if ckpt is None:
                self.metrics.reset()
            else:
                self.metrics.truncate_after(trainer.step)
        self.parallel.barrier()
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
        reset_peak_memory(self.parallel.device)
        start = time.perf_counter()
        start_step = trainer.step
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

    def train_loop(self) -> None:
        trainer, c = self.trainer, self.config
        tick, tick_step = time.perf_counter(), trainer.step
        while trainer.step < c.steps:
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
            save = (c.save_every and step % c.save_every == 0) or last
            if evaluate or save:
                self._check_finite()
                if evaluate:
                    self._eval()
                if save:
                    self._save()
                tick, tick_step = time.perf_counter(), step

    def _record(self, values: dict[str, Any]) -> dict[str, Any]:
        step = self.trainer.step
        record = {"step": step, "tokens": step * self.config.tokens_per_step, **values}
        if self.parallel.is_main:
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
            }
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
            prune_checkpoints(self.run_dir, c.keep_checkpoints)
            self.last_ckpt = path
            self.cb.on_checkpoint(trainer.step, path)
        self.last_ckpt = self.parallel.broadcast_object(self.last_ckpt)

    def _plot(self) -> None:
        from merit_core.train.plots import plot_curves

        c = self.config
        title = f"{c.model} · {c.optimizer} · batch {c.batch_size} x {c.seq_len} · lr {c.lr:g}"
        plot_curves(self.run_dir, title=title)


def _n_layers(model) -> int:
    return int(getattr(model.config, "num_hidden_layers", None) or model.config.n_layer)


def _checkpoints(run_dir: Path):
    from merit_core.train.checkpoint import list_checkpoints

    return list_checkpoints(run_dir)
