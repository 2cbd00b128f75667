"""`merit compare`: the paper's experiment at any scale (optimizers x batch sizes, each at its best lr).

Every run is an ordinary `merit train` run folder under `<out>/runs/<optimizer>-b<batch>-lr<lr>/`;
at the end `<out>/summary.json`, `<out>/compare.png` and `<out>/REPORT.md` are written from
those folders. Modules: spec (settings), grid (lr grids and run configs), runner (states and
execution), worker (one run in a subprocess), summary, report, plots.

Rounds: train the planned runs; while an auto grid's best lr sits on its edge, train the next
lr beyond it (grid); top each best cell up to `best_seeds` seeds (3 by default) until the best
cells stand; re-run each best cell's first seed(s) under each perturbation of the floating-point
environment (another thread count, a lower torch ISA, a lower MKL ISA: the environment check,
environment); train again any run whose folder was removed meanwhile (a run that stays gone is
'missing' in the summary, never 'diverged'); then measure the best runs (--hessian, --eval:
measures) and write the outputs, with the commit, times and host in settings.provenance.
Every run but the environment re-runs uses one intra-op thread count (runner.compare_threads). `--seeds N` trains every lr N times and ranks on the mean (summary); `--preset
ablations` compares MERIT with its registry ablations at the largest batch (spec, report).
`run_compare` returns a typed `CompareSummary` (results) whose `to_dict()` is summary.json.

The default comparison (no arguments) is adamw, lamb and merit on gpt2-tiny (1.35M parameters)
with the built-in corpus, sequence length 128, batch sizes 2 and 16 (8x apart, as the paper's
GPT-2 medium 480 -> 4k) at 131,072 tokens per run (512 and 64 optimizer steps), a three-point
lr grid each (extended past an edge holding the best lr, at most twice per side): 18 runs or
more, one per core at a time on CPU; then two more seeds for each of the 6 best cells (12 runs)
and three environment re-runs of each where the host can make them (18 runs): 48 runs or more,
about 2.7 times the grid's cost. `--quick` runs the auto grid's centre only, at 65,536
tokens and with half the evaluations (grid.QUICK_EVAL_POINTS): 6 runs, a smoke run; with one
lr per cell its report states no verdict on the paper's claims (report). On a CPU the start
says how long the planned runs should take (estimate).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from merit_core.checkpoint.resolve import latest_checkpoint
from merit_core.checkpoint.state import read_trainer_state
from merit_core.compare.environment import FLOORS, Perturbation, perturbations
from merit_core.compare.estimate import estimate_runs
from merit_core.compare.grid import (
    RUNS_DIR,
    Cell,
    PlannedRun,
    annotate_extensions,
    lr_grids,
    next_extensions,
    next_top_ups,
    plan_runs,
    seed_list,
)
from merit_core.compare.markdown_report import render_report
from merit_core.compare.measures import (
    PAPER,
    eval_cell,
    hessian_cell,
    hessian_environment,
    hessian_spread,
    run_eval,
    run_hessian,
)
from merit_core.compare.plots import PLOT_FILE, plot_compare
from merit_core.compare.provenance import Provenance
from merit_core.compare.results import BestResult, CompareSettings, CompareSummary, RunResult
from merit_core.compare.runner import (
    CompareCallbacks,
    Execution,
    compare_threads,
    default_jobs,
    execute,
    run_state,
    state_now,
    usable_cores,
)
from merit_core.compare.spec import CompareSpec, load_spec
from merit_core.compare.summary import SUMMARY_FILE, build_summary, select_best, write_json
from merit_core.data import load_meta, resolve_data
from merit_core.devices import measurement_device
from merit_core.durable_writes import TMP_PREFIX, atomic_write, refuse_link, refuse_special
from merit_core.evaluation.tasks import resolve_tasks
from merit_core.optim.merit.verify import verify_backend
from merit_core.optim.registry import get_spec
from merit_core.output_checks import check_writable_folder, refuse_foreign_entries
from merit_core.settings import VOCAB_SIZE
from merit_core.train.hardware import float_environment

REPORT_FILE = "REPORT.md"

__all__ = [
    "CompareSpec",
    "CompareCallbacks",
    "CompareResult",
    "CompareSummary",
    "BestResult",
    "RunResult",
    "PlannedRun",
    "load_spec",
    "plan_compare",
    "run_compare",
    "select_best",
    "lr_grids",
]


@dataclass
class ComparePlan:
    """Checked runs and their states before anything is written."""

    spec: CompareSpec
    runs: list[PlannedRun]
    states: dict[str, str]
    jobs: int


@dataclass
class CompareResult:
    """What `run_compare` produced (`summary`: typed; `summary.to_dict()` is summary.json)."""

    out: Path
    summary: CompareSummary
    summary_path: Path
    plot_path: Path
    report_path: Path
    states_before: dict[str, str]
    trained: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


def plan_compare(
    spec: CompareSpec,
    extra: dict[tuple[str, int], list[float]] | None = None,
    top_ups: dict | None = None,
    env_runs: dict | None = None,
) -> ComparePlan:
    """Validate the comparison and find each run's state; writes nothing (ConfigError on bad input).

    `extra`: lrs added past grid edges; `top_ups`, `env_runs`: best cells' extra seeds and
    environment re-runs (see merit_core.compare.grid)."""
    check_compare_out(spec.out)
    runs = plan_runs(spec, extra, top_ups, env_runs)
    states = {run.name: run_state(run) for run in runs}
    device = str(spec.train.get("device", "auto"))
    todo = sum(state in ("new", "partial") for state in states.values())
    return ComparePlan(spec, runs, states, spec.jobs or default_jobs(device, todo))


def check_compare_out(out: Path) -> Path:
    """ConfigError unless `out` may hold a comparison: absent, empty, or holding only what compare writes
    (runs/, logs/, summary.json, compare.png, REPORT.md and their temp files). Writes nothing.

    Like `merit train --out`, compare never writes into a folder of the user's own files. UnsafePath
    when its runs/ or logs/ is a symbolic link or holds one, or logs/ holds a special file: compare
    writes in both and never follows a link planted there."""
    check_writable_folder(out, "--out")
    if not out.is_dir():
        return out
    refuse_foreign_entries(
        out, sorted(p.name for p in out.iterdir() if not _compare_owns(p.name)), "a merit comparison"
    )
    for name in (RUNS_DIR, "logs"):
        refuse_link(out / name, "in a comparison folder")
        if (out / name).is_dir():
            for entry in sorted((out / name).iterdir()):
                refuse_link(entry, "in a comparison folder")
                if name == "logs":
                    refuse_special(entry)
    return out


_COMPARE_ENTRIES = (RUNS_DIR, "logs", SUMMARY_FILE, PLOT_FILE, REPORT_FILE)


def _compare_owns(name: str) -> bool:
    if name in _COMPARE_ENTRIES or name == REPORT_FILE + ".tmp":  # REPORT.md's temp file in earlier versions
        return True
    stem, _, pid = name.rpartition(".")  # an atomic write's temp file: .tmp-<name>.<pid>
    return stem.startswith(TMP_PREFIX) and stem[len(TMP_PREFIX) :] in _COMPARE_ENTRIES and pid.isdigit()


def run_compare(spec: CompareSpec, callbacks: CompareCallbacks | None = None) -> CompareResult:
    """Run (or finish) the comparison and write summary.json, compare.png and REPORT.md.

    Rounds: train the planned runs; while an auto grid's best lr sits on its edge (and the
    extension limit allows), add the next lr beyond it and train that; then measure the best
    runs (--hessian, --eval) and write the outputs."""
    callbacks = callbacks or CompareCallbacks()
    start = time.perf_counter()

    if spec.eval is not None:
        resolve_tasks(list(spec.eval.tasks), spec.eval.include_path)  # a bad task name fails before training
    plan = plan_compare(spec)
    threads = compare_threads(str(spec.train.get("device", "auto")), spec.jobs)
    host = float_environment(threads)
    provenance = Provenance(host)
    warming = _warm_merit_kernel(spec, threads)
    data_dir, meta = _prepare_data(spec, callbacks)
    if warming is not None:
        warming.join()
    callbacks.on_plan(plan.runs, plan.states, plan.jobs)
    estimate = estimate_runs(plan.runs, plan.states, plan.jobs, threads, meta)
    if estimate is not None:
        auto = any(setting == "auto" for setting in spec.lrs.values())
        later = spec.best_seeds > spec.seeds or spec.environment_check or (not spec.quick and auto)
        callbacks.on_estimate(dataclasses.replace(estimate, more=later))
    states = execute(plan.runs, Execution(plan.states, plan.jobs, spec.out / "logs", callbacks, threads))
    before = dict(plan.states)
    extra: dict[tuple[str, int], list[float]] = {}
    top_ups: dict = {}
    env_runs: dict[Cell, list[tuple[int, Perturbation]]] = {}
    made: list[Perturbation] = []
    skipped: list[str] = []

    def train_new(why: str | None, jobs: int | None = None) -> None:
        nonlocal plan
        plan = plan_compare(spec, extra, top_ups, env_runs)
        new = [run for run in plan.runs if run.name not in states]
        before.update({run.name: plan.states[run.name] for run in new})
        jobs = min(plan.jobs, jobs or plan.jobs)
        if why is None:
            callbacks.on_extend(new, plan.states, jobs)
        else:
            callbacks.on_add(new, plan.states, jobs, why)
        states.update(execute(new, Execution(plan.states, jobs, spec.out / "logs", callbacks, threads)))

    while True:
        summary = build_summary(None, plan.runs, states)
        grown = next_extensions(spec, summary.best, extra)
        if not grown:
            break
        extra = grown
        train_new(None)
    while True:  # top the best cells up; a best cell the new seeds displace is topped up in turn
        more = next_top_ups(spec, build_summary(None, plan.runs, states).best, top_ups)
        if not more:
            break
        top_ups = more
        train_new("seeds")
    if spec.environment_check:
        made, skipped = perturbations(spec.environment_perturbations, threads or _torch_threads(), host)
        best = build_summary(None, plan.runs, states).best
        samples = {
            (b.optimizer, b.batch_size, b.lr): range(min(spec.environment_samples, len(b.seeds or [0])))
            for b in best
            if b.status == "finished"
        }
        # the re-runs at the comparison's thread count first, as many at once as the grid's; then
        # those at another thread count, as many at once as the cores hold at theirs
        for group in ([p for p in made if p.threads is None], [p for p in made if p.threads is not None]):
            if not group or not samples:
                continue
            for cell, indices in samples.items():
                env_runs.setdefault(cell, []).extend((index, p) for index in indices for p in group)
            widest = max(p.threads or threads or 1 for p in group)
            train_new("environment", max(1, usable_cores() // widest) if threads is not None else None)
    # a run folder removed after its run finished (or diverged) is trained again, once; one replaced by a
    # link or a file, or no longer holding this run, is 'missing' (summary.run_record says why)
    now = {r.name: state_now(r)[0] for r in plan.runs if states[r.name] in ("finished", "diverged")}
    states.update({name: "missing" for name, state in now.items() if state == "missing"})
    vanished = [r for r in plan.runs if now.get(r.name) in ("new", "partial")]
    if vanished:
        again = {r.name: now[r.name] for r in vanished}
        states.update(again)
        before.update(again)
        callbacks.on_add(vanished, again, plan.jobs, "missing")
        states.update(execute(vanished, Execution({**states}, plan.jobs, spec.out / "logs", callbacks, threads)))
    settings = _settings(spec, plan.runs, meta, extra)
    settings.environment = _environment(threads, host, made, skipped, spec.environment_samples if env_runs else 0)
    summary = build_summary(settings, plan.runs, states)
    annotate_extensions(spec, summary.best)
    _measure(spec, summary, data_dir, callbacks)
    spec.out.mkdir(parents=True, exist_ok=True)
    summary.settings.provenance = provenance.record()
    summary_path = write_json(spec.out / SUMMARY_FILE, summary.to_dict())
    plot_path = plot_compare(summary, spec.out)
    report_path = atomic_write(spec.out / REPORT_FILE, render_report(summary))
    trained = [name for name, state in before.items() if state in ("new", "partial")]
    return CompareResult(
        spec.out,
        summary,
        summary_path,
        plot_path,
        report_path,
        before,
        trained,
        time.perf_counter() - start,
    )


def _measure(spec: CompareSpec, summary: CompareSummary, data_dir: Path, callbacks: CompareCallbacks) -> None:
    """--hessian and --eval on every seed of each finished best cell (see merit_core.compare.measures)."""
    run_dirs = {r.name: Path(r.run_dir) for r in summary.runs}
    finished = [b for b in summary.best if b.status == "finished"]
    if spec.hessian:
        device = measurement_device(spec.train.get("device"))
        for entry in finished:
            measured = []
            for name in entry.run_names:
                callbacks.on_measure("hessian", name)
                measured.append(run_hessian(run_dirs[name], data_dir, device))
            entry.hessian = hessian_cell(measured)
            env = entry.environment
            if env is not None:  # the Hessian's environment spread, at every batch
                spreads = []
                for sample in env.samples:
                    if sample.status not in ("finished", "unstable"):
                        continue
                    index = entry.run_names.index(_original(entry, sample.seed))
                    callbacks.on_measure("hessian", sample.run)
                    again = run_hessian(run_dirs[sample.run], data_dir, device)
                    spreads.append(hessian_spread(measured[index], again))
                env.hessian = hessian_environment(spreads) if spreads else None
    if spec.eval is not None and finished:
        names = [name for entry in finished for name in entry.run_names]
        for name in names:
            callbacks.on_measure("eval", name)
        results = dict(
            zip(names, run_eval([run_dirs[n] for n in names], spec.eval, measurement_device(spec.train.get("device"))))
        )
        for entry in finished:
            entry.zero_shot = eval_cell([results[name] for name in entry.run_names])


def _original(entry: BestResult, seed: int) -> str:
    """The name of a best cell's run of `seed` (an environment sample's original)."""
    seeds = entry.seeds or [entry.seed]
    return entry.run_names[seeds.index(seed)] if seed in seeds else entry.run_names[0]


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _environment(
    threads: int | None, host: dict[str, Any], made: list[Perturbation], skipped: list[str], samples: int
) -> dict[str, Any]:
    """summary.json settings.environment: the floating-point environment of the runs (hardware.
    float_environment at the runs' thread count) and what the environment check changed: its
    perturbations, the ones this host could not make, and the seeds re-run per best cell."""
    threaded = next((p.threads for p in made if p.threads is not None), None)
    return {
        **host,
        "check": (
            f"each best cell's first {samples} seed(s) re-trained under each perturbation: "
            + ", ".join(p.describe() for p in made)
        )
        if samples and made
        else "not run",
        "check_threads": threaded if samples else None,
        "perturbations": [{"kind": p.kind, "value": p.value} for p in made] if samples else [],
        "perturbations_skipped": skipped if samples else [],
        "samples": samples,
        "floors": dict(FLOORS) if samples else {},
    }


def _warm_merit_kernel(spec: CompareSpec, threads: int | None) -> threading.Thread | None:
    """On a CPU, when a run uses MERIT's default backend: MERIT's C++ kernel built and checked against the
    reference step (merit_core.optim.merit.verify, once per machine, cached) in a thread beside the data
    preparation. Every run does it before its first step; done here first, the MERIT runs that start side
    by side find both in the cache instead of each building and checking the kernel before training."""
    merit_like = [
        name
        for name in spec.optimizers
        if "implementation" in get_spec(name).defaults
        and spec.optimizer_args.get(name, {}).get("implementation") is None
    ]
    if threads is None or not merit_like:
        return None
    thread = threading.Thread(target=verify_backend, args=("cpu",), name="merit-kernel-check", daemon=True)
    thread.start()
    return thread


def _prepare_data(spec: CompareSpec, callbacks: CompareCallbacks):
    """Prepare the shared data once, before any run (the runs then find it in the cache)."""
    path = resolve_data(
        spec.train.get("data"),
        tokenizer=spec.train.get("tokenizer"),
        vocab_size=int(spec.train.get("vocab_size", VOCAB_SIZE)),
        progress=callbacks.on_prepare,
    )
    return Path(path), load_meta(path)


def _settings(spec: CompareSpec, runs: list[PlannedRun], meta, extra=None) -> CompareSettings:
    first = runs[0].config
    n_params = None
    for run in runs:
        latest = latest_checkpoint(run.run_dir)
        if latest is not None:
            n_params = read_trainer_state(latest[1]).n_params
            break
    grids = lr_grids(spec)
    rule = (
        "auto: a centre per optimizer and batch (the registry's measured lr for the model, batch and "
        "sequence length, else the nearest measured one x sqrt(tokens per step ratio); unmeasured "
        "optimizers: a centre x sqrt(batch / smallest batch)), "
        + (
            "the centre only (--quick)"
            if spec.quick
            else f"x {{1/3, 1, 3}}, extended x3 past an edge holding the best lr, at most {spec.max_extensions} "
            "time(s) per side"
        )
        + " (see merit_core.compare.grid)"
    )
    explicit = {name for name, setting in spec.lrs.items() if setting != "auto"}
    if explicit:
        rule = (
            "given lists"
            if len(explicit) == len(spec.lrs)
            else f"given lists for {', '.join(sorted(explicit))}, otherwise {rule}"
        )
    data = spec.train.get("data") or "built-in corpus (Python standard-library docstrings)"
    return CompareSettings(
        model=str(first.model),
        n_params=n_params,
        optimizers=spec.optimizers,
        batch_sizes=spec.all_batch_sizes,
        seq_len=int(first.seq_len),
        tokens=spec.tokens,
        tokens_per_run=max(run.tokens for run in runs),
        steps={str(b): next(r.steps for r in runs if r.batch_size == b) for b in spec.all_batch_sizes},
        data=f"{data}: {meta.train_tokens:,} train / {meta.val_tokens:,} validation tokens, "
        f"vocabulary {meta.vocab_size}",
        lr_rule=rule,
        lr_grids=[{"optimizer": o, "batch_size": b, "lrs": lrs} for (o, b), lrs in grids.items()],
        lr_grids_extended=[
            {"optimizer": o, "batch_size": b, "lrs": lrs} for (o, b), lrs in lr_grids(spec, extra).items()
        ],
        max_extensions=spec.max_extensions,
        warmup_steps={
            str(b): next(int(r.config.warmup_steps) for r in runs if r.batch_size == b) for b in spec.all_batch_sizes
        },
        min_lr_ratio=float(first.min_lr_ratio),
        grad_clip=float(first.grad_clip),
        seed=int(first.seed),
        seeds=seed_list(spec),
        best_seeds=spec.best_seeds,
        hessian=spec.hessian,
        eval=None
        if spec.eval is None
        else {"tasks": list(spec.eval.tasks), "include_path": spec.eval.include_path, "limit": spec.eval.limit},
        preset=spec.preset,
        paper=PAPER,
        command=spec.command,
        dtype=str(first.dtype),
        eval_tokens=int(first.eval_batches * first.eval_batch_size * first.seq_len),
        out=str(spec.out),
        quick=spec.quick,
    )
