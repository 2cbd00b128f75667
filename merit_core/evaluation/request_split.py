"""`merit eval CKPT --devices D1,D2,... --share requests`: one checkpoint's requests shared over devices.

lm-eval's own data-parallel run splits requests only under `accelerate launch` with several CUDA
devices; this split is merit's and runs on CPU processes as well. One worker process per device
(merit_core.evaluation.worker_processes), started once per eval, loads each checkpoint in turn as the
one-device run does (`harness.build_device_lm`: merit's checks, dtype and batch size). lm-eval runs in
the parent with a `SplitLM` in place of its HFLM: each of its request methods cuts the list it is given
into contiguous shares of about equal text, one per worker, and returns the workers' answers in the
original order. lm-eval then filters, scores and aggregates exactly as for one device, so the output
is key for key what it writes for one device; a request's answer may differ from the one-device run's
only by float rounding, where the requests batched with it (padding, batch shape) differ.

A worker that fails or dies stops the whole eval with one line naming its device: a checkpoint with a
share of its requests unscored has no score.

This module imports lm-eval at its top (SplitLM is one of its LM classes): `merit eval` reaches it, through
merit_core.evaluation.workers, only once it has set the hub offline-first and is about to score.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from types import SimpleNamespace
from typing import Any, NoReturn

from lm_eval.api.model import LM

from merit_core.devices import resolve_device
from merit_core.errors import RunFailed, first_line
from merit_core.evaluation.checkpoint import CheckpointRef, resolve_dtype
from merit_core.evaluation.harness import (
    EvalSettings,
    Scorer,
    build_device_lm,
    check_checkpoints,
    count_parameters,
    exact_float32,
    silenced,
)
from merit_core.evaluation.results import CheckpointResult
from merit_core.evaluation.worker_processes import REQUESTS, Worker, prepare_worker, start_workers, stop_workers
from merit_core.progress import ProgressFn

_TOKENIZER_FIELDS = ("pad_token", "pad_token_id", "eos_token", "eos_token_id", "bos_token", "bos_token_id")


def evaluate_split(
    checkpoints: Sequence[str],
    settings: EvalSettings,
    devices: Sequence[str],
    progress: ProgressFn | None = None,
    quiet: bool = False,
    note: Callable[[str], None] | None = None,
) -> list[CheckpointResult]:
    """Each checkpoint scored in turn with its requests shared over one worker per entry of `devices`;
    one record per checkpoint, as `harness.evaluate_checkpoints` gives for one device."""
    settings = settings.validated()
    first = str(resolve_device(devices[0]))
    settings = replace(settings, device=first, dtype=resolve_dtype(settings.dtype, first))  # one dtype on all
    pool = RequestPool(settings, devices, quiet)  # the workers start while the checks run
    try:
        refs = check_checkpoints(checkpoints, settings, progress, note)
        scorer = Scorer(settings, refs, progress, quiet, note, source=pool)
        records = [scorer.score(index) for index in range(len(refs))]
    except BaseException:
        pool.stop(at_once=True)
        raise
    pool.stop()
    for text in pool.notes:
        if note is not None:
            note(text)
    return records


def contiguous_shares(sizes: Sequence[int], parts: int) -> list[range]:
    """`parts` contiguous ranges of indices covering `sizes` in order, each cut where the running sum
    comes nearest to an equal part of the total (a share may be empty when there are fewer items than
    parts); a size of 0 counts as 1, so that empty requests are shared out too."""
    prefix = list(itertools.accumulate(max(1, s) for s in sizes))
    total = prefix[-1] if prefix else 0
    cuts = [0]
    for k in range(1, parts):
        target = total * k / parts
        j = bisect.bisect_left(prefix, target)
        if j >= len(prefix):
            cut = len(prefix)
        else:  # after item j (its sum reaches the target) or before it, whichever is nearer
            before = prefix[j - 1] if j > 0 else 0
            cut = j + 1 if prefix[j] - target <= target - before else j
        cuts.append(max(cut, cuts[-1]))
    cuts.append(len(sizes))
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def _size(args: tuple) -> int:
    return sum(len(a) for a in args if isinstance(a, str))


class RequestPool:
    """The parent's side: the workers, each checkpoint loaded by all of them, requests shared out."""

    def __init__(self, settings: EvalSettings, devices: Sequence[str], quiet: bool):
        self.devices = tuple(devices)
        self.label = ""  # the checkpoint loaded now, named in a worker's failure
        self.notes: list[str] = []  # what loading said (the same in every worker), each once
        self.workers = start_workers(_worker, settings, self.devices, quiet, "merit-eval-requests")

    def placement(self) -> dict[str, Any]:
        return {"split": REQUESTS, "workers": list(self.devices)}

    def build(self, ref: CheckpointRef) -> tuple[SplitLM, int | str]:
        """Every worker loads `ref`; a SplitLM over them and the batch size each scores with."""
        self.label = ref.label
        replies = self._ask([("load", ref)] * len(self.workers), "loading it")
        for text in (t for reply in replies for t in reply["notes"]):
            if text not in self.notes:
                self.notes.append(text)
        info = replies[0]
        return SplitLM(self, info), info["batch_size"]

    def answer(self, request_type: str, args: list[tuple]) -> tuple[list[Any], dict]:
        """The answers to `args` (the requests' arguments) in order, from one contiguous share per
        worker; and the batch sizes lm-eval's HFLM recorded in the first worker that had a share."""
        shares = contiguous_shares([_size(a) for a in args], len(self.workers))
        asked = [(slot, share) for slot, share in enumerate(shares) if len(share)]
        messages: list[Any] = [None] * len(self.workers)
        for slot, share in asked:
            messages[slot] = ("score", request_type, args[share.start : share.stop])
        replies = self._ask(messages, "scoring its share of the requests")
        answers: list[Any] = []
        for slot, _ in asked:
            answers.extend(replies[slot]["answers"])
        return answers, replies[asked[0][0]]["batch_sizes"] if asked else {}

    def _ask(self, messages: Sequence[Any], doing: str) -> list[Any]:
        """Send each worker its message (None: nothing for it) and wait for every reply; RunFailed (one
        line naming the device) when a worker fails or stops."""
        waiting: set[int] = set()
        for slot, (worker, message) in enumerate(zip(self.workers, messages)):
            if message is None:
                continue
            if not worker.send(message):
                self._failed(worker, f"stopped ({worker.how_it_stopped()}) while {doing}")
            waiting.add(slot)
        replies: list[Any] = [None] * len(self.workers)
        while waiting:
            ready = wait([self.workers[slot].conn for slot in waiting])
            for slot in sorted(waiting):
                worker = self.workers[slot]
                if worker.conn not in ready:
                    continue
                waiting.discard(slot)
                try:
                    reply = worker.conn.recv()
                except (EOFError, OSError):
                    self._failed(worker, f"stopped ({worker.how_it_stopped()}) while {doing}")
                if reply[0] == "failed":
                    self._failed(worker, f"failed while {doing}: {reply[1]}")
                replies[slot] = reply[1]
        return replies

    def _failed(self, worker: Worker, what: str) -> NoReturn:
        slot = self.workers.index(worker) + 1
        raise RunFailed(f"{self.label}: the worker on {worker.device} ({slot} of {len(self.workers)}) {what}")

    def stop(self, at_once: bool = False) -> None:
        """The workers stopped (merit_core.evaluation.worker_processes.stop_workers)."""
        stop_workers(self.workers, at_once)


class SplitLM(LM):
    """lm-eval's model object for a checkpoint loaded by every worker of a RequestPool: its request
    methods share the requests out; what lm-eval records of the model (its name, parameters, dtype,
    tokenizer, context length) is the first worker's HFLM's, as it reported them after loading."""

    def __init__(self, pool: RequestPool, info: dict[str, Any]):
        super().__init__()
        self.pool = pool
        self.info = info
        self.config = SimpleNamespace(_name_or_path=info["name_or_path"])
        self.tokenizer = SimpleNamespace(**info["tokenizer"])
        self.eot_token_id = info["eot_token_id"]
        self.max_length = info["max_length"]
        self.parameter_count = info["parameters"]
        self.batch_sizes: dict = {}

    def get_model_info(self) -> dict:
        return dict(self.info["model_info"])

    def _shared(self, request_type: str, requests: list[Any]) -> list[Any]:
        answers, self.batch_sizes = self.pool.answer(request_type, [req.args for req in requests])
        return answers

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self._shared("loglikelihood", requests)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        return self._shared("loglikelihood_rolling", requests)

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        return self._shared("generate_until", requests)


def _loaded(lm: Any, batch_size: int | str, notes: list[str]) -> dict[str, Any]:
    """What the parent's SplitLM records of the HFLM `lm` (plain data, to cross the pipe)."""
    tokenizer = lm.tokenizer
    return {
        "batch_size": batch_size,
        "notes": notes,
        "name_or_path": getattr(lm.config, "_name_or_path", None),
        "model_info": lm.get_model_info(),
        "tokenizer": {name: getattr(tokenizer, name, None) for name in _TOKENIZER_FIELDS},
        "eot_token_id": lm.eot_token_id,
        "max_length": lm.max_length,
        "parameters": count_parameters(lm.model),
    }


def _worker(conn: Connection, settings: EvalSettings, threads: int, quiet: bool) -> None:
    """One worker process: load the checkpoint the parent names, score the shares of requests it
    sends, until the parent closes the pipe."""
    try:
        prepare_worker(settings.device, threads, quiet)
        with silenced(quiet), exact_float32(settings.device, settings.dtype):
            _serve(conn, settings)
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the parent says what stopped
        return


def _serve(conn: Connection, settings: EvalSettings) -> None:
    import gc

    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models import huggingface  # noqa: F401 - transformers imported while the parent checks and loads tasks

    lm: Any = None
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        try:
            if message[0] == "load":
                lm = None
                gc.collect()
                if settings.device.startswith("cuda"):
                    torch.cuda.empty_cache()
                notes: list[str] = []
                lm, batch_size = build_device_lm(message[1], settings, settings.device, settings.dtype, notes.append)
                conn.send(("loaded", _loaded(lm, batch_size, notes)))
            else:
                _, request_type, args = message
                requests = [Instance(request_type, {}, a, i) for i, a in enumerate(args)]
                answers = getattr(lm, request_type)(requests, disable_tqdm=True)
                conn.send(("answers", {"answers": answers, "batch_sizes": dict(lm.batch_sizes)}))
        except Exception as exc:  # noqa: BLE001 - the parent names this worker's device and stops the eval
            conn.send(("failed", first_line(exc)))
