"""Per-step time of MERIT and AdamW under FSDP2 (2 CPU processes, gloo), measured in one run.

Both optimizers train the same sharded model (`fully_shard` per block and at the root, as
`merit train --parallel fsdp` does) on the same random batches; the rounds alternate between
them so machine-load drift hits both alike. For each: the forward+backward time, the
optimizer step time and the whole step, as medians over the timed rounds (each step's time is
the slowest process's), with ratios to AdamW. MERIT's extra communication, the all-reduces
that complete its row/column/tensor max-norms across shards, is counted (calls and bytes per
step) and timed (launch to completed wait), next to FSDP's own all-gathers and reduce-scatters.
A last row runs MERIT's per-tensor reference update through DTensor ops (what MERIT did on
DTensors before the batched sharded step) to show the collectives the batching saves.

    python benchmarks/distributed_step.py                       # gpt2-tiny, 2 processes
    python benchmarks/distributed_step.py --model gpt2-small --batch-size 2 --seq-len 256 --rounds 3
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# FSDP2 (torch 2.13) gathers and reduce-scatters through the *_single functions.
COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single")


class CommStats:
    """Calls, bytes and seconds of the torch.distributed collectives issued while active."""

    def __init__(self):
        self.active = False
        self.calls = dict.fromkeys(COLLECTIVES, 0)
        self.bytes = dict.fromkeys(COLLECTIVES, 0)
        self.seconds = dict.fromkeys(COLLECTIVES, 0.0)

    def reset(self):
        self.__init__()

    def install(self):
        for name in COLLECTIVES:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, real):
        stats = self

        def counted(*args, **kwargs):
            if not stats.active:
                return real(*args, **kwargs)
            if name == "all_reduce":
                tensor = args[0] if args else kwargs["tensor"]
            else:  # count what each process contributes: the input
                tensor = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
            start = time.perf_counter()
            work = real(*args, **kwargs)
            stats.calls[name] += 1
            stats.bytes[name] += tensor.numel() * tensor.element_size()
            if work is None:
                stats.seconds[name] += time.perf_counter() - start
                return None
            return _TimedWork(work, start, stats, name)

        return counted


class _TimedWork:
    def __init__(self, work, start, stats, name):
        self._work, self._start, self._stats, self._name = work, start, stats, name

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        self._stats.seconds[self._name] += time.perf_counter() - self._start
        return result

    def __getattr__(self, item):
        return getattr(self._work, item)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def build(name: str, args, parallel):
    from merit_core.models import build_model, model_config
    from merit_core.optim import build_optimizer

    model = build_model(model_config(args.model, vocab_size=args.vocab_size), seed=0)
    model.to(parallel.device)
    parallel.wrap(model)
    kind = "merit" if name == "merit-reference" else name
    optimizer = build_optimizer(kind, model, lr=1e-3)
    return model, optimizer


@torch.no_grad()
def reference_step(optimizer) -> None:
    """MERIT's per-tensor reference update on each DTensor (DTensor ops insert the collectives)."""
    from merit_core.optim.merit.common import Hyper
    from merit_core.optim.merit.reference import reference_step as one_tensor

    for group in optimizer.param_groups:
        hyper = Hyper.of_group(group)
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
            state["step"] += 1
            one_tensor(p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], hyper)


def worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=5))
    from torch.distributed.tensor.debug import CommDebugMode

    from merit_core.train.parallel import setup_parallel

    parallel = setup_parallel("fsdp", "cpu", "float32")
    names = ["adamw", "merit"] + (["merit-reference"] if args.reference else [])
    runs = {name: build(name, args, parallel) for name in names}
    stats = CommStats()
    stats.install()
    gen = torch.Generator().manual_seed(rank)
    times = {name: {"fwd_bwd": [], "step": [], "total": []} for name in names}
    comm = {name: [] for name in names}
    fsdp_comm = []
    for round_ in range(args.warmup + args.rounds):
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            model, optimizer = runs[name]
            x = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len), generator=gen)
            dist.barrier()
            stats.reset()
            stats.active = True
            t0 = time.perf_counter()
            model(input_ids=x, labels=x).loss.backward()
            t1 = time.perf_counter()
            fsdp = (dict(stats.calls), dict(stats.bytes))
            stats.reset()
            stats.active = True
            if name == "merit-reference":
                with CommDebugMode() as debug:
                    reference_step(optimizer)
                dtensor_calls = debug.get_total_counts()
            else:
                optimizer.step()
                dtensor_calls = 0
            t2 = time.perf_counter()
            stats.active = False
            optimizer.zero_grad(set_to_none=True)
            if round_ >= args.warmup:
                fwd_bwd, step = _slowest(t1 - t0), _slowest(t2 - t1)
                times[name]["fwd_bwd"].append(fwd_bwd)
                times[name]["step"].append(step)
                times[name]["total"].append(fwd_bwd + step)
                comm[name].append(
                    (
                        stats.calls["all_reduce"] + dtensor_calls,
                        stats.bytes["all_reduce"],
                        _slowest(stats.seconds["all_reduce"]),
                    )
                )
                fsdp_comm.append(fsdp)
    if rank == 0:
        report(args, world, names, times, comm, fsdp_comm, runs)
    dist.barrier()
    dist.destroy_process_group()


def report(args, world, names, times, comm, fsdp_comm, runs) -> None:
    from merit_core.models import count_parameters

    med = {n: {k: statistics.median(v) for k, v in times[n].items()} for n in names}
    base = med["adamw"]
    n_params = count_parameters(runs["adamw"][0])
    print(
        f"\nFSDP2 on CPU (gloo), {world} processes x {args.threads} thread(s); {args.model} "
        f"({n_params / 1e6:.2f}M params); batch {args.batch_size} x {args.seq_len} per process; "
        f"median of {args.rounds} rounds after {args.warmup} warm-up\n"
    )
    head = (
        f"{'optimizer':<16}{'fwd+bwd ms':>11}{'step ms':>9}{'step/AdamW':>11}{'total ms':>10}{'total/AdamW':>12}"
        f"{'extra all-reduces':>18}{'extra KiB':>10}{'in them ms':>11}{'% of step':>10}"
    )
    print(head)
    print("-" * len(head))
    for n in names:
        m = med[n]
        calls = statistics.median(c for c, _, _ in comm[n])
        kib = statistics.median(b for _, b, _ in comm[n]) / 1024
        secs = statistics.median(s for _, _, s in comm[n])
        measured = calls and n != "merit-reference"  # DTensor's own collectives are counted, not timed
        extra = f"{calls:.0f}" + (" (DTensor)" if n == "merit-reference" else "")
        kib_s = f"{kib:.2f}" if measured else "-"
        secs_s = f"{1e3 * secs:.2f}" if measured else "-"
        share = f"{100 * secs / m['step']:.1f}" if measured else "-"
        print(
            f"{n:<16}{1e3 * m['fwd_bwd']:>11.1f}{1e3 * m['step']:>9.1f}{m['step'] / base['step']:>11.2f}"
            f"{1e3 * m['total']:>10.1f}{m['total'] / base['total']:>12.2f}{extra:>18}"
            f"{kib_s:>10}{secs_s:>11}{share:>10}"
        )
    calls, nbytes = fsdp_comm[0]
    print(
        f"\nFSDP's own collectives per step (forward+backward, per process): "
        f"{calls['all_gather_single']} all-gathers ({nbytes['all_gather_single'] / 2**20:.2f} MiB in), "
        f"{calls['reduce_scatter_single']} reduce-scatters ({nbytes['reduce_scatter_single'] / 2**20:.2f} MiB in)"
    )
    print(
        "extra all-reduces: issued by the optimizer step (MERIT: one per param group with DTensor params, all "
        "parameters' statistics in one buffer; 'in them': launch to completed wait, skew between processes "
        "included); merit-reference: the collectives DTensor ops issue (counted, not timed)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per process")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument(
        "--no-reference", dest="reference", action="store_false", help="skip the per-tensor DTensor reference row"
    )
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(worker, args=(args.world_size, port, args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
