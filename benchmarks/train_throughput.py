"""Training throughput: `merit train`'s loop next to a minimal plain loop, in one run.

Side by side (the default): per model, the same model (merit's `build_model`, SDPA attention),
global batch, dtype (bf16 autocast on CUDA, fp32 on CPU) and gradient clipping (1.0) in the
loops `--loops` names, each built fresh, warmed up (compilation happens there; its wall time is
the 'cold s' column), then timed. A loop is named KIND MODE (OPTIMIZER):
  plain eager (adamw)     HF model, logits -> F.cross_entropy, micro-batches accumulated, AdamW
                          (fused on CUDA); the plain loops run AdamW only
  plain compiled (adamw)  the same under torch.compile(model) (`--compile-backend`, inductor)
  merit eager (NAME)      merit's Trainer (`build_trainer`, `train_step`) with compile=false,
                          kernels=none, optimizer NAME from the registry (merit, adamw, lamb, ...)
  merit default (NAME)    merit's Trainer with the run defaults for the device (compile auto,
                          kernels auto)
"(OPTIMIZER)" may be left out: adamw for the plain loops, `--optimizer` for merit's. Adding a
loop to the comparison is adding its name to `--loops`. The merit loops read loss and grad norm
every `--log-every` steps, as `merit train` logs. The plain loops use the micro-batch merit's
first loop chose (auto), so all do the same work. With `--json`, the rows so far are rewritten
to the file after each loop, so a run cut off keeps what it measured.
Printed per loop: tokens/s (median over rounds of `--steps` steps), the ratio to the plain
compiled loop, MFU and peak memory (CUDA: max allocated; CPU: process peak RSS, which only grows).

MFU = tokens/s x FLOPs per token / the device's dense bf16 peak (merit_core.train.hardware), with
FLOPs per token = 6 N + 12 L d T (N parameters, L layers, d = heads x head dim, T sequence
length): 6N for the weights' matrix products (forward 2N, backward 4N) and 12 L d T for attention's
scores and values (forward 2 x 2 L d T, backward twice that), counted over the full T x T square
as in the PaLM paper's appendix B (causal masking halves the useful part). The 6N column alone is
shown too, as many published tables quote it.

    python benchmarks/train_throughput.py --device cuda    # gpt2-small 64 x 1024 and llama-1b 16 x 2048
    python benchmarks/train_throughput.py --device cpu     # tiny models, minutes on a CPU
    python benchmarks/train_throughput.py --optimizers adamw,merit   # the optimizer comparison below

Optimizer comparison (`--optimizers a,b,...`): whole training steps of one model through merit's
Trainer, one Trainer per optimizer (same initial weights, same batches); after warm-up the
optimizers take turns, `--steps` timed steps each, for `--rounds` rounds in alternating order;
median and best round in tokens/s, each as a ratio to the first optimizer, and the optimizer step
alone (fastest of several, on one step's gradients).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# model, global batch, seq len, vocabulary (None: the named model's), timed steps per round
CUDA_MODELS = (("gpt2-small", 64, 1024, None, 10), ("llama-1b", 16, 2048, None, 4))
CPU_MODELS = (("gpt2-tiny", 8, 128, None, 2), ("llama-tiny", 8, 128, None, 2))
LOOPS = ("plain compiled", "merit default (merit)", "merit default (adamw)", "merit eager (merit)", "plain eager")
KINDS = {"plain": ("eager", "compiled"), "merit": ("eager", "default")}


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """One loop of the side-by-side comparison: `kind` plain or merit, its `mode`, the optimizer."""

    kind: str
    mode: str
    optimizer: str

    @property
    def label(self) -> str:
        return f"{self.kind} {self.mode} ({self.optimizer})"


def parse_loop(text: str, merit_optimizer: str = "adamw") -> LoopSpec:
    """'merit default (lamb)' -> LoopSpec('merit', 'default', 'lamb'); see the module docstring."""
    words = text.strip()
    optimizer = None
    if words.endswith(")") and "(" in words:
        words, optimizer = words[:-1].split("(", 1)
        words, optimizer = words.strip(), optimizer.strip()
    kind, _, mode = words.partition(" ")
    if mode not in KINDS.get(kind, ()):
        choices = ", ".join(f"{k} {m}" for k, modes in KINDS.items() for m in modes)
        raise ValueError(f"unknown loop {text!r}: one of {choices}, optionally followed by (optimizer)")
    optimizer = optimizer or ("adamw" if kind == "plain" else merit_optimizer)
    if kind == "plain" and optimizer != "adamw":
        raise ValueError(f"{text!r}: the plain loops run AdamW only")
    return LoopSpec(kind, mode, optimizer)


def build_trainer(optimizer: str, args, train_tokens, val_tokens, model_name=None, **overrides):
    from merit_core.devices import resolve_device
    from merit_core.models import build_model, model_config
    from merit_core.train.config import TrainConfig, resolve
    from merit_core.train.distributed import Parallel
    from merit_core.train.trainer import build_trainer as trainer_for

    values = dict(
        model=model_name or args.model,
        optimizer=optimizer,
        batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        steps=10_000,
        eval_batches=1,
        eval_batch_size=1,
        device=args.device,
        compile=args.compile,
        out="unused",
    )
    values.update(overrides)
    config = resolve(TrainConfig(**values), auto_micro_batch=True).config
    parallel = Parallel(resolve_device(args.device))
    mconf = model_config(values["model"], vocab_size=args.vocab_size, context=max(args.seq_len, 256))
    model = build_model(mconf, seed=0).to(parallel.device)
    trainer = trainer_for(config, model, parallel, train_tokens, val_tokens)
    if config.micro_batch_size is None:  # 'auto', settled before step 0 as TrainingRun does
        trainer.config = dataclasses.replace(config, micro_batch_size=trainer.choose_micro_batch())
    return trainer


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(trainer, n: int, log_every: int = 0) -> float:
    """Seconds for `n` updates; loss and grad norm read every `log_every` steps and at the end."""
    start = time.perf_counter()
    for i in range(n):
        out = trainer.train_step()
        if log_every and (i + 1) % log_every == 0:
            float(out.loss.item()), float(out.grad_norm.item())
    float(out.loss.item())  # one sync at the end, as on a log step
    _sync(trainer.device)
    return time.perf_counter() - start


# -- the plain loop ----------------------------------------------------------------------------
class PlainLoop:
    """A minimal training loop: HF model, logits -> cross-entropy, accumulation, clip, AdamW."""

    def __init__(self, model_name, args, batches, micro, compiled: bool):
        import torch

        from merit_core.models import build_model, model_config

        self.device = torch.device(args.device)
        mconf = model_config(model_name, vocab_size=args.vocab_size, context=max(args.seq_len, 256))
        self.model = build_model(mconf, seed=0).to(self.device)
        cuda = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=3e-4, weight_decay=0.1, fused=cuda, foreach=None if cuda else True
        )
        self.forward = torch.compile(self.model, backend=args.compile_backend) if compiled else self.model
        self.batches, self.micro, self.args = batches, micro, args
        self.step = 0

    def train_step(self):
        import torch
        import torch.nn.functional as F

        from merit_core.train.batches import to_device

        a = self.args
        n_micro = a.batch_size // self.micro
        autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else contextlib.nullcontext()
        )
        total = torch.zeros((), device=self.device)
        for x, y in self.batches.micro_batches(self.step, batch_size=a.batch_size, micro_batch_size=self.micro):
            x, y = to_device((x, y), self.device)
            with autocast:
                logits = self.forward(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / n_micro
            loss.backward()
            total += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

        class Out:
            pass

        out = Out()
        out.loss, out.grad_norm = total, norm
        return out


def flops_per_token(mconf, n_params: int, seq_len: int) -> tuple[float, float]:
    """(6N, 6N + 12 L d T): see the module docstring."""
    from merit_core.models import family_spec

    fam = family_spec(mconf)
    layers, heads, head_dim = fam.n_layers(mconf), fam.n_heads(mconf), fam.head_dim(mconf)
    return 6.0 * n_params, 6.0 * n_params + 12.0 * layers * heads * head_dim * seq_len


def side_by_side(args) -> list[dict]:
    import numpy as np
    import torch

    from merit_core.models import count_parameters, model_config
    from merit_core.train.batches import TrainBatches
    from merit_core.train.hardware import device_info, peak_memory, reset_peak_memory

    device = torch.device(args.device)
    hw = device_info(device)
    models = CUDA_MODELS if device.type == "cuda" else CPU_MODELS
    if args.models:
        wanted = args.models.split(",")
        models = [m for m in models if m[0] in wanted] or [
            (w, args.batch_size, args.seq_len, None, args.steps or 2) for w in wanted
        ]
    rows: list[dict] = []
    for name, batch, seq, vocab, steps in models:
        steps = args.steps or steps
        args.batch_size, args.seq_len = batch, seq
        args.vocab_size = vocab or args.vocab_arg or model_config(name).vocab_size
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, args.vocab_size, size=max(2_000_000, 4 * batch * (seq + 1)), dtype=np.int64)
        tokens = tokens.astype(np.uint16 if args.vocab_size < 65536 else np.uint32)
        micro = args.micro_batch_size
        for spec in args.loops:
            label = spec.label
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            t0 = time.perf_counter()
            try:
                if spec.kind == "merit":
                    overrides = dict(compile=_default_compile(device)) if spec.mode == "default" else {}
                    if spec.mode == "eager":
                        overrides = dict(compile=False, kernels="none")
                    loop = build_trainer(spec.optimizer, args, tokens, tokens[:100_000], name, **overrides)
                    micro = micro or loop.config.micro_batch_size
                else:
                    batches = TrainBatches(tokens, seq, seed=0, pin_memory=device.type == "cuda")
                    loop = PlainLoop(name, args, batches, micro or batch, compiled=spec.mode == "compiled")
                reset_peak_memory(device)  # after merit's micro-batch search, which tries the larger sizes
                timed_steps(loop, args.warmup, args.log_every)
                cold = time.perf_counter() - t0
                rates = [steps * batch * seq / timed_steps(loop, steps, args.log_every) for _ in range(args.rounds)]
            except Exception as exc:  # a loop that fails is a row that says so, the others still run
                rows.append({"model": name, "loop": label, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
                print(f"{name} {label}: FAILED {exc!r:.300}", flush=True)
                _write_rows(rows, args.json)
                continue
            model = loop.model
            n_params = count_parameters(model)
            f6n, fall = flops_per_token(model.config, n_params, seq)
            tps = statistics.median(rates)
            row = {
                "model": name,
                "n_params": n_params,
                "vocab": args.vocab_size,
                "batch": f"{batch}x{seq}",
                "micro": micro or batch,
                "loop": label,
                "optimizer": spec.optimizer,
                "tokens_per_s": tps,
                "vs_plain_compiled": None,
                "cold_s": cold,
                "mfu_6n": tps * f6n / hw.peak_flops if hw.peak_flops else None,
                "mfu": tps * fall / hw.peak_flops if hw.peak_flops else None,
                "peak_memory_gib": peak_memory(device) / 2**30,
                "device": hw.name,
            }
            if spec.kind == "merit":
                row["compile"] = getattr(loop, "compile_state", loop.config.compile)
                row["kernels"] = getattr(loop, "kernels", "none")
            elif spec.mode == "compiled":
                row["compile"] = f"torch.compile(model, backend={args.compile_backend!r})"
            rows.append(row)
            _with_ratios(rows)
            _write_rows(rows, args.json)
            print(json.dumps(row), flush=True)
            del loop, model
    return rows


def _with_ratios(rows: list[dict]) -> None:
    """Each row's tokens/s over its model's plain compiled loop (when that one was measured)."""
    for r in rows:
        base = next((b["tokens_per_s"] for b in rows if b["model"] == r["model"] and _plain_compiled(b)), None)
        if "tokens_per_s" in r:
            r["vs_plain_compiled"] = r["tokens_per_s"] / base if base else None


def _plain_compiled(row: dict) -> bool:
    return row["loop"].startswith("plain compiled") and "error" not in row


def _write_rows(rows: list[dict], path: str | None) -> None:
    """The rows so far, to `path` in one rename (a reader never sees half a file)."""
    if path:
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(rows, indent=1))
        os.replace(tmp, path)


def _default_compile(device):
    """`merit train`'s default compile setting (resolved per device by the Trainer)."""
    from merit_core.train.config import TrainConfig

    return TrainConfig().compile


def print_side_by_side(rows: list[dict], args) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"merit train's loop vs a minimal plain loop, {args.device}, median of {args.rounds} rounds")
    cols = [
        "model",
        "loop",
        "tokens/s",
        "vs plain compiled",
        "MFU (6N+attn)",
        "MFU (6N)",
        "peak GiB",
        "cold s",
        "micro",
    ]
    for col in cols:
        table.add_column(col, justify="left" if col in ("model", "loop") else "right")
    for r in rows:
        if "error" in r:
            table.add_row(r["model"], r["loop"], r["error"], *[""] * (len(cols) - 3))
            continue
        ratio = r.get("vs_plain_compiled")
        pct = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
        table.add_row(
            f"{r['model']} ({r['n_params'] / 1e6:.1f}M, V={r['vocab']}, {r['batch']})",
            r["loop"] + (f" [compile={r['compile']}, kernels={r['kernels']}]" if "kernels" in r else ""),
            f"{r['tokens_per_s']:,.0f}",
            f"{ratio:.2f}x" if ratio else "-",
            pct(r["mfu"]),
            pct(r["mfu_6n"]),
            f"{r['peak_memory_gib']:.1f}",
            f"{r['cold_s']:.0f}",
            str(r["micro"]),
        )
    Console(width=max(Console().width, 160)).print(table)  # a log file gets whole rows


# -- the optimizer comparison ------------------------------------------------------------------
def optimizer_step_time(trainer, n: int = 9) -> float:
    """Fastest seconds of optimizer.step() alone, on the gradients of one fresh training step
    (it changes the model and optimizer state: call it last)."""
    c = trainer.config
    trainer.optimizer.zero_grad(set_to_none=True)
    x, y = next(trainer.batches.micro_batches(0, batch_size=c.batch_size, micro_batch_size=c.micro_batch_size))
    loss = trainer._loss(trainer.forward, x.to(trainer.device), y.to(trainer.device), 1.0 / y.numel())
    loss.backward()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        trainer.optimizer.step()
        _sync(trainer.device)
        times.append(time.perf_counter() - start)
    return min(times)


def compare_optimizers(args) -> None:
    import numpy as np
    import torch
    from rich.console import Console
    from rich.table import Table

    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    args.vocab_size = args.vocab_arg or 4096
    rng = np.random.default_rng(0)
    train_tokens = rng.integers(0, args.vocab_size, size=2_000_000, dtype=np.int64).astype(np.uint16)
    val_tokens = train_tokens[:10_000]
    trainers = {n: build_trainer(n, args, train_tokens, val_tokens) for n in names}
    tokens_per_step = args.batch_size * args.seq_len
    for trainer in trainers.values():
        timed_steps(trainer, args.warmup)

    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            rates[n].append(args.steps * tokens_per_step / timed_steps(trainers[n], args.steps))
    step_ms = {n: 1e3 * optimizer_step_time(trainers[n]) for n in names}

    base = statistics.median(rates[names[0]])
    table = Table(
        title=f"Training throughput: {args.model}, batch {args.batch_size} x {args.seq_len}, "
        f"{args.device}, {torch.get_num_threads()} threads, {args.rounds} rounds x {args.steps} steps"
    )
    best_base = max(rates[names[0]])
    for col in (
        "optimizer",
        "tokens/s median",
        "tokens/s best",
        "optimizer step ms",
        f"median vs {names[0]}",
        f"best vs {names[0]}",
    ):
        table.add_column(col, justify="left" if col == "optimizer" else "right")
    for n in names:
        med, best = statistics.median(rates[n]), max(rates[n])
        table.add_row(
            n, f"{med:,.0f}", f"{best:,.0f}", f"{step_ms[n]:.2f}", f"{med / base:.3f}", f"{best / best_base:.3f}"
        )
    Console().print(table)
    Console().print("[dim]'best' is each optimizer's fastest round: the least disturbed by other load.[/]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--models", default=None, help="side by side: comma-separated named models (default: per device)"
    )
    parser.add_argument(
        "--optimizer", default="adamw", help="side by side: the optimizer of a merit loop named without one"
    )
    parser.add_argument("--optimizers", default=None, help="comma-separated: run the optimizer comparison instead")
    parser.add_argument("--model", default="gpt2-tiny", help="the optimizer comparison's model")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab-size", dest="vocab_arg", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per loop (default 3 on CUDA, 2 on CPU)")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (side by side), 6 (optimizers)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round (default: per model)")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument(
        "--loops", default=",".join(LOOPS), help="side by side: the loops in order, comma-separated (see above)"
    )
    parser.add_argument("--compile-backend", default="inductor", help="the plain compiled loop's torch.compile backend")
    parser.add_argument("--compile", action="store_true", help="the optimizer comparison: compile=true")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", default=None, help="side by side: also write the rows here")
    args = parser.parse_args()

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    if args.optimizers:
        args.warmup = 3 if args.warmup is None else args.warmup
        args.rounds = args.rounds or 6
        args.steps = args.steps or 4
        compare_optimizers(args)
        return
    args.warmup = (3 if cuda else 2) if args.warmup is None else args.warmup
    args.rounds = args.rounds or (3 if cuda else 2)
    try:
        args.loops = [parse_loop(name, args.optimizer) for name in args.loops.split(",") if name.strip()]
    except ValueError as exc:
        parser.error(str(exc))
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    rows = side_by_side(args)
    print_side_by_side(rows, args)


if __name__ == "__main__":
    main()
