"""The Trainer: one optimizer update per `train_step`, evaluation, and its checkpointable state.

One code path for every batch size: the global batch is split over processes and then into
micro-batches whose gradients accumulate; the loss is normalised over the global batch, so
the gradient does not depend on how the batch is split. No host synchronisation happens in
`train_step`: loss, gradient norm and a first-non-finite-step marker stay on the device until
the caller reads them on log steps, and the next micro-batch's host-to-device copy is issued
before the current one's forward (pinned buffers, non_blocking copies on CUDA).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from merit_core.devices import available_host_memory
from merit_core.metric_names import (
    UPDATE_RATIO,
    VAL_LOSS,
)
from merit_core.models.attention_probe import probe_attention
from merit_core.optim.merit.verify import guard_training
from merit_core.optim.registry import OptimizerSpec, StepHook, build_optimizer, get_spec
from merit_core.schedule import lr_at
from merit_core.settings import ResolvedConfig
from merit_core.train import lm_loss
from merit_core.train.batches import TrainBatches, to_device, val_batches
from merit_core.train.compiling import (
    compile_errors,
    compile_failure,
    compile_note,
    eager,
    fallback_warning,
    resolve_compile,
    transformer_blocks,
)
from merit_core.train.distributed import Parallel
from merit_core.train.liger_kernels import apply_liger, choose_kernels, mask_free_attention
from merit_core.train.step_hooks import StepContext


@dataclass
class StepOutput:
    """What one update leaves on the device: this process's loss share and the global grad norm."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float


class StepAbandoned(Exception):
    """Raised between micro-batches when `Trainer.should_stop` says a stop signal arrived."""


def compute_dtype(dtype: str, device: torch.device) -> str:
    """What a run's dtype setting means on `device`: 'bfloat16' (autocast) or 'float32'."""
    return "bfloat16" if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda") else "float32"


def _autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    if compute_dtype(dtype, device) != "bfloat16":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def build_trainer(
    config: ResolvedConfig,
    model: torch.nn.Module,
    parallel: Parallel,
    train_tokens: np.ndarray,
    val_tokens: np.ndarray,
    spec: OptimizerSpec | None = None,
) -> Trainer:
    """Wrap `model` (on its device) for `parallel`, build the configured optimizer, return the Trainer.

    `spec` is the optimizer's registry entry (looked up from `config.optimizer` when not given): it
    builds the optimizer and gives the Trainer its step hook."""
    spec = get_spec(spec or config.optimizer)
    mask_free_attention(model)  # no per-forward mask building (and its host sync)
    loss_fn = None
    if choose_kernels(config.kernels, model.config, parallel.device) == "liger":
        loss_fn = apply_liger(model)  # before wrapping: the wrapper and the compiler see the new modules
    forward = parallel.wrap(model, compile=resolve_compile(config.compile, parallel.device))
    optimizer = build_optimizer(spec, model, lr=config.lr, weight_decay=config.weight_decay, **config.optimizer_args)
    guard_training(optimizer, parallel.device)  # a fused MERIT kernel wrong on this device: foreach, one warning
    return Trainer(
        config, model, forward, optimizer, train_tokens, val_tokens, parallel, loss_fn=loss_fn, hook=spec.step_hook
    )


class Trainer:
    """Model + optimizer + data for a ResolvedConfig, on the processes of `parallel`.

    `model` is the plain transformers module (on the device); `forward` is what training runs
    through (the parallel wrapper, compiled if asked). Evaluation, diagnostics and saving use
    the plain module. `hook` is the optimizer spec's step hook (`build_trainer` passes it).
    """

    def __init__(
        self,
        config: ResolvedConfig,
        model: torch.nn.Module,
        forward: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_tokens: np.ndarray,
        val_tokens: np.ndarray,
        parallel: Parallel,
        loss_fn=None,
        hook: StepHook | None = None,
    ):
        self.config = config
        self.parallel = parallel
        self.device = parallel.device
        self.model = model
        self.forward = forward
        self.optimizer = optimizer
        self.lr_scales = [group["lr"] / config.lr for group in optimizer.param_groups]
        self.batches = TrainBatches(train_tokens, config.seq_len, config.seed, pin_memory=self.device.type == "cuda")
        self.val = val_batches(val_tokens, config.eval_batches, config.eval_batch_size, config.seq_len)
        self.autocast = lambda: _autocast(self.device, config.dtype)
        self.per_rank = config.batch_size // parallel.world_size
        self.compiled = resolve_compile(config.compile, self.device)
        self.compile_fallback: str | None = None  # the compiler's error when compile=auto fell back to eager
        self.first_step_s: float | None = None  # wall time of this process's first update (compilation)
        self.notes: list[str] = []  # one-line notes for the user (TrainingRun passes them to on_note)
        # the loss is summed inside the forward: Liger's fused loss (`loss_fn`) or merit's chunk loop,
        # its chunk step compiled where the run compiles on CUDA
        fused = self.compiled and self.device.type == "cuda"
        self.head = lm_loss.install(model, fused=fused, loss_fn=loss_fn)
        self.kernels = "liger" if loss_fn is not None else "none"
        self.hook = hook  # the optimizer spec's extra work after some updates (StepHook), or None
        self.hook_every = self.hook.interval(optimizer) if self.hook is not None else None
        self.step = 0  # completed updates
        # asked between micro-batches (one process only): True abandons the step, train_step returns None
        self.should_stop: Callable[[], bool] | None = None
        self._first_bad = torch.zeros((), dtype=torch.int64, device=self.device)  # 0: all finite so far

    # -- training ----------------------------------------------------------------------------
    def lr_for(self, index: int) -> float:
        c = self.config
        return lr_at(index, lr=c.lr, min_lr=c.min_lr, warmup_steps=c.warmup_steps, total_steps=c.steps)

    @property
    def n_micro(self) -> int:
        """Micro-batches per update on each process."""
        assert self.config.micro_batch_size is not None  # chosen before step 0 (TrainingRun, choose_micro_batch)
        return self.per_rank // self.config.micro_batch_size

    def _loss(self, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
        """scale * the summed token cross-entropy of `module` on (x, y), in fp32; the full
        [batch, seq, vocab] logits never exist at once (see merit_core.train.lm_loss)."""
        with self.autocast(), lm_loss.targets_for(self.head, y) as summed:
            out = module(input_ids=x, use_cache=False).logits
        if summed:
            return out * scale
        return F.cross_entropy(out.float().flatten(0, 1), y.flatten(), reduction="sum") * scale

    # -- choosing the micro-batch ------------------------------------------------------------
    def choose_micro_batch(self) -> int:
        """The micro-batch size for this run: config.micro_batch_size when set, else the size 'auto'
        stands for, found here before step 0. Returned, not written: TrainingRun puts it into the
        config (once), which config.toml then records.

        On CUDA: the largest fitting size L (the per-process batch if a forward + backward of it
        fits next to the optimizer state still to come, else the largest divisor of it at most
        half the last size that ran out of memory), then the fastest of L and the next two
        halvings (timed forward + backward passes, eagerly: see `fastest_fitting`). On CPU: the
        per-process batch unless its estimated activations exceed half the available host memory.
        Under several processes the smallest choice is taken by all (under fsdp the tries run in
        lockstep and assume every process runs out of memory alike: give --micro-batch-size to be
        safe).
        """
        if self.config.micro_batch_size is not None:
            return self.config.micro_batch_size
        with eager():  # the sizes tried would each compile a graph
            if self.device.type == "cuda":
                size = fastest_fitting(self.per_rank, self._fits_on_gpu, self._seconds_per_sequence)
            else:
                size = largest_fitting(self.per_rank, self._fits_in_host_memory)
        return int(self.parallel.all_reduce(torch.tensor(size, device=self.device), op="min").item())

    def _fits_in_host_memory(self, size: int) -> bool:
        free = available_host_memory()
        return free is None or size * activation_bytes_per_sequence(self.model.config, self.config.seq_len) <= free // 2

    def _first_micro_batch(self, size: int):
        """This step's first micro-batch of `size` sequences on this process (the search's probe input)."""
        batches = self.batches.micro_batches(
            self.step,
            batch_size=self.config.batch_size,
            micro_batch_size=size,
            rank=self.parallel.rank,
            world_size=self.parallel.world_size,
        )
        return next(batches)

    def _seconds_per_sequence(self, size: int, repeats: int = 2) -> float:
        """Seconds per sequence of a forward + backward of `size` sequences on the plain model
        (one untimed pass first); gradients are dropped and the RNG left as it was."""
        x, y = self._first_micro_batch(size)
        x, y = x.to(self.device), y.to(self.device)
        with torch.random.fork_rng(devices=[self.device]):
            try:
                for i in range(repeats + 1):
                    if i == 1:
                        torch.cuda.synchronize(self.device)
                        start = time.perf_counter()
                    self._loss(self.model, x, y, 1.0).backward()
                torch.cuda.synchronize(self.device)
                seconds = time.perf_counter() - start
            finally:
                self.model.zero_grad(set_to_none=True)
        return seconds / (repeats * size)

    def _fits_on_gpu(self, size: int) -> bool:
        """One forward + backward of `size` sequences (step 0's first micro-batch) on the plain
        model, with the optimizer state's future memory held in reserve; the RNG is left as it was."""
        x, y = self._first_micro_batch(size)
        ok = True
        reserve = loss = None
        with torch.random.fork_rng(devices=[self.device]):
            try:
                reserve = torch.empty(
                    optimizer_state_reserve(self.model, self.optimizer), dtype=torch.uint8, device=self.device
                )
                loss = self._loss(self.model, x.to(self.device), y.to(self.device), 1.0)
                loss.backward()
                torch.cuda.synchronize(self.device)
            except torch.cuda.OutOfMemoryError:
                ok = False
            finally:
                del reserve, loss
                self.model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
        if self.parallel.lockstep_forward:  # every process tries the same sizes
            ok = bool(self.parallel.all_reduce(torch.tensor(int(ok), device=self.device), op="min").item())
        return ok

    def train_step(self) -> StepOutput | None:
        """One optimizer update on global batch number `self.step`; None when `should_stop` abandoned it."""
        c = self.config
        index = self.step
        lr = self.lr_for(index)
        for group, scale in zip(self.optimizer.param_groups, self.lr_scales):
            group["lr"] = lr * scale
        scale = 1.0 / (self.per_rank * c.seq_len)  # DDP averages over ranks -> global-batch mean
        assert c.micro_batch_size is not None  # chosen before step 0 (TrainingRun, choose_micro_batch)
        micro_size = c.micro_batch_size
        micro = lambda: self.batches.micro_batches(  # noqa: E731  (a fresh iterator for a redone step)
            index,
            batch_size=c.batch_size,
            micro_batch_size=micro_size,
            rank=self.parallel.rank,
            world_size=self.parallel.world_size,
        )
        start = time.perf_counter() if self.first_step_s is None else None

        def accumulate() -> tuple[torch.Tensor, torch.Tensor | None]:
            loss_sum, first = torch.zeros((), device=self.device), None
            for k, (x, y) in enumerate(prefetched(micro(), self.device)):
                if k and self.should_stop is not None and self.should_stop():
                    raise StepAbandoned
                first = x if first is None else first
                sync = k == self.n_micro - 1
                with contextlib.nullcontext() if sync else self.parallel.no_sync():
                    loss = self._loss(self.forward, x, y, scale)
                    loss.backward()
                loss_sum += loss.detach()
            return loss_sum, first

        try:
            loss_sum, first = self._compiling(accumulate)
        except StepAbandoned:  # the weights are still the last update's: nothing of this step is kept
            self.optimizer.zero_grad(set_to_none=True)
            return None
        if start is not None:
            self.first_step_s = time.perf_counter() - start
            if self.compiled:
                self.notes.append(compile_note(len(transformer_blocks(self.model)), self.first_step_s))
        grad_norm = self.parallel.clip_grad_norm(self.model, c.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.hook_every and index % self.hook_every == self.hook_every - 1:
            self._run_hook(index, first)
        finite = torch.isfinite(loss_sum) & torch.isfinite(grad_norm)
        self._first_bad = torch.where((self._first_bad == 0) & ~finite, index + 1, self._first_bad)
        self.step += 1
        return StepOutput(loss_sum, grad_norm, lr)

    def _run_hook(self, index: int, x: torch.Tensor) -> None:
        """The optimizer spec's step hook after update `index` (Sophia-G: its Hessian refresh), on this
        process's first micro-batch, with a generator seeded from (seed, index, rank)."""
        hook = self.hook
        if hook is None:
            return
        gen = torch.Generator(device=self.device)
        gen.manual_seed((self.config.seed * 1_000_003 + index) * 4099 + self.parallel.rank)

        def logits() -> torch.Tensor:
            with self.autocast():
                return self.forward(input_ids=x, use_cache=False).logits

        self._compiling(lambda: hook.run(StepContext(self.optimizer, index, logits, gen, self.parallel.world_size)))
        self.optimizer.zero_grad(set_to_none=True)

    def _compiling(self, work: Callable[[], Any]) -> Any:
        """`work()` (forward and backward passes) under the run's compile setting: a compile failure
        stops a compile=true run in one line (CompileFailed); under compile=auto it warns once
        (a note), clears the gradients of the failed attempt and redoes `work` eagerly, and the
        run stays eager from then on (`compile_fallback`)."""
        if self.compile_fallback is not None:
            with eager():
                return work()
        try:
            with compile_errors(self.compiled and self.config.compile is True):
                return work()
        except Exception as exc:
            failure = compile_failure(exc) if self.compiled else None
            if failure is None:
                raise
        self.compiled, self.compile_fallback = False, failure
        self.notes.append(fallback_warning(failure))
        self.optimizer.zero_grad(set_to_none=True)
        with eager():
            return work()

    @property
    def compile_state(self) -> str:
        """How training ran: 'compiled', 'eager', or eager after a compile=auto fallback (with why)."""
        if self.compile_fallback is not None:
            return f"eager (compile=auto fell back: {self.compile_fallback})"
        return "compiled" if self.compiled else "eager"

    def first_nonfinite_step(self) -> int | None:
        """The first update (1-based) whose loss or grad norm was not finite on any process (syncs)."""
        bad = self.parallel.all_reduce(torch.where(self._first_bad > 0, self._first_bad, 1 << 62), op="min")
        value = int(bad.item())
        return None if value == 1 << 62 else value

    # -- evaluation --------------------------------------------------------------------------
    @torch.no_grad()
    @eager()
    def evaluate(self) -> dict[str, Any]:
        """Validation loss over the fixed val batches and, from one probe pass on the first val batch,
        per layer the max attention logit (max over heads), the smallest normalised attention entropy
        (min over heads and positions) and the residual stream's max / median |h|, and the output
        layer's mean log Z (docs/DIAGNOSTICS.md). Compiled blocks run eagerly here (see
        merit_core.train.compiling)."""
        self.model.eval()
        try:
            total = torch.zeros((), device=self.device)
            world, rank = self.parallel.world_size, self.parallel.rank
            mine = list(range(rank, len(self.val), world))
            rounds = -(-len(self.val) // world) if self.parallel.lockstep_forward else len(mine)
            for r in range(rounds):  # in lockstep, a process short of batches repeats one with weight 0
                j, weight = (mine[r], 1.0) if r < len(mine) else (0, 0.0)
                x, y = self.val[j]
                total += self._loss(self.model, x.to(self.device), y.to(self.device), weight)
            n_tokens = sum(y.numel() for _, y in self.val)
            val_loss = self.parallel.all_reduce(total, op="sum") / n_tokens
            with self.autocast():  # the probe turns autocast off: float32 numbers on every device
                probed = probe_attention(self.model, self.val[0][0].to(self.device), instability=True)
        finally:
            self.model.train()
        record = {VAL_LOSS: float(val_loss.item()), **probed.eval_metrics()}
        ratio = self.update_ratio()
        if ratio is not None:
            record[UPDATE_RATIO] = ratio
        return record

    def update_ratio(self) -> float | None:
        """The largest RMS(next update) / RMS(weight) over 2-D weights, for an optimizer that exposes
        it from its state (MERIT, not under sharded state), at the lr of the next update; else None."""
        ratios = getattr(self.optimizer, "update_ratios", None)
        if ratios is None or self.parallel.sharded_state or self.step == 0:
            return None
        lr = self.lr_for(self.step)
        for group, scale in zip(self.optimizer.param_groups, self.lr_scales):
            group["lr"] = lr * scale  # what train_step sets for the next update anyway
        values = [r for p, r in ratios() if p.ndim == 2]
        return max(values) if values else None

    # -- state --------------------------------------------------------------------------------
    def state_dict(self, checkpoint_dir: Path | None = None) -> dict[str, Any]:
        """Tensor state for trainer_state.pt (collective under sharded parallelism, which writes the
        optimizer shards into `checkpoint_dir`, the checkpoint being staged)."""
        rng: dict[str, Any] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "step": self.step,
            "optimizer": self.parallel.optimizer_state_dict(self.model, self.optimizer, checkpoint_dir),
            "rng": rng,
            "data": {"seed": self.config.seed, "next_batch": self.step},
        }

    def load_state_dict(self, state: dict[str, Any], checkpoint_dir: Path | None = None) -> None:
        """Restore from trainer_state.pt's `state` (and `checkpoint_dir`, the folder it came from): at the
        start of a resumed run or in the middle of one (a rewind), the same state either way."""
        self.parallel.load_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], checkpoint_dir)
        self.step = int(state["step"])
        self._first_bad.zero_()  # a checkpoint's updates were all finite; steps abandoned after it are forgotten
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            cuda_states = state["rng"]["cuda"]
            if len(cuda_states) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda_states)


def prefetched(micro_batches, device: torch.device):
    """(x, y) on `device`, the next pair's copy issued before the current one is handed out: on
    CUDA the copies from pinned memory are asynchronous and overlap the compute; elsewhere this is
    the plain sequence of copies."""
    it = iter(micro_batches)
    nxt = next(it, None)
    while nxt is not None:
        current = to_device(nxt, device)
        nxt = next(it, None)
        if nxt is not None and device.type == "cuda":
            nxt = to_device(nxt, device)  # in flight while `current` runs
        yield current


# -- micro-batch helpers ---------------------------------------------------------------------
def fastest_fitting(
    per_rank: int, fits: Callable[[int], bool], seconds_per_sequence: Callable[[int], float], candidates: int = 3
) -> int:
    """The largest size that fits (`largest_fitting`), or a smaller one among the next
    `candidates - 1` halvings (largest divisor of per_rank at most half the previous) when it
    processes sequences more than 3% faster: past some size a bigger micro-batch only costs
    memory (and allocator pressure near the limit makes it slower)."""
    largest = largest_fitting(per_rank, fits)
    sizes = [largest]
    while len(sizes) < candidates and sizes[-1] > 1:
        sizes.append(max(d for d in range(1, sizes[-1] // 2 + 1) if per_rank % d == 0))
    if len(sizes) == 1:
        return largest
    times = {size: seconds_per_sequence(size) for size in sizes}
    best = min(sizes, key=lambda s: times[s])
    return best if times[best] < 0.97 * times[largest] else largest


def largest_fitting(per_rank: int, fits) -> int:
    """The first size that `fits(size)` accepts in per_rank, then repeatedly the largest divisor of
    per_rank at most half the last size tried; 1 if none does (it is then left to fail in training)."""
    size = per_rank
    while size > 1:
        if fits(size):
            return size
        size = max(d for d in range(1, size // 2 + 1) if per_rank % d == 0)
    return 1


def activation_bytes_per_sequence(model_config: Any, seq_len: int) -> int:
    """Estimated fp32 activation memory one training sequence keeps for backward: the usual
    per-layer count s * h * (34 + 5 * a * s / h) bytes for 16-bit activations (Korthikanti et al.,
    2022), doubled for fp32; the chunked loss adds little beyond it."""
    layers = int(getattr(model_config, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(model_config, "hidden_size", 0) or 0)
    heads = int(getattr(model_config, "num_attention_heads", 0) or 0)
    return 2 * layers * seq_len * (34 * hidden + 5 * heads * seq_len)


def optimizer_state_reserve(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes to keep free for an optimizer state not allocated yet: two fp32 moments per local
    parameter element (AdamW, MERIT, Sophia-G, LAMB; more than Lion or Muon need); 0 once it exists."""
    if optimizer.state:
        return 0
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += 2 * 4 * local.numel()
    return total
