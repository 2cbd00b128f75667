"""Verdicts that survive their own noise: the environment spread, smoke runs, and the plot's marks
(fake summaries and monkeypatched training; nothing is trained)."""

from __future__ import annotations

from click.testing import CliRunner

from merit_core.compare.markdown_report import render_report
from merit_core.compare.plots import BAND_LABEL, BEST_LABEL, DIVERGED_LABEL, compare_figure
from merit_core.compare.results import CompareSettings, CompareSummary, Measured
from merit_core.compare.summary import cells
from merit_core.compare.verdicts import findings, resolution
from tests.compare.records import best_of, seeded, synthetic_summary, with_env
from tests.compare.test_compare_plans import fake_training


def three_seed_summary(loss_spread: float):
    """adamw and merit at batches 8 and 64, three seeds, two lrs each; merit lower by 0.03 at 64
    with seed ranges apart; every best cell's environment spread is `loss_spread`."""
    records = [
        *seeded("adamw", 8, 1e-3, [4.00, 4.01, 4.02], logits=[20.0, 21.0, 22.0]),
        *seeded("merit", 8, 1e-3, [4.05, 4.06, 4.07], logits=[10.0, 11.0, 12.0]),
        *seeded("adamw", 64, 1e-3, [4.30, 4.31, 4.32], logits=[30.0, 31.0, 32.0]),
        *seeded("merit", 64, 1e-3, [4.27, 4.28, 4.29], logits=[10.0, 11.0, 12.0]),
    ]
    records += [r for o in ("adamw", "merit") for b in (8, 64) for r in seeded(o, b, 3e-3, [5.0, 5.1, 5.2])]
    summary = synthetic_summary()
    summary.settings.seeds = [0, 1, 2]
    summary.runs, summary.cells = records, cells(records)
    summary.best = with_env(best_of(records), loss_spread=loss_spread, logit_spread=0.5)
    return summary


def test_an_environment_spread_larger_than_the_gap_leaves_the_claim_not_resolved():
    text = render_report(three_seed_summary(loss_spread=0.02))  # 0.02 + 0.02 > the gap of 0.03
    assert (
        "Paper claim 1 (MERIT has the lowest loss at large batch): at batch 64, **not resolved**: MERIT 4.2800 ± "
        "0.0100 vs adamw 4.3100 ± 0.0100 (not resolved: apart over 3 seeds, but the gap 0.0300 is within the "
        "environment spread 0.0400)" in text
    )
    assert "**holds here**" not in text.split("Paper claim 1")[1].split("\n")[0]
    # the max logit gap (20) is far beyond its environment spread (1.0): claim 2 holds
    assert "Paper claim 2 (MERIT keeps the max attention logit lower): at batch 64, **holds here**" in text

    text = render_report(three_seed_summary(loss_spread=0.005))  # 0.01 < 0.03: resolved
    assert "at batch 64, **holds here**: MERIT 4.2800" in text
    assert "resolved by 3 seeds and beyond the environment spread 0.0100" in text


def test_a_claim_holds_only_if_resolved_against_every_other_optimizer():
    summary = three_seed_summary(loss_spread=0.005)
    records = summary.runs + seeded("lamb", 64, 1e-3, [4.285, 4.295, 4.305]) + seeded("lamb", 64, 3e-3, [5.0] * 3)
    summary.settings.optimizers = ["adamw", "lamb", "merit"]
    summary.runs, summary.cells = records, cells(records)
    summary.best = with_env(best_of(records), loss_spread=0.005)
    line = next(x for x in findings(summary) if x.startswith("Paper claim 1"))
    # lower than both means, resolved against adamw, within the seed spread of lamb: not resolved
    assert "**not resolved**" in line and "lamb 4.2950 ± 0.0100 (not resolved: within the spread of 3 seeds)" in line


def test_a_difference_without_a_measured_environment_spread_is_not_resolved():
    a = Measured({"final_val_loss": 4.0, "final_val_loss_values": [3.9, 4.0, 4.1]})
    b = Measured({"final_val_loss": 5.0, "final_val_loss_values": [4.9, 5.0, 5.1]})
    verdict = resolution(a, b)
    assert verdict.resolved is False and "environment spread was not measured" in verdict.text


def _smoke_words(text: str) -> list[str]:
    lowered = text.lower()
    return [
        w for w in ("best lr", "had the lowest", "; then ", "holds here", "does not hold", " x the ") if w in lowered
    ]


def test_quick_report_and_terminal_give_no_ranking(tmp_path, model_cfg, data_dir, monkeypatch):
    from merit_cli.main import cli

    fake_training(monkeypatch, {"adamw": 1e-3, "merit": 1e-2})
    out = tmp_path / "cmp"
    args = ["compare", "--quick", "--model", str(model_cfg), "--data", str(data_dir), "--seq-len", "32"]
    args += ["--optimizers", "adamw,merit", "--batch-sizes", "8,16", "--out", str(out)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "no verdict: smoke run" in result.output
    assert _smoke_words(result.output) == []
    report = (out / "REPORT.md").read_text()
    assert "**no verdict: smoke run.**" in report  # the report's opening, said once
    assert "**no verdict**: this is a smoke run" in report and "smoke run**: this is a smoke run" not in report
    assert _smoke_words(report) == []
    # a comparison with a single given lr is a smoke run too
    summary = synthetic_summary()
    for b in summary.best:
        b.grid = [b.lr]
    assert findings(summary)[0].startswith("**no verdict**: one lr only for")


def _labels(ax) -> list[str]:
    return ax.get_legend_handles_labels()[1]


def test_plot_marks_diverged_lrs_at_the_edge_and_the_best_lr_with_its_band():
    import matplotlib.pyplot as plt

    summary = three_seed_summary(loss_spread=0.01)
    records = summary.runs + seeded("merit", 64, 1e-2, [None] * 3, statuses=["diverged"] * 3)
    summary.runs, summary.cells = records, cells(records)
    summary.best = best_of(records)
    fig = compare_figure(summary)
    try:
        panels = {ax.get_title().split("\n")[0]: ax for ax in fig.axes}
        assert all(ax.axison and (ax.lines or ax.patches or ax.collections) for ax in fig.axes)  # no empty panel
        merit_loss = panels["merit: final validation loss vs lr"]
        labels = _labels(merit_loss)
        assert f"batch 64: {DIVERGED_LABEL}" in labels and f"batch 8: {DIVERGED_LABEL}" not in labels
        (marker,) = [line for line in merit_loss.lines if line.get_label() == f"batch 64: {DIVERGED_LABEL}"]
        assert list(marker.get_xdata()) == [1e-2] and list(marker.get_ydata()) == [1.0]  # axes coordinates: the top
        assert marker.get_marker() == "^" and not marker.get_clip_on()
        for b in (8, 64):
            assert f"batch {b}: {BEST_LABEL}" in labels and f"batch {b}: {BAND_LABEL}" in labels
        (best_line,) = [line for line in merit_loss.lines if line.get_label() == f"batch 64: {BEST_LABEL}"]
        assert list(best_line.get_xdata()) == [1e-3, 1e-3]
        # each batch its own colour and marker
        handles = dict(zip(labels, merit_loss.get_legend_handles_labels()[0]))
        bars = {b: handles[b].lines[0] for b in ("batch 8", "batch 64")}  # errorbar containers: their data line
        assert bars["batch 8"].get_color() != bars["batch 64"].get_color()
        assert bars["batch 8"].get_marker() != bars["batch 64"].get_marker()
        # min-max error bars stay positive on the log logit axis
        logit = panels["merit: max attention logit at the end vs lr"]
        assert logit.get_yscale() == "log"
        segments = [seg for coll in logit.collections if hasattr(coll, "get_segments") for seg in coll.get_segments()]
        assert segments and all(seg[:, 1].min() > 0 for seg in segments)
        assert merit_loss.get_xlabel() == "peak learning rate (log scale)"
    finally:
        plt.close(fig)
    # a smoke run marks no best lr
    summary.settings.quick = True
    fig = compare_figure(summary)
    try:
        assert not any(BEST_LABEL in label for ax in fig.axes for label in _labels(ax))
    finally:
        plt.close(fig)


def test_ablation_report_says_when_the_clip_never_bound():
    from merit_core.compare.markdown_report import ablation_lines

    records = [
        *seeded("merit", 64, 3e-2, [4.00, 4.02], logits=[2.0, 2.2]),
        *seeded("merit-noclip", 64, 3e-2, [4.00, 4.02], logits=[2.0, 2.2]),  # the same runs, bit for bit
    ]
    summary = CompareSummary(
        settings=CompareSettings(optimizers=["merit", "merit-noclip"], batch_sizes=[64]),
        runs=records,
        cells=cells(records),
        best=with_env(best_of(records)),
    )
    (line,) = ablation_lines(summary)
    assert "(merit-noclip): the clip never bound" in line and "|s_ij u_ij| <= max|W|" in line
    records[-1].final_val_loss = 4.03  # one seed differs: the clip acted, the usual line
    summary.cells, summary.best = cells(records), with_env(best_of(records))
    assert "never bound" not in ablation_lines(summary)[0]
