"""Running a comparison: which runs are done, and training the rest, one at a time or in parallel.

A run's state comes from its folder alone, so a re-run of the comparison picks up where the
last one stopped: 'finished' (its latest checkpoint is at the planned last step: skipped),
'diverged' (a marker the comparison wrote when training stopped on a non-finite loss:
skipped), 'partial' (a checkpoint short of the end: resumed with `merit train`'s resume),
'new'. With one job, runs train in this process through `run_training`; with more, runs train
in worker processes (`python -m merit_core.compare.worker`), one per GPU when there are GPUs
(CUDA_VISIBLE_DEVICES), and on CPU the cores are split between them (OMP_NUM_THREADS). A GPU
run gets a fresh worker; on CPU a worker goes on to the next run of its slot when that run has
the same environment and no torch.compile (`reusable_worker`), so torch and transformers are
imported once per slot rather than once per run.

Interruptions: SIGTERM / SIGUSR1 / SIGINT to the comparison are forwarded to its workers, which
finish their step, checkpoint and exit; the comparison waits for them and stops with
`RunInterrupted`. Workers also get SIGTERM when the comparison process dies (Linux
PR_SET_PDEATHSIG), so none keeps training unseen, and each run folder's lock refuses a
second writer: a re-run trains each run once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from merit_core.checkpoint.resolve import latest_checkpoint
from merit_core.checkpoint.run_config import read_run_config
from merit_core.checkpoint.state import read_trainer_state
from merit_core.compare.grid import PlannedRun, config_mismatch
from merit_core.durable_writes import atomic_write_json, open_truncated, refuse_link
from merit_core.errors import ConfigError, MeritError, RunFailed, RunInterrupted, TrainingDiverged, printable
from merit_core.metrics import json_safe, read_metrics
from merit_core.progress import Progress
from merit_core.train import training_run  # run_training looked up per call: tests stand in for it
from merit_core.train.callbacks import HANDLED_SIGNALS, STOP_SIGNALS, TrainCallbacks
from merit_core.train.compiling import resolve_compile
from merit_core.values import coerce

if TYPE_CHECKING:
    from merit_core.compare.estimate import CompareEstimate

STATUS_FILE = "compare_status.json"
EXIT_INTERRUPTED = (130, 143)
EXIT_DIVERGED = 3
EXIT_USER_ERROR = 2
MAX_CPU_JOBS = 4


class CompareCallbacks:
    """Progress hooks of a comparison; override what you need."""

    def on_prepare(self, event: Progress) -> None:
        """Data preparation progress (the shared data is prepared once, before any run)."""

    def on_plan(self, runs: list[PlannedRun], states: dict[str, str], jobs: int) -> None:
        """The runs, their states before this invocation, and how many run at once."""

    def on_estimate(self, estimate: CompareEstimate) -> None:
        """After on_plan, on a CPU: how long the planned runs are expected to take (merit_core.compare.estimate)."""

    def on_run_start(self, run: PlannedRun, resumed: bool) -> None:
        """A run starts training (`resumed`: from its latest checkpoint)."""

    def on_run_progress(self, run: PlannedRun, record: Mapping[str, Any]) -> None:
        """A metrics record of a running run (log or eval line, with 'step')."""

    def on_run_end(self, run: PlannedRun, state: str, message: str | None) -> None:
        """A run stopped: state 'finished' or 'diverged' (message: why)."""

    def on_extend(self, runs: list[PlannedRun], states: dict[str, str], jobs: int) -> None:
        """Runs added past a grid edge holding the best lr (see grid.next_extensions), before they train."""

    def on_add(self, runs: list[PlannedRun], states: dict[str, str], jobs: int, why: str) -> None:
        """Runs added after the grids, before they train: `why` is 'seeds' (a best cell topped up
        to spec.best_seeds) or 'environment' (a best cell's first seed under another thread count)."""

    def on_measure(self, what: str, run_name: str) -> None:
        """A best run's final checkpoint is measured: what is 'hessian' or 'eval'."""


# -- state ------------------------------------------------------------------------------------
def run_state(run: PlannedRun) -> str:
    """'finished', 'diverged', 'partial' or 'new' (see the module docstring).

    ConfigError when the folder holds a run with other settings (another comparison's run).
    """
    status = read_status(run.run_dir)
    saved = status.get("config") if status.get("state") == "diverged" else None
    if saved is None:
        saved = read_run_config(run.run_dir)
    if saved is None:
        return "new"
    diff = config_mismatch(saved, run.config)
    if diff is not None:
        raise ConfigError(
            f"{run.run_dir} holds a run with other settings ({diff}); choose another --out or remove that folder"
        )
    if status.get("state") == "diverged":
        return "diverged"
    latest = latest_checkpoint(run.run_dir)
    if latest is None:
        return "new"
    return "finished" if read_trainer_state(latest[1]).step >= run.steps else "partial"


def replaced(run_dir: Path) -> str | None:
    """Why `run_dir` no longer is a run folder the comparison may read or train in: it is now a symbolic
    link (never followed: it leads out of the comparison) or something other than a folder; else None."""
    if run_dir.is_symlink():
        return f"its run folder was replaced by a symbolic link to {printable(os.readlink(run_dir))} (not followed)"
    if run_dir.exists() and not run_dir.is_dir():
        return "its run folder was replaced by something that is not a folder"
    return None


def state_now(run: PlannedRun) -> tuple[str, str | None]:
    """The state of a run read again after it ended (run_state), and why it is 'missing' when its
    folder was replaced (`replaced`) or no longer holds this run (a MeritError: a marker or
    config.toml that is not this run's, an unreadable checkpoint; its one line)."""
    why = replaced(run.run_dir)
    if why is not None:
        return "missing", why
    try:
        return run_state(run), None
    except MeritError as exc:
        return "missing", str(exc)


STATUS_STATES = ("diverged",)
MAX_STATUS_BYTES = 1 << 20  # a marker is a few kB: its config and one message


def read_status(run_dir: Path) -> dict[str, Any]:
    """The comparison's marker of a run ({} when there is none).

    ConfigError in one line when the file is not a marker the comparison wrote (not JSON, another
    shape, an unknown state, a non-text message or a config that is not a table, more than
    MAX_STATUS_BYTES): each field is checked with values.coerce before it is used."""
    path = Path(run_dir) / STATUS_FILE
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_STATUS_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the comparison's run marker ({exc.strerror})") from None
    fix = "remove it to train that run again"
    if len(raw) > MAX_STATUS_BYTES:
        raise ConfigError(f"{path}: not a comparison run marker (over {MAX_STATUS_BYTES:,} bytes); {fix}")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ConfigError(f"{path}: not a comparison run marker (not JSON); {fix}") from None
    try:
        data = coerce(data, dict[str, Any], str(path))
        state = coerce(data.get("state"), str, f"{path}: state")
        if state not in STATUS_STATES:
            raise ConfigError(f"{path}: state must be one of {', '.join(STATUS_STATES)}, got {state!r}")
        message = coerce(data.get("message"), str | None, f"{path}: message")
        config = coerce(data.get("config"), dict[str, Any] | None, f"{path}: config")
    except ConfigError as exc:
        raise ConfigError(f"{exc}; {fix}") from None
    return {**data, "state": state, "message": message, "config": config}


def mark_diverged(run: PlannedRun, message: str) -> None:
    """Write the marker that keeps a re-run from training a diverged run again (with its config)."""
    run.run_dir.mkdir(parents=True, exist_ok=True)

    record = {"state": "diverged", "message": message, "config": json_safe(dataclasses.asdict(run.config))}
    atomic_write_json(run.run_dir / STATUS_FILE, record, indent=2)


# -- execution --------------------------------------------------------------------------------
def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_jobs(device: str = "auto", n_runs: int | None = None) -> int:
    """One job per GPU when the runs go to GPUs; on CPU one per core, at most MAX_CPU_JOBS.

    On CPU, separate single-threaded processes beat one multi-threaded run for small models
    (intra-op threads spin when cores are busy; the measurement is in benchmarks/README.md).
    """
    import torch

    if device != "cpu" and torch.cuda.is_available():
        jobs = max(1, torch.cuda.device_count())
    else:
        jobs = min(usable_cores(), MAX_CPU_JOBS)
    return max(1, min(jobs, n_runs)) if n_runs else jobs


@dataclasses.dataclass(frozen=True)
class Execution:
    """How `execute` trains the runs it is given.

    states: every run's state before it ('new' and 'partial' ones train); jobs: how many train at
    once (1: in this process); log_dir: where a worker's output goes; threads: the intra-op thread
    count of every run but an environment re-run (which has its own), whatever the number of runs
    left; None leaves it to the worker's share of the cores."""

    states: dict[str, str]
    jobs: int
    log_dir: Path
    callbacks: CompareCallbacks
    threads: int | None = None


def execute(runs: list[PlannedRun], how: Execution) -> dict[str, str]:
    """Train every 'new' or 'partial' run; return the state of every run afterwards."""
    todo = [run for run in runs if how.states[run.name] in ("new", "partial")]
    final = dict(how.states)
    if how.jobs <= 1:
        # a run with its own environment variables (an ISA or BLAS re-run) needs a process of its own:
        # torch and MKL read them when they start
        for run in todo:
            if run.env:
                final.update(_run_parallel([run], how))
            else:
                final[run.name] = _run_here(run, how.states[run.name] == "partial", how.callbacks, how.threads)
    else:
        final.update(_run_parallel(todo, how))
    return final


def compare_threads(device: str, jobs: int | None) -> int | None:
    """The one intra-op thread count of a CPU comparison's runs: each job's share of the cores at
    the comparison's job count (`jobs`, else default_jobs), however many runs are left to train, so
    every run of the grid computes in the same floating-point environment. None on GPUs."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return None
    return max(1, usable_cores() // (jobs or default_jobs("cpu")))


def other_threads(threads: int) -> int:
    """The thread count of an environment re-run: 2 after 1, else 1 (a different summation order)."""
    return 2 if threads == 1 else 1


@contextlib.contextmanager
def _intra_op_threads(threads: int | None):
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run_here(run: PlannedRun, resume: bool, callbacks: CompareCallbacks, threads: int | None = None) -> str:
    callbacks.on_run_start(run, resume)
    try:
        with _intra_op_threads(run.threads or threads):
            training_run.run_training(dataclasses.replace(run.config, resume=resume), _Forward(run, callbacks))
    except TrainingDiverged as exc:
        mark_diverged(run, str(exc))
        callbacks.on_run_end(run, "diverged", str(exc))
        return "diverged"
    callbacks.on_run_end(run, "finished", None)
    return "finished"


class _Forward(TrainCallbacks):
    """TrainCallbacks that pass log and eval records on as run progress."""

    def __init__(self, run: PlannedRun, callbacks: CompareCallbacks):
        self.run, self.cb = run, callbacks

    def on_log(self, record: dict[str, Any]) -> None:
        self.cb.on_run_progress(self.run, record)

    def on_eval(self, record: dict[str, Any]) -> None:
        self.cb.on_run_progress(self.run, record)


def worker_env(slot: int, jobs: int, n_gpus: int, threads: int | None = None) -> dict[str, str]:
    """Environment of the worker in `slot`: its GPU, or its share of the CPU cores (`threads`:
    an environment re-run's own thread count instead)."""
    env = dict(os.environ)
    if n_gpus:
        visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = visible[slot % n_gpus] if len(visible) >= n_gpus else str(slot % n_gpus)
    if not n_gpus or threads is not None:
        count = str(threads if threads is not None else max(1, usable_cores() // jobs))
        env.update(OMP_NUM_THREADS=count, MKL_NUM_THREADS=count)
    return env


def _gpu_count(runs: list[PlannedRun]) -> int:
    if not runs or all(run.config.device == "cpu" for run in runs):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _die_with_parent() -> None:
    """In a worker, before exec: ask Linux to send SIGTERM when the comparison process dies."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def _forward_signals(active: dict):
    """While workers run: a stop signal is passed on to every active worker (and remembered)."""
    received: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum, frame):
        name = signal.Signals(signum).name
        received.append(name)
        for _, proc, _, _ in list(active.values()):
            with contextlib.suppress(OSError):
                proc.send_signal(signum)

    previous = {}
    for name in HANDLED_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            previous[sig] = signal.signal(sig, handler)
    try:
        yield received
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class _Worker:
    """A worker process of `_run_parallel`: `python -m merit_core.compare.worker --serve FD`, which takes
    runs one after another on stdin and answers each with its exit code on a pipe (see the worker's
    docstring). `reusable`: it may take another run after this one (a CPU run without torch.compile, in
    the same environment); otherwise its stdin is closed with the first run and it exits after it."""

    def __init__(self, env: dict[str, str], log: Path, reusable: bool):
        self.env, self.reusable = env, reusable
        read_end, write_end = os.pipe()
        try:
            with os.fdopen(open_truncated(log), "w") as fh:  # never through a planted link
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "merit_core.compare.worker", "--serve", str(write_end)],
                    stdin=subprocess.PIPE,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    env=env,
                    pass_fds=(write_end,),
                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
                    start_new_session=True,  # Ctrl-C reaches the comparison, which forwards it once
                )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        os.set_blocking(read_end, False)
        self.results = read_end
        self.buffer = b""
        self.runs = 0

    def start(self, config: dict[str, Any], log: Path) -> None:
        """Give the worker its next run; its output goes to `log` (the first run's log is the one the
        process was started with)."""
        if self.runs:
            os.close(open_truncated(log))  # created or emptied here, so a planted link fails in this process
        job = {"config": config, "log": str(log) if self.runs else None}
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it died meanwhile: outcome() gives its exit status
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            self.proc.stdin.flush()
        self.runs += 1
        if not self.reusable:
            self.close()

    def outcome(self) -> int | None:
        """The exit code of the run under way once it ended (its answer, else the process's exit status),
        or None while it trains."""
        status = self.proc.poll()  # before reading: an answer written before the process ended is read
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self.results, 64):
                self.buffer += chunk
        if b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            return int(line)
        return status

    @property
    def idle(self) -> bool:
        """It answered its run and can take another."""
        return self.reusable and self.proc.poll() is None

    def close(self) -> None:
        """End of its runs: its stdin closed, it exits after the run under way (if any)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def stop(self, busy: bool) -> None:
        """SIGTERM to a worker with a run under way (it checkpoints and exits); an idle one just closes."""
        self.close()
        if busy:
            with contextlib.suppress(OSError):
                self.proc.terminate()

    def wait(self) -> None:
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.results)


def reusable_worker(run: PlannedRun, n_gpus: int) -> bool:
    """Whether a worker may go on to another run after `run`: on CPU without torch.compile. A GPU run
    keeps a fresh process (the CUDA caching allocator and torch.compile's caches would carry over);
    what a worker computes does not depend on the runs it trained before (tests/compare)."""
    import torch

    return n_gpus == 0 and not resolve_compile(run.config.compile, torch.device("cpu"))


def _run_parallel(todo: list[PlannedRun], how: Execution) -> dict[str, str]:
    callbacks, log_dir = how.callbacks, how.log_dir
    n_gpus = _gpu_count(todo)
    jobs = min(how.jobs, len(todo))
    pending = deque(todo)
    free = list(range(jobs))
    active: dict[int, tuple[PlannedRun, subprocess.Popen, Path, int]] = {}
    workers: dict[int, _Worker] = {}  # the process of each slot, busy (in active) or idle
    final: dict[str, str] = {}
    refuse_link(log_dir, "in a comparison folder")  # a planted link would take every run's log elsewhere
    log_dir.mkdir(parents=True, exist_ok=True)
    with _forward_signals(active) as received:
        try:
            while pending or active:
                while pending and free and not received:
                    run, slot = pending.popleft(), free.pop(0)
                    resume = how.states[run.name] == "partial"
                    config = dataclasses.asdict(dataclasses.replace(run.config, resume=resume))
                    log = log_dir / f"{run.name}.log"
                    env = {**worker_env(slot, jobs, n_gpus, run.threads or how.threads), **run.env}
                    worker = workers.get(slot)
                    reusable = reusable_worker(run, n_gpus)
                    if worker is None or not (worker.idle and reusable and worker.env == env):
                        if worker is not None:
                            worker.stop(busy=False)
                            worker.wait()
                        worker = workers[slot] = _Worker(env, log, reusable)
                    worker.start(config, log)
                    callbacks.on_run_start(run, resume)
                    active[slot] = (run, worker.proc, log, _line_count(run))
                if received and not active:
                    break
                time.sleep(0.5)
                for slot, (run, proc, log, seen) in list(active.items()):
                    code = workers[slot].outcome()  # before reading: a finished run's records are all on disk
                    seen = _forward_new_records(run, seen, callbacks)
                    active[slot] = (run, proc, log, seen)
                    if code is None:
                        continue
                    del active[slot]
                    free.append(slot)
                    if code in EXIT_INTERRUPTED or (received and code < 0):
                        continue  # stopped on our signal after its checkpoint: 'partial' for the next run
                    final[run.name] = _finish(run, code, log, callbacks)
        finally:
            for slot, worker in workers.items():
                worker.stop(busy=slot in active)  # SIGTERM to a busy one: the worker checkpoints and exits
            for worker in workers.values():
                worker.wait()
    if received:
        name = received[0]
        raise RunInterrupted(
            f"comparison stopped by {name}: every running run saved a checkpoint; run the same command again "
            "to continue",
            STOP_SIGNALS[name],
        )
    return final


def _forward_new_records(run: PlannedRun, seen: int, callbacks: CompareCallbacks) -> int:
    """Pass a worker's metrics records past line `seen` on as progress; return the new count."""
    records = read_metrics(run.run_dir) if run.run_dir.is_dir() else []
    if len(records) < seen:  # a resumed run truncated its metrics file
        seen = 0
    for record in records[seen:]:
        callbacks.on_run_progress(run, record)
    return max(seen, len(records))


def _finish(run: PlannedRun, code: int, log: Path, callbacks: CompareCallbacks) -> str:
    if code == 0:
        callbacks.on_run_end(run, "finished", None)
        return "finished"
    last = _last_line(log)
    if code == EXIT_DIVERGED:
        mark_diverged(run, last)
        callbacks.on_run_end(run, "diverged", last)
        return "diverged"
    if code == EXIT_USER_ERROR:
        raise MeritError(f"{run.name}: {last}")
    raise RunFailed(f"run {run.name} failed (exit code {code}): {last} (full log: {log})")


def _line_count(run: PlannedRun) -> int:
    return len(read_metrics(run.run_dir)) if run.run_dir.is_dir() else 0


def _last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
