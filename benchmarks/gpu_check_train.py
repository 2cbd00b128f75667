"""One training run of benchmarks/gpu_check.sh, summarised as one JSON object.

    python benchmarks/gpu_check_train.py --optimizer merit --model gpt2-small --batch-size 64 \
        --seq-len 1024 --steps 100 --out RUN_DIR --json RESULT.json

Runs `merit_core.train.training_run.run_training` on the built-in corpus (a BPE of --vocab-size
trained on the Python standard library's docstrings, offline), evaluating and saving only at the
end, and writes: steady tokens/s (the median over log intervals after the first, which holds
start-up; evaluation and saving fall outside the intervals), the MFU of that rate, peak memory,
final train loss, final validation loss, the largest max attention logit over layers, the
micro-batch chosen, the last checkpoint, how the run compiled (compiled, eager, or eager after
compile=auto fell back) and torch.compile's counters for the whole run: graphs compiled, graph
breaks (with their most frequent reasons), frames compiled. Log lines are printed as they come.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from merit_core.train.callbacks import TrainCallbacks  # noqa: E402
from merit_core.train.config import load_config  # noqa: E402
from merit_core.train.training_run import run_training  # noqa: E402


class PrintLogs(TrainCallbacks):
    def __init__(self):
        self.logs: list[dict] = []
        self.info = None

    def on_start(self, info):
        self.info = info
        c = info.config
        print(
            f"start: {c.model} {info.n_params / 1e6:.1f}M params, {c.optimizer}, batch {c.batch_size} x {c.seq_len}, "
            f"micro-batch {c.micro_batch_size}, {info.device} ({info.device_name}), {info.compute_dtype}, "
            f"tf32 {c.tf32}, peak {info.peak_flops}",
            flush=True,
        )

    def on_log(self, record):
        self.logs.append(record)
        print(
            f"step {record['step']:>4}  loss {record['loss']:.4f}  grad_norm {record['grad_norm']:.3f}  "
            f"tokens/s {record['tokens_per_s']:,.0f}",
            flush=True,
        )

    def on_eval(self, record):
        print(f"eval step {record['step']}: val loss {record['val_loss']:.4f}", flush=True)


def compile_counters() -> dict:
    """torch.compile's counters of this process: graphs, graph breaks (top reasons), frames compiled
    (recompilations are in the log under TORCH_LOGS=recompiles: gpu_check.sh counts them)."""
    from torch._dynamo.utils import counters

    breaks = counters.get("graph_break", {})
    reasons = sorted(breaks.items(), key=lambda kv: -kv[1])[:3]
    return {
        "graphs": counters.get("stats", {}).get("unique_graphs", 0),
        "graph_breaks": sum(breaks.values()),
        "graph_break_reasons": [f"{n}x {reason[:120]}" for reason, n in reasons],
        "frames_compiled": counters.get("frames", {}).get("ok", 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", default="merit")
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=None, help="default: the optimizer's registry default")
    ap.add_argument("--vocab-size", type=int, default=50257)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compile", default="auto", choices=["auto", "true", "false"])
    ap.add_argument("--kernels", default="auto", help="auto, liger or none")
    ap.add_argument("--data", default=None, help="a text file or prepared folder (default: the built-in corpus)")
    ap.add_argument("--out", required=True, help="run folder (must not hold checkpoints)")
    ap.add_argument("--json", required=True, help="where to write the summary")
    args = ap.parse_args()

    from merit_core.train.hardware import mfu, peak_bf16_flops

    config = load_config(
        values=dict(
            model=args.model,
            optimizer=args.optimizer,
            lr=args.lr,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            steps=args.steps,
            vocab_size=args.vocab_size,
            device=args.device,
            dtype=args.dtype,
            compile={"auto": "auto", "true": True, "false": False}[args.compile],
            kernels=args.kernels,
            data=args.data,
            out=args.out,
            eval_every=0,
            save_every=0,
            log_every=args.log_every,
        )
    )
    logs = PrintLogs()
    start = time.perf_counter()
    summary = run_training(config, logs)
    rates = [r["tokens_per_s"] for r in logs.logs[1:]] or [r["tokens_per_s"] for r in logs.logs]
    steady = statistics.median(rates) if rates else None
    peak = peak_bf16_flops(summary.device_name) if summary.device.startswith("cuda") else None
    logits = [v for v in (summary.max_attention_logit or []) if v is not None]
    result = {
        "optimizer": summary.config.optimizer,
        "model": summary.config.model,
        "n_params": summary.n_params,
        "bpe_vocab_size": args.vocab_size,
        "batch": f"{summary.config.batch_size}x{summary.config.seq_len}",
        "micro_batch_size": summary.config.micro_batch_size,
        "steps": summary.steps,
        "device": summary.device,
        "device_name": summary.device_name,
        "dtype": summary.compute_dtype,
        "tokens_per_s": steady,
        "tokens_per_s_whole_run": summary.tokens_per_s,
        "mfu": mfu(summary.n_params, steady, peak),
        "peak_memory_gib": summary.peak_memory / 2**30 if summary.peak_memory else None,
        "final_loss": summary.final_loss,
        "final_val_loss": summary.final_val_loss,
        "max_attention_logit": max(logits) if logits else None,
        "checkpoint": str(summary.last_checkpoint) if summary.last_checkpoint else None,
        "wall_s": time.perf_counter() - start,
        "compile": summary.compile,
        "kernels": args.kernels,
        **compile_counters(),
    }
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
