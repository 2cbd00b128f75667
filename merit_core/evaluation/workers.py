"""`merit eval --devices D1,D2,...`: checkpoints scored by worker processes, one per device.

The workers (merit_core.evaluation.worker_processes: one spawned process per device, the cores shared
out) share the work one of two ways, `--share`:
- `checkpoints` (the default when there are at least as many checkpoints as devices): each worker loads
  the tasks once and then scores whole checkpoints, the next one the parent hands it when it finishes
  one, so a fast device takes more. A worker that fails or dies leaves the checkpoint it was scoring
  missing (one line naming it); the other workers score the rest.
- `requests` (the default for fewer checkpoints than devices, e.g. one): each checkpoint in turn is
  loaded by every worker and its requests are cut into one share per worker
  (merit_core.evaluation.request_split); lm-eval runs in this process and aggregates as for one device.

The parent checks every checkpoint (files, checksums, config, tokenizer) before any worker scores, as
the one-device run does, draws one progress view from the workers' events and returns the records
in the order of the list: each record is what the one-device run gives for that checkpoint (lm-eval
seeds every run alike), the times aside. `cpu,cpu` is two worker processes on the CPU; `all` is every
visible CUDA device.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import Connection, wait
from typing import Any

from merit_core.errors import ConfigError, MeritError, first_line
from merit_core.evaluation.backends import check_model_args, splits_model
from merit_core.evaluation.checkpoint import CheckpointRef
from merit_core.evaluation.harness import EvalSettings, Scorer, check_checkpoints, evaluate_checkpoints
from merit_core.evaluation.request_split import evaluate_split
from merit_core.evaluation.results import CheckpointResult, jsonable
from merit_core.evaluation.worker_processes import (
    CHECKPOINTS,
    REQUESTS,
    choose_split,
    error_class,
    prepare_worker,
    start_workers,
    stop_workers,
)
from merit_core.progress import Progress, ProgressFn


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
    missing, the devices the work was shared over (one entry per worker) and how (`split`)."""

    records: list[CheckpointResult]
    scored: list[int]  # the list's index of each record
    missing: list[Missing] = field(default_factory=list)
    devices: tuple[str, ...] = ()
    split: str = CHECKPOINTS

    def json_extra(self) -> dict[str, Any]:
        """The results JSON's keys beside "checkpoints": "devices" (the split) when there were several,
        "missing" when a checkpoint was not scored; none for one device, whose JSON is unchanged."""
        extra: dict[str, Any] = {}
        if len(self.devices) > 1:
            extra["devices"] = {"split": self.split, "workers": list(self.devices)}
        if self.missing:
            extra["missing"] = [m.to_json() for m in self.missing]
        return extra


def evaluate_on_devices(
    checkpoints: Sequence[str],
    settings: EvalSettings,
    devices: Sequence[str],
    progress: ProgressFn | None = None,
    quiet: bool = False,
    note: Callable[[str], None] | None = None,
    split: str | None = None,
) -> Outcome:
    """Score `checkpoints` with one worker process per entry of `devices`, sharing out whole checkpoints
    or each checkpoint's requests (`split`: CHECKPOINTS, REQUESTS, or None for `choose_split`'s
    default). One device, or one checkpoint split by checkpoints, is the one-process run of
    merit_core.evaluation.harness, in this process."""
    settings = settings.validated()
    split = choose_split(split, len(checkpoints), len(devices))
    if len(devices) < 2 or (split == CHECKPOINTS and len(checkpoints) < 2):
        device = devices[0] if devices else settings.device
        records = evaluate_checkpoints(checkpoints, replace(settings, device=device), progress, quiet, note)
        return Outcome(records, list(range(len(records))), devices=tuple(devices[:1]))
    if splits_model(settings.backend, check_model_args(settings.backend, settings.model_args)):
        raise ConfigError(
            "--devices gives each worker a device of its own; --model_args parallelize=True (or vLLM's parallel "
            "sizes) splits one model over the devices: give one of them"
        )
    if split == REQUESTS:
        records = evaluate_split(checkpoints, settings, devices, progress, quiet, note)
        return Outcome(records, list(range(len(records))), devices=tuple(devices), split=REQUESTS)
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
        self.workers = start_workers(_worker, settings, self.devices, quiet, "merit-eval")
        self.busy: dict[int, int | None] = {slot: None for slot in range(len(self.workers))}

    def run(self, refs: Sequence[CheckpointRef]) -> Outcome:
        """Send the checked list to every worker, then hand out its checkpoints one at a time."""
        self.refs = list(refs)
        self.queue = list(range(len(self.refs)))
        live = {slot for slot, worker in enumerate(self.workers) if worker.send(self.refs)}
        try:
            while live:
                ready = wait([self.workers[s].conn for s in live])
                for slot in sorted(live):
                    if self.workers[slot].conn not in ready:
                        continue
                    try:
                        message = self.workers[slot].conn.recv()
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
            self.error = error_class(message[1])(message[2])
            return False
        return True

    def _hand_out(self, slot: int) -> bool:
        index = self.queue.pop(0) if self.queue and self.error is None else None
        self.busy[slot] = index
        if not self.workers[slot].send(index):
            self._lost(slot)
            return False
        return index is not None

    def _lost(self, slot: int) -> None:
        """Worker `slot` stopped without a word (killed, out of memory): its checkpoint is missing."""
        worker = self.workers[slot]
        index = self.busy.get(slot)
        if index is not None:
            self.missing[index] = f"the worker on {worker.device} stopped ({worker.how_it_stopped()}) while scoring it"
            self.busy[slot] = None

    def stop(self, at_once: bool = False) -> None:
        """The workers stopped (merit_core.evaluation.worker_processes.stop_workers)."""
        stop_workers(self.workers, at_once)


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
    prepare_worker(settings.device, threads, quiet)

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
