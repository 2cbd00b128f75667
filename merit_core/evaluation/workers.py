"""`merit eval --devices D1,D2,...`: a list of checkpoints scored by worker processes, one per device.

Each device given is one worker process (spawned, so that CUDA and lm-eval start clean in each),
which loads the tasks once and then scores whole checkpoints, the next one the parent hands it when
it finishes one: a fast device takes more. `cpu,cpu` is two worker processes on the CPU; `all` is every
visible CUDA device. Each worker sets torch's thread count to its share of this process's cores, so
that N workers do not oversubscribe the CPU.

The parent checks every checkpoint (files, checksums, config, tokenizer) before any worker starts, as
the one-device run does, draws one progress view from the workers' events and returns the records
in the order of the list: each record is what the one-device run gives for that checkpoint (lm-eval
seeds every run alike), the times aside. A worker that fails or dies leaves the checkpoint it was
scoring missing (one line naming it); the other workers score the rest.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import Connection, wait
from typing import Any

from merit_core import errors
from merit_core.devices import resolve_device
from merit_core.errors import ConfigError, MeritError, first_line
from merit_core.evaluation.backends import check_model_args, splits_model
from merit_core.evaluation.checkpoint import CheckpointRef
from merit_core.evaluation.harness import EvalSettings, Scorer, check_checkpoints, evaluate_checkpoints
from merit_core.evaluation.results import CheckpointResult, jsonable
from merit_core.progress import Progress, ProgressFn

ALL_GPUS = "all"
SPLIT = "checkpoints"  # what the workers share out: whole checkpoints (recorded in the results JSON)


@dataclass(frozen=True)
class Missing:
    """A checkpoint no worker scored, and the one line that says why."""

    path: str
    label: str
    error: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "error": self.error}


@dataclass
class Outcome:
    """What a run over devices gives: the records scored (in the order of the list), the checkpoints
    missing, and the devices the checkpoints were shared over (one entry per worker)."""

    records: list[CheckpointResult]
    scored: list[int]  # the list's index of each record
    missing: list[Missing] = field(default_factory=list)
    devices: tuple[str, ...] = ()

    def json_extra(self) -> dict[str, Any]:
        """The results JSON's keys beside "checkpoints": "devices" (the split) when there were several,
        "missing" when a checkpoint was not scored; none for one device, whose JSON is unchanged."""
        extra: dict[str, Any] = {}
        if len(self.devices) > 1:
            extra["devices"] = {"split": SPLIT, "workers": list(self.devices)}
        if self.missing:
            extra["missing"] = [m.to_json() for m in self.missing]
        return extra


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


def thread_share(workers: int, cores: int | None = None) -> int:
    """Torch threads for each of `workers` processes: this process's cores shared out, at least one."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, workers))


def evaluate_on_devices(
    checkpoints: Sequence[str],
    settings: EvalSettings,
    devices: Sequence[str],
    progress: ProgressFn | None = None,
    quiet: bool = False,
    note: Callable[[str], None] | None = None,
) -> Outcome:
    """Score `checkpoints` with one worker process per entry of `devices`; one device (or one
    checkpoint) is the one-process run of merit_core.evaluation.harness, in this process."""
    settings = settings.validated()
    if len(devices) < 2 or len(checkpoints) < 2:
        device = devices[0] if devices else settings.device
        records = evaluate_checkpoints(checkpoints, replace(settings, device=device), progress, quiet, note)
        return Outcome(records, list(range(len(records))), devices=tuple(devices[:1]))
    if splits_model(settings.backend, check_model_args(settings.backend, settings.model_args)):
        raise ConfigError(
            "--devices gives each worker a device of its own; --model_args parallelize=True (or vLLM's parallel "
            "sizes) splits one model over the devices: give one of them"
        )
    pool = _Pool(settings, devices, progress, quiet, note)  # the workers start while the checks run
    try:
        refs = check_checkpoints(checkpoints, settings, progress, note)
    except BaseException:
        pool.stop(at_once=True)
        raise
    return pool.run(refs)


class _Pool:
    """The parent's side: start the workers, hand out checkpoints, relay events, collect records."""

    def __init__(
        self,
        settings: EvalSettings,
        devices: Sequence[str],
        progress: ProgressFn | None,
        quiet: bool,
        note: Callable[[str], None] | None,
    ):
        self.refs: list[CheckpointRef] = []
        self.devices = tuple(devices)
        self.progress = progress
        self.note = note
        self.queue: list[int] = []  # not yet handed out, in order
        self.records: dict[int, CheckpointResult] = {}
        self.missing: dict[int, str] = {}
        self.error: MeritError | None = None
        context = multiprocessing.get_context("spawn")
        threads = thread_share(len(self.devices))
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self.busy: dict[int, int | None] = {}
        for slot, device in enumerate(self.devices):
            mine, theirs = context.Pipe()
            proc = context.Process(
                target=_worker,
                args=(theirs, replace(settings, device=device), threads, quiet),
                name=f"merit-eval-{slot}",
            )
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)
            self.busy[slot] = None

    def run(self, refs: Sequence[CheckpointRef]) -> Outcome:
        """Send the checked list to every worker, then hand out its checkpoints one at a time."""
        self.refs = list(refs)
        self.queue = list(range(len(self.refs)))
        live = set(range(len(self.procs)))
        for slot in sorted(live):
            try:
                self.conns[slot].send(self.refs)
            except (BrokenPipeError, OSError):
                live.discard(slot)
        try:
            while live:
                ready = wait([self.conns[s] for s in live])
                for slot in sorted(live):
                    if self.conns[slot] not in ready:
                        continue
                    try:
                        message = self.conns[slot].recv()
                    except (EOFError, OSError):
                        self._lost(slot)
                        live.discard(slot)
                        continue
                    if not self._handle(slot, message):
                        live.discard(slot)
                if self.error is not None:
                    raise self.error
        except BaseException:  # an error, Ctrl-C: nothing more will be scored
            self.stop(at_once=True)
            raise
        self.stop()
        for index in self.queue:  # every worker stopped before these were handed out
            self.missing[index] = "not scored: every worker stopped before it"
        scored = sorted(self.records)
        records = [self.records[i] for i in scored]
        missing = [
            Missing(self.refs[i].location, self.refs[i].label, f"{self.refs[i].label}: {self.missing[i]}")
            for i in sorted(self.missing)
        ]
        return Outcome(records, scored, missing, self.devices)

    def _handle(self, slot: int, message: tuple) -> bool:
        """Act on one message of worker `slot`; False when that worker is done."""
        kind = message[0]
        if kind == "progress" and self.progress is not None:
            self.progress(Progress(**message[1]))
        elif kind == "note" and self.note is not None:
            self.note(message[1])
        elif kind == "ready":
            return self._hand_out(slot)
        elif kind == "done":
            index, record = message[1], message[2]
            self.records[index] = CheckpointResult(**record)
            self.busy[slot] = None
            return self._hand_out(slot)
        elif kind == "failed":
            self.missing[message[1]] = message[2]
            self.busy[slot] = None
            return self._hand_out(slot)
        elif kind == "error":  # the settings themselves are wrong (a task, a dataset): the same in every worker
            self.error = _error_class(message[1])(message[2])
            return False
        return True

    def _hand_out(self, slot: int) -> bool:
        index = self.queue.pop(0) if self.queue and self.error is None else None
        self.busy[slot] = index
        try:
            self.conns[slot].send(index)
        except (BrokenPipeError, OSError):
            self._lost(slot)
            return False
        return index is not None

    def _lost(self, slot: int) -> None:
        """Worker `slot` stopped without a word (killed, out of memory): its checkpoint is missing."""
        proc = self.procs[slot]
        proc.join(timeout=5)
        index = self.busy.get(slot)
        if index is not None:
            code = proc.exitcode
            how = f"signal {-code}" if isinstance(code, int) and code < 0 else f"exit code {code}"
            self.missing[index] = f"the worker on {self.devices[slot]} stopped ({how}) while scoring it"
            self.busy[slot] = None

    def stop(self, at_once: bool = False) -> None:
        """Close the pipes (a worker waiting for work then returns) and wait for the workers; `at_once`
        (an error: nothing more will be scored) ends them without waiting."""
        for conn in self.conns:
            conn.close()
        for proc in self.procs:
            if not at_once:
                proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join()


def _error_class(name: str) -> type[MeritError]:
    found = getattr(errors, name, None)
    return found if isinstance(found, type) and issubclass(found, MeritError) else MeritError


def _plain(record: CheckpointResult) -> dict[str, Any]:
    """A record as plain JSON data (what crosses to the parent): lm-eval's output as lm-eval's own
    results writer turns it into JSON, the rest as merit's JSON writer does, so that both files are
    written from it exactly as from the record itself."""
    from lm_eval.utils import handle_non_serializable

    def plain(value: Any, default: Callable[[Any], Any]) -> Any:
        return json.loads(json.dumps(value, default=default))

    return {
        "path": record.path,
        "label": record.label,
        "results": plain(record.results, jsonable),
        "meta": plain(record.meta, jsonable),
        "lm_eval": None if record.lm_eval is None else plain(record.lm_eval, handle_non_serializable),
    }


def _worker(conn: Connection, settings: EvalSettings, threads: int, quiet: bool) -> None:
    """One worker process: load the tasks, take the checked list of checkpoints, then score the indices
    of it the parent sends until None."""
    try:
        _serve(conn, settings, threads, quiet)
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the parent says what stopped
        return


def _serve(conn: Connection, settings: EvalSettings, threads: int, quiet: bool) -> None:
    import logging

    import torch

    torch.set_num_threads(threads)
    if settings.device.startswith("cuda"):  # this worker's GPU is its current one (no context on cuda:0)
        torch.cuda.set_device(torch.device(settings.device))
    if quiet:
        for name in ("lm_eval", "transformers", "datasets", "accelerate", "huggingface_hub"):
            logging.getLogger(name).setLevel(logging.ERROR)

    def progress(event: Progress) -> None:
        conn.send(("progress", asdict(event)))

    def note(text: str) -> None:
        conn.send(("note", text))

    try:
        scorer = Scorer(settings, [], progress, quiet, note)
        refs = conn.recv()
    except MeritError as exc:
        conn.send(("error", type(exc).__name__, str(exc)))
        return
    except EOFError:  # the parent stopped (a checkpoint failed its checks)
        return
    scorer.run.refs = list(refs)
    conn.send(("ready",))
    while True:
        try:
            index = conn.recv()
        except EOFError:
            return
        if index is None:
            return
        try:
            record = scorer.score(index)
        except Exception as exc:  # noqa: BLE001 - a checkpoint that fails is reported by name, the rest go on
            conn.send(("failed", index, f"failed on {settings.device}: {first_line(exc)}"))
            continue
        conn.send(("done", index, _plain(record)))
