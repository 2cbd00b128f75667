"""compare.png checked through the figure's artists: titles and labels inside the canvas, tick labels
apart, markers on every series, legends off the data, error bars that span what the titles say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from merit_core.compare.plots import BARS, SMOKE_TITLE, UNSTABLE_LABEL, compare_figure
from merit_core.compare.results import CompareSummary
from merit_core.compare.summary import cells
from tests.compare.records import best_of, seeded, synthetic_summary, with_env

ROOT = Path(__file__).resolve().parents[2]
COMPARE_CPU = ROOT / "results" / "compare-cpu" / "summary.json"


@pytest.fixture(scope="module")
def committed():
    """The figure of the committed CPU reproduction, drawn (so every extent is known)."""
    import matplotlib.pyplot as plt

    summary = CompareSummary.from_dict(json.loads(COMPARE_CPU.read_text()))
    fig = compare_figure(summary)
    fig.canvas.draw()
    yield summary, fig, fig.canvas.get_renderer()
    plt.close(fig)


def _inside(inner, outer, slack: float = 1.0) -> bool:
    return (
        inner.x0 >= outer.x0 - slack
        and inner.y0 >= outer.y0 - slack
        and inner.x1 <= outer.x1 + slack
        and inner.y1 <= outer.y1 + slack
    )


def _panels(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes}


def test_titles_and_labels_lie_inside_the_canvas(committed):
    _, fig, renderer = committed
    canvas = fig.bbox
    texts = [fig._suptitle]
    for ax in fig.axes:
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label]
    for text in texts:
        if text is not None and text.get_text():
            assert _inside(text.get_window_extent(renderer), canvas), text.get_text()
    hessian = next(ax for ax in fig.axes if ax.get_title().startswith("Largest algebraic Hessian"))
    assert "paper (GPT-2 Small, top)" in hessian.get_xlabel()  # the x label that used to be cut off


def test_tick_labels_do_not_collide(committed):
    _, fig, renderer = committed
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            boxes = [
                t.get_window_extent(renderer)
                for t in axis.get_ticklabels(which="both")
                if t.get_visible() and t.get_text() and _inside(t.get_window_extent(renderer), fig.bbox, 40)
            ]
            lo, hi = ax.get_xlim() if axis is ax.xaxis else ax.get_ylim()
            for a, b in zip(boxes, boxes[1:]):
                assert not a.overlaps(b), (ax.get_title(), [t.get_text() for t in axis.get_ticklabels()])


def test_every_series_has_a_marker_and_no_legend_lies_over_data(committed):
    _, fig, renderer = committed
    for ax in fig.axes:
        for line in ax.lines:
            if len(line.get_xdata()) and line.get_linestyle() == "None":
                assert line.get_marker() not in (None, "None", ""), ax.get_title()
        for container in ax.containers:  # errorbars: their data line carries the marker
            if hasattr(container, "lines") and container.lines[0] is not None:
                assert container.lines[0].get_marker() not in (None, "None", ""), ax.get_title()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    legends += [legend for sub in fig.subfigs for legend in sub.legends]
    assert legends
    plot_areas = [ax.get_window_extent(renderer) for ax in fig.axes]
    for legend in legends:
        box = legend.get_window_extent(renderer)
        assert _inside(box, fig.bbox)
        assert not any(box.overlaps(area) for area in plot_areas), [t.get_text() for t in legend.get_texts()]
    # the lr rows: one legend per row, not one per panel
    lr_panels = [ax for ax in fig.axes if " vs lr" in ax.get_title()]
    assert lr_panels and all(ax.get_legend() is None for ax in lr_panels)
    assert [len(sub.legends) for sub in fig.subfigs] == [0, 1, 1]


def test_error_bars_span_the_seeds_min_to_max_and_say_so(committed):
    summary, fig, _ = committed
    panels = _panels(fig)
    for title, ax in panels.items():
        if any(c for c in ax.containers if hasattr(c, "has_yerr") and c.has_yerr):
            assert BARS in title, title
    loss = next(ax for title, ax in panels.items() if title.startswith("Final validation loss vs batch size"))
    merit = next(i for i, c in enumerate(loss.containers) if c.get_label() == "merit")
    segments = loss.containers[merit].lines[2][0].get_segments()
    for segment, batch in zip(segments, summary.settings.batch_sizes):
        values = summary.best_for("merit", batch).final_val_loss_values
        assert segment[:, 1].min() == pytest.approx(min(values)) and segment[:, 1].max() == pytest.approx(max(values))


def test_the_max_logit_vs_batch_panel(committed):
    summary, fig, _ = committed
    ax = next(ax for title, ax in _panels(fig).items() if title.startswith("Max attention logit at the end vs batch"))
    for container in ax.containers:
        name = container.get_label()
        xs, ys = container.lines[0].get_data()
        assert list(xs) == summary.settings.batch_sizes
        expected = [summary.best_for(name, b).max_attention_logit for b in summary.settings.batch_sizes]
        assert list(ys) == pytest.approx(expected)
    assert {c.get_label() for c in ax.containers} == set(summary.settings.optimizers)


def test_unstable_lrs_are_crosses_at_their_value():
    import matplotlib.pyplot as plt

    records = seeded("adamw", 8, 1e-3, [4.0, 4.1]) + seeded("adamw", 8, 3e-3, [4.5, 4.6])  # 3e-3: a collapse
    records += seeded("adamw", 64, 1e-3, [4.2, 4.3], logits=[5.0, 200.0])  # a saturated logit
    records += seeded("adamw", 64, 3e-4, [4.4, 4.5])
    summary = synthetic_summary()
    summary.settings.optimizers, summary.settings.seeds = ["adamw"], [0, 1]
    summary.runs, summary.cells = records, cells(records)
    summary.cells[2].status = "unstable"  # as run_record marks a run with a saturated logit
    summary.best = with_env(best_of(records))
    fig = compare_figure(summary)
    try:
        ax = next(ax for ax in fig.axes if ax.get_title().startswith("adamw: final validation loss vs lr"))
        (crosses,) = [line for line in ax.lines if line.get_label() == f"batch 8: {UNSTABLE_LABEL}"]
        assert crosses.get_marker() == "X" and list(crosses.get_xdata()) == [3e-3]
        assert list(crosses.get_ydata()) == pytest.approx([4.55])
    finally:
        plt.close(fig)


def test_a_smoke_run_says_so_and_has_no_lr_panels():
    import matplotlib.pyplot as plt

    records = seeded("adamw", 8, 1e-3, [4.0]) + seeded("adamw", 64, 1e-3, [4.3])
    records += seeded("merit", 8, 1e-2, [3.9]) + seeded("merit", 64, 1e-2, [4.1])
    summary = synthetic_summary()
    summary.settings.quick = True
    summary.runs, summary.cells, summary.best = records, cells(records), best_of(records)
    fig = compare_figure(summary)
    try:
        assert SMOKE_TITLE in fig._suptitle.get_text() and "smoke run" in fig._suptitle.get_text()
        titles = [ax.get_title() for ax in fig.axes]
        assert not any(" vs lr" in t for t in titles)  # no lr panels of one point per series
        assert not any("best lr" in t for t in titles) and any("one untuned lr each" in t for t in titles)
        # every series of the summary panels has a point per batch
        loss = next(ax for ax in fig.axes if ax.get_title().startswith("Final validation loss vs batch"))
        assert all(len(c.lines[0].get_xdata()) == 2 for c in loss.containers)
    finally:
        plt.close(fig)
