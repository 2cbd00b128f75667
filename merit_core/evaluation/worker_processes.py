"""The worker processes of `merit eval --devices`: one per device, whatever work they share out.

Each device given is one worker process, spawned (so that CUDA and lm-eval start clean in it), with a
pipe of its own to the parent. Each worker sets torch's thread count to its share of the parent's
cores, so that N workers do not oversubscribe the CPU, and on CUDA makes its device the current one.
Two kinds of work run on them: whole checkpoints (`CHECKPOINTS`, merit_core.evaluation.workers) or
one checkpoint's requests cut into shares (`REQUESTS`, merit_core.evaluation.request_split).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from merit_core import errors
from merit_core.devices import resolve_device
from merit_core.errors import ConfigError, MeritError

ALL_GPUS = "all"

CHECKPOINTS = "checkpoints"  # each worker scores whole checkpoints, the next one when it finishes one
REQUESTS = "requests"  # every worker scores a share of each checkpoint's requests
SPLITS = (CHECKPOINTS, REQUESTS)


def parse_devices(text: str) -> tuple[str, ...]:
    """`--devices`: 'all' (every visible CUDA device) or a comma-separated list, one worker per entry
    (an entry may repeat: 'cpu,cpu' is two CPU workers); each entry is checked to exist here."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    if [w.lower() for w in words] == [ALL_GPUS]:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError("--devices all: no CUDA GPU is visible; give CPU workers as --devices cpu,cpu")
        return tuple(f"cuda:{i}" for i in range(count))
    if not words:
        raise ConfigError("--devices: give a comma-separated list such as cuda:0,cuda:1 or cpu,cpu, or all")
    devices = []
    for word in words:
        try:
            devices.append(str(resolve_device(word)))
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("--device ", "--devices ", 1)) from None
    return tuple(devices)


def choose_split(split: str | None, checkpoints: int, devices: int) -> str:
    """The split asked for, or by default whole checkpoints when there are at least as many as devices
    (no device waits for work) and one checkpoint's requests over every device otherwise."""
    if split is None:
        return CHECKPOINTS if checkpoints >= devices else REQUESTS
    if split not in SPLITS:
        raise ConfigError(f"--share {split}: give {' or '.join(SPLITS)}")
    return split


def thread_share(workers: int, cores: int | None = None) -> int:
    """Torch threads for each of `workers` processes: this process's cores shared out, at least one."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, workers))


@dataclass
class Worker:
    """The parent's handle on one worker process: its device, its end of the pipe, the process."""

    device: str
    conn: Connection
    proc: Any  # a multiprocessing process of the spawn context

    def send(self, message: Any) -> bool:
        """Send `message`; False when the worker is gone (its end of the pipe closed)."""
        try:
            self.conn.send(message)
        except (BrokenPipeError, OSError):
            return False
        return True

    def how_it_stopped(self) -> str:
        """'signal 9' or 'exit code 1': how a worker that stopped without a word ended."""
        self.proc.join(timeout=5)
        code = self.proc.exitcode
        return f"signal {-code}" if isinstance(code, int) and code < 0 else f"exit code {code}"


def start_workers(
    target: Callable[..., None], settings: Any, devices: Sequence[str], quiet: bool, name: str
) -> list[Worker]:
    """One spawned process per entry of `devices`, each running `target(conn, settings, threads,
    quiet)` with `settings.device` set to its device and `threads` its share of the cores."""
    context = multiprocessing.get_context("spawn")
    threads = thread_share(len(devices))
    workers = []
    for slot, device in enumerate(devices):
        mine, theirs = context.Pipe()
        proc = context.Process(
            target=target, args=(theirs, replace(settings, device=device), threads, quiet), name=f"{name}-{slot}"
        )
        proc.start()
        theirs.close()
        workers.append(Worker(device, mine, proc))
    return workers


def stop_workers(workers: Sequence[Worker], at_once: bool = False) -> None:
    """Close the pipes (a worker waiting for work then returns) and wait for the workers; `at_once`
    (an error: nothing more will be scored) ends them without waiting."""
    for worker in workers:
        worker.conn.close()
    for worker in workers:
        if not at_once:
            worker.proc.join(timeout=10)
        if worker.proc.is_alive():
            worker.proc.terminate()
            worker.proc.join()


def prepare_worker(device: str, threads: int, quiet: bool) -> None:
    """In a worker process: its torch thread count, its GPU as the current one (no context on cuda:0),
    and with `quiet` the libraries' logs kept off the console."""
    import logging

    import torch

    torch.set_num_threads(threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if quiet:
        for name in ("lm_eval", "transformers", "datasets", "accelerate", "huggingface_hub"):
            logging.getLogger(name).setLevel(logging.ERROR)


def error_class(name: str) -> type[MeritError]:
    """The MeritError subclass a worker named (it crosses the pipe as its name), else MeritError."""
    found = getattr(errors, name, None)
    return found if isinstance(found, type) and issubclass(found, MeritError) else MeritError
