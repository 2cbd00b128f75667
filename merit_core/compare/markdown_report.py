"""REPORT.md: what a comparison's numbers show, written from its typed record (summary.json) alone.

Every sentence is computed from the records (which optimizer had the lowest loss at each
batch size and by how much, how much each optimizer's loss rose from the smallest to the
largest batch, how the max attention logits compare), so the report reads the same way
whichever way the numbers fall. It ends with the grids, the setup and the caveats of scale.
"""

from __future__ import annotations

import math

from merit_core.compare.precursor_table import instability_lines
from merit_core.compare.results import (
    BestResult,
    CellResult,
    CompareSummary,
    EnvironmentCheck,
    EnvironmentSample,
    Measured,
)
from merit_core.compare.verdicts import (
    PAPER_SHARPNESS,
    SHARPNESS,
    SMOKE,
    findings,
    fmt,
    fmt_lr,
    is_finished,
    mean_std,
    no_verdict,
    num,
    resolution_text,
)
from merit_core.metric_names import MAX_ATTENTION_LOGIT


def results_table(summary: CompareSummary) -> list[str]:
    """Markdown: optimizers x batch sizes, best-lr validation loss and max attention logit (a smoke
    run's one lr per cell: the same columns, no best lr)."""
    best = summary.best_table()
    batches = summary.settings.batch_sizes
    head = "| optimizer | " + " | ".join(f"b{b} val loss | b{b} lr | b{b} max logit" for b in batches) + " |"
    rule = "|---|" + "---:|---:|---:|" * len(batches)
    rows = [head, rule]
    for name in summary.settings.optimizers:
        cells = []
        for b in batches:
            e = best.get((name, b))
            if e is None:
                cells += ["", "", ""]
            elif not is_finished(e):
                cells += [e.status, "-", "-"]
            else:
                cells += [mean_std(e, "final_val_loss"), fmt_lr(e.lr), mean_std(e, MAX_ATTENTION_LOGIT, 2)]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def seeds_table(summary: CompareSummary) -> list[str]:
    """Markdown: each seed's final validation loss and max logit of every best cell (several seeds only)."""
    if all(len(b.seeds or []) < 2 for b in summary.best):
        return []
    rows = ["| optimizer | batch | lr | seed: final val loss | seed: max logit |", "|---|---:|---:|---|---|"]
    for b in summary.best:
        seeds = b.seeds or []
        losses = ", ".join(f"{s}: {fmt(v)}" for s, v in zip(seeds, b.final_val_loss_values or []))
        logits = ", ".join(f"{s}: {fmt(v, 2)}" for s, v in zip(seeds, b.max_attention_logit_values or []))
        rows.append(f"| {b.optimizer} | {b.batch_size} | {fmt_lr(b.lr)} | {losses} | {logits} |")
    return rows


def hessian_lines(summary: CompareSummary) -> list[str]:
    """Markdown: the extreme Hessian eigenvalues and trace of each best run, beside the paper's figures."""
    entries = [b for b in summary.best if b.hessian]
    if not entries:
        return []
    first = entries[0].hessian or {}
    batch, est = first.get("batch") or {}, first.get("estimator") or {}
    paper = (summary.settings.paper or {}).get("hessian") or {}
    rows = [
        f"Final weights of this comparison's own best runs, on a fixed validation batch (the first "
        f"{batch.get('sequences')} windows of {batch.get('seq_len')} tokens of the training's first validation "
        "batch, on which the max attention logit is measured; the same for every run). Three conventions, named "
        "apart: the *largest algebraic* eigenvalue (the most positive curvature), the *smallest algebraic* one "
        "and the one of *largest magnitude* (sign kept: what power iteration, as in the paper's PyHessian, calls "
        f"the top eigenvalue). Lanczos with full reorthogonalisation (at most {est.get('iters')} Hessian-vector "
        "products; 'converged' tests the largest algebraic one), trace by Hutchinson "
        f"({est.get('samples')} Rademacher samples); mean ± std over seeds.",
        "",
        "| optimizer | batch | lr | largest algebraic | smallest algebraic | largest magnitude | trace | converged "
        "| paper top eigenvalue | paper trace |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for b in entries:
        h = Measured(dict(b.hessian or {}))
        conv = "yes" if all(h.values.get("eigen_converged") or [False]) else "no"
        top = (paper.get("top_eigenvalue") or {}).get(b.optimizer)
        trace = (paper.get("trace") or {}).get(b.optimizer)
        rows.append(
            f"| {b.optimizer} | {b.batch_size} | {fmt_lr(b.lr)} | {mean_std(h, SHARPNESS, 3)} | "
            f"{mean_std(h, 'smallest_algebraic_eigenvalue', 3)} | {mean_std(h, PAPER_SHARPNESS, 3)} | {mean_std(h, 'trace', 1)} | "
            f"{conv} | {'-' if top is None else f'{top:g}'} | {'-' if trace is None else f'{trace:,.0f}'} |"
        )
    rows += [
        "",
        f"The paper's figures are for {paper.get('model', 'GPT-2 Small')} trained on billions of tokens; "
        "compare the ordering between optimizers, not the magnitudes.",
    ]
    return rows


def environment_lines(summary: CompareSummary) -> list[str]:
    """Markdown: the floating-point environment of the runs and, per best cell, how far its first seed
    moved when trained again under another thread count (the environment spread verdicts weigh)."""
    env = summary.settings.environment or {}
    checked = [b for b in summary.best if b.environment]
    if not env and not checked:
        return []
    rows = []
    if env:
        rows.append(
            f"Runs computed with torch {env.get('torch')}, BLAS {env.get('blas')}, {env.get('threads')} intra-op "
            f"thread(s), CPU {env.get('cpu')} (torch dispatch {env.get('cpu_capability')}; ISA flags "
            f"{', '.join(env.get('isa_flags') or []) or '-'}). Runs are bit-reproducible only in the same "
            "environment: another thread count, BLAS or ISA reorders sums, and an optimizer can amplify that "
            "rounding difference over hundreds of steps."
        )
    if not checked:
        rows += ["", "The environment spread was not measured (no environment check): no difference is resolved."]
        return rows
    rows += [
        "",
        "Each best cell's seed(s), trained again with everything equal but one part of the floating-point "
        "environment (a perturbation: the thread count, torch's ISA, MKL's ISA; "
        "merit_core/compare/environment.py): |difference| per sample, and the cell's environment spread, the "
        "largest difference, never below a floor relative to the value ("
        + (
            ", ".join(f"{k} {100 * v:g}%" for k, v in (env.get("floors") or {}).items() if k in _ENV_FLOOR_KEYS)
            or "none: a summary of an earlier version"
        )
        + "). A difference between two cells is resolved only when the seeds resolve it and it exceeds the sum of "
        "their environment spreads.",
        "",
        "| optimizer | batch | lr | seed | perturbation | val loss | re-run | difference | max logit | re-run "
        "| difference |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for b in checked:
        e = _env(b)
        samples = e.samples or [_legacy_sample(e, env)]
        for sample in samples:
            rows.append(
                f"| {b.optimizer} | {b.batch_size} | {fmt_lr(b.lr)} | {sample.seed} | "
                f"{sample.perturbation or '-'} | {fmt(sample.final_val_loss_original)} | "
                f"{fmt(sample.final_val_loss_rerun)} | {fmt(sample.final_val_loss_difference)} | "
                f"{fmt(sample.max_attention_logit_original, 2)} | "
                f"{fmt(sample.max_attention_logit_rerun, 2)} | "
                f"{fmt(sample.max_attention_logit_difference, 2)} |"
            )
    rows += [
        "",
        "Environment spread of each best cell (largest difference, floored): "
        + "; ".join(
            f"{b.optimizer} b{b.batch_size} loss {fmt(_env(b).final_val_loss_spread)}, max logit "
            f"{fmt(_env(b).max_attention_logit_spread, 2)}"
            for b in checked
        )
        + ".",
    ]
    sharp = [b for b in checked if (_env(b).hessian or {}).get(f"{SHARPNESS}_spread") is not None]
    if sharp:
        rows += [
            "",
            "Hessian environment spread (largest difference over the samples, floored): "
            + "; ".join(
                f"{b.optimizer} b{b.batch_size} largest algebraic spread "
                f"{fmt((_env(b).hessian or {}).get(f'{SHARPNESS}_spread'), 3)}, "
                f"largest magnitude spread {fmt((_env(b).hessian or {}).get(f'{PAPER_SHARPNESS}_spread'), 3)}"
                for b in sharp
            )
            + ".",
        ]
    return rows


def _env(entry: BestResult) -> EnvironmentCheck:
    """A checked best cell's environment check (callers list only cells that have one)."""
    if entry.environment is None:
        raise ValueError(f"{entry.optimizer} b{entry.batch_size} has no environment check")
    return entry.environment


_ENV_FLOOR_KEYS = ("final_val_loss", MAX_ATTENTION_LOGIT, SHARPNESS)


def _legacy_sample(e: EnvironmentCheck, env: dict) -> EnvironmentSample:
    """A summary.json of an earlier version: its one thread-count re-run as a sample."""
    threads = "-" if e.threads is None else e.threads
    return EnvironmentSample(
        seed=e.seed,
        perturbation=f"{env.get('threads', '-')} -> {threads} intra-op thread(s)",
        final_val_loss_original=e.final_val_loss_original,
        final_val_loss_rerun=e.final_val_loss_rerun,
        final_val_loss_difference=e.final_val_loss_spread,
        max_attention_logit_original=e.max_attention_logit_original,
        max_attention_logit_rerun=e.max_attention_logit_rerun,
        max_attention_logit_difference=e.max_attention_logit_spread,
    )


def speed_lines(summary: CompareSummary) -> list[str]:
    """Markdown: training tokens/s of each best cell (median of each run's log lines, mean over seeds)
    and each optimizer's speed relative to LAMB at the same batch."""
    best = summary.best_table()
    batches = summary.settings.batch_sizes
    rows = []
    for batch in batches:
        speeds: dict[str, float] = {}
        for o in summary.settings.optimizers:
            speed = best[o, batch].tokens_per_s if (o, batch) in best else None
            if speed:
                speeds[o] = speed
        if not speeds:
            continue
        ref = speeds.get("lamb")
        parts = [
            f"{o} {v:,.0f}" + (f" ({v / ref:.3f}x LAMB)" if ref and o != "lamb" else "") for o, v in speeds.items()
        ]
        rows.append(f"- Batch {batch}: " + ", ".join(parts) + " tokens/s.")
    if not rows:
        return []
    return [
        "Training tokens/s of the best runs (median over each run's log lines, mean over seeds). The runs "
        "shared the machine with the comparison's other runs, so these are rough; benchmarks/train_throughput.py "
        "measures the optimizers side by side in one process (benchmarks/README.md). The paper puts MERIT's "
        "cost at about 1% over LAMB.",
        "",
        *rows,
    ]


ABLATION_COMPONENTS = {
    "merit-noclip": "element-wise clipping of the update ratios",
    "merit-nobound": "the weight-wise bound on the element-wise ratios",
    "max-lamb": "element-wise ratios (one max-norm ratio per tensor instead)",
    "l2-merit": "max-norms (l2 norms instead)",
    "lamb-ref": "all of MERIT's changes (the LAMB reference)",
}


def ablation_lines(summary: CompareSummary) -> list[str]:
    """One line per MERIT ablation that ran with MERIT at the largest batch: did removing the
    component hurt the final validation loss, by how much, and do the seeds resolve it."""
    batch = summary.settings.batch_sizes[-1]
    best = summary.best_table()
    merit = best.get(("merit", batch))
    ablations = [o for o in summary.settings.optimizers if o in ABLATION_COMPONENTS]
    if not ablations or merit is None:
        return []
    if not is_finished(merit):
        return [f"MERIT diverged at every lr tried at batch {batch}: the ablations cannot be judged."]
    lines = []
    for name in ablations:
        e = best.get((name, batch))
        what = ABLATION_COMPONENTS[name]
        if not is_finished(e):
            lines.append(f"Without {what} ({name}): diverged at every lr tried, where MERIT did not.")
            continue
        if name == "merit-noclip" and _same_runs(summary, merit, name):
            lines.append(
                f"Without {what} ({name}): the clip never bound: at MERIT's lr every seed's loss and max logit "
                "equal MERIT's exactly. With max-norm ratios |s_ij u_ij| <= max|W| (docs/MERIT.md), so the clip at 1 "
                "only acts on a tensor holding an entry above 1 in magnitude; nothing here tests it."
            )
            continue
        delta = num(e.final_val_loss) - num(merit.final_val_loss)
        verdict = "hurt" if delta > 0 else "did not hurt"
        lines.append(
            f"Without {what} ({name}): {verdict}: loss {mean_std(e, 'final_val_loss')} vs MERIT "
            f"{mean_std(merit, 'final_val_loss')} ({delta:+.4f}, {100 * delta / num(merit.final_val_loss):+.2f}%; "
            f"{resolution_text(merit, e)}); max logit {mean_std(e, MAX_ATTENTION_LOGIT, 2)} vs "
            f"{mean_std(merit, MAX_ATTENTION_LOGIT, 2)}."
        )
    return lines


def _same_runs(summary: CompareSummary, merit: BestResult, name: str) -> bool:
    """Whether `name`'s cell at MERIT's best lr gave exactly MERIT's numbers on every seed."""
    cell = next(
        (c for c in summary.cells if (c.optimizer, c.batch_size, c.lr) == (name, merit.batch_size, merit.lr)), None
    )
    if cell is None or cell.status != "finished" or cell.seeds != merit.seeds:
        return False
    return (
        cell.final_val_loss_values == merit.final_val_loss_values
        and cell.max_attention_logit_values == merit.max_attention_logit_values
    )


def zero_shot_lines(summary: CompareSummary) -> list[str]:
    """Markdown: the zero-shot scores of each best run (mean ± std over seeds), one column per metric."""
    entries = [b for b in summary.best if b.zero_shot]
    if not entries:
        return []
    keys = list(dict.fromkeys((r["task"], r["metric"]) for b in entries for r in b.zero_shot or []))
    arrows: dict[tuple[str, str], str] = {}
    for b in entries:
        for r in b.zero_shot or []:
            arrows.setdefault((r["task"], r["metric"]), {True: " ↑", False: " ↓"}.get(r["higher_is_better"], ""))
    head = "| optimizer | batch | lr | " + " | ".join(f"{t} {m}{arrows[t, m]}" for t, m in keys) + " |"
    rows = [head, "|---|---:|---:|" + "---:|" * len(keys)]
    for b in entries:
        by_key = {(r["task"], r["metric"]): Measured(r) for r in b.zero_shot or []}
        cells = [mean_std(by_key[k], "value") if k in by_key else "-" for k in keys]
        rows.append(f"| {b.optimizer} | {b.batch_size} | {fmt_lr(b.lr)} | " + " | ".join(cells) + " |")
    ev = summary.settings.eval or {}
    paper = (summary.settings.paper or {}).get("zero_shot") or {}
    average = paper.get("average") or {}
    rows += [
        "",
        f"Zero-shot with lm-evaluation-harness (`merit eval`) on {', '.join(ev.get('tasks') or [])}"
        + (f", at most {ev['limit']} documents per task" if ev.get("limit") else "")
        + ". The paper's zero-shot average (LAMBADA, WikiText, SuperGLUE) on GPT-2: "
        + ", ".join(f"{o} {v:g}" for o, v in average.items())
        + ".",
    ]
    return rows


def _grids(summary: CompareSummary) -> dict[tuple[str, int], list[CellResult]]:
    """(optimizer, batch size) -> the cells of its grid, in first-seen order."""
    groups: dict[tuple[str, int], list[CellResult]] = {}
    for r in summary.grid_cells():
        groups.setdefault((r.optimizer, r.batch_size), []).append(r)
    return groups


def grid_table(summary: CompareSummary) -> list[str]:
    """Markdown: every lr tried, its final validation loss (mean ± std over seeds, or 'diverged'), the best in
    bold (none in a smoke run)."""
    best = {} if no_verdict(summary) else {(b.optimizer, b.batch_size): b.lr for b in summary.best}
    rows = ["| optimizer | batch | steps | lr: final val loss |", "|---|---:|---:|---|"]
    for (name, batch), runs in _grids(summary).items():
        cells = []
        for r in sorted(runs, key=lambda r: r.lr):
            value = mean_std(r, "final_val_loss") if r.status == "finished" else r.status
            if r.valued and r.status != "finished":
                value += f" ({mean_std(r, 'final_val_loss')})"
            cell = f"{fmt_lr(r.lr)}: {value}"
            cells.append(f"**{cell}**" if r.lr == best.get((name, batch)) and r.status == "finished" else cell)
        rows.append(f"| {name} | {batch} | {runs[0].steps} | {', '.join(cells)} |")
    return rows


# An lr counts as "good" when its mean final validation loss is within this fraction of the cell's best.
GOOD_LR_TOLERANCE = 0.02


def sensitivity_lines(summary: CompareSummary) -> list[str]:
    """Markdown: final validation loss and max attention logit against lr for each optimizer and
    batch (mean ± std over seeds), and how wide the range of good lrs is (GOOD_LR_TOLERANCE)."""
    groups = _grids(summary)
    if not groups or all(len(cells) < 2 for cells in groups.values()):
        return []
    rows = [
        "Every lr of every grid: final validation loss and max attention logit (max over layers) at the "
        f"end, mean ± std over seeds; *good lrs* are those within {100 * GOOD_LR_TOLERANCE:g}% of the "
        "cell's best loss, and their span (largest / smallest) says how forgiving the optimizer is "
        "at that batch.",
        "",
        "| optimizer | batch | lr | final val loss | max logit | diverged seeds | status |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    spans = []
    diverged = {r.name for r in summary.runs if r.status == "diverged"}
    for (name, batch), cells in groups.items():
        cells = sorted(cells, key=lambda r: r.lr)
        for r in cells:
            finished = r.status == "finished"
            n_seeds = len(r.seeds or [r.seed])
            values = r.final_val_loss_values or [r.final_val_loss]
            if r.run_names:  # the seeds whose run diverged (a missing one did not)
                n_bad = sum(name in diverged for name in r.run_names)
            else:
                n_bad = 0 if r.valued else sum(v is None or not math.isfinite(v) for v in values) or n_seeds
            rows.append(
                f"| {name} | {batch} | {fmt_lr(r.lr)} | "
                + (
                    f"{mean_std(r, 'final_val_loss')} | {mean_std(r, 'max_attention_logit', 2)}"
                    if finished or r.valued
                    else "- | -"
                )
                + f" | {n_bad} of {n_seeds} | {r.status} |"
            )
        done = [r for r in cells if r.finished]
        if done:
            top = min(num(r.final_val_loss) for r in done)
            good = [r.lr for r in done if num(r.final_val_loss) <= top * (1 + GOOD_LR_TOLERANCE)]
            edge = " (reaches the grid's edge)" if min(good) == cells[0].lr or max(good) == cells[-1].lr else ""
            spans.append(
                f"- {name} at batch {batch}: good lrs {fmt_lr(min(good))}-{fmt_lr(max(good))}, "
                f"x{max(good) / min(good):.3g} wide, {len(good)} of {len(cells)} grid points{edge}."
            )
    return rows + [""] + spans


def caveats(summary: CompareSummary) -> list[str]:
    s = summary.settings
    params = s.n_params
    size = f"{params / 1e6:.2f}M parameters" if params else "its size"
    lines = [
        f"Scale: {s.model} has {size} and each run saw {s.tokens_per_run:,} tokens; the paper's "
        "results are for GPT-2 models of 125M-770M parameters trained on billions of tokens at batch "
        "sizes of 1k-8k sequences. Effects of large-batch training (and the attention-logit growth the paper "
        "reports) need not appear, or may look different, at this scale.",
    ]
    seeds = s.seeds or [s.seed]
    if max(len(seeds), s.best_seeds or 0) < 2:
        lines.append("One seed per run: the run-to-run spread was not measured, so small gaps may be noise.")
    else:
        lines.append(
            f"{len(seeds)} seed(s) per learning rate (train seeds {', '.join(map(str, seeds))})"
            + (f", {s.best_seeds} at each best lr" if (s.best_seeds or 0) > len(seeds) else "")
            + ": numbers are the mean ± the sample standard deviation over seeds, and the best lr is chosen on the "
            "mean. A difference is called resolved only when every seed of one lies below every seed of the other "
            "and the gap between the means exceeds the two cells' environment spreads (see Environment spread); "
            "otherwise it is not resolved, and a claim holds only when resolved against every other optimizer."
        )
    for b in summary.best:
        if b.lr_extended:
            lines.append(
                f"{b.optimizer} at batch {b.batch_size}: the grid was extended past its edge "
                f"(added lr {', '.join(fmt_lr(v) for v in b.lr_extended)})"
                + ("; the best lr is now interior." if not b.lr_at_edge else ".")
            )
        if b.lr_at_edge:
            side = "smallest" if b.lr_at_edge == "low" else "largest"
            reason = {
                "limit": f"after {s.max_extensions} extension(s) on that side, the stated limit",
                "given": "a given lr list, which is never extended",
                "quick": "--quick runs one lr per grid and never extends it",
            }.get(b.edge_reason or "", "")
            lines.append(
                f"{b.optimizer} at batch {b.batch_size}: the best lr ({fmt_lr(b.lr)}) is still the {side} "
                f"of its grid ({reason}), so its optimum may lie outside the grid: this comparison is not "
                "fair to it yet."
            )
    unstable = [c for c in summary.grid_cells() if c.status == "unstable"]
    if unstable:
        lines.append(
            "Unstable lrs (finished with a finite loss, but the attention logit saturated or the loss collapsed; "
            "shown, never a best lr; the rule: merit_core/compare/stability.py): "
            + "; ".join(f"{c.optimizer} b{c.batch_size} lr {fmt_lr(c.lr)} ({c.message})" for c in unstable)
            + "."
        )
    missing = [r for r in summary.runs if r.status == "missing"]
    if missing:
        lines.append(
            "Missing runs (their folder no longer held the run; not counted): "
            + ", ".join(r.name for r in missing)
            + "."
        )
    diverged = [r for r in summary.runs if r.status == "diverged"]
    if diverged:
        lines.append(
            "Diverged runs (non-finite loss; ranked last): "
            + ", ".join(
                f"{r.optimizer} b{r.batch_size} lr {fmt_lr(r.lr)}"
                + (f" (seed {r.seed} of {', '.join(map(str, seeds))})" if len(seeds) > 1 else "")
                for r in diverged
            )
            + "."
        )
    return lines


def setup_lines(summary: CompareSummary) -> list[str]:
    s = summary.settings
    steps = ", ".join(f"batch {b}: {n} steps" for b, n in s.steps.items())
    warmup = ", ".join(f"batch {b}: {n} steps" for b, n in s.warmup_steps.items())
    return [
        f"- Model: {s.model}" + (f" ({s.n_params:,} parameters)" if s.n_params else ""),
        f"- Data: {s.data}",
        f"- Sequence length {s.seq_len}; token budget {s.tokens_per_run:,} tokens per run at every "
        f"batch size ({steps})",
        f"- Schedule: linear warmup ({warmup}), then cosine decay to {s.min_lr_ratio:g} x lr; "
        f"gradient clipping at {s.grad_clip:g}; "
        + (f"seeds {', '.join(map(str, s.seeds))}" if len(s.seeds or []) > 1 else f"seed {s.seed}"),
        f"- Learning rates: {s.lr_rule}; "
        + (
            "one per optimizer and batch size, untuned (smoke run)"
            if no_verdict(summary)
            else "the best per optimizer and batch size by (mean) final validation loss"
        ),
        f"- Validation: {s.eval_tokens:,} held-out tokens; max attention logit on the first validation batch",
    ] + ([f"- Command: `{s.command}`"] if s.command else [])


def _section(title: str, lines: list[str]) -> list[str]:
    return [f"## {title}", "", *lines, ""] if lines else []


def render_report(summary: CompareSummary) -> str:
    """The whole REPORT.md, from the comparison's typed record."""
    s = summary.settings
    title = " vs ".join(s.optimizers)
    intro = (
        f"**{SMOKE}.** One learning rate per optimizer and batch size (no grid, so no optimizer was tuned); "
        "the numbers check that everything runs. Generated from `summary.json`."
        if no_verdict(summary)
        else "Each optimizer at its best learning rate (by final validation loss, the mean over seeds) for each "
        "batch size, all at the same token budget. Generated from `summary.json`."
    )
    parts = [
        f"# merit compare: {title} on {s.model}",
        "",
        intro,
        "",
        "## Results",
        "",
        *results_table(summary),
        "",
        "## What the numbers show",
        "",
        *[f"- {line}" for line in findings(summary)],
        "",
        *_section("Each seed", seeds_table(summary)),
        *_section("Learning-rate sensitivity", sensitivity_lines(summary)),
        *_section("Sharpness (Hessian)", hessian_lines(summary)),
        *_section("Instability precursors", instability_lines(summary)),
        *_section("Environment spread", environment_lines(summary)),
        *_section("Training speed", speed_lines(summary)),
        *_section("Ablations (largest batch)", [f"- {line}" for line in ablation_lines(summary)]),
        *_section("Zero-shot evaluation", zero_shot_lines(summary)),
        "## Caveats",
        "",
        *[f"- {line}" for line in caveats(summary)],
        "",
        "## Learning-rate grid",
        "",
        *grid_table(summary),
        "",
        "## Setup",
        "",
        *setup_lines(summary),
        "",
    ]
    return "\n".join(parts)
